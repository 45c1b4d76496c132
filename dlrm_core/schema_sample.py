"""A sample of the input for schema inference: the first rows of the files, streamed (text in
1 MiB blocks, every column as strings; Parquet in batches), with where each row came from, so a
rule's message can name the file and line. Used by ``dlrm_core.schema_inference``.
"""

from __future__ import annotations

import csv
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from dlrm_core.errors import DataError
from dlrm_core.formats.base import check_files, check_format, open_stream
from dlrm_core.schema import FormatName

SAMPLE_ROWS = 100_000  # rows read by default
NUMBER = r"^\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$"


@dataclass
class Sample:
    """The rows read, one column per input column (``c0``, ``c1``, ...): text as strings (null when
    empty)."""

    files: list[Path]
    format: FormatName
    header: bool  # delimited text: the first file starts with a header line
    delimiter: str
    names: list[str]  # the header's or Parquet's names; "0", "1", ... without a header
    table: pa.Table
    counts: list[int]  # rows taken from each file read, in order
    headers: list[bool]  # whether each file read starts with a header line
    truncated: bool = False  # the files hold more rows than were read
    skipped: int = 0  # malformed lines (wrong field count) skipped

    def column_ref(self, pos: int) -> str | int:
        """How the config names column ``pos``: its name, or its position when it has none."""
        named = self.header or self.format == "parquet"
        return self.names[pos] if named and self.names[pos] else pos

    def feature_name(self, pos: int) -> str:
        """The feature's name: the column's (up to 64 characters), else ``c<pos>``."""
        ref = self.column_ref(pos)
        return ref if isinstance(ref, str) and len(ref) <= 64 else f"c{pos}"

    def where(self, row: int) -> str:
        """``file:line`` (``file: row n`` for Parquet) of sampled row ``row``."""
        i = 0
        while row >= self.counts[i]:
            row, i = row - self.counts[i], i + 1
        if self.format == "parquet":
            return f"{self.files[i]}: row {row + 1}"
        ncols, quoted = len(self.names), self.format != "criteo"
        # the lines pyarrow took as rows: not empty, malformed or the header
        with open_stream(self.files[i]) as f:
            lines = (
                n
                for n, line in enumerate(f, 1)
                if (n > 1 or not self.headers[i])
                and line.strip()
                and len(_split(line, self.delimiter, quoted)) == ncols
            )
            return f"{self.files[i]}:{next(itertools.islice(lines, row, None), row + 1)}"

    def describe(self) -> str:
        """``the first N rows of FILES (format, header)``, for the table and the config's
        comment."""
        read = ", ".join(str(f) for f in self.files[: len(self.counts)])
        layout = (
            "Parquet"
            if self.format == "parquet"
            else f"{self.format}, {'a' if self.header else 'no'} header line"
        )
        skipped = f", {self.skipped} malformed line(s) skipped" if self.skipped else ""
        return (
            f"{'the first' if self.truncated else 'all'} {sum(self.counts):,} rows of {read} "
            f"({layout}{skipped})"
        )


