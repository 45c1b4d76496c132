"""Prometheus metrics of the serving API, one view over every worker process.

One worker (tests, ``--workers 1``): each app has its own registry. Several workers
(``dlrm serve --workers N`` sets ``PROMETHEUS_MULTIPROC_DIR``): every worker writes its values
to memory-mapped files in that directory and whichever worker answers ``/metrics`` reads them
all (prometheus_client's multiprocess mode): counters and histograms are sums over the workers,
gauges say how they combine (``livemin``: the oldest model any live worker serves). Process
metrics are read from ``/proc`` for each live worker (label ``pid``). Ages (model age, store
staleness) and the cache hit ratio are derived when scraped, so they are never stale.
"""

from __future__ import annotations

import glob
import math
import os
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKERS_ENV = "DLRM_WORKERS"
"""How many workers ``dlrm serve`` started (readiness waits for all of them)."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServingMetrics:
    """The metrics one app updates. ``multiprocess_dir`` default: ``$PROMETHEUS_MULTIPROC_DIR``."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROC_ENV) or None
        self.registry = None if self.multiprocess_dir else CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "dlrm_request_latency_seconds",
            "Request latency by route template, method and status",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "dlrm_batch_instances",
            "Examples per scored request, by input kind (instances, lines, tensors)",
            ["input"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        self.model_batch_requests = Histogram(
            "dlrm_model_batch_requests",
            "Requests coalesced into one model call (dynamic batching; 1: alone)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.model_batch_examples = Histogram(
            "dlrm_model_batch_examples",
            "Examples scored by one model call (all its requests' together)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        self.store_latency = Histogram(
            "dlrm_store_seconds",
            "Store round trips by operation (lookup: a request's rows; poll: "
            "current version and live updates; load: a whole version)",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(
            "dlrm_cache_hits_total", "Row lookups served by the row cache", registry=r
        )
        self.cache_misses = Counter(
            "dlrm_cache_misses_total", "Row lookups that went to the store", registry=r
        )
        self.lookups = Counter("dlrm_row_lookups_total", "Distinct rows looked up", registry=r)
        self.unknown_ids = Counter(
            "dlrm_unknown_ids_total",
            "Ids served their table's default row: rows missing from a version "
            "the store holds, ids a dynamic table never admitted",
            ["table"],
            registry=r,
        )
        self.store_errors = Counter(
            "dlrm_store_errors_total", "Failed store calls", ["operation"], registry=r
        )
        self.reloads = Counter(
            "dlrm_version_loads_total",
            "Versions loaded, by reason (new: the store's current one moved or "
            "a request pinned it; lost: live updates were trimmed; vanished: the version was "
            "deleted)",
            ["reason"],
            registry=r,
        )
        self.live_updates = Counter(
            "dlrm_live_row_updates_total", "Rows refreshed by live updates", registry=r
        )
        self.model_version = Gauge(
            "dlrm_model_version_info",
            "The version being served (1) by some live worker",
            ["version"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.generation = Gauge(
            "dlrm_model_generation",
            "Live updates applied to the served version (lowest over workers)",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.published_at = Gauge(
            "dlrm_model_published_timestamp_seconds",
            "Publish time of the served version (oldest over workers)",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.last_sync = Gauge(
            "dlrm_store_last_sync_timestamp_seconds",
            "Last time a worker caught up with the store (oldest over workers)",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.update_lag = Gauge(
            "dlrm_live_update_lag_seconds",
            "Delay between a live update's write and its application, at the "
            "last poll that applied some (worst worker)",
            multiprocess_mode="livemax",
            registry=r,
        )
        self.ready = Gauge(
            "dlrm_worker_ready",
            "1 once the worker has a model loaded (per worker: pid)",
            multiprocess_mode="liveall",
            registry=r,
        )
        if r is not None:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)
        self._ready = ready

    def workers_ready(self) -> tuple[int, int]:
        """(workers with a model, workers started): over every live worker in multiprocess mode
        (reading only the readiness gauge's files: the probes ask often)."""
        if self.multiprocess_dir is None:
            return int(getattr(self, "_ready", False)), 1
        expected = int(os.environ.get(WORKERS_ENV, "1"))
        _forget_dead_workers(self.multiprocess_dir)
        files = glob.glob(os.path.join(self.multiprocess_dir, "gauge_liveall_*.db"))
        ready = 0
        for family in MultiProcessCollector.merge(files, accumulate=False):
            if family.name == "dlrm_worker_ready":
                ready = sum(1 for s in family.samples if s.value >= 1)
        return ready, max(expected, 1)

    # -- exposition --------------------------------------------------------------------------------
    def _collect(self) -> list[Metric]:
        if self.registry is not None:
            return list(self.registry.collect())
        _forget_dead_workers(self.multiprocess_dir)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        return [*registry.collect(), *_worker_processes(self.multiprocess_dir)]

    def render(self) -> bytes:
        """The text exposition of every worker's metrics, with the derived gauges."""
        families = self._collect()
        families += _derived(families, time.time())
        return generate_latest(_Families(families))


class _Families:
    """A registry-shaped view of collected families (``generate_latest`` reads ``collect()``)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _value(families: list[Metric], name: str) -> float | None:
    values = [
        s.value
        for f in families
        if f.name == name
        for s in f.samples
        if s.name in (name, f"{name}_total")
    ]
    return sum(values) if values else None


def _derived(families: list[Metric], now: float) -> list[Metric]:
    out = []
    hits, misses = _value(families, "dlrm_cache_hits"), _value(families, "dlrm_cache_misses")
    if hits is not None and misses is not None and hits + misses > 0:
        out.append(
            GaugeMetricFamily(
                "dlrm_cache_hit_ratio",
                "Row lookups served by the row cache, since start",
                value=hits / (hits + misses),
            )
        )
    for source, name, doc in (
        (
            "dlrm_model_published_timestamp_seconds",
            "dlrm_model_age_seconds",
            "Age of the oldest served version",
        ),
        (
            "dlrm_store_last_sync_timestamp_seconds",
            "dlrm_store_staleness_seconds",
            "Seconds since the most lagging worker last caught up with the store",
        ),
    ):
        stamp = _value(families, source)
        if stamp is not None and stamp > 0 and math.isfinite(stamp):
            out.append(GaugeMetricFamily(name, doc, value=max(0.0, now - stamp)))
    return out


def _pids(directory: str) -> set[int]:
    pids = set()
    for path in glob.glob(os.path.join(directory, "*.db")):
        tail = os.path.basename(path).rsplit("_", 1)[-1].removesuffix(".db")
        if tail.isdigit():
            pids.add(int(tail))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _forget_dead_workers(directory: str) -> None:
    """Drop the live gauges of workers that died (uvicorn restarts them under a new pid)."""
    for pid in _pids(directory):
        if not _alive(pid):
            mark_process_dead(pid, directory)


def _worker_processes(directory: str) -> list[Metric]:
    """process_* metrics of every live worker, labelled by pid (read from /proc)."""
    merged: dict[str, Metric] = {}
    for pid in sorted(p for p in _pids(directory) if _alive(p)):
        for family in ProcessCollector(pid=lambda p=pid: p, registry=None).collect():
            out = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            for sample in family.samples:
                out.add_sample(sample.name, {**sample.labels, "pid": str(pid)}, sample.value)
    return list(merged.values())
