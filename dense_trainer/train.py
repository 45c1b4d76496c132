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

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch.nn.parallel import DistributedDataParallel

from dense_trainer.best_model import BestModel
from dense_trainer.checkpointing import (
    TrainerCheckpoints,
    TrainState,
    checkpoint_with,
    fault_report,
    load_checkpoint,
    save_checkpoint,
)
from dense_trainer.config import Config, prepare_config
from dense_trainer.data.elastic import Consumed
from dense_trainer.data.loader import BatchLoader
from dense_trainer.data.split import RowSplit
from dense_trainer.data.steps import Step, Steps, partial_step, resume_positions
from dense_trainer.evaluation import (
    HeldOut,
    evaluate_into_history,
    evaluation_due,
    training_split,
    validation_of,
)
from dense_trainer.lr_schedule import lr_factor, set_dense_rate
from dense_trainer.model import build_dense_model
from dense_trainer.report import RunningLoss, write_metrics
from dense_trainer.run_setup import prepare_out_dir, resolve_device
from dense_trainer.stopping import stop_cluster, stop_signals
from dlrm_core.batch import Batch, Position, SparseFeatures
from dlrm_core.errors import DataError
from dlrm_core.formats import InputReader, check_files
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.client.base import EmbeddingClient
from embedding_server.client.local import InProcessEmbeddingClient
from embedding_server.idmap.ahead import overlaps
from embedding_server.kernels.optimizers import build_dense_optimizer
from embedding_server.runtime.cluster import Cluster
from embedding_server.runtime.pipelining import pipelining

