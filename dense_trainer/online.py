"""Online training: ``dlrm train --stream URL`` trains from impression and click streams until
stopped, and serves fresh through live updates as file training does.

    streams (Redis) -> joiner -> featurizer -> step (predict-then-train) -> checkpoint -> XACK

Every entry is trained on at least once, and twice only if it came after the last checkpoint:
an entry is acknowledged only once a checkpoint that holds the step which trained on it is
durable, and that checkpoint records the entries it acknowledges, so a run that dies between
the checkpoint and the acknowledgement acknowledges them when it resumes. What a dead run had
read but not acknowledged (trained since its last checkpoint, or still waiting in the joiner)
is delivered again to the resumed consumer of the same name. Figures: progressive AUC and log
loss (``progressive.py``), rows/s, the group's lag, the joiner's counts, freshness (event to
trained), dead letters; each ``report_every_s`` in a log line and ``OUT/metrics.json``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dense_trainer.config import Config
from dense_trainer.data.stream.batches import StreamBatch, StreamBatches
from dense_trainer.data.stream.source import Entry, RetryingSource, StreamSource
from dense_trainer.lr_schedule import lr_factor
from dense_trainer.progressive import Progressive, Scores
from dense_trainer.report import cluster_metrics, peak_rss_mb
from dense_trainer.run_setup import prepare_out_dir
from dense_trainer.stopping import stop_cluster, stop_signals
from dense_trainer.train import Trainer
from dlrm_core.errors import ConfigError, DlrmError
from dlrm_core.secrets import redact_url
from dlrm_core.statistics import needs_statistics

log = logging.getLogger(__name__)


def stream_config(cfg: Config) -> Config:
    """The run's config for a stream: dynamic ids unless the config chose (new ids arrive all
    the time), a checkpoint every ``stream.checkpoint_every_s`` unless ``[train]`` sets a time,
    and no statistics to learn from files (``standardize`` needs its mean and std given)."""
    emb, train = cfg.embedding, cfg.train
    missing = needs_statistics(cfg.features) if cfg.features else []
    if missing:
        raise ConfigError(
            f"feature {sorted(missing)[0]!r}: standardize needs its mean and std in the config "
            "for a stream (no files to learn them from)"
        )
    update: dict[str, Any] = {}
    chosen = "ids" in emb.model_fields_set or any(t.ids for t in emb.tables)
    if not chosen:
        update["embedding"] = emb.model_copy(update={"ids": "dynamic"})
    if not train.checkpoint_every_s:
        update["train"] = train.model_copy(
            update={"checkpoint_every_s": cfg.stream.checkpoint_every_s}
        )
    return cfg.model_copy(update=update) if update else cfg


class AckLog:
    """Entry ids trained on and not yet acknowledged, per stream, in order. A checkpoint takes
    them all (:meth:`cut`); once it is durable its prefix is acknowledged (:meth:`durable`)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[str]] = {}
        self._dropped: dict[str, int] = {}  # per stream: ids acknowledged (gone from ``ids``)
        self._cuts: deque[tuple[int, dict[str, int]]] = deque()  # step, ids ever added then

    def add(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.ids.setdefault(e.stream, []).append(e.id)

    def cut(self, step: int) -> dict[str, str]:
        """Mark what checkpoint ``step`` holds; returns it for the checkpoint to record."""
        added = {s: self._dropped.get(s, 0) + len(ids) for s, ids in self.ids.items()}
        self._cuts.append((step, added))
        return {s: "\n".join(ids) for s, ids in self.ids.items()}

    def durable(self, latest_step: int | None, source: StreamSource) -> int:
        """Acknowledge what the checkpoints up to ``latest_step`` hold; returns how many."""
        acked = 0
        while self._cuts and latest_step is not None and self._cuts[0][0] <= latest_step:
            _, added = self._cuts[0]
            upto = {s: n - self._dropped.get(s, 0) for s, n in added.items()}
            entries = [Entry(s, i, {}) for s, n in upto.items() for i in self.ids[s][:n]]
            source.ack(entries)  # if it fails, the cut stays: acknowledged again next time
            self._cuts.popleft()
            acked += len(entries)
            for s, n in upto.items():
                self.ids[s] = self.ids[s][n:]
                self._dropped[s] = added[s]
        return acked


def acknowledge_recorded(recorded: dict | None, source: StreamSource) -> int:
    """Acknowledge what a checkpoint recorded (again: acknowledging twice is harmless)."""
    ack = (recorded or {}).get("ack") or {}
    entries = [Entry(s, i, {}) for s, ids in ack.items() for i in ids.split("\n") if i]
    for k in range(0, len(entries), 10_000):
        source.ack(entries[k : k + 10_000])
    return len(entries)


class OnlineTraining:
    """Args:
    trainer: the model, tables and checkpoints (``train.Trainer``, built from a config that
        went through :func:`stream_config`).
    source: the streams; default Redis at ``stream.url``, this trainer a consumer of its group.
    """

    def __init__(self, trainer: Trainer, source: StreamSource | None = None) -> None:
        self.trainer, self.cfg = trainer, trainer.cfg.stream
        if source is None:
            from dense_trainer.data.stream.redis_streams import RedisStreamSource

            if not self.cfg.url:
                raise ConfigError("--stream URL: no stream to train from")
            redis_source = RedisStreamSource(
                self.cfg.url,
                [self.cfg.impressions, self.cfg.clicks],
                self.cfg.group,
                f"{self.cfg.consumer}-{trainer.rank}",
                timeout_s=trainer.cfg.dist.timeout_s,
            )
            source = RetryingSource(redis_source, self.cfg.reconnect_s, (DlrmError,))
        self.source = source
        self.batches = StreamBatches(source, trainer.spec, self.cfg, trainer.cfg.train.batch_size)
        self.acks = AckLog()
        self.progressive = Progressive()
        self.rows = 0
        self.acked = 0
        self.fresh_s: deque[float] = deque(maxlen=10_000)  # event entered -> trained on
        self.history: list[dict] = []
        self._log = None

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train until stopped, ``max_rows`` or idle; returns the metrics written."""
        t = self.trainer
        prepare_out_dir(t.out_dir)
        if resume:
            t._resume()
            self._restore(t.state.stream)
        t.wait_for_master()  # with embedding servers: they restore their pieces meanwhile
        if t.cfg.live.store and t.live is None:
            from dense_trainer.live import start_live

            start_live(t)
        if self.cfg.metrics_port:
            from dense_trainer.online_metrics import serve_metrics

            serve_metrics(self, self.cfg.metrics_port, self.cfg.metrics_host)
        if self.cfg.trained_log:
            self._log = Path(self.cfg.trained_log).open("a", encoding="utf-8")
        started = time.monotonic()
        try:
            with stop_signals(t):
                self._loop()
            self._checkpoint("full", wait=True)  # then acknowledge everything trained on
            self.acked += self.acks.durable(t.state.step, self.source)
        finally:
            t.checkpoints.close()
            if t.live is not None:
                t.live.close()
            if self._log is not None:
                self._log.close()
        cluster_stats = stop_cluster(t)  # with embedding servers: stop them, gather figures
        metrics = self.metrics(time.monotonic() - started, cluster_stats)
        self.source.close()
        return metrics

    def _restore(self, recorded: dict | None) -> None:
        self.acked += acknowledge_recorded(recorded, self.source)
        if recorded:
            self.rows = recorded.get("rows", 0)
            if "scores" in recorded:
                self.progressive = Progressive(Scores.from_state(recorded["scores"]))
            log.info("stream: resumed after %d rows trained on", self.rows)

    def _loop(self) -> None:
        t, s = self.trainer, self.trainer.state
        last_report = time.monotonic()
        log.info(
            "training from %s (streams %s and %s, group %s)",
            redact_url(self.cfg.url or ""),
            self.cfg.impressions,
            self.cfg.clicks,
            self.cfg.group,
        )
        t_last = time.perf_counter()
        while not (self.cfg.max_rows and self.rows >= self.cfg.max_rows):
            step = self.batches.next(lambda: t._stop_signal is not None)
            if step is None:
                return
            kind = t.checkpoints.due(s.step + 1)
            self._train(step)
            now = time.perf_counter()
            s.train_seconds += now - t_last  # waiting for rows included, as file training counts
            t_last = now
            if kind:
                self._checkpoint(kind, wait=False)
            self.acked += self.acks.durable(t.checkpoints.finalizer.latest_step, self.source)
            if time.monotonic() - last_report >= self.cfg.report_every_s:
                self._report()
                last_report = time.monotonic()

    def _train(self, step: StreamBatch) -> None:
        t, s = self.trainer, self.trainer.state
        sched = t.cfg.schedule
        rates = (lr_factor(sched, s.step + 1, 0), lr_factor(sched, s.step + 2, 0))
        t.train_step(step.batch, lr=rates)
        self.progressive.add(t.last_logits, step.batch.labels)
        if t.live is not None:
            t.live.after_step(step.batch.sparse)
        s.step += 1
        n = step.batch.batch_size
        s.samples_seen += n
        self.rows += n
        self.fresh_s.append(max(0.0, time.time() - step.ready_ms / 1000))
        self.acks.add(step.entries)
        self.acks.add(self.batches.take_done())
        if self._log is not None:
            self._log.write("".join(f"{s.step}\t{i}\n" for i in step.impression_ids))
            self._log.flush()

    def _checkpoint(self, kind: str, wait: bool) -> None:
        t = self.trainer
        t.state.stream = {
            "ack": self.acks.cut(t.state.step),
            "rows": self.rows,
            "scores": self.progressive.total.state(),
        }
        t.save_checkpoint(kind, wait)

    def _report(self) -> None:
        recent = self.progressive.take_recent()
        total = self.progressive.summary()
        stats = self.batches.joiner.stats
        lag = self.lag()
        p50 = self.freshness(0.5)
        self.history.append(
            {"rows": self.rows, "auc": recent["auc"], "logloss": recent["logloss"], "lag": lag}
        )
        log.info(
            "stream: %s rows, progressive AUC %.4f (last %s rows %.4f), log loss %.4f; lag %s, "
            "pending %s, late %s, dead %s, trained %.1fs after the event (p50)",
            f"{self.rows:,}",
            total["auc"],
            f"{recent['rows']:,}",
            recent["auc"],
            total["logloss"],
            f"{lag:,}" if lag is not None else "?",
            f"{self.batches.joiner.pending:,}",
            f"{stats.late:,}",
            f"{sum(self.batches.dead.values()):,}",
            float("nan") if p50 is None else p50,
        )

    def lag(self) -> int | None:
        """Entries of the streams not yet delivered to the group (None: unknown now)."""
        try:
            return self.source.lag()
        except Exception as exc:  # a figure: never worth stopping training for
            log.warning("stream lag unavailable: %s", exc)
            return None

    def freshness(self, q: float) -> float | None:
        """Quantile ``q`` of the recent steps' freshness, seconds (None: no step yet)."""
        fresh = sorted(self.fresh_s)
        return fresh[min(len(fresh) - 1, int(q * len(fresh)))] if fresh else None

    def metrics(self, seconds: float, cluster_stats: dict | None = None) -> dict[str, Any]:
        t, s = self.trainer, self.trainer.state
        total = self.progressive.summary()
        out = {
            "mode": "stream",
            "stream": redact_url(self.cfg.url or ""),
            "rows": self.rows,
            "steps": s.step,
            "progressive_auc": total["auc"],
            "progressive_logloss": total["logloss"],
            "rows_per_s": self.rows / s.train_seconds if s.train_seconds else None,
            "train_seconds": s.train_seconds,
            "seconds": seconds,
            "step_time_breakdown_ms": {
                k.removesuffix("_s"): 1e3 * v / max(s.step, 1) for k, v in t.timings.items()
            },
            "freshness_s": {"p50": self.freshness(0.5), "p99": self.freshness(0.99)},
            "entries_read": self.batches.entries_read,
            "entries_acked": self.acked,
            "lag_entries": self.lag(),
            "join": asdict(self.batches.joiner.stats),
            "join_pending": self.batches.joiner.pending,
            "dead_letters": dict(self.batches.dead),
            "history": self.history,
            "peak_rss_mb": peak_rss_mb(),
            "config": t.cfg.model_dump(mode="json"),
            "checkpoints": {"written": len(t.checkpoints.finalizer.completed)},
            "embedding_servers": t.cluster.roles.num_servers if t.cluster else 0,
        }
        if cluster_stats is not None:
            out.update(
                cluster_metrics(cluster_stats, sum(t.client.output_dims()), len(t.spec.tables), s)
            )
        if t.live is not None:
            out["live_updates"] = t.live.stats()
        (t.out_dir / "metrics.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
        return out


def train_stream(cfg: Config, out_dir: Path, resume: bool = False) -> dict[str, Any]:
    """``dlrm train --stream``: one process, the tables in it."""
    trainer = Trainer(stream_config(cfg), out_dir)
    return OnlineTraining(trainer).run(resume)
