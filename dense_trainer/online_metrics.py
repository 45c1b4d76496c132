"""Prometheus metrics of online training (``stream.metrics_port``), read when scraped.

Nothing is updated in the training loop: a collector reads the run's own counters (rows, the
joiner's counts, dead letters, the progressive figures, freshness) at each scrape, and the
group's lag from Redis (bounded by the source's timeout; a failing read leaves it out).
"""

from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


class OnlineCollector:
    """Args:
    run: the ``online.OnlineTraining`` being measured.
    """

    def __init__(self, run) -> None:
        self.run = run

    def collect(self) -> list[Metric]:
        r = self.run
        stats, joiner = r.batches.joiner.stats, r.batches.joiner
        out: list[Metric] = [
            CounterMetricFamily(
                "dlrm_stream_rows", "Rows trained on from the stream", value=r.rows
            ),
            CounterMetricFamily(
                "dlrm_stream_entries_read", "Entries read", value=r.batches.entries_read
            ),
            CounterMetricFamily(
                "dlrm_stream_entries_acked", "Entries acknowledged (checkpointed)", value=r.acked
            ),
            GaugeMetricFamily(
                "dlrm_join_pending", "Impressions waiting for feedback", value=joiner.pending
            ),
            CounterMetricFamily(
                "dlrm_join_late", "Feedback after its impression's window", value=stats.late
            ),
        ]
        rows = CounterMetricFamily(
            "dlrm_join_rows", "Rows made by the joiner, by how", labels=["how"]
        )
        for how in ("joined", "expired", "evicted"):
            rows.add_metric([how], getattr(stats, how))
        dead = CounterMetricFamily(
            "dlrm_stream_dead_letters",
            "Malformed entries dead-lettered, by reason",
            labels=["reason"],
        )
        for reason, n in r.batches.dead.items():
            dead.add_metric([reason[:120]], n)
        out += [rows, dead]
        total = r.progressive.summary()
        for name, value in (("auc", total["auc"]), ("logloss", total["logloss"])):
            if not math.isnan(value):
                out.append(
                    GaugeMetricFamily(
                        f"dlrm_stream_progressive_{name}",
                        f"Progressive (predict-then-train) {name} of every row so far",
                        value=value,
                    )
                )
        if r.fresh_s:
            g = GaugeMetricFamily(
                "dlrm_stream_freshness_seconds",
                "From a row's label (its click, its window's close) to trained on, recent steps",
                labels=["quantile"],
            )
            for q in (0.5, 0.99):
                g.add_metric([str(q)], r.freshness(q))
            out.append(g)
        lag = r.lag()
        if lag is not None:
            out.append(
                GaugeMetricFamily(
                    "dlrm_stream_lag_entries", "Entries not yet delivered to the group", value=lag
                )
            )
        return out


def serve_metrics(run, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    """Serve ``/metrics`` of ``run`` on ``host:port`` (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(OnlineCollector(run))
    start_http_server(port, addr=host, registry=registry)
    log.info("stream metrics on http://%s:%d/metrics", host, port)
    return registry