log = logging.getLogger(__name__)


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
        self,
        cfg: Config,
        out_dir: Path,
        client: EmbeddingClient | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        # Data parallelism: trainer `rank` of `trainers` takes its share of every global batch.
        self.cluster = cluster
        self.rank = cluster.rank if cluster else 0
        self.trainers = cluster.roles.num_trainers if cluster else 1
        self.is_master = self.rank == 0  # logs, writes metrics and makes checkpoints current
        self.pipelining = pipelining(cfg.dist)
        self.device = resolve_device(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)

        # 1. feature spec: tables, hashing
        self.spec: FeatureSpec = cfg.feature_spec()
        # 2. embedding client (the SparseArch): shards with the fused sparse optimizer
        self.client = client or InProcessEmbeddingClient(
            self.spec.tables,
            cfg.embedding.optimizer,
            cfg.embedding.device,
            cfg.train.seed,
            cfg.embedding.init_scale or None,
            self.spec.feature_tables,
            remap_ahead=overlaps(self.device),
        )
        # 3. dense model: over the tables' vectors, or the tower outputs of compressing towers
        self.towers = self.client.tower_layout
        # else exactly the flat model
        compressed = self.towers is not None and self.towers.compressed
        self.model = build_dense_model(
            cfg.model,
            self.spec.dense_width,
            self.client.output_dims(),
            self.towers.out_dim if compressed else cfg.embedding.dim,
            append_embeddings=compressed,
        )
        self.model.to(self.device)
        self.net = self.model  # what forward runs: the model, or DDP around it
        if self.trainers > 1:
            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(
                self.model, process_group=cluster.trainer_group, device_ids=ids
            )
        # 4. dense optimizer
        self.optimizer = build_dense_optimizer(cfg.optim, self.model.parameters())
        self.state = TrainState()
        self._stop_signal: int | None = None
        self._peer_stopped = False
        self.live = None  # a LivePublisher while live updates run
        self.timings = {
            "embedding_forward_s": 0.0,
            "dense_forward_s": 0.0,
            "backward_s": 0.0,
            "optimizer_s": 0.0,
        }
        self.step_losses: list[float] = []
        self.last_logits: torch.Tensor | None = None  # the last training step's, float [B]
        self.checkpoints = TrainerCheckpoints(self)  # when to cut; writing and finishing them
        self.best = BestModel(self)  # early stopping and the model the run ends with
        self.validation: HeldOut | None = None  # set by fit
        self.resumed: dict | None = None  # the fault this run resumed from (OUT/last-fault.json)

    # -- one step -------------------------------------------------------------------------------

    def forward(
        self, batch: Batch, prefetch: SparseFeatures | None = None, next_lr: float = 1.0
    ) -> torch.Tensor:
        """Logits float [B] of a batch; ``prefetch``: the next batch's ids, sent to the embedding
        servers while this batch's dense part runs (pipelining), its rate factor ``next_lr``."""
        t0 = time.perf_counter()
        embedded = self.client.lookup(batch.sparse)  # [B, sum(D_f)]
        if prefetch is not None:
            self.client.lr_factor = next_lr
            self.client.prefetch(prefetch)
        t1 = time.perf_counter()
        dense = batch.dense.to(self.device, non_blocking=True)  # [B, I]
        logits = self.net(dense, embedded.to(self.device, non_blocking=True))
        self.timings["embedding_forward_s"] += t1 - t0
        self.timings["dense_forward_s"] += time.perf_counter() - t1
        return logits

    def train_step(
        self,
        batch: Batch,
        global_batch: int | None = None,
        prefetch: SparseFeatures | None = None,
        lr: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """One optimizer step; returns the (detached) mean loss over the global batch.

        With several trainers, ``batch`` is this trainer's share of a global batch of
        ``global_batch`` examples. The loss is scaled so that DDP's averaging of dense gradients
        and the servers' summing of embedding gradients both give the gradient of the global
        mean loss, exactly as one process would compute it. ``lr``: the rate factors of this
        step and the next (``lr_schedule.py``).
        """
        self.model.train()
        set_dense_rate(self.optimizer, lr[0])
        self.client.lr_factor = lr[0]
        logits = self.forward(batch, prefetch, lr[1])
        self.last_logits = logits.detach()  # scored before this update (progressive validation)
        labels = batch.labels.to(self.device, non_blocking=True)
        rows = batch.batch_size if global_batch is None else global_batch
        # A step of fewer rows than the batch size (an epoch's tail, where the trainers' shares
        # run out unevenly) weighs by its rows: its loss is the sum over the batch size, so that
        # the Adagrad of the tables does not take a full step on a handful of rows.
        denominator = max(rows, self.cfg.train.batch_size)
        if self.trainers == 1 and rows >= denominator:
            loss = nnf.binary_cross_entropy_with_logits(logits, labels)
            report = loss.detach()
        elif self.trainers == 1:
            total = nnf.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            loss, report = total / denominator, total.detach() / rows
        else:
            total = nnf.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            loss = total * (self.trainers / denominator)
            report = total.detach() / rows
            # on the device: NCCL for CUDA
            dist.all_reduce(report, group=self.cluster.trainer_group)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss.backward()  # also sends the embedding gradients to the fused sparse optimizer
        t1 = time.perf_counter()
        with partial_step(self.optimizer, rows, self.cfg.train.batch_size):
            self.optimizer.step()
        self.timings["backward_s"] += t1 - t0
        self.timings["optimizer_s"] += time.perf_counter() - t1
        return report

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        return self.forward(batch)

    def steps_of(
        self,
        files,
        batch_size: int,
        epochs: int,
        starts: list[Position] | None = None,
        max_rows: int = 0,
        consumed: Consumed | None = None,
        split: RowSplit | None = None,
    ) -> Steps:
        """This process's shares of ``files`` as agreed steps: trainer r of T reads blocks r mod T
        (a single process with ``data.interleave = k`` reads all k shares, as k trainers would)."""
        d = self.cfg.data
        parts = self.trainers if self.trainers > 1 else max(1, d.interleave)
        mine = [self.rank] if self.trainers > 1 else list(range(parts))
        training, block_bytes = starts is not None, d.block_bytes
        if training:
            block_bytes = self._block_grid(bool(starts))
        starts, consumed = resume_positions(starts, parts, consumed)
        if training:
            self.state.consumed = consumed  # checkpoints keep it until the epoch ends
        loaders = [
            BatchLoader(
                files,
                self.spec,
                batch_size * (t + 1) // parts - batch_size * t // parts,
                num_workers=d.num_workers,
                block_bytes=block_bytes,
                prefetch_batches=d.prefetch_batches,
                strict=d.strict,
                epochs=epochs,
                start=starts[t],
                max_rows=max_rows // parts if max_rows else 0,
                pin_memory=self.device.type == "cuda",
                part=t,
                parts=parts,
                consumed=consumed,
                split=split,
            )
            for t in mine
        ]
        return Steps(
            loaders,
            self.spec.dense_width,
            len(self.spec.categorical),
            self._agree,
            min(p.epoch for p in starts),
        )

    def _block_grid(self, resuming: bool) -> int:
        """The training data's block size: a resumed run keeps its checkpoint's (positions are
        block numbers and offsets on that grid)."""
        s, wanted = self.state, self.cfg.data.block_bytes
        if resuming and s.block_bytes and s.block_bytes != wanted:
            log.warning(
                "data.block_bytes = %d ignored until the end of this run: the checkpoint's "
                "positions are on "
                "a grid of %d-byte blocks",
                wanted,
                s.block_bytes,
            )
            return s.block_bytes
        s.block_bytes = wanted
        return wanted

    def loader(self, files, batch_size: int, epochs: int = 1, max_rows: int = 0) -> BatchLoader:
        """A plain loader of ``files`` with this run's data settings (one share: every row)."""
        d = self.cfg.data
        return BatchLoader(
            files,
            self.spec,
            batch_size,
            num_workers=d.num_workers,
            block_bytes=d.block_bytes,
            prefetch_batches=d.prefetch_batches,
            strict=d.strict,
            epochs=epochs,
            max_rows=max_rows,
            pin_memory=self.device.type == "cuda",
        )

    def _agree(self, vector: list[float]) -> list[float]:
        """Sum a per-step vector over the trainers (they call it together)."""
        if self.trainers == 1:
            return vector
        t = torch.tensor(vector, dtype=torch.float64)
        dist.all_reduce(t, group=self.cluster.trainer_cpu_group)
        return t.tolist()

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
        if test_files:  # none: the run is scored on its validation rows only (dlrm tune)
            check_files(test_files, "test")
        self.validation = validation_of(self.cfg, train_files)
        self._prepare(train_files, test_files)
        prepare_out_dir(self.out_dir)
        if resume:
            self._resume()
        self.wait_for_master()  # servers restore their pieces meanwhile, however long it takes
        if self.cfg.live.store and self.live is None:
            from dense_trainer.live import start_live

            start_live(self)
        steps = self.steps_of(
            train_files,
            self.cfg.train.batch_size,
            self.cfg.train.epochs,
            self.state.positions,
            consumed=self.state.consumed,
            split=training_split(self.validation),
        )
        steps.shares[0].loader.bad_lines.restore(self.state.bad_lines)
        self._parse_base = (0, 0.0)  # loader counters already folded into the state
        try:
            with stop_signals(self):
                finished = self._train_epochs(steps, on_step)
                if not self._stopped:
                    self.best.validate(steps)  # the end of the last epoch (or of max_steps)
        finally:
            steps.close()
            if self.live is not None:
                self.live.close()
        if summary := steps.shares[0].loader.bad_lines.summary():
            log.warning(summary)
        restore = not self._stopped and self.best.restore_due
        if not restore:
            checkpoint_with(self, steps)
        self.checkpoints.close()
        if self._stopped:
            stop_cluster(self)
            raise KeyboardInterrupt(
                f"stopped by {signal.Signals(self._stop_signal or signal.SIGTERM).name} at step "
                f"{self.state.step}; "
                f"checkpoint written to {self.checkpoint_dir}, continue with --resume"
            )
        if self.state.samples_seen == 0:
            raise DataError(
                f"no valid rows in the training data ({', '.join(map(str, train_files))})"
            )
        if restore:
            self.best.restore()  # after the last evaluation: nothing is being written now
        test = HeldOut("test", list(test_files))
        final = evaluate_into_history(self, test, final=True) if test_files else {}
        cluster_stats = stop_cluster(self)
        return write_metrics(self, final, train_files, test_files, finished, cluster_stats)

    @property
    def _stopped(self) -> bool:
        """Stopped by a signal (here or on another trainer): a checkpoint to resume from."""
        return self._stop_signal is not None or self._peer_stopped

    def _train_epochs(self, steps: Steps, on_step: Callable[[int, float], None] | None) -> bool:
        """Take the agreed steps; True when training ran to its end (every epoch, or early
        stopping). The next step is agreed on before this one runs, so that its ids can travel
        meanwhile (``dist.pipeline``)."""
        cfg, s, sched = self.cfg.train, self.state, self.cfg.schedule
        epoch = s.position.epoch
        running = RunningLoss(self, s.samples_seen)
        t_last = time.perf_counter()
        cur = steps.next(self._stop_signal is not None)
        try:
            while cur is not None:
                if cur.stop:
                    self._peer_stopped = True
                    return False
                if cfg.max_steps and s.step >= cfg.max_steps:
                    return False
                if cur.epoch != epoch:  # the previous epoch ended
                    if self.best.validate(steps):
                        return True
                    epoch = cur.epoch
                s.data_wait_seconds += time.perf_counter() - t_last  # time the data kept us waiting
                nxt = steps.next(self._stop_signal is not None)
                # Decided before the step runs (the same on every trainer): ids of the next step
                # must not be on their way while the servers cut a checkpoint.
                kind = self.checkpoints.due(s.step + 1)
                rates = (lr_factor(sched, s.step + 1, epoch), lr_factor(sched, s.step + 2, epoch))
                ahead = None if kind else self._prefetch(cur, nxt)  # never across an epoch
                loss = self.train_step(cur.batch, cur.global_rows, ahead, rates)
                if self.live is not None:
                    self.live.after_step(cur.batch.sparse)
                s.step += 1
                s.samples_seen += cur.global_rows
                s.position, s.positions = cur.positions[0], cur.positions
                now = time.perf_counter()
                s.train_seconds += now - t_last
                t_last = now
                running.add(loss, cur.global_rows, epoch)
                if on_step is not None:
                    on_step(s.step, float(loss))
                if evaluation_due(self) and self.best.validate(steps):
                    return True
                if kind:  # in the background: training goes on
                    checkpoint_with(self, steps, kind, wait=False)
                t_last = time.perf_counter()
                cur = nxt
            return True
        finally:
            running.close()

    def _prefetch(self, cur: Step, nxt: Step | None) -> SparseFeatures | None:
        """The next step's ids, when they may travel during this step: pipelining is on, the
        route allows it, and nothing (an evaluation, a checkpoint, the end) comes between."""
        cfg, step = self.cfg.train, self.state.step + 1
        if not self.pipelining.prefetch or not self.client.can_prefetch:
            return None
        # one process: pushes read the maps between steps
        if self.live is not None and self.client.plan is None:
            return None
        if (
            nxt is None
            or nxt.stop
            or nxt.epoch != cur.epoch
            or (cfg.max_steps and step >= cfg.max_steps)
        ):
            return None
        if cfg.eval_every_steps and step % cfg.eval_every_steps == 0:
            return None
        return nxt.batch.sparse

    def _prepare(self, train_files: list[Path], test_files: list[Path]) -> None:
        """Learn what the schema takes from the data (column names, standardize statistics), and
        find every feature's column in every input file (failing early, naming file and column)."""
        cfg = prepare_config(self.cfg, train_files)
        if cfg is not self.cfg:
            self.cfg, self.spec = cfg, cfg.feature_spec()
        valid = self.validation.files if self.validation and not self.validation.split else []
        InputReader(self.spec, [*train_files, *valid, *test_files]).check()

    # -- checkpoints and stopping ------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def save_checkpoint(self, kind: str = "full", wait: bool = True) -> Path | None:
        return save_checkpoint(self, kind, wait)

    def load_checkpoint(self, path: Path) -> None:
        """Restore the model, the tables and the run's state from checkpoint ``path``."""
        self.state = load_checkpoint(self, path)

    def wait_for_master(self) -> None:
        """With embedding servers: every rank meets (long timeout) once the master's long work is
        done."""
        if self.cluster is not None:
            dist.barrier(group=self.cluster.slow_group)

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.checkpoint_dir)
        if ckpt is None:
            log.warning(
                "--resume: no checkpoint in %s; starting from the beginning", self.checkpoint_dir
            )
        else:
            self.load_checkpoint(ckpt)
            if self.is_master:
                self.resumed = fault_report(self, self.state, ckpt) or {
                    "resumed_step": self.state.step
                }
