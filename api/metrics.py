"""Prometheus metrics of one app instance (its own registry, so that apps do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "dlrm_request_latency_seconds", "Request latency by endpoint", ["endpoint", "status"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.batch_size = Histogram(
            "dlrm_batch_instances", "Instances per predict request",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r,
        )
        self.cache_hits = Counter("dlrm_cache_hits_total", "Row lookups served by the row cache", registry=r)
        self.cache_misses = Counter("dlrm_cache_misses_total", "Row lookups that went to the store", registry=r)
        self.lookups = Counter("dlrm_row_lookups_total", "Distinct rows looked up", registry=r)
        self.unknown_ids = Counter(
            "dlrm_unknown_ids_total", "Rows missing from the store (served the default embedding)", registry=r
        )
        self.store_errors = Counter("dlrm_store_errors_total", "Failed store calls", ["operation"], registry=r)
        self.model_version = Gauge(
            "dlrm_model_version_info", "The version being served (value 1)", ["version"], registry=r
        )
        self.live_updates = Counter("dlrm_live_row_updates_total", "Rows refreshed by live updates", registry=r)
