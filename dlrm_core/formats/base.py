"""What every input format shares: opening files, raw blocks, finding the schema's columns in a
file, and counting malformed lines."""

from __future__ import annotations

import difflib
import gzip
import io
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrm_core.errors import DataError
from dlrm_core.featurize import LABEL, BadLine
from dlrm_core.schema import Column, FeatureSpec

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class RawBlock:
    """A run of whole rows of one file, on the format's fixed block grid.

    ``offset`` is where the block starts (a byte offset in the decompressed text, or a row index
    in a Parquet file) and ``line`` the 1-based line (row) number of its first row.
    """

    file_index: int
    offset: int
    line: int
    data: Any  # bytes of whole lines, or a pyarrow Table
    num_lines: int


@dataclass
class FileLayout:
    """Where the schema's columns are in one input file."""

    path: Path
    names: list[str]
    """Every column of the file, in order."""
    positions: dict[str, int]
    """Position of the label (key ``LABEL``) and of each feature's column (key: its name)."""
    first_row: int = 1
    """The file line (1-based) of its first data row: 2 after a header, else 1."""

    @property
    def used(self) -> list[int]:
        return sorted(set(self.positions.values()))


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


PARQUET_MAGIC = b"PAR1"


def sniff_format(path: Path) -> str:
    """What the file's first bytes say it is: ``parquet`` (its magic), ``text`` (CSV/TSV/Criteo,
    plain or gzip: no NUL, few control bytes) or ``binary`` (anything else)."""
    with open_stream(path) as f:
        head = f.read(4096)
    if head[:4] == PARQUET_MAGIC:
        return "parquet"
    control = sum(b < 32 and b not in (9, 10, 13) for b in head)  # Latin-1 or UTF-8 text has none
    return "binary" if b"\x00" in head or control > len(head) // 20 else "text"


def check_format(path: Path, format: str, setting: str = 'format = "{}" in the config') -> None:
    """Refuse a file whose content is not the schema's ``format``, naming what it is and the
    setting to change (instead of reading a Parquet file's bytes as a CSV header).

    Raises:
        DataError: a Parquet file read as text, or a text / binary file read as Parquet.
            ``setting`` (``{}`` for the format to give) says where the format is chosen.
    """
    found = sniff_format(path)
    if format == "parquet" and found != "parquet":
        what = (
            "a text file (CSV or TSV)" if found == "text" else "not a Parquet file (no PAR1 magic)"
        )
        raise DataError(
            f"{path}: the schema's format is 'parquet', but the file is {what}; "
            f"set {setting.format('csv')} (or tsv)"
        )
    if format != "parquet" and found == "parquet":
        raise DataError(
            f"{path}: the file is Parquet (PAR1 magic), but the schema's format is {format!r}; "
            f"set {setting.format('parquet')}"
        )
    if format != "parquet" and found == "binary":
        raise DataError(
            f"{path}: the file is binary, not {format} text (nor gzip, nor Parquet); "
            f"check the path, or set {setting.format('...')}"
        )


def printable(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters, non-printable ones escaped (safe for a terminal)."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)


def check_files(paths: list[Path], what: str) -> None:
    """Fail early, naming the file, if any input cannot be opened."""
    if not paths:
        raise DataError(f"no {what} files given")
    for p in paths:
        open_stream(Path(p)).close()


def resolve_column(ref: Column, names: list[str], where: str, what: str) -> int:
    """Position of column ``ref`` (a name, or a 0-based index) among ``names``.

    Raises:
        DataError: naming ``where`` (the file), the column and, when one is close, a suggestion.
    """
    if isinstance(ref, str) and ref in names:
        return names.index(ref)
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        i = int(ref)
        if 0 <= i < len(names):
            return i
        raise DataError(f"{where}: {what} is column {i}, but the input has {len(names)} columns")
    close = difflib.get_close_matches(str(ref), names, n=1)
    hint = f" (did you mean {printable(close[0])!r}?)" if close else ""
    shown = ", ".join(printable(n) for n in names[:12]) + (" ..." if len(names) > 12 else "")
    raise DataError(f"{where}: no column {ref!r} for {what}{hint}; the columns are: {shown}")


def feature_positions(
    spec: FeatureSpec, names: list[str], where: str, with_label: bool = True
) -> dict[str, int]:
    """Position in the input of the label (key :data:`LABEL`) and of every feature's column."""
    out: dict[str, int] = {}
    if with_label:
        out[LABEL] = resolve_column(spec.label, names, where, "the label")
    for feat in [*spec.dense, *spec.categorical]:
        ref = feat.column if feat.column is not None else feat.name
        out[feat.name] = resolve_column(ref, names, where, f"feature {feat.name!r}")
    return out


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
                    b.file,
                    b.line,
                    b.reason,
                )
            self.count += 1
            self.by_reason[_reason_kind(b.reason)] += 1

    def summary(self) -> str | None:
        if not self.count:
            return None
        kinds = ", ".join(f"{k}: {v}" for k, v in self.by_reason.most_common())
        return (
            f"skipped {self.count} malformed line(s) ({kinds}); first at "
            f"{self.first.file}:{self.first.line}"
        )

    def state(self) -> dict:
        return {"count": self.count, "by_reason": dict(self.by_reason)}

    def restore(self, state: dict) -> None:
        self.count = int(state.get("count", 0))
        self.by_reason = Counter(state.get("by_reason", {}))


def _reason_kind(reason: str) -> str:
    if reason.startswith("wrong field count"):
        return "wrong field count"
    if "not an integer" in reason:
        return "non-integer value"
    if "not a number" in reason:
        return "non-numeric dense value"
    if "not hex" in reason:
        return "bad hex categorical"
    if "quote" in reason or "cannot parse" in reason:
        return "unparsable line"
    return "bad label"
