"""The training loop: build, train, evaluate (checkpoints: ``checkpointing.py``; the report:
``report.py``).

The system is built in one fixed order, each stage needing the one before:

    feature spec (tables, hashing)  ->  embedding client (shards + fused sparse optimizer)
    ->  dense model (DenseArch, InteractionArch, OverArch)  ->  dense optimizer  ->  data pipeline

One step: the client looks up pooled embeddings (the SparseArch: autograd-connected), the dense
model turns them and the dense features into logits, and ``backward`` updates the embedding rows
(fused in the client's backward) before the dense optimizer steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dense_trainer.checkpointing import (
    TrainerCheckpoints,
    TrainState,
    fault_report,
    load_checkpoint,
    save_checkpoint,
)
from dense_trainer.config import Config, prepare_config
from dense_trainer.data.loader import BatchLoader
from dense_trainer.metrics import log_loss_from_logits, roc_auc
from dense_trainer.model import build_dense_model
from dense_trainer.report import write_metrics
from dlrm_core.batch import Batch
from dlrm_core.errors import ConfigError, DataError
from dlrm_core.formats import InputReader, check_files
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint import latest_checkpoint
from embedding_server.client import EmbeddingClient
from embedding_server.cluster import Cluster
from embedding_server.optimizers import build_dense_optimizer
from embedding_server.shard import InProcessEmbeddingClient

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available")
    return torch.device(name)


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and check that it is writable, or fail naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: not writable ({exc.strerror or exc})") from None


class Trainer:
    """DLRM training on an injectable embedding client: the tables in this process (the embedded
    default), or on embedding servers with this process one of ``cluster``'s trainers.

    Args:
        cfg: the run's configuration.
        out_dir: where metrics, plot and checkpoints go.
        client: where the tables live; default: in this process, built from ``cfg``.
        cluster: this trainer's place in a distributed job (None: a single process).
    """

    def __init__(
        self, cfg: Config, out_dir: Path, client: EmbeddingClient | None = None, cluster: Cluster | None = None
    ) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        # Data parallelism: trainer `rank` of `trainers` takes its share of every global batch.
        self.cluster = cluster
        self.rank = cluster.rank if cluster else 0
        self.trainers = cluster.roles.num_trainers if cluster else 1
        self.is_master = self.rank == 0  # logs, writes metrics and makes checkpoints current
        self.device = resolve_device(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)

        # 1. feature spec: tables, hashing
        self.spec: FeatureSpec = cfg.feature_spec()
        # 2. embedding client (the SparseArch): shards with the fused sparse optimizer
        self.client = client or InProcessEmbeddingClient(
            self.spec.tables, cfg.embedding.optimizer, cfg.embedding.device, cfg.train.seed,
            cfg.embedding.init_scale or None, self.spec.feature_tables,
        )
        # 3. dense model: over the tables' vectors, or the tower outputs of compressing towers
        self.towers = self.client.tower_layout
        compressed = self.towers is not None and self.towers.compressed  # else exactly the flat model
        self.model = build_dense_model(cfg.model, len(self.spec.dense), self.client.output_dims(),
                                       self.towers.out_dim if compressed else cfg.embedding.dim,
                                       append_embeddings=compressed)
        self.model.to(self.device)
        self.net = self.model  # what forward runs: the model, or DDP around it
        if self.trainers > 1:
            self.net = DistributedDataParallel(self.model, process_group=cluster.trainer_group)
        # 4. dense optimizer
        self.optimizer = build_dense_optimizer(cfg.optim, self.model.parameters())
        self.state = TrainState()
        self._stop_signal: int | None = None
        self._peer_stopped = False
        self.live = None  # a LivePublisher while live updates run
        self.timings = {"embedding_forward_s": 0.0, "dense_forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        self.step_losses: list[float] = []
        self.checkpoints = TrainerCheckpoints(self)  # when to cut; writing and finishing them
        self.resumed: dict | None = None  # the fault this run resumed from (OUT/last-fault.json)

    # -- one step -------------------------------------------------------------------------------

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits float [B] of a batch."""
        t0 = time.perf_counter()
        embedded = self.client.lookup(batch.sparse)  # [B, sum(D_t)]
        t1 = time.perf_counter()
        dense = batch.dense.to(self.device, non_blocking=True)  # [B, I]
        logits = self.net(dense, embedded.to(self.device, non_blocking=True))
        self.timings["embedding_forward_s"] += t1 - t0
        self.timings["dense_forward_s"] += time.perf_counter() - t1
        return logits

    def train_step(self, batch: Batch, global_batch: int | None = None) -> torch.Tensor:
        """One optimizer step; returns the (detached) mean loss over the global batch.

        With several trainers, ``batch`` is this trainer's share of a global batch of
        ``global_batch`` examples. The loss is scaled so that DDP's averaging of dense gradients
        and the servers' summing of embedding gradients both give the gradient of the global
        mean loss, exactly as one process would compute it.
        """
        self.model.train()
        logits = self.forward(batch)
        labels = batch.labels.to(self.device, non_blocking=True)
        if self.trainers == 1:
            loss = nnf.binary_cross_entropy_with_logits(logits, labels)
            report = loss.detach()
        else:
            total = nnf.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            loss = total * (self.trainers / global_batch)
            report = total.detach() / global_batch
            dist.all_reduce(report, group=self.cluster.trainer_group)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss.backward()  # also sends the embedding gradients to the fused sparse optimizer
        t1 = time.perf_counter()
        self.optimizer.step()
        self.timings["backward_s"] += t1 - t0
        self.timings["optimizer_s"] += time.perf_counter() - t1
        return report

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        return self.forward(batch)

    def evaluate(self, files: list[Path], max_rows: int = 0) -> dict[str, float]:
        """Exact AUC and log loss over ``files`` (the first ``max_rows`` rows when > 0)."""
        loader = self._loader(files, self.cfg.train.eval_batch_size, epochs=1, max_rows=max_rows)
        logits, labels = [], []
        for batch in loader:
            if self.trainers > 1:
                batch = batch.share(self.rank, self.trainers)
            logits.append(self.predict(batch).float().cpu().numpy())
            labels.append(batch.labels.numpy())
        if self.trainers > 1:  # every trainer scored its share: the master sees them all
            parts: list = [None] * self.trainers
            dist.all_gather_object(parts, (logits, labels), group=self.cluster.trainer_group)
            logits = [z for part in parts for z in part[0]]
            labels = [y for part in parts for y in part[1]]
        if not logits:
            raise DataError(f"no valid rows in the test data ({', '.join(map(str, files))})")
        z, y = np.concatenate(logits), np.concatenate(labels)
        return {"test_auc": roc_auc(z, y), "test_logloss": log_loss_from_logits(z, y), "test_rows": int(y.size)}

    def _loader(self, files, batch_size, epochs, start=None, max_rows=0) -> BatchLoader:
        d = self.cfg.data
        return BatchLoader(
            files, self.spec, batch_size, num_workers=d.num_workers, block_bytes=d.block_bytes,
            prefetch_batches=d.prefetch_batches, strict=d.strict, epochs=epochs, start=start,
            max_rows=max_rows, pin_memory=self.device.type == "cuda",
        )

    # -- the run -----------------------------------------------------------------------------------

    def fit(
        self,
        train_files: list[Path],
        test_files: list[Path],
        resume: bool = False,
        on_step: Callable[[int, float], None] | None = None,
    ) -> dict[str, Any]:
        """Train for ``cfg.train.epochs`` (or ``max_steps``), evaluate, write metrics and plot.

        Returns:
            The metrics written to ``out_dir/metrics.json``.
        """
        check_files(train_files, "training")
        check_files(test_files, "test")
        self._prepare(train_files, test_files)
        prepare_out_dir(self.out_dir)
        if resume:
            self._resume()
        self.wait_for_master()  # servers restore their pieces meanwhile, however long it takes
        if self.cfg.live.store and self.live is None:
            self._start_live()
        loader = self._loader(train_files, self.cfg.train.batch_size, self.cfg.train.epochs,
                              start=self.state.position)
        loader.bad_lines.restore(self.state.bad_lines)
        self._parse_base = (0, 0.0)  # loader counters already folded into the state
        try:
            with self._stop_signals():
                finished = self._train_epochs(loader, test_files, on_step)
        finally:
            loader.close()
            if self.live is not None:
                self.live.close()
        if summary := loader.bad_lines.summary():
            log.warning(summary)
        self._checkpoint_with(loader)
        self.checkpoints.close()
        if self._stop_signal is not None or self._peer_stopped:
            self._stop_cluster()
            raise KeyboardInterrupt(
                f"stopped by {signal.Signals(self._stop_signal or signal.SIGTERM).name} at step {self.state.step}; "
                f"checkpoint written to {self.checkpoint_dir}, continue with --resume"
            )
        if self.state.samples_seen == 0:
            raise DataError(f"no valid rows in the training data ({', '.join(map(str, train_files))})")
        final = self._evaluate_into_history(test_files, final=True)
        cluster_stats = self._stop_cluster()
        return write_metrics(self, final, train_files, test_files, finished, cluster_stats)

    def _train_epochs(self, loader: BatchLoader, test_files: list[Path],
                      on_step: Callable[[int, float], None] | None) -> bool:
        """Step through ``loader``; True when every epoch ran to its end."""
        cfg, s = self.cfg.train, self.state
        epoch = s.position.epoch
        running = _RunningLoss(self, s.samples_seen)
        t_last = time.perf_counter()
        try:
            for batch in loader:
                s.data_wait_seconds += time.perf_counter() - t_last  # time the loader kept us waiting
                if cfg.max_steps and s.step >= cfg.max_steps:
                    return False
                if batch.position.epoch != epoch:  # the previous epoch ended
                    self._evaluate_into_history(test_files, final=False)
                    epoch = batch.position.epoch
                    t_last = time.perf_counter()
                b = batch.batch_size
                local = batch if self.trainers == 1 else batch.share(self.rank, self.trainers)
                loss = self.train_step(local, global_batch=b)
                if self.live is not None:
                    self.live.after_step(batch.sparse)
                s.step += 1
                s.samples_seen += b
                s.position = batch.position
                now = time.perf_counter()
                s.train_seconds += now - t_last
                t_last = now
                running.add(loss, b, epoch)
                if on_step is not None:
                    on_step(s.step, float(loss))
                if cfg.eval_every_steps and s.step % cfg.eval_every_steps == 0:
                    self._evaluate_into_history(test_files, final=False)
                    t_last = time.perf_counter()
                if kind := self.checkpoints.due(s.step):  # in the background: training goes on
                    self._checkpoint_with(loader, kind, wait=False)
                    t_last = time.perf_counter()
                if self._should_stop() or (cfg.max_steps and s.step >= cfg.max_steps):
                    return False
            return True
        finally:
            running.close()

    def _prepare(self, train_files: list[Path], test_files: list[Path]) -> None:
        """Learn what the schema takes from the data (column names, standardize statistics), and
        find every feature's column in every input file (failing early, naming file and column)."""
        cfg = prepare_config(self.cfg, train_files)
        if cfg is not self.cfg:
            self.cfg, self.spec = cfg, cfg.feature_spec()
        InputReader(self.spec, list(train_files) + list(test_files)).check()

    # -- checkpoints and stopping -------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def save_checkpoint(self, kind: str = "full", wait: bool = True) -> Path | None:
        return save_checkpoint(self, kind, wait)

    def load_checkpoint(self, path: Path) -> None:
        """Restore the model, the tables and the run's state from checkpoint ``path``."""
        self.state = load_checkpoint(self, path)

    def wait_for_master(self) -> None:
        """With embedding servers: every rank meets (long timeout) once the master's long work is done."""
        if self.cluster is not None:
            dist.barrier(group=self.cluster.slow_group)

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.checkpoint_dir)
        if ckpt is None:
            log.warning("--resume: no checkpoint in %s; starting from the beginning", self.checkpoint_dir)
        else:
            self.load_checkpoint(ckpt)
            if self.is_master:
                self.resumed = fault_report(self, self.state, ckpt) or {"resumed_step": self.state.step}

    def _checkpoint_with(self, loader: BatchLoader, kind: str = "full", wait: bool = True) -> None:
        """Fold the loader's counters into the state, then checkpoint."""
        s = self.state
        s.bad_lines = loader.bad_lines.state()
        rows0, secs0 = self._parse_base
        s.parse_rows += loader.stats.rows - rows0
        s.parse_seconds += loader.stats.parse_seconds - secs0
        self._parse_base = (loader.stats.rows, loader.stats.parse_seconds)
        self.save_checkpoint(kind, wait)

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM stop training at the next step boundary (with a checkpoint)."""

        def on_signal(signum, _frame) -> None:
            self._stop_signal = signum
            log.warning("received %s: stopping after this step and writing a checkpoint", signal.Signals(signum).name)

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _should_stop(self) -> bool:
        """A stop signal seen by any trainer stops them all at the same step."""
        if self.trainers == 1:
            return self._stop_signal is not None
        flag = torch.tensor([1 if self._stop_signal is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cluster.trainer_group)
        self._peer_stopped = bool(flag.item())
        return self._peer_stopped

    def _stop_cluster(self) -> dict | None:
        """Stop the embedding servers and collect every rank's timings and traffic at the master."""
        if self.cluster is None:
            return None
        self.client.close()
        mine = {"rank": self.rank, "timings": dict(self.timings), "client": dict(self.client.stats),
                "exchange": dict(self.cluster.exchange.stats) if self.cluster.exchange else {}}
        gathered: list | None = [None] * self.cluster.roles.world_size if self.is_master else None
        dist.gather_object(mine, gathered, dst=0)
        return {"ranks": gathered} if self.is_master else None

    # -- live updates and evaluation ------------------------------------------------------------------

    def _start_live(self) -> None:
        """Publish a live version and push updates while training (``dense_trainer/live.py``)."""
        from dense_trainer.live import LivePublisher
        from embedding_server.stores import open_store

        live = self.cfg.live
        if self.cluster is None:  # the tables are here: publish them from memory
            self.live = LivePublisher(self, open_store(live.store), live.push_every_s, live.dense_every_s)
            self.client.live_start(self.live.start)
            return
        # Embedding servers: checkpoint, the master publishes it, then every server pushes its rows.
        checkpoint = self.save_checkpoint()
        publish = None
        if self.is_master:
            self.live = LivePublisher(self, open_store(live.store), live.push_every_s, live.dense_every_s)

            def publish() -> str:  # the others wait on the slow group: bounded by the bytes, as this is
                with self.checkpoints.phase(f"publishing {checkpoint.name}"):
                    return self.live.start_from_checkpoint(checkpoint)
        self.client.live_start(publish)

    def _evaluate_into_history(self, test_files: list[Path], final: bool) -> dict[str, float]:
        max_rows = 0 if final else self.cfg.train.eval_max_rows
        t0 = time.perf_counter()
        result = self.evaluate(test_files, max_rows=max_rows)
        log.info(
            "eval at %d samples: AUC %.4f, log loss %.4f over %d rows (%.1fs)",
            self.state.samples_seen, result["test_auc"], result["test_logloss"], result["test_rows"],
            time.perf_counter() - t0,
        )
        self.state.history.append({"samples": self.state.samples_seen, **result, "final": final})
        return result


class _RunningLoss:
    """The progress bar and the running training loss in the history (every 20 steps)."""

    def __init__(self, trainer: Trainer, initial: int) -> None:
        self.trainer = trainer
        self.loss_sum = torch.zeros((), device=trainer.device)
        self.steps = self.samples = 0
        self.bar = tqdm(
            desc="train", unit="samples", unit_scale=True,
            disable=not (trainer.cfg.train.progress and trainer.is_master), dynamic_ncols=True,
            mininterval=0.5, file=sys.stderr, initial=initial,
        )

    def add(self, loss: torch.Tensor, b: int, epoch: int) -> None:
        t = self.trainer
        if t.cfg.train.log_step_losses:
            t.step_losses.append(float(loss))
        self.loss_sum += loss * b
        self.steps += 1
        self.samples += b
        if self.steps % 20 == 0 or self.steps == 1:
            running = float(self.loss_sum) / self.samples
            self.bar.set_postfix(loss=f"{running:.4f}", epoch=epoch, refresh=False)
            t.state.history.append({"samples": t.state.samples_seen, "train_loss": running})
            self.loss_sum.zero_()
            self.samples = 0
        self.bar.update(b)

    def close(self) -> None:
        self.bar.close()
