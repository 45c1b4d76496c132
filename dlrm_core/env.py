"""``DLRM_*`` environment variables: containers are configured by environment alone.

Every command-line option ``--some-option`` of every ``dlrm`` command may instead come from
``DLRM_SOME_OPTION`` (command line first). Lists are whitespace-separated; options that may be
repeated (``--set``) are separated by ``;``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable

from dlrm_core.errors import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "DLRM_"


def env_names(action: argparse.Action) -> list[str]:
    """The variables an option reads: ``DLRM_<DEST>`` and, for each long option string,
    ``DLRM_<OPTION>`` (``--embedding.dim`` -> ``DLRM_EMBEDDING_DIM``)."""
    names = [ENV_PREFIX + action.dest.upper().replace(".", "_").replace("-", "_")]
    for opt in action.option_strings:
        if opt.startswith("--") and not opt.startswith("--no-"):
            names.append(ENV_PREFIX + opt[2:].upper().replace(".", "_").replace("-", "_"))
    return list(dict.fromkeys(names))


def _convert(action: argparse.Action, raw: str, name: str):
    try:
        if action.nargs == 0:  # store_true / store_const / BooleanOptionalAction
            truthy = raw.strip().lower() in ("1", "true", "yes", "on")
            if isinstance(action, argparse.BooleanOptionalAction):
                return truthy
            return action.const if truthy else None
        if isinstance(action, argparse._AppendAction):
            return [v.strip() for v in raw.split(";") if v.strip()]
        if action.nargs in ("+", "*"):
            return [(action.type or str)(v) for v in raw.split()]
        return (action.type or str)(raw)
    except (ValueError, argparse.ArgumentTypeError):
        raise ConfigError(f"{name}={raw!r}: not a valid {action.option_strings[0]}") from None


def fill_from_env(
    parser: argparse.ArgumentParser, args: argparse.Namespace, required: list[str]
) -> None:
    """Options not given on the command line come from their ``DLRM_*`` variable.

    Args:
        parser: the command's parser (its actions say each option's type).
        args: the parsed command line, completed in place.
        required: destinations that must be set one way or the other.

    Raises:
        ConfigError: a variable holds a bad value, or a required option is missing.
    """
    for action in parser._actions:
        dest = action.dest
        if dest in ("help", "func", "command", "parser") or not action.option_strings:
            continue
        if getattr(args, dest, None) not in (None, False, []):
            continue
        for name in env_names(action):
            raw = os.environ.get(name)
            if raw is None or raw == "":
                continue
            value = _convert(action, raw, name)
            if action.choices is not None and value not in action.choices:
                raise ConfigError(f"{name}={raw!r}: choose from {list(action.choices)}")
            setattr(args, dest, value)
            break
    for dest in required:
        if getattr(args, dest, None) in (None, []):
            raise ConfigError(
                f"--{dest.replace('_', '-')} (or {ENV_PREFIX}{dest.upper()}) is required"
            )


def wait_until(ready: Callable[[], bool], deadline: float, what: str, every_s: float = 1.0) -> None:
    """Poll ``ready()`` until it is true or ``deadline`` (monotonic) passes (then a clear error)."""
    attempt = 0
    while not ready():
        attempt += 1
        if time.monotonic() > deadline:
            raise ConfigError(f"gave up waiting for {what}")
        if attempt % 10 == 1:
            log.info("waiting for %s", what)
        time.sleep(every_s)
