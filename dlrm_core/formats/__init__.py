"""Input formats: how files become featurised blocks of rows (one module per format).

    delimited.py   criteo (TSV, no header), csv and tsv (a header line, quoted fields)
    parquet.py     Parquet row groups (list columns are multi-hot)

:class:`InputReader` puts a format and the featuriser (``dlrm_core/featurize.py``) together:
``blocks()`` yields raw blocks on the format's fixed grid (exact resume positions), ``parse()``
turns one into a :class:`~dlrm_core.featurize.ParsedBlock` (thread-safe: the loader calls it
from worker threads).
"""

from __future__ import annotations

import csv
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dlrm_core.errors import DataError
from dlrm_core.featurize import DENSE_MAX_ABS, LABEL, Featurizer, ParsedBlock
from dlrm_core.featurize_values import ValueFeaturizer
from dlrm_core.formats.base import FileLayout, RawBlock, check_files, feature_positions, open_stream
from dlrm_core.formats.delimited import DelimitedFormat
from dlrm_core.formats.parquet import ParquetFormat
from dlrm_core.schema import FeatureSpec

__all__ = ["InputReader", "RawBlock", "check_files", "open_format", "open_stream"]


def open_format(spec: FeatureSpec) -> DelimitedFormat | ParquetFormat:
    return ParquetFormat(spec) if spec.format == "parquet" else DelimitedFormat(spec)


class InputReader:
    """Reads the input files of one feature spec.

    Args:
        spec: the schema (format, columns, features).
        files: the input files, in order (``file_index`` counts in this list).
        with_label: the input has a label column (training and test files do; requests may not).
    """

    def __init__(self, spec: FeatureSpec, files: list[Path], with_label: bool = True) -> None:
        self.spec = spec
        self.files = [Path(f) for f in files]
        self.format = open_format(spec)
        self.featurizer = Featurizer(spec, with_label)
        self.with_label = with_label
        self._layouts: dict[int, FileLayout] = {}
        self._lock = threading.Lock()

    def layout(self, file_index: int) -> FileLayout:
        """Where the schema's columns are in file ``file_index`` (read once)."""
        with self._lock:
            if file_index not in self._layouts:
                path = self.files[file_index]
                names = self.format.column_names(path)
                positions = feature_positions(self.spec, names, str(path), self.with_label)
                layout = FileLayout(path, names, positions, self.format.first_row_line(path))
                if isinstance(self.format, ParquetFormat):
                    self.format.check_types(layout)
                self._layouts[file_index] = layout
            return self._layouts[file_index]

    def row_numbers(self, file_index: int, lines: np.ndarray) -> np.ndarray:
        """The data-row ordinals (1-based, the header not counted) of rows at ``lines`` of file
        ``file_index``: the same rows of a table in CSV and in Parquet get the same numbers."""
        return lines - (self.layout(file_index).first_row - 1)

    def check(self) -> None:
        """Open every file and find the schema's columns in it (fail early, naming file and
        column)."""
        check_files(self.files, "input")
        for i in range(len(self.files)):
            self.layout(i)

    def blocks(
        self, file_index: int, block_bytes: int, offset: int = 0, line: int = 1
    ) -> Iterator[RawBlock]:
        """Raw blocks of one file from ``offset`` (a block boundary) on."""
        yield from self.format.blocks(
            self.layout(file_index), file_index, block_bytes, offset, line
        )

    def parse(self, raw: RawBlock) -> ParsedBlock:
        layout = self.layout(raw.file_index)
        name = str(self.files[raw.file_index])
        columns, n, lines, bad = self.format.parse(raw, layout, name)
        return self.featurizer(columns, n, lines, name, bad)


_PLAIN_INT = re.compile(r"-?[1-9][0-9]{0,14}|0")
"""A dense field the value path reads: an integer every parser reads alike (no sign on 0, no
leading zeros, exact as float64)."""


class LineParser:
    """Lines in a model's own input layout, as a request sends them (``:predict_tsv``), with or
    without the label column. Parquet models take tab-separated lines in the schema's column order.
    """

    def __init__(self, spec: FeatureSpec, dense_max_abs: float = DENSE_MAX_ABS) -> None:
        if not spec.columns:
            raise DataError("the model's spec lists no input columns: it cannot parse lines")
        self.spec = spec
        self.names = list(spec.columns)
        text_spec = (
            spec
            if spec.format != "parquet"
            else spec.model_copy(update={"format": "tsv", "delimiter": "\t"})
        )
        self.format = DelimitedFormat(text_spec.model_copy(update={"header": False}))
        self.with_label = FileLayout(
            Path("request"), self.names, feature_positions(spec, self.names, "request")
        )
        without = [n for i, n in enumerate(self.names) if i != self.with_label.positions[LABEL]]
        self.without_label = FileLayout(
            Path("request"), without, feature_positions(spec, without, "request", False)
        )
        self.featurize = {
            True: Featurizer(spec, True, dense_max_abs),
            False: Featurizer(spec, False, dense_max_abs),
        }
        self.values = ValueFeaturizer(spec, dense_max_abs)

    def one_line(self, text: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A single unquoted line -> model inputs through the value path (the same inputs as
        :meth:`parse`); None where :meth:`parse` must take it (several lines, quoting, a field
        count or a value it reads otherwise: a label other than 0/1, a number that is not a
        plain integer, ...), which also reports what is wrong."""
        if self.format.quoted or text.count(b"\n") > 1:
            return None
        try:
            line = text.rstrip(b"\n").decode("utf-8")
        except UnicodeDecodeError:
            return None
        fields = line.split(self.format.delimiter)
        if (
            not line.strip()
            or "\r" in line
            or len(fields) not in (len(self.names), len(self.names) - 1)
        ):
            return None
        layout = self.with_label if len(fields) == len(self.names) else self.without_label
        at = layout.positions
        if LABEL in at and fields[at[LABEL]] not in ("0", "1"):
            return None
        dense = []
        for f in self.spec.dense:
            v = fields[at[f.name]]
            if v and not _PLAIN_INT.fullmatch(v):
                return None
            dense.append([int(v) if v else None])
        cats = [[fields[at[f.name]] or None] for f in self.spec.categorical]
        return self.values(dense, cats, 1)

    def fields(self, first_line: bytes) -> int:
        text = first_line.decode("utf-8", errors="replace").rstrip("\r\n")
        if self.format.quoted:
            return len(next(csv.reader([text], delimiter=self.format.delimiter)))
        return text.count(self.format.delimiter) + 1

    def parse(self, text: bytes, name: str = "request") -> ParsedBlock:
        """Lines -> featurised rows; the label column is optional (all lines alike)."""
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise DataError(f"{name}: no lines")
        fields = self.fields(lines[0])
        if fields not in (len(self.names), len(self.names) - 1):
            raise DataError(
                f"line 1: expected {len(self.names) - 1} fields (without the label) or "
                f"{len(self.names)} (with it), got {fields}"
            )
        labelled = fields == len(self.names)
        layout = self.with_label if labelled else self.without_label
        raw = RawBlock(0, 0, 1, b"\n".join(lines) + b"\n", len(lines))
        columns, n, line_numbers, bad = self.format.parse(raw, layout, name)
        return self.featurize[labelled](columns, n, line_numbers, name, bad)
