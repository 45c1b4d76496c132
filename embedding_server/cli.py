"""``dlrm publish``: export a checkpoint to a serving store."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV_PREFIX = "DLRM_"


def fill_from_env(parser: argparse.ArgumentParser, args: argparse.Namespace, required: list[str]) -> None:
    """Options not given on the command line come from ``DLRM_<OPTION>`` (e.g. ``DLRM_TRAIN``,
    ``DLRM_EMBEDDING_SERVERS``): containers are configured by environment alone. Lists are
    whitespace-separated (``DLRM_SET`` is separated by ``;``)."""
    from embedding_server.errors import ConfigError

    for action in parser._actions:
        dest = action.dest
        if dest in ("help", "func", "command") or not action.option_strings:
            continue
        current = getattr(args, dest, None)
        if current not in (None, False, []):
            continue
        raw = os.environ.get(ENV_PREFIX + dest.upper())
        if raw is None or raw == "":
            continue
        try:
            if isinstance(action, argparse._StoreTrueAction):
                value = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(action, argparse._AppendAction):
                value = [v.strip() for v in raw.split(";") if v.strip()]
            elif action.nargs in ("+", "*"):
                value = [(action.type or str)(v) for v in raw.split()]
            else:
                value = (action.type or str)(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}{dest.upper()}={raw!r}: not a valid {action.option_strings[0]}") from None
        if action.choices is not None and value not in action.choices:
            raise ConfigError(f"{ENV_PREFIX}{dest.upper()}={raw!r}: choose from {list(action.choices)}")
        setattr(args, dest, value)
    for dest in required:
        if getattr(args, dest, None) in (None, []):
            raise ConfigError(f"--{dest.replace('_', '-')} (or {ENV_PREFIX}{dest.upper()}) is required")


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


def wait_until(ready, deadline: float, what: str, every_s: float = 1.0) -> None:
    """Poll ``ready()`` until it is true or ``deadline`` passes (then a clear error)."""
    from embedding_server.errors import ConfigError

    attempt = 0
    while not ready():
        attempt += 1
        if time.monotonic() > deadline:
            raise ConfigError(f"gave up waiting for {what}")
        if attempt % 10 == 1:
            log.info("waiting for %s", what)
        time.sleep(every_s)


def run_publish(args: argparse.Namespace) -> int:
    from embedding_server.errors import ConfigError
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
