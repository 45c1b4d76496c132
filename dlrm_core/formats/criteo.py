"""The Criteo text layout, parsed column-wise: shared by the trainer's reader and the API's
``:predict_tsv`` endpoint, so that a line scores the same offline and online.

A line is ``label \\t I1..I13 \\t C1..C26``: an integer label (0/1), 13 integers and 26 hex
categoricals, any of them empty when missing. A block of whole lines is parsed by pyarrow (all
columns as strings), validated, and turned into model inputs by :mod:`dlrm_core.features`.
Malformed lines (wrong field count, non-integer I, bad hex C, label not 0/1) are reported as
:class:`BadLine` (file, line, reason) and left out.
"""

from __future__ import annotations

import gzip
import io
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from dlrm_core.errors import DataError
from dlrm_core.features import FeatureSpec, hash_to_rows, hex_to_uint64, transform_dense

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class BadLine:
    file: str
    line: int
    reason: str


@dataclass
class ParsedBlock:
    """The valid rows of one block, ready to batch.

    Attributes:
        labels: float32 [n].
        dense: float32 [n, I], already ``log(1 + max(x, 0))``.
        ids: int64 [F, n] rows (one-hot), or None when multi-hot.
        values: multi-hot only: per feature, int64 ids of all its bags, in row order.
        lengths: multi-hot only: int32 [F, n] bag lengths.
        lines: int64 [n], 1-based line number of each row in its file.
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray | None
    values: list[np.ndarray] | None
    lengths: np.ndarray | None
    lines: np.ndarray
    bad: list[BadLine] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class RawBlock:
    """A run of whole lines of one file."""

    file_index: int
    offset: int  # byte offset of the first line in the (decompressed) stream
    line: int  # 1-based number of the first line
    data: bytes
    num_lines: int


class BlockParser:
    """Parses raw blocks into :class:`ParsedBlock` for one feature spec (thread-safe)."""

    def __init__(self, spec: FeatureSpec, file_names: list[str]) -> None:
        self.spec = spec
        self.file_names = file_names
        self.names = spec.column_names
        self._read = pcsv.ReadOptions(column_names=self.names, use_threads=False, block_size=1 << 30)
        self._convert = pcsv.ConvertOptions(
            column_types={n: pa.string() for n in self.names},
            null_values=[""],
            strings_can_be_null=True,
        )

    def parse(self, raw: RawBlock) -> ParsedBlock:
        spec = self.spec
        fname = self.file_names[raw.file_index]
        bad: list[BadLine] = []

        def on_invalid(row: pcsv.InvalidRow) -> str:
            bad.append(
                BadLine(
                    fname,
                    raw.line + (row.number or 1) - 1,
                    f"wrong field count ({row.actual_columns}, expected {row.expected_columns})",
                )
            )
            return "skip"

        parse_opts = pcsv.ParseOptions(
            delimiter="\t", quote_char=False, ignore_empty_lines=False, invalid_row_handler=on_invalid
        )
        try:
            table = pcsv.read_csv(
                pa.py_buffer(raw.data), read_options=self._read, parse_options=parse_opts,
                convert_options=self._convert,
            )
        except pa.ArrowInvalid as exc:
            raise DataError(f"{fname}:{raw.line}: cannot parse block: {exc}") from None
        n = table.num_rows
        # Line number of each parsed row: the block's lines minus the ones skipped above.
        skipped = np.array(sorted(b.line for b in bad), dtype=np.int64)
        all_lines = np.arange(raw.line, raw.line + n + len(skipped), dtype=np.int64)
        lines = np.setdiff1d(all_lines, skipped, assume_unique=True) if len(skipped) else all_lines
        ok = np.ones(n, dtype=bool)
        reasons: list[tuple[np.ndarray, str]] = []

        label = self._ints(table.column("label"))
        label_ok = ~np.isnan(label) & ((label == 0) | (label == 1))
        reasons.append((~label_ok, "label is not 0 or 1"))

        dense = np.empty((n, len(spec.dense)), dtype=np.float32)
        for j, name in enumerate(spec.dense):
            col = self._ints(table.column(name))
            dense[:, j] = transform_dense(col)
            reasons.append((np.isinf(col), f"{name} is not an integer"))

        multi = spec.multi_hot_sep is not None
        ids = None if multi else np.empty((len(spec.tables), n), dtype=np.int64)
        values: list[np.ndarray] = []
        lengths = np.empty((len(spec.tables), n), dtype=np.int32) if multi else None
        for f, t in enumerate(spec.tables):
            col = table.column(t.name).combine_chunks()
            if multi:
                lists = pc.split_pattern(pc.fill_null(col, ""), spec.multi_hot_sep)
                lengths[f] = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
                raw_ids, valid = hex_to_uint64(pc.list_flatten(lists))
                row_of = np.repeat(np.arange(n), lengths[f])
                bad_rows = np.zeros(n, dtype=bool)
                bad_rows[row_of[~valid]] = True
                reasons.append((bad_rows, f"{t.name} is not hex"))
                values.append(hash_to_rows(raw_ids, t.rows))
            else:
                raw_ids, valid = hex_to_uint64(col)
                reasons.append((~valid, f"{t.name} is not hex"))
                ids[f] = hash_to_rows(raw_ids, t.rows)

        for mask, reason in reasons:
            if mask.any():
                for i in np.flatnonzero(mask & ok):
                    bad.append(BadLine(fname, int(lines[i]), reason))
                ok &= ~mask
        if not ok.all():
            keep = np.flatnonzero(ok)
            label, dense, lines = label[keep], dense[keep], lines[keep]
            if multi:
                values = [v[np.repeat(ok, lengths[f])] for f, v in enumerate(values)]
                lengths = lengths[:, keep]
            else:
                ids = ids[:, keep]
        bad.sort(key=lambda b: b.line)
        return ParsedBlock(label.astype(np.float32), dense, ids, values if multi else None, lengths, lines, bad)

    @staticmethod
    def _ints(col: pa.ChunkedArray) -> np.ndarray:
        """Integer column as float64: NaN where empty, +inf where not an integer."""
        col = col.combine_chunks()
        try:
            return pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            good = pc.match_substring_regex(col, r"^\s*[+-]?[0-9]{1,18}\s*$")
            good = pc.or_kleene(good, pc.is_null(col))
            cleaned = pc.if_else(good, col, pa.scalar(None, pa.string()))
            out = pc.cast(pc.utf8_trim_whitespace(cleaned), pa.int64())
            arr = out.to_numpy(zero_copy_only=False).astype(np.float64)
            arr[~good.to_numpy(zero_copy_only=False)] = np.inf
            return arr



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