def detect_format(path: Path, requested: str = "auto") -> FormatName:
    """``requested``; for ``auto``, by extension (.parquet/.pq, .csv, .tsv/.txt, maybe .gz), else
    by content (Parquet's magic, a tab in line 1)."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    suffixes = [s.lower() for s in path.suffixes]
    ext = "".join((suffixes[:-1] if suffixes[-1:] == [".gz"] else suffixes)[-1:])
    known = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "tsv"}
    if ext in known:
        return known[ext]  # type: ignore[return-value]
    with open_stream(path) as f:
        head = f.read(4096)
    return (
        "parquet" if head[:4] == b"PAR1" else "tsv" if b"\t" in head.split(b"\n", 1)[0] else "csv"
    )


def _split(line: bytes, delimiter: str, quoted: bool) -> list[str]:
    """The fields of one line, as the readers split them (quoted fields unless Criteo)."""
    text = line.decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")
    if quoted:
        return [c.strip() for c in next(csv.reader([text], delimiter=delimiter), [])]
    return [c.strip() for c in text.split(delimiter)]


def _head_lines(path: Path, n: int = 50) -> list[bytes]:
    """The first ``n`` non-empty lines of a plain or gzip text file."""
    try:
        with open_stream(path) as f:
            lines = list(itertools.islice((line for line in f if line.strip()), n))
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    if not lines:
        raise DataError(f"{path}: empty file")
    return lines


def looks_like_header(first: list[str], rest: list[list[str]]) -> bool:
    """Whether ``first`` names the columns of the lines ``rest``: distinct names, none a number,
    and unlike the data (numbers under a word; a name that recurs as a value means data)."""
    names = [f for f in first if f]
    if not names or len(set(names)) < len(names) or any(re.match(NUMBER, f) for f in names):
        return False
    columns = [
        (name, [r[j] for r in rest if len(r) > j and r[j]]) for j, name in enumerate(first) if name
    ]
    numbers_under_words = any(v and all(re.match(NUMBER, x) for x in v) for _, v in columns)
    return numbers_under_words or not any(name in v for name, v in columns)


def _read_text(
    path: Path, ncols: int, header: bool, delimiter: str, quoted: bool, limit: int
) -> tuple[pa.Table, int, bool]:
    """Up to ``limit`` rows, every column a string (null when empty), streamed in 1 MiB blocks
    (plain or gzip): (rows, malformed lines skipped, whether rows were left unread)."""
    skipped, cols, batches, rows, more = [], [f"c{i}" for i in range(ncols)], [], 0, False
    try:
        with open_stream(path) as stream:
            reader = pcsv.open_csv(
                stream,
                read_options=pcsv.ReadOptions(
                    column_names=cols, skip_rows=int(header), block_size=1 << 20
                ),
                parse_options=pcsv.ParseOptions(
                    delimiter=delimiter,
                    quote_char='"' if quoted else False,
                    invalid_row_handler=lambda row: skipped.append(row) or "skip",
                ),
                convert_options=pcsv.ConvertOptions(
                    column_types=dict.fromkeys(cols, pa.string()),
                    null_values=[""],
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=True,
                ),
            )
            for batch in reader:
                batches.append(batch)
                rows += batch.num_rows
                if rows >= limit:
                    more = rows > limit or next(iter(reader), None) is not None
                    break
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    return (
        pa.Table.from_batches(batches, pa.schema([(c, pa.string()) for c in cols])).slice(0, limit),
        len(skipped),
        more,
    )


def _read_parquet(path: Path, limit: int) -> tuple[pa.Table, int, bool]:
    """Up to ``limit`` rows of a Parquet file as stored: (rows, 0, whether rows were left
    unread)."""
    try:
        f = pq.ParquetFile(path)
        batches: list[pa.RecordBatch] = []
        for batch in f.iter_batches(batch_size=min(limit, 65536)):
            batches.append(batch)
            if sum(b.num_rows for b in batches) >= limit:
                break
        table = pa.Table.from_batches(batches, f.schema_arrow).slice(0, limit)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a Parquet file ({exc})") from None
    return table, 0, f.metadata.num_rows > table.num_rows


def read_sample(
    files: Sequence[Path], format: str = "auto", sample_rows: int = SAMPLE_ROWS
) -> Sample:
    """The first ``sample_rows`` rows of ``files``, read in order until there are enough."""
    files = [Path(f) for f in files]
    check_files(files, "input")
    fmt = detect_format(files[0], format)
    for path in files:
        # --format csv on a Parquet file, or the reverse: say so
        check_format(path, fmt, "--format {}")
    names, header, delimiter, quoted = [], False, "," if fmt == "csv" else "\t", fmt != "criteo"
    if fmt == "parquet":
        names = _read_parquet(files[0], 1)[0].column_names
    else:
        rows = [_split(line, delimiter, quoted) for line in _head_lines(files[0])]
        header = quoted and looks_like_header(rows[0], rows[1:])
        names = rows[0] if header else [str(i) for i in range(len(rows[0]))]
    s, tables = Sample(files, fmt, header, delimiter, names, pa.table({}), [], []), []
    for i, path in enumerate(files):
        left = sample_rows - sum(s.counts)
        if left <= 0:
            s.truncated = True
            break
        if fmt == "parquet":
            table, bad, s.truncated = _read_parquet(path, left)
            first, has_header = table.column_names, False
        else:
            first = _split(_head_lines(path, 1)[0], delimiter, quoted)
            has_header = header and (i == 0 or first == names)  # a test file may lack the header
            table, bad, s.truncated = _read_text(
                path, len(names), has_header, delimiter, quoted, left
            )
        if len(first) != len(names) or (fmt == "parquet" and first != names):
            raise DataError(
                f"{path}: {len(first)} columns ({', '.join(first[:6])}, ...) unlike {files[0]}'s"
            )
        tables.append(table.rename_columns([f"c{j}" for j in range(len(names))]))
        s.counts.append(table.num_rows)
        s.headers.append(has_header)
        s.skipped += bad
    s.table = pa.concat_tables(tables, promote_options="permissive")
    if s.table.num_rows == 0:
        raise DataError(f"{files[0]}: no data rows")
    # label, 13 counts, 26 hex values
    criteo = ["^[01]$"] + [r"^-?[0-9]+$"] * 13 + ["^[0-9a-fA-F]{1,8}$"] * 26
    if (
        fmt == "tsv"
        and format == "auto"
        and not header
        and len(names) == 40
        and all(
            pc.all(pc.match_substring_regex(s.table.column(j).drop_null(), c)).as_py() is not False
            for j, c in enumerate(criteo)
        )
    ):
        s.format = "criteo"
    return s
