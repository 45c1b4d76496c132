"""Streaming reader of the Criteo Kaggle / Terabyte layout.

A line is ``label \\t I1..I13 \\t C1..C26``: an integer label (0/1), 13 integers and 26 hex
categoricals, any of them empty when missing. Files may be plain or gzip (detected by magic
bytes), and of any size: they are read in blocks of ``block_bytes`` cut at line ends, so memory
is bounded by the block size times the blocks in flight.

Each block is parsed column-wise by ``embedding_server.criteo_format`` (the code the API uses
too). Malformed lines (wrong field count, non-integer I, bad hex C, label not
0/1) are dropped and counted; in strict mode the first one raises a :class:`DataError` naming the
file and line.
"""

from __future__ import annotations

import gzip
import io
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from embedding_server.criteo_format import BadLine, RawBlock
from embedding_server.errors import DataError

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"


def open_stream(path: Path) -> io.BufferedIOBase:
    """Open a plain or gzip file for binary reading (gzip detected by its magic bytes)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (returned)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a data file") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied") from None
    if f.peek(2)[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def check_files(paths: list[Path], what: str) -> None:
    """Fail early, naming the file, if any input cannot be opened."""
    if not paths:
        raise DataError(f"no {what} files given")
    for p in paths:
        open_stream(Path(p)).close()


def read_raw_blocks(
    path: Path, file_index: int, block_bytes: int, offset: int = 0, line: int = 1
) -> Iterator[RawBlock]:
    """Blocks of whole lines from ``path``, starting at byte ``offset`` (line number ``line``).

    Block boundaries lie on a fixed grid: a block holds the lines that start before the next
    multiple of ``block_bytes``. So the blocks are the same whether a file is read from its start
    or from any block boundary, which makes a :class:`Position` inside a block exact on resume.
    """
    with open_stream(path) as f:
        try:
            if offset:
                f.seek(offset)
            buf = b""
            eof = False
            while True:
                grid = (offset // block_bytes + 1) * block_bytes
                need = grid - offset  # the block ends with the line holding byte grid - 1
                while len(buf) < need and not eof:
                    chunk = f.read(block_bytes)
                    eof = not chunk
                    buf += chunk
                nl = buf.find(b"\n", max(need - 1, 0))
                while nl < 0 and not eof:
                    chunk = f.read(block_bytes)
                    eof = not chunk
                    start = len(buf)
                    buf += chunk
                    nl = buf.find(b"\n", start)
                if nl < 0:  # end of file: what is left is the last block
                    if buf:
                        block = buf if buf.endswith(b"\n") else buf + b"\n"
                        yield RawBlock(file_index, offset, line, block, block.count(b"\n"))
                    return
                block, buf = buf[: nl + 1], buf[nl + 1 :]
                n = block.count(b"\n")
                yield RawBlock(file_index, offset, line, block, n)
                offset += len(block)
                line += n
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"{path}: cannot read near byte {offset}: {exc}") from None


class BadLineLog:
    """Counts malformed lines; warns once, summarises at the end, or raises in strict mode."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.count = 0
        self.by_reason: Counter[str] = Counter()
        self.first: BadLine | None = None

    def add(self, bad: list[BadLine]) -> None:
        for b in bad:
            if self.strict:
                raise DataError(f"{b.file}:{b.line}: malformed line: {b.reason}")
            if self.first is None:
                self.first = b
                log.warning(
                    "%s:%d: malformed line skipped (%s); further ones are counted and summarised",
                    b.file, b.line, b.reason,
                )
            self.count += 1
            self.by_reason[_reason_kind(b.reason)] += 1

    def summary(self) -> str | None:
        if not self.count:
            return None
        kinds = ", ".join(f"{k}: {v}" for k, v in self.by_reason.most_common())
        return f"skipped {self.count} malformed line(s) ({kinds}); first at {self.first.file}:{self.first.line}"

    def state(self) -> dict:
        return {"count": self.count, "by_reason": dict(self.by_reason)}

    def restore(self, state: dict) -> None:
        self.count = int(state.get("count", 0))
        self.by_reason = Counter(state.get("by_reason", {}))


def _reason_kind(reason: str) -> str:
    if reason.startswith("wrong field count"):
        return "wrong field count"
    if "not an integer" in reason:
        return "non-integer dense value"
    if "not hex" in reason:
        return "bad hex categorical"
    return "bad label"
