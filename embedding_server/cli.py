"""``dlrm publish``: export a checkpoint to a serving store."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from dlrm_core.env import fill_from_env, wait_until
from dlrm_core.errors import ConfigError

log = logging.getLogger(__name__)

def add_publish_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="publish a checkpoint to a serving store",
        description="Export a checkpoint's embedding rows, dense model and feature spec as one "
        "version of a serving store; the store's current version moves only once it is complete.",
    )
    p.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="a checkpoint, a checkpoints directory, or a `dlrm train --out` directory (latest)")
    p.add_argument("--store", metavar="URL", help="file://DIR or redis://[:password@]host:port/db")
    p.add_argument("--version", help="version name (default: step<N>-<date>-<time>)")
    p.add_argument("--row-dtype", choices=["fp32", "fp16"], default="fp32", help="storage type of the rows")
    p.add_argument("--keep", type=int, default=None, metavar="N", help="versions kept in the store (default 3)")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help="wait up to S seconds for the training run to finish (its metrics.json) and the store to answer")
    p.set_defaults(func=run_publish, parser=p)


def run_publish(args: argparse.Namespace) -> int:
    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import StoreUnavailable, open_store

    fill_from_env(args.parser, args, ["checkpoint", "store"])
    keep = 3 if args.keep is None else args.keep
    if keep < 1:
        raise ConfigError("--keep must be at least 1")
    store = open_store(args.store, keep_versions=keep)
    if args.wait:
        deadline = time.monotonic() + args.wait
        wait_until(lambda: (Path(args.checkpoint) / "metrics.json").exists() or (Path(args.checkpoint) / "manifest.json").exists(),
                   deadline, f"the training run to finish ({args.checkpoint}/metrics.json)")

        def store_answers() -> bool:
            try:
                store.current_version()
                return True
            except StoreUnavailable:
                return False

        wait_until(store_answers, deadline, f"the store {args.store}")
    try:
        meta = publish_checkpoint(args.checkpoint, store, args.version, args.row_dtype)
    finally:
        store.close()
    print(json.dumps({"version": meta.version, "step": meta.step, "store": args.store,
                      "tables": len(meta.spec.tables), "row_dtype": meta.row_dtype}))
    return 0
