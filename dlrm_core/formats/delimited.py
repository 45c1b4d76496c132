"""Delimited text: Criteo TSV (no header, no quoting), and CSV / TSV with a header line (quoted
fields, empty cells are missing). Plain or gzip, streamed in blocks of whole lines.

Blocks lie on a fixed grid: a block holds the lines that start before the next multiple of
``block_bytes``, so the blocks are the same whether a file is read from its start or from any
block boundary, which makes a position inside a block exact on resume. Each block is parsed
column-wise by pyarrow (only the columns the schema uses, all as strings) and handed to the
featuriser. A quoted value may hold the delimiter, not a line break.
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from dlrm_core.errors import DataError
from dlrm_core.featurize import BadLine
from dlrm_core.formats.base import FileLayout, RawBlock, check_format, open_stream
from dlrm_core.schema import FeatureSpec


def read_raw_blocks(
    path: Path, file_index: int, block_bytes: int, offset: int = 0, line: int = 1
) -> Iterator[RawBlock]:
    """Blocks of whole lines from ``path``, starting at byte ``offset`` (line number ``line``)."""
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


class DelimitedFormat:
    """One delimited layout (``criteo``, ``csv`` or ``tsv``) for one feature spec."""

    def __init__(self, spec: FeatureSpec) -> None:
        self.spec = spec
        self.delimiter = spec.delimiter
        self.header = spec.header
        self.quoted = spec.format != "criteo"

    def _first_line(self, path: Path) -> bytes:
        with open_stream(path) as f:
            try:
                return f.readline()
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise DataError(f"{path}: cannot read: {exc}") from None

    def _fields(self, line: bytes) -> list[str]:
        text = line.decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")
        if self.quoted:
            return [c.strip() for c in next(csv.reader([text], delimiter=self.delimiter), [])]
        return [c.strip() for c in text.split(self.delimiter)]

    def first_row_line(self, path: Path) -> int:
        """The line number of the file's first data row (after its header, if any)."""
        return 2 if self.has_header(path) else 1

    def has_header(self, path: Path) -> bool:
        """Whether the file starts with a header line. With ``header`` set, a file whose first line
        is not a header of the known columns (``spec.columns``, e.g. the first training file's)
        is read as data in that layout: a test file without the training file's header works."""
        if not self.header:
            return False
        known = self.spec.columns
        if not known:
            return True
        fields = self._fields(self._first_line(path))
        named = {
            f.column if isinstance(f.column, str) else f.name
            for f in [*self.spec.dense, *self.spec.categorical]
        }
        return fields == list(known) or named <= set(fields)

    def column_names(self, path: Path) -> list[str]:
        """The file's columns: its header, the spec's ``columns``, or ``0, 1, ...``."""
        check_format(path, self.spec.format)  # a Parquet file under a CSV schema: say so
        first = self._first_line(path)
        if self.has_header(path):
            if not first.strip():
                raise DataError(f"{path}: empty file, expected a header line")
            return self._fields(first)
        if self.spec.columns:
            return list(self.spec.columns)
        return [str(i) for i in range(len(self._fields(first)))]

    def data_start(self, path: Path) -> tuple[int, int]:
        """(byte offset, line number) of the first data line."""
        if not self.has_header(path):
            return 0, 1
        return len(self._first_line(path)), 2

    def blocks(
        self, layout: FileLayout, file_index: int, block_bytes: int, offset: int, line: int
    ) -> Iterator[RawBlock]:
        start, first_line = self.data_start(layout.path)
        if offset < start:
            offset, line = start, first_line
        yield from read_raw_blocks(layout.path, file_index, block_bytes, offset, line)

    def parse(
        self,
        raw: RawBlock,
        layout: FileLayout,
        file_name: str,
    ) -> tuple[dict[str, pa.Array], int, np.ndarray, list[BadLine]]:
        """A block of lines -> (the used columns by key, rows, line of each row, malformed
        lines)."""
        positions, num_columns = layout.positions, len(layout.names)
        bad: list[BadLine] = []

        def on_invalid(row: pcsv.InvalidRow) -> str:
            bad.append(
                BadLine(
                    file_name,
                    raw.line + (row.number or 1) - 1,
                    f"wrong field count ({row.actual_columns}, expected {row.expected_columns})",
                )
            )
            return "skip"

        names = [f"c{i}" for i in range(num_columns)]
        used = sorted(set(positions.values()))
        try:
            table = pcsv.read_csv(
                pa.py_buffer(raw.data),
                read_options=pcsv.ReadOptions(
                    column_names=names, use_threads=False, block_size=1 << 30
                ),
                parse_options=pcsv.ParseOptions(
                    delimiter=self.delimiter,
                    quote_char='"' if self.quoted else False,
                    ignore_empty_lines=False,
                    invalid_row_handler=on_invalid,
                ),
                convert_options=pcsv.ConvertOptions(
                    include_columns=[names[i] for i in used],
                    column_types={names[i]: pa.string() for i in used},
                    null_values=[""],
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=True,
                ),
            )
        except pa.ArrowInvalid as exc:
            raise DataError(f"{file_name}:{raw.line}: cannot parse block: {exc}") from None
        n = table.num_rows
        # Line number of each parsed row: the block's lines minus the ones skipped above.
        skipped = np.array(sorted(b.line for b in bad), dtype=np.int64)
        all_lines = np.arange(raw.line, raw.line + n + len(skipped), dtype=np.int64)
        lines = np.setdiff1d(all_lines, skipped, assume_unique=True) if len(skipped) else all_lines
        columns = {key: table.column(names[pos]) for key, pos in positions.items()}
        return columns, n, lines, bad
