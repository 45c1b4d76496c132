"""``dlrm publish`` (a checkpoint becomes a serving version) and ``dlrm store`` (list,
promote and collect the versions of a serving store)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from dlrm_core.env import fill_from_env, wait_until
from dlrm_core.errors import ConfigError
from dlrm_core.secrets import redact_url

log = logging.getLogger(__name__)

STORE_HELP = (
    "file://DIR, redis://[user@]host:port/db or rediss://... (TLS); password in "
    "--store-password-file"
)


def _add_store_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="URL", help=STORE_HELP)
    p.add_argument(
        "--store-password-file",
        type=Path,
        metavar="FILE",
        help="file holding the store's password (DLRM_STORE_PASSWORD_FILE)",
    )


def add_publish_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="publish a checkpoint to a serving store",
        description="Export a checkpoint's embedding rows, dense model and feature spec as one "
        "version of a serving store; the store's current version moves only once it is complete.",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="a checkpoint, a checkpoints directory, or a `dlrm train --out` directory (latest)",
    )
    _add_store_options(p)
    p.add_argument("--version", help="version name (default: step<N>-<date>-<time>)")
    p.add_argument(
        "--row-dtype",
        choices=["fp32", "fp16", "int8", "int4"],
        default="fp32",
        help="storage type of the rows (int8/int4: fbgemm row-wise quantized, scale and bias per "
        "row)",
    )
    p.add_argument(
        "--rows",
        choices=["all", "trained"],
        default="all",
        help="trained: store only rows training moved (Redis; the others are served the table "
        "default)",
    )
    p.add_argument(
        "--keep", type=int, default=None, metavar="N", help="versions kept in the store (default 3)"
    )
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="wait up to S seconds for the training run to finish (its metrics.json) and the "
        "store to answer",
    )
    p.set_defaults(func=run_publish, parser=p)


def run_publish(args: argparse.Namespace) -> int:
    from dlrm_core.store_url import check_store_url

    fill_from_env(args.parser, args, ["checkpoint", "store"])
    keep = 3 if args.keep is None else args.keep
    if keep < 1:
        raise ConfigError("--keep must be at least 1")
    check_store_url(args.store)  # a bad URL refused before torch loads
    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import StoreUnavailable, open_store

    store = open_store(args.store, keep_versions=keep, password_file=args.store_password_file)
    if args.wait:
        deadline = time.monotonic() + args.wait
        wait_until(
            lambda: (
                (Path(args.checkpoint) / "metrics.json").exists()
                or (Path(args.checkpoint) / "manifest.json").exists()
            ),
            deadline,
            f"the training run to finish ({args.checkpoint}/metrics.json)",
        )

        def store_answers() -> bool:
            try:
                store.current_version()
                return True
            except StoreUnavailable:
                return False

        wait_until(store_answers, deadline, f"the store {store.url}")
    try:
        meta = publish_checkpoint(
            args.checkpoint, store, args.version, args.row_dtype, rows=args.rows
        )
    finally:
        store.close()
    print(
        json.dumps(
            {
                "version": meta.version,
                "step": meta.step,
                "store": redact_url(args.store),
                "tables": len(meta.spec.tables),
                "row_dtype": meta.row_dtype,
            }
        )
    )
    return 0


def add_store_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "store",
        help="list, promote (roll back) and collect the versions of a serving store",
        description="Manage the versions of a serving store. `list` prints one JSON line per "
        "complete "
        "version (oldest first, the current one marked); `promote VERSION` makes a complete "
        "version "
        "current, atomically (a rollback when it is older; serving replicas switch within their "
        "poll "
        "interval); `gc --keep N` deletes all but the newest N versions, never the current one.",
    )
    p.add_argument("action", choices=["list", "promote", "gc"])
    p.add_argument("version", nargs="?", help="promote: the version to make current")
    _add_store_options(p)
    p.add_argument(
        "--keep", type=int, default=None, metavar="N", help="gc: versions kept (default 3)"
    )
    p.set_defaults(func=run_store, parser=p)


def run_store(args: argparse.Namespace) -> int:
    from embedding_server.stores import open_store

    fill_from_env(args.parser, args, ["store"])
    if args.action == "promote" and not args.version:
        raise ConfigError("store promote: name the VERSION to make current (see `dlrm store list`)")
    if args.action != "promote" and args.version:
        raise ConfigError(f"store {args.action}: takes no VERSION")
    keep = 3 if args.keep is None else args.keep
    if keep < 1:
        raise ConfigError("--keep must be at least 1")
    store = open_store(args.store, password_file=args.store_password_file)
    try:
        if args.action == "list":
            current = store.current_version()
            for meta in store.describe():
                print(
                    json.dumps(
                        {
                            "version": meta.version,
                            "current": meta.version == current,
                            "step": meta.step,
                            "published_at": meta.created_at,
                            "row_dtype": meta.row_dtype,
                            "tables": len(meta.spec.tables),
                        }
                    )
                )
        elif args.action == "promote":
            before = store.current_version()
            store.promote(args.version)
            log.info("%s: current version %s -> %s", store.url, before, args.version)
            print(json.dumps({"current": args.version, "previous": before, "store": store.url}))
        else:
            deleted = store.collect_garbage(keep=keep)
            print(
                json.dumps({"deleted": deleted, "kept": store.list_versions(), "store": store.url})
            )
    finally:
        store.close()
    return 0
