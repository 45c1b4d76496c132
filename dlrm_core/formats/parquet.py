"""Parquet: row groups streamed with pyarrow, only the columns the schema uses.

Blocks lie on a fixed grid inside each row group (``block_rows`` rows from the group's start),
so a position (the row a block starts at, plus rows consumed) resumes exactly. List columns
are multi-hot features as they are; numbers, strings and dictionaries are read as they are
stored. A column whose type cannot be a feature (a list for a dense feature, floats for a
categorical one) is refused, naming the file and the column.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_core.errors import DataError
from dlrm_core.featurize import LABEL, BadLine
from dlrm_core.formats.base import FileLayout, RawBlock, check_format
from dlrm_core.schema import FeatureSpec

ROW_BYTES = 64
"""Rows per block = block_bytes / ROW_BYTES (64k rows for the default 4 MB)."""


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (pa.ArrowInvalid, OSError) as exc:
        check_format(path, "parquet")  # a CSV under a Parquet schema: says so, and which setting
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None


def _kind_of(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind_of(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _kind_of(t.value_type)
        return "list" if inner in ("string", "integer") else "other"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
        return "string"
    return "other"


ACCEPTED = {
    "label": {"integer", "float", "bool", "string"},
    "dense": {"integer", "float", "bool", "string"},
    "categorical": {"integer", "string", "list"},
}


class ParquetFormat:
    def __init__(self, spec: FeatureSpec) -> None:
        self.spec = spec

    def first_row_line(self, path: Path) -> int:
        """The row number of the file's first row (rows count from 1, as lines do)."""
        return 1

    def column_names(self, path: Path) -> list[str]:
        return list(_open(path).schema_arrow.names)

    def check_types(self, layout: FileLayout) -> None:
        """Refuse columns whose type cannot feed their feature, naming file and column."""
        path, positions = layout.path, layout.positions
        schema = _open(path).schema_arrow
        roles = {
            LABEL: "label",
            **{f.name: "dense" for f in self.spec.dense},
            **{f.name: "categorical" for f in self.spec.categorical},
        }
        for key, pos in positions.items():
            field = schema.field(pos)
            kind = _kind_of(field.type)
            role = roles[key]
            if kind not in ACCEPTED[role]:
                what = "the label" if key == LABEL else f"{role} feature {key!r}"
                raise DataError(
                    f"{path}: column {field.name!r} is {field.type}, which cannot be {what} "
                    f"(expected {' or '.join(sorted(ACCEPTED[role]))})"
                )

    def blocks(
        self, layout: FileLayout, file_index: int, block_bytes: int, offset: int, line: int
    ) -> Iterator[RawBlock]:
        path = layout.path
        f = _open(path)
        read = [layout.names[i] for i in layout.used]
        block_rows = max(1024, block_bytes // ROW_BYTES)
        start = 0
        for g in range(f.metadata.num_row_groups):
            rows = f.metadata.row_group(g).num_rows
            if start + rows <= offset:
                start += rows
                continue
            try:
                group = f.read_row_group(g, columns=read)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"{path}: cannot read row group {g}: {exc}") from None
            for lo in range(0, rows, block_rows):
                if start + lo + block_rows <= offset:
                    continue
                piece = group.slice(lo, block_rows)
                yield RawBlock(file_index, start + lo, start + lo + 1, piece, piece.num_rows)
            start += rows

    def parse(
        self,
        raw: RawBlock,
        layout: FileLayout,
        file_name: str,
    ) -> tuple[dict[str, pa.Array], int, np.ndarray, list[BadLine]]:
        table: pa.Table = raw.data
        columns = {key: table.column(layout.names[pos]) for key, pos in layout.positions.items()}
        lines = np.arange(raw.line, raw.line + table.num_rows, dtype=np.int64)
        return columns, table.num_rows, lines, []
