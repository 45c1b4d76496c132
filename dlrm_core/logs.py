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
import threading
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


class _SecondText:
    """``time.strftime(fmt, convert(t))``, made once a second rather than once a line (the cached
    tuple is replaced whole: threads formatting at once never mix two)."""

    def __init__(self, convert) -> None:
        self._convert = convert
        self._last: tuple[int, str | None, str] = (-1, None, "")  # (second, format, its text)

    def __call__(self, created: float, fmt: str) -> str:
        second, last_fmt, text = self._last
        if int(created) != second or fmt != last_fmt:
            text = time.strftime(fmt, self._convert(created))
            self._last = (int(created), fmt, text)
        return text


class TextFormatter(logging.Formatter):
    """``time LEVEL [rank N] logger: [request id] message``."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__(
            f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S"
        )
        self._stamp = _SecondText(self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        if datefmt is None:  # logging's default format carries milliseconds: not cached
            return super().formatTime(record)
        return self._stamp(record.created, datefmt)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid:
            head, sep, tail = text.partition(f"{record.name}: ")
            text = f"{head}{sep}[{rid}] {tail}"
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stamp = _SecondText(time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": f"{self._stamp(record.created, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d}Z",
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


class NotAccess(logging.Filter):
    """Drops the access log's lines (``api.access``): they have their own handler, and still
    propagate to ``api`` and the root logger for handlers added there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "api.access"


class BufferedStreamHandler(logging.StreamHandler):
    """A stream handler that writes its lines in batches: at most ``capacity`` lines or
    ``interval_s`` seconds after the first of them (a daemon thread writes what waits at
    low traffic; :meth:`flush` and ``close``, which ``logging.shutdown`` calls at exit, write at
    once). Records of ``flush_level`` and above are written at once with what came before.

    For the access log, a line a request: a plain StreamHandler writes and flushes each one,
    a system call that also hands the GIL to the batcher thread on every request. Measured
    (an ad-hoc A/B, bench/serving.py's 64-client phase, file store, one worker, 2026-12-04):
    the access log on cost 18% of the instances/s (3,278 against 3,985 off) with a write per
    line. A crash loses at most ``interval_s`` of lines.
    """

    def __init__(
        self,
        stream=None,
        capacity: int = 256,
        interval_s: float = 0.2,
        flush_level: int = logging.WARNING,
    ) -> None:
        super().__init__(stream)
        self.capacity, self.interval_s, self.flush_level = capacity, interval_s, flush_level
        self._lines: list[str] = []
        self._due = 0.0  # monotonic time by which the buffered lines are written
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._pid = os.getpid()

    def emit(self, record: logging.LogRecord) -> None:
        if self._pid != os.getpid():  # a forked child: the parent writes what it had buffered
            self._pid, self._lines, self._writer = os.getpid(), [], None
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - logging's own rule: a bad record never raises
            self.handleError(record)
            return
        now = time.monotonic()
        if not self._lines:  # the first line of a batch: due in interval_s, the writer thread up
            self._due = now + self.interval_s
            self._start_writer()
        self._lines.append(line)
        if (
            len(self._lines) >= self.capacity
            or now >= self._due
            or record.levelno >= self.flush_level
        ):
            self._write()

    def _write(self) -> None:
        """Write the buffered lines (the handler's lock held: ``handle`` calls emit under it)."""
        if self._lines:
            text, self._lines = "".join(self._lines), []
            try:
                self.stream.write(text)
                self.stream.flush()
            # a closed stream (at exit: logging.shutdown ignores it too): dropped
            except ValueError:
                pass
            except Exception:  # noqa: BLE001 - a full or broken stream: reported as logging does, the lines dropped
                self.handleError(None)

    def flush(self) -> None:
        self.acquire()
        try:
            self._write()
        finally:
            self.release()

    def _start_writer(self) -> None:
        if self._writer is None:  # one per process (after a fork, anew: emit)
            self._writer = threading.Thread(target=self._write_loop, name="log-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while not self._wake.wait(self.interval_s):
            if self._lines:
                self.flush()

    def close(self) -> None:
        self.flush()
        self._wake.set()
        super().close()


def logging_config(
    verbose: bool = False, quiet: bool = False, json_lines: bool = False, level: str | None = None
) -> dict:
    """A ``logging.config.dictConfig`` dict: our packages at INFO (DEBUG with verbose, WARNING
    when quiet; ``level`` when given, e.g. ``dlrm serve --log-level``, for every one of them, the
    access log and uvicorn's loggers alike), third-party libraries at WARNING; uvicorn takes it as
    its ``log_config``."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    formatter = {"()": JsonFormatter} if json_lines else {"()": TextFormatter, "prefix": prefix}
    verbose = verbose or (level or "").lower() == "debug"
    level = level.upper() if level else "DEBUG" if verbose else "WARNING" if quiet else "INFO"
    uvicorn_level = level if level != "DEBUG" else "INFO"  # uvicorn's DEBUG: every connection
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"dlrm": formatter},
        "filters": {"request_id": {"()": RequestIdFilter}, "not_access": {"()": NotAccess}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "dlrm",
                "filters": ["not_access", "request_id"],
                "stream": "ext://sys.stderr",
            },
            # the access log (a line a request) in batches: BufferedStreamHandler
            "access": {
                "()": BufferedStreamHandler,
                "formatter": "dlrm",
                "filters": ["request_id"],
                "stream": "ext://sys.stderr",
            },
        },
        "root": {"level": "DEBUG" if verbose else "WARNING", "handlers": ["stderr"]},
        "loggers": {
            **{name: {"level": level} for name in OUR_LOGGERS},
            # (the root's stderr handler drops them)
            "api.access": {"level": level, "handlers": ["access"]},
            # uvicorn's own loggers go through the same handler (no handlers of their own).
            **{
                name: {
                    "level": max(uvicorn_level, "INFO", key=logging.getLevelName),
                    "handlers": [],
                    "propagate": True,
                }
                for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
            },
        },
    }


def setup_logging(
    verbose: bool = False, quiet: bool = False, json_lines: bool = False, level: str | None = None
) -> None:
    """Our packages log at INFO (DEBUG with -v, WARNING when quiet: the non-master ranks of a
    distributed job; ``level`` when given); third-party libraries only warnings (fbgemm logs every
    TBE's full argument list at INFO on the root logger). Ranks prefix their lines with
    ``[rank N]``."""
    logging.config.dictConfig(logging_config(verbose, quiet, json_lines, level))
