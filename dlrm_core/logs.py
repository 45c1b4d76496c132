"""Logging setup shared by every process (CLI, trainer and server ranks, API workers).

Lines are text (``12:00:01 INFO api.service: ...``) or, with ``json=True``, one JSON object per
line (``ts``, ``level``, ``logger``, ``message``, ``request_id``, ``exc``, and the fields a caller
passed as ``extra={"fields": {...}}``) for log pipelines. A request's id (:data:`REQUEST_ID`,
set by the API for the duration of a request) is on every line logged while serving it.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import time
from contextvars import ContextVar

OUR_LOGGERS = ("dlrm_core", "embedding_server", "dense_trainer", "api", "dlrm")

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
"""The id of the request being served in this context (None outside requests)."""


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (``record.request_id``, None outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL [rank N] logger: [request id] message``."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid:
            head, sep, tail = text.partition(f"{record.name}: ")
            text = f"{head}{sep}[{rid}] {tail}"
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        rank = os.environ.get("RANK")
        if rank is not None:
            out["rank"] = int(rank) if rank.isdigit() else rank
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def logging_config(verbose: bool = False, quiet: bool = False, json_lines: bool = False) -> dict:
    """A ``logging.config.dictConfig`` dict: our packages at INFO (DEBUG with verbose, WARNING
    when quiet), third-party libraries at WARNING; uvicorn takes it as its ``log_config``."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    formatter = {"()": JsonFormatter} if json_lines else {"()": TextFormatter, "prefix": prefix}
    level = "DEBUG" if verbose else "WARNING" if quiet else "INFO"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"dlrm": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "dlrm", "filters": ["request_id"],
                                "stream": "ext://sys.stderr"}},
        "root": {"level": "DEBUG" if verbose else "WARNING", "handlers": ["stderr"]},
        "loggers": {
            **{name: {"level": level} for name in OUR_LOGGERS},
            # uvicorn's own loggers go through the same handler (no handlers of their own).
            **{name: {"level": "INFO", "handlers": [], "propagate": True}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
        },
    }


def setup_logging(verbose: bool = False, quiet: bool = False, json_lines: bool = False) -> None:
    """Our packages log at INFO (DEBUG with -v, WARNING when quiet: the non-master ranks of a
    distributed job); third-party libraries only warnings (fbgemm logs every TBE's full argument
    list at INFO on the root logger). Ranks prefix their lines with ``[rank N]``."""
    logging.config.dictConfig(logging_config(verbose, quiet, json_lines))
