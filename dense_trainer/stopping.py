"""How a training run stops: on a signal at the next step boundary, and, with embedding
servers, by stopping them and gathering every rank's timings and traffic at the master."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

import torch.distributed as dist

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_signals(trainer) -> Iterator[None]:
    """SIGINT/SIGTERM stop training at the next step boundary (with a checkpoint)."""

    def on_signal(signum, _frame) -> None:
        trainer._stop_signal = signum
        log.warning(
            "received %s: stopping after this step and writing a checkpoint",
            signal.Signals(signum).name,
        )

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def stop_cluster(trainer) -> dict | None:
    """Stop the embedding servers and collect every rank's timings and traffic at the master."""
    if trainer.cluster is None:
        return None
    trainer.client.close()
    mine = {
        "rank": trainer.rank,
        "timings": dict(trainer.timings),
        "client": dict(trainer.client.stats),
        "rows_parsed": trainer.state.parse_rows,
        "exchange": dict(trainer.cluster.transport.stats) if trainer.cluster.transport else {},
    }
    gathered: list | None = [None] * trainer.cluster.roles.world_size if trainer.is_master else None
    dist.gather_object(mine, gathered, dst=0)
    return {"ranks": gathered} if trainer.is_master else None
