"""The training loop: build, train, evaluate, checkpoint, resume.

The system is built in one fixed order, each stage needing the one before:

    feature spec (tables, hashing)  ->  embedding client (shards + fused sparse optimizer)
    ->  dense model (DenseArch, InteractionArch, OverArch)  ->  dense optimizer  ->  data pipeline

One step: the client looks up pooled embeddings (autograd-connected), the dense model turns
them and the dense features into logits, and ``backward`` updates the embedding rows (fused in
the client's backward) before the dense optimizer steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dense_trainer.config import Config, DenseOptimizerConfig
from dense_trainer.data.batch import Batch, Position
from dense_trainer.data.criteo import check_files
from dense_trainer.data.loader import CriteoLoader
from dense_trainer.metrics import log_loss_from_logits, roc_auc
from dense_trainer.model import SparseArch, build_dense_model
from dense_trainer.plots import plot_curves
from embedding_server.checkpoint import (
    finalize_checkpoint,
    latest_checkpoint,
    load_file,
    partial_dir,
    read_manifest,
    save_file,
)
from embedding_server.client import EmbeddingClient, InProcessEmbeddingClient
from embedding_server.cluster import Cluster
from embedding_server.errors import CheckpointError, ConfigError, DataError
from embedding_server.features import FeatureSpec

log = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available")
    return torch.device(name)


def build_dense_optimizer(cfg: DenseOptimizerConfig, params) -> torch.optim.Optimizer:
    params = list(params)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[cfg.kind]
    if cfg.kind != "sgd":
        kwargs["eps"] = cfg.eps
    try:
        return cls(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return cls(params, foreach=True, **kwargs)


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and check that it is writable, or fail naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: not writable ({exc.strerror or exc})") from None


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class TrainState:
    """Everything besides tensors needed to continue a run exactly."""

    step: int = 0
    samples_seen: int = 0
    position: Position = field(default_factory=Position)
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)
    bad_lines: dict = field(default_factory=dict)
    parse_rows: int = 0
    parse_seconds: float = 0.0


class Trainer:
    """Single-process DLRM training (the embedded default) on an injectable embedding client.

    Args:
        cfg: the run's configuration.
        out_dir: where metrics, plot and checkpoints go.
        client: where the tables live; default: in this process, built from ``cfg``.
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
        self.is_master = self.rank == 0
        self.device = resolve_device(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)

        # 1. feature spec: tables, hashing
        self.spec: FeatureSpec = cfg.feature_spec()
        # 2. embedding client: shards with the fused sparse optimizer
        self.client = client or InProcessEmbeddingClient(
            self.spec.tables, cfg.embedding.optimizer, cfg.embedding.device, cfg.train.seed,
            cfg.embedding.init_scale or None,
        )
        self.sparse_arch = SparseArch(self.client)
        # 3. dense model
        dims = self.client.output_dims()  # per table, or per tower output
        self.towers = getattr(self.client, "layout", None)  # a TowerLayout with tower modules on servers
        compressed = self.towers is not None and self.towers.compressed  # else exactly the flat model
        self.model = build_dense_model(cfg.model, len(self.spec.dense), dims,
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

    # -- one step -------------------------------------------------------------------------------

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits float [B] of a batch."""
        t0 = time.perf_counter()
        embedded = self.sparse_arch(batch.sparse)  # [B, sum(D_t)]
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

    def _loader(self, files, batch_size, epochs, start=None, max_rows=0) -> CriteoLoader:
        d = self.cfg.data
        return CriteoLoader(
            files, self.spec, batch_size, num_workers=d.num_workers, block_bytes=d.block_bytes,
            prefetch_batches=d.prefetch_batches, strict=d.strict, epochs=epochs, start=start,
            max_rows=max_rows, pin_memory=self.device.type == "cuda",
        )

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def _compat_meta(self) -> dict[str, Any]:
        return {
            "feature_spec": self.spec.model_dump(),
            "model": self.cfg.model.model_dump(),
            "embedding_dim": self.cfg.embedding.dim,
            "sparse_optimizer": self.cfg.embedding.optimizer.kind,
            "dense_optimizer": self.cfg.optim.kind,
            "towers": {"towers": [t.model_dump() for t in self.towers.plan.towers], "out_dim": self.towers.out_dim}
            if self.towers else None,
        }

    def save_checkpoint(self) -> Path:
        s = self.state
        trainer_state = {
            "step": s.step,
            "samples_seen": s.samples_seen,
            "position": s.position.to_dict(),
            "train_seconds": s.train_seconds,
            "data_wait_seconds": s.data_wait_seconds,
            "history": s.history,
            "bad_lines": s.bad_lines,
            "parse_rows": s.parse_rows,
            "parse_seconds": s.parse_seconds,
            "torch_rng": torch.get_rng_state(),
        }
        # The master empties the partial directory before anyone writes into it (servers write
        # only after the master's CHECKPOINT header), so no leftover of a crashed run joins it.
        directory = partial_dir(self.checkpoint_dir, s.step, fresh=self.is_master)
        self.client.save(directory, s.step)  # the tables: here, or on every embedding server
        if not self.is_master:
            self._wait_for_master()
            return self.checkpoint_dir / f"step-{s.step:010d}"
        save_file(directory, "dense.pt", self.model.state_dict())
        save_file(directory, "optimizer.pt", self.optimizer.state_dict())
        save_file(directory, "trainer.pt", trainer_state)
        meta = {**self._compat_meta(), "config": self.cfg.model_dump(mode="json"), "kernel": self.client.kernel,
                "plan": getattr(getattr(self.client, "plan", None), "model_dump", lambda: None)()}
        path = finalize_checkpoint(self.checkpoint_dir, s.step, meta, keep=self.cfg.train.keep_checkpoints)
        self._wait_for_master()
        log.info("checkpoint written: %s", path)
        return path

    def _wait_for_master(self) -> None:
        """With embedding servers: every rank meets (long timeout) once the master's long work is done."""
        if self.cluster is not None:
            dist.barrier(group=self.cluster.slow_group)

    def load_checkpoint(self, path: Path) -> None:
        manifest = read_manifest(path)
        saved, mine = manifest["meta"], self._compat_meta()
        for key, value in mine.items():
            if saved.get(key) != value:
                raise CheckpointError(
                    f"checkpoint {path} does not match this model: {key} differs "
                    f"(checkpoint {json.dumps(saved.get(key))[:200]}, now {json.dumps(value)[:200]})"
                )
        self.client.restore(path)
        self.model.load_state_dict(load_file(path, "dense.pt"))
        self.optimizer.load_state_dict(load_file(path, "optimizer.pt"))
        t = load_file(path, "trainer.pt")
        torch.set_rng_state(t["torch_rng"])
        self.state = TrainState(
            step=t["step"], samples_seen=t["samples_seen"], position=Position(**t["position"]),
            train_seconds=t["train_seconds"], data_wait_seconds=t["data_wait_seconds"], history=list(t["history"]), bad_lines=dict(t["bad_lines"]),
            parse_rows=t["parse_rows"], parse_seconds=t["parse_seconds"],
        )
        log.info("resumed from %s (step %d, %d samples seen)", path, self.state.step, self.state.samples_seen)

    # -- the run -----------------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum
        log.warning("received %s: stopping after this step and writing a checkpoint", signal.Signals(signum).name)

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
        cfg = self.cfg.train
        check_files(train_files, "training")
        check_files(test_files, "test")
        prepare_out_dir(self.out_dir)
        if resume:
            ckpt = latest_checkpoint(self.checkpoint_dir)
            if ckpt is None:
                log.warning("--resume: no checkpoint in %s; starting from the beginning", self.checkpoint_dir)
            else:
                self.load_checkpoint(ckpt)
        self._wait_for_master()  # servers restore their pieces meanwhile, however long it takes

        s = self.state
        if self.cfg.live.store and self.live is None:
            self._start_live()
        loader = self._loader(train_files, cfg.batch_size, cfg.epochs, start=s.position)
        loader.bad_lines.restore(s.bad_lines)
        old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        bar = tqdm(
            desc="train", unit="samples", unit_scale=True, disable=not (cfg.progress and self.is_master),
            dynamic_ncols=True, mininterval=0.5, file=sys.stderr, initial=s.samples_seen,
        )
        loss_sum = torch.zeros((), device=self.device)
        loss_steps, loss_samples = 0, 0
        epoch = s.position.epoch
        finished = True
        self._parse_base = (0, 0.0)
        t_last = time.perf_counter()
        try:
            for batch in loader:
                s.data_wait_seconds += time.perf_counter() - t_last  # time the loader kept us waiting
                if cfg.max_steps and s.step >= cfg.max_steps:
                    finished = False
                    break
                if batch.position.epoch != epoch:  # the previous epoch ended
                    self._evaluate_into_history(test_files, final=False)
                    epoch = batch.position.epoch
                    t_last = time.perf_counter()
                b = batch.batch_size
                local = batch if self.trainers == 1 else batch.share(self.rank, self.trainers)
                loss = self.train_step(local, global_batch=b)
                if cfg.log_step_losses:
                    self.step_losses.append(float(loss))
                if self.live is not None:
                    self.live.after_step(batch.sparse)
                loss_sum += loss * b
                loss_steps += 1
                loss_samples += b
                s.step += 1
                s.samples_seen += b
                s.position = batch.position
                now = time.perf_counter()
                s.train_seconds += now - t_last
                t_last = now
                if on_step is not None:
                    on_step(s.step, float(loss))
                if loss_steps % 20 == 0 or loss_steps == 1:
                    running = float(loss_sum) / loss_samples
                    bar.set_postfix(loss=f"{running:.4f}", epoch=epoch, refresh=False)
                    s.history.append({"samples": s.samples_seen, "train_loss": running})
                    loss_sum.zero_()
                    loss_samples = 0
                bar.update(b)
                if cfg.eval_every_steps and s.step % cfg.eval_every_steps == 0:
                    self._evaluate_into_history(test_files, final=False)
                    t_last = time.perf_counter()
                if cfg.checkpoint_every_steps and s.step % cfg.checkpoint_every_steps == 0:
                    self._checkpoint_with(loader)
                    t_last = time.perf_counter()
                if self._should_stop() or (cfg.max_steps and s.step >= cfg.max_steps):
                    finished = False
                    break
        finally:
            bar.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            loader.close()
            if self.live is not None:
                self.live.close()
        summary = loader.bad_lines.summary()
        if summary:
            log.warning(summary)
        self._checkpoint_with(loader)
        if self._stop_signal is not None or self._peer_stopped:
            self._stop_cluster()
            raise KeyboardInterrupt(
                f"stopped by {signal.Signals(self._stop_signal or signal.SIGTERM).name} at step {s.step}; "
                f"checkpoint written to {self.checkpoint_dir}, continue with --resume"
            )
        if s.samples_seen == 0:
            raise DataError(f"no valid rows in the training data ({', '.join(map(str, train_files))})")
        final = self._evaluate_into_history(test_files, final=True)
        cluster_stats = self._stop_cluster()
        return self._write_metrics(final, train_files, test_files, finished, cluster_stats)

    def _start_live(self) -> None:
        from dense_trainer.live import LivePublisher
        from embedding_server.stores import open_store

        live = self.cfg.live
        if self.cluster is None:
            self.live = LivePublisher(self, open_store(live.store), live.push_every_s, live.dense_every_s)
            self.live.start()
            return
        # Embedding servers: checkpoint, the master publishes it, then every server pushes its rows.
        checkpoint = self.save_checkpoint()
        publish = None
        if self.is_master:
            self.live = LivePublisher(self, open_store(live.store), live.push_every_s, live.dense_every_s)
            publish = lambda: self.live.start_from_checkpoint(checkpoint)  # noqa: E731
        self.client.live_start(publish)

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
        mine = {"rank": self.rank, "timings": dict(self.timings), "client": dict(getattr(self.client, "stats", {})),
                "exchange": dict(self.cluster.exchange.stats) if self.cluster.exchange else {}}
        gathered: list | None = [None] * self.cluster.roles.world_size if self.is_master else None
        dist.gather_object(mine, gathered, dst=0)
        return {"ranks": gathered} if self.is_master else None

    def _checkpoint_with(self, loader: CriteoLoader) -> None:
        """Fold the loader's counters into the state, then checkpoint."""
        s = self.state
        s.bad_lines = loader.bad_lines.state()
        rows0, secs0 = self._parse_base
        s.parse_rows += loader.stats.rows - rows0
        s.parse_seconds += loader.stats.parse_seconds - secs0
        self._parse_base = (loader.stats.rows, loader.stats.parse_seconds)
        self.save_checkpoint()

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

    def _write_metrics(self, final: dict, train_files, test_files, finished: bool, cluster_stats=None) -> dict[str, Any]:
        s = self.state
        bayes = _bayes_beside(test_files)
        metrics: dict[str, Any] = {
            "test_auc": final["test_auc"],
            "test_logloss": final["test_logloss"],
            "test_rows": final["test_rows"],
            "train_samples_per_s": s.samples_seen / s.train_seconds if s.train_seconds else math.nan,
            "samples_seen": s.samples_seen,
            "steps": s.step,
            "epochs": self.cfg.train.epochs,
            "completed": finished,
            "train_seconds": s.train_seconds,
            "data_wait_share": s.data_wait_seconds / s.train_seconds if s.train_seconds else None,
            "parse_rows_per_s": s.parse_rows / s.parse_seconds if s.parse_seconds else None,
            "malformed_lines": s.bad_lines.get("count", 0),
            "embedding_kernel": self.client.kernel,
            "device": str(self.device),
            "peak_rss_mb": peak_rss_mb(),
            "bayes_auc": bayes.get("test_auc") if bayes else None,
            "bayes_logloss": bayes.get("test_logloss") if bayes else None,
            "train_files": [str(f) for f in train_files],
            "test_files": [str(f) for f in test_files],
            "history": s.history,
            "config": self.cfg.model_dump(mode="json"),
            "trainers": self.trainers,
            "embedding_servers": self.cluster.roles.num_servers if self.cluster else 0,
            "step_time_breakdown_ms": {k.removesuffix("_s"): 1e3 * v / max(s.step, 1) for k, v in self.timings.items()},
        }
        if cfg_losses := self.step_losses:
            metrics["step_losses"] = cfg_losses
        if cluster_stats is not None:
            metrics.update(_cluster_metrics(cluster_stats, sum(self.client.output_dims()), len(self.spec.tables), s))
        if not self.is_master:
            return metrics
        (self.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        title = f"{self.cfg.model.kind}/{self.cfg.model.interaction}: test AUC {final['test_auc']:.4f}"
        plot_curves(s.history, self.out_dir / "curves.png", title, metrics["bayes_auc"])
        return metrics


def _cluster_metrics(stats: dict, width: int, num_tables: int, state: TrainState) -> dict[str, Any]:
    """All-to-all traffic per sample against the analytical minimum, and the step's breakdown."""
    ranks = stats["ranks"]
    trainer_stats = [r for r in ranks if "client" in r and r["client"]]
    servers = [r for r in ranks if "server" in r]
    samples = max(state.samples_seen, 1)
    out_bytes = sum(r["client"]["bytes_out"] for r in trainer_stats)
    in_bytes = sum(r["client"]["bytes_in"] for r in trainer_stats)
    minimum = {"ids": 4 * num_tables, "pooled": 4 * width, "gradients": 4 * width}  # width: sum D_t, or C * D'
    steps = max(state.step, 1)
    comm_ms = 1e3 * sum(r["client"]["comm_s"] for r in trainer_stats) / len(trainer_stats) / steps
    cross = sum(r.get("exchange", {}).get("cross_host_bytes", 0) for r in trainer_stats)
    cross += sum(r.get("cross_host_bytes", 0) for r in servers)
    messages = sum(r.get("exchange", {}).get("cross_host_messages", 0) for r in trainer_stats)
    messages += sum(r.get("cross_host_messages", 0) for r in servers)
    return {
        "cross_host_bytes_per_sample": cross / samples,
        "cross_host_messages_per_step": messages / steps,
        "alltoall_bytes_per_sample": {
            "trainers_to_servers": out_bytes / samples,
            "servers_to_trainers": in_bytes / samples,
            "analytical_minimum": minimum,
            "note": "trainers_to_servers counts ids, bag lengths, headers and gradients (training "
                    "and evaluation lookups); the minimum is one int32 id per feature and the "
                    "fp32 pooled vectors and their gradients",
        },
        "server_time_ms_per_step": {
            "lookup": 1e3 * max(r["lookup_s"] for r in servers) / steps if servers else 0.0,
            "update": 1e3 * max(r["update_s"] for r in servers) / steps if servers else 0.0,
            "tower_module": 1e3 * max(r.get("tower_s", 0.0) for r in servers) / steps if servers else 0.0,
        },
        "communication_ms_per_step": comm_ms,
    }


def _bayes_beside(test_files: list[Path]) -> dict | None:
    """The generator's ``bayes.json`` next to a single generated test file, if there is one."""
    if len(test_files) != 1:
        return None
    path = Path(test_files[0]).parent / "bayes.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
