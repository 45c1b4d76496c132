"""``dlrm publish``: export a checkpoint to a serving store."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_publish_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="publish a checkpoint to a serving store",
        description="Export a checkpoint's embedding rows, dense model and feature spec as one "
        "version of a serving store; the store's current version moves only once it is complete.",
    )
    p.add_argument("--checkpoint", type=Path, required=True, metavar="DIR",
                   help="a checkpoint, a checkpoints directory, or a `dlrm train --out` directory (latest)")
    p.add_argument("--store", required=True, metavar="URL", help="file://DIR or redis://[:password@]host:port/db")
    p.add_argument("--version", help="version name (default: step<N>-<date>-<time>)")
    p.add_argument("--row-dtype", choices=["fp32", "fp16"], default="fp32", help="storage type of the rows")
    p.add_argument("--keep", type=int, default=3, metavar="N", help="versions kept in the store (default 3)")
    p.set_defaults(func=run_publish)


def run_publish(args: argparse.Namespace) -> int:
    from embedding_server.errors import ConfigError
    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import open_store

    if args.keep < 1:
        raise ConfigError("--keep must be at least 1")
    store = open_store(args.store, keep_versions=args.keep)
    try:
        meta = publish_checkpoint(args.checkpoint, store, args.version, args.row_dtype)
    finally:
        store.close()
    print(json.dumps({"version": meta.version, "step": meta.step, "store": args.store,
                      "tables": len(meta.spec.tables), "row_dtype": meta.row_dtype}))
    return 0
