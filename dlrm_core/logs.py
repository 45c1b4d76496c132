"""Logging setup shared by every process (CLI, trainer and server ranks, API workers)."""

from __future__ import annotations

import logging
import os

OUR_LOGGERS = ("dlrm_core", "embedding_server", "dense_trainer", "api", "dlrm")


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """Our packages log at INFO (DEBUG with -v, WARNING when quiet: the non-master ranks of a
    distributed job); third-party libraries only warnings (fbgemm logs every TBE's full argument
    list at INFO on the root logger). Ranks prefix their lines with ``[rank N]``."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level)
