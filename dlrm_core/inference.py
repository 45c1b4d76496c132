"""Schema inference (``dlrm data schema``): read a sample of the input (the first rows, streamed:
text in 1 MiB blocks, all columns as strings; Parquet in batches), decide what each column is and why,
and write the config that trains on it. The rules, in order (flags override them): always empty ->
ignored; multi-hot (``|``, ``;``, ``,`` or a space in >= 10% of the cells, tokens repeating; Parquet
lists) -> categorical; unique per row -> ignored, an id; decimals -> dense (log1p when non-negative
and skewed, else standardize); integers -> dense log1p when they look like counts, else categorical;
other text -> categorical, hashed as a string (``"123"`` in CSV, ``123`` in JSON: one row).
"""

from __future__ import annotations

import csv
import difflib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import tomli_w

from dlrm_core.errors import ConfigError, DataError
from dlrm_core.featurize import parse_labels
from dlrm_core.formats.base import check_files, check_format, open_stream
from dlrm_core.schema import FORMAT_DEFAULTS, CategoricalFeature, DenseFeature, FormatName

SAMPLE_ROWS, MAX_ROWS = 100_000, 1_000_000  # rows read; cap of a table's rows (the default embedding.hash_size)
ID_SHARE, ID_MIN_ROWS = 0.9, 1000  # >= 90% distinct over >= 1000 sampled rows: an id, not a feature
SEPARATORS = ("|", ";", ",", " ")  # multi-hot separators tried (not the file's own delimiter)
MULTI_HOT_SHARE = 0.1  # share of the non-empty cells holding the separator in a multi-hot column
FEW_DISTINCT = 100  # integers with at most this many distinct values are categories unless counts
COUNT_MIN_DISTINCT = 5  # fewer distinct integers than this are categories even when they run 0..k
SKEWNESS = 2.0  # non-negative numbers more skewed than this get log1p rather than standardize
Kind = Literal["label", "ignored", "dense", "categorical"]
Guess = tuple[Kind, str, str | None]  # (kind, why, dense transform)
NUMBER = r"^\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$"
INTEGER, LEADING_ZERO = r"^\s*[+-]?[0-9]+\s*$", r"^\s*[+-]?0[0-9]"


@dataclass
class Sample:
    """The rows read, one column per input column (``c0``, ``c1``, ...): text as strings (null when empty)."""

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
        with open_stream(self.files[i]) as f:  # the lines pyarrow took as rows: not empty, malformed or the header
            lines = (n for n, line in enumerate(f, 1) if (n > 1 or not self.headers[i]) and line.strip()
                     and len(_split(line, self.delimiter, quoted)) == ncols)
            return f"{self.files[i]}:{next(itertools.islice(lines, row, None), row + 1)}"

    def describe(self) -> str:
        """``the first N rows of FILES (format, header)``, for the table and the config's comment."""
        read = ", ".join(str(f) for f in self.files[: len(self.counts)])
        layout = "Parquet" if self.format == "parquet" else f"{self.format}, {'a' if self.header else 'no'} header line"
        skipped = f", {self.skipped} malformed line(s) skipped" if self.skipped else ""
        return f"{'the first' if self.truncated else 'all'} {sum(self.counts):,} rows of {read} ({layout}{skipped})"


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
    return "parquet" if head[:4] == b"PAR1" else "tsv" if b"\t" in head.split(b"\n", 1)[0] else "csv"


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
    columns = [(name, [r[j] for r in rest if len(r) > j and r[j]]) for j, name in enumerate(first) if name]
    numbers_under_words = any(v and all(re.match(NUMBER, x) for x in v) for _, v in columns)
    return numbers_under_words or not any(name in v for name, v in columns)


def _read_text(path: Path, ncols: int, header: bool, delimiter: str, quoted: bool, limit: int
               ) -> tuple[pa.Table, int, bool]:
    """Up to ``limit`` rows, every column a string (null when empty), streamed in 1 MiB blocks
    (plain or gzip): (rows, malformed lines skipped, whether rows were left unread)."""
    skipped, cols, batches, rows, more = [], [f"c{i}" for i in range(ncols)], [], 0, False
    try:
        with open_stream(path) as stream:
            reader = pcsv.open_csv(
                stream, read_options=pcsv.ReadOptions(column_names=cols, skip_rows=int(header), block_size=1 << 20),
                parse_options=pcsv.ParseOptions(delimiter=delimiter, quote_char='"' if quoted else False,
                                                invalid_row_handler=lambda row: skipped.append(row) or "skip"),
                convert_options=pcsv.ConvertOptions(column_types=dict.fromkeys(cols, pa.string()), null_values=[""],
                                                    strings_can_be_null=True, quoted_strings_can_be_null=True))
            for batch in reader:
                batches.append(batch)
                rows += batch.num_rows
                if rows >= limit:
                    more = rows > limit or next(iter(reader), None) is not None
                    break
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    return pa.Table.from_batches(batches, pa.schema([(c, pa.string()) for c in cols])).slice(0, limit), len(skipped), more


def _read_parquet(path: Path, limit: int) -> tuple[pa.Table, int, bool]:
    """Up to ``limit`` rows of a Parquet file as stored: (rows, 0, whether rows were left unread)."""
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


def read_sample(files: Sequence[Path], format: str = "auto", sample_rows: int = SAMPLE_ROWS) -> Sample:
    """The first ``sample_rows`` rows of ``files``, read in order until there are enough."""
    files = [Path(f) for f in files]
    check_files(files, "input")
    fmt = detect_format(files[0], format)
    for path in files:
        check_format(path, fmt, "--format {}")  # --format csv on a Parquet file, or the reverse: say so
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
            table, bad, s.truncated = _read_text(path, len(names), has_header, delimiter, quoted, left)
        if len(first) != len(names) or (fmt == "parquet" and first != names):
            raise DataError(f"{path}: {len(first)} columns ({', '.join(first[:6])}, ...) unlike {files[0]}'s")
        tables.append(table.rename_columns([f"c{j}" for j in range(len(names))]))
        s.counts.append(table.num_rows)
        s.headers.append(has_header)
        s.skipped += bad
    s.table = pa.concat_tables(tables, promote_options="permissive")
    if s.table.num_rows == 0:
        raise DataError(f"{files[0]}: no data rows")
    criteo = ["^[01]$"] + [r"^-?[0-9]+$"] * 13 + ["^[0-9a-fA-F]{1,8}$"] * 26  # label, 13 counts, 26 hex values
    if fmt == "tsv" and format == "auto" and not header and len(names) == 40 and all(
            pc.all(pc.match_substring_regex(s.table.column(j).drop_null(), c)).as_py() is not False
            for j, c in enumerate(criteo)):
        s.format = "criteo"
    return s


@dataclass
class Profile:
    """What the sample shows of one column."""

    storage: str  # text, integer, float, bool, list, null or other
    type: str  # the Arrow type, for messages
    non_empty: int
    values: int = 0  # values seen: the non-empty cells, or a multi-hot column's tokens
    distinct: int = 0
    numbers: np.ndarray | None = None  # float64 of the non-empty values, when all are numbers
    integral: bool = False  # integers as stored (an integer type, or text without a point)
    whole: bool = False  # every value a whole number (126 or 126.0): an id when unique per row
    leading_zeros: bool = False
    example: str | None = None  # a value that is not a number
    separator: str | None = None
    bag: bool = False  # multi-hot: a separator, or a list column


def _storage(t: pa.DataType) -> str:
    """text, integer, float, bool, list (of text or integers), null or other."""
    if pa.types.is_dictionary(t):
        return _storage(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list" if _storage(t.value_type) in ("text", "integer") else "other"
    tests = {"null": pa.types.is_null, "bool": pa.types.is_boolean, "integer": pa.types.is_integer,
             "float": lambda t: pa.types.is_floating(t) or pa.types.is_decimal(t),
             "text": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)}
    return next((name for name, test in tests.items() if test(t)), "other")


def _non_empty(values: pa.Array) -> pa.Array:
    """The values that are neither null nor an empty string."""
    values = values.drop_null()
    return values.filter(pc.not_equal(values, "")) if _storage(values.type) == "text" else values


def profile(column: pa.ChunkedArray, delimiter: str) -> Profile:
    """Counts, numbers and multi-hot separator of one sampled column (``delimiter``: the file's)."""
    values = column.combine_chunks()
    values = values.dictionary_decode() if pa.types.is_dictionary(values.type) else values
    storage, values = _storage(values.type), _non_empty(values)
    p = Profile(storage, str(column.type), len(values), len(values))
    if not len(values) or storage in ("null", "other", "bool"):
        return p
    if storage == "list":
        tokens = _non_empty(pc.list_flatten(values))
        p.bag, p.values, p.distinct = True, len(tokens), pc.count_distinct(tokens).as_py()
        return p
    p.distinct = pc.count_distinct(values).as_py()
    if storage in ("integer", "float"):
        p.numbers = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
        p.integral = storage == "integer"
        p.whole = p.integral or _whole(p.numbers)  # 126.0 as stored reads as 126 in a CSV
        return p
    good = pc.match_substring_regex(values, NUMBER)
    if not pc.all(good).as_py():
        p.example = values.filter(pc.invert(good))[0].as_py()
        # multi-hot: a separator in >= 10% of the cells, tokens repeating, not all of one arity (a date and a time)
        shares = {sep: pc.sum(pc.match_substring(values, sep)).as_py() / len(values) for sep in SEPARATORS if sep != delimiter}
        sep = max(shares, key=lambda s: shares[s])
        bags = pc.split_pattern(values, sep)
        tokens, sizes = _non_empty(pc.list_flatten(bags)), pc.min_max(pc.list_value_length(bags)).as_py()
        distinct = pc.count_distinct(tokens).as_py()
        if shares[sep] >= MULTI_HOT_SHARE and 2 * distinct <= len(tokens) and (shares[sep] < 1 or sizes["min"] != sizes["max"]):
            p.separator, p.bag, p.values, p.distinct = sep, True, len(tokens), distinct
        return p
    p.numbers = pc.cast(pc.utf8_trim_whitespace(values), pa.float64()).to_numpy(zero_copy_only=False)
    p.integral = bool(pc.all(pc.match_substring_regex(values, INTEGER)).as_py())
    p.whole = p.integral or _whole(p.numbers)
    p.leading_zeros = p.integral and bool(pc.any(pc.match_substring_regex(values, LEADING_ZERO)).as_py())
    return p


def _whole(x: np.ndarray) -> bool:
    """Whether every value is a whole number (exactly representable): ``126.0`` counts as an
    integer whether a file stores it as a float (Parquet) or as text (``126`` or ``126.0``), so
    that CSV and Parquet copies of one table get one schema."""
    return bool(len(x)) and bool(np.isfinite(x).all()) and float(np.abs(x).max()) < 2.0**53 \
        and bool((x == np.floor(x)).all())


def looks_like_counts(x: np.ndarray, distinct: int) -> bool:
    """Integers that count something: 0 or 1 among them, small negatives at most; with many distinct
    values, skewed (median 10x below the maximum), unlike ids spread evenly over a range; with few, the
    median in the lowest quarter, 0..10 mostly there, frequencies falling after one mode (Criteo's I10),
    unlike codes (Avazu's C18: 0..3 of frequencies 70, 0.2, 12, 19%) or an hour of the day."""
    lo, hi = float(x.min()), float(x.max())
    if lo < -3 or distinct < COUNT_MIN_DISTINCT or not ((x == 0) | (x == 1)).any():
        return False
    if distinct > FEW_DISTINCT or np.median(x) * 4 > hi:
        return distinct > FEW_DISTINCT and (np.median(x) + 1) * 10 <= hi + 1
    base = max(lo, 0.0)
    counts = np.bincount((x[(x >= base) & (x <= base + 20)] - base).astype(np.int64))
    mode, tol = int(np.argmax(counts)), 0.01 * len(x)  # rising to one mode, falling after it, within noise:
    unimodal = all((side[1:] <= 2 * np.minimum.accumulate(side)[:-1] + tol).all()  # no count > twice the lowest
                   for side in (counts[mode:], counts[mode::-1]))  # between it and the mode, plus 1% of the rows
    return (counts[: int(min(hi - base, 10)) + 1] > 0).mean() >= 0.8 and unimodal


def _transform(p: Profile) -> str:
    """log1p for counts and skewed non-negative numbers, else standardize."""
    x, std = p.numbers, p.numbers.std()
    skewness = float(np.mean(((x - x.mean()) / std) ** 3)) if std > 0 else 0.0
    return "log1p" if (p.integral and looks_like_counts(x, p.distinct)) or (x.min() >= 0 and skewness > SKEWNESS) \
        else "standardize"


def guess(p: Profile, rows: int) -> Guess:
    """(kind, why, dense transform) of a column from its profile, by the module's rules."""
    if p.storage == "other":
        return "ignored", f"type {p.type} cannot be a feature", None
    if p.non_empty == 0:
        return "ignored", "always empty", None
    if p.bag:
        how = f"{p.separator!r}-separated values" if p.separator else "lists"
        return "categorical", f"multi-hot: {how}, {p.distinct:,} distinct tokens", None
    if p.storage == "bool":
        return "dense", "true/false", "none"
    if (p.numbers is None or p.whole) and rows >= ID_MIN_ROWS and p.distinct >= ID_SHARE * p.non_empty:
        return "ignored", f"unique per row ({p.distinct:,} distinct of {p.non_empty:,}): an id", None
    if p.numbers is None:
        return "categorical", f"text, {p.distinct:,} distinct values", None
    x, lo, hi = p.numbers, float(p.numbers.min()), float(p.numbers.max())
    span = "..".join(str(int(v)) if v.is_integer() and abs(v) < 1e18 else f"{v:g}" for v in (lo, hi))
    if not p.integral:
        transform = _transform(p)
        return "dense", f"decimals {span}{', skewed' if transform == 'log1p' else ''}", transform
    if p.leading_zeros:
        return "categorical", "integers with leading zeros: codes", None
    if not ((x == 0) | (x == 1)).any():
        if lo > 1 and hi - lo < lo:
            return "categorical", f"integers in a narrow band far from 0 ({span}): codes", None
        return "categorical", f"integers {span}, never 0 or 1: codes", None
    if looks_like_counts(x, p.distinct):
        return "dense", f"counts {span}{', skewed' if p.distinct > FEW_DISTINCT else ', falling frequencies'}", "log1p"
    if p.distinct <= FEW_DISTINCT:
        return "categorical", f"{p.distinct} distinct integers ({span})", None
    return "categorical", f"{p.distinct:,} integers {span}, evenly spread: ids", None


def _forced(p: Profile, flag: str, where: str) -> Guess:
    """The guess for a column named by --categorical or --dense, or an error when it cannot be."""
    if flag == "--categorical":
        if p.storage in ("float", "bool", "other"):
            raise DataError(f"{where} is {p.type}, which cannot be categorical (integers, strings or lists can)")
        return "categorical", "forced by --categorical", None
    if p.bag or p.storage in ("list", "other") or p.example is not None:
        shown = f"e.g. {p.example!r}" if p.example is not None else p.type
        raise DataError(f"{where} is not numeric ({shown}): it cannot be --dense")
    return "dense", "forced by --dense", "none" if p.numbers is None else _transform(p)


def table_rows(distinct: int, values: int, cap: int) -> int:
    """Rows for ``distinct`` values among ``values`` seen: about 2x distinct (at least one more), rounded
    up to 1, 2 or 5 x 10^k, at most ``cap``; ``cap`` when every value seen was new."""
    if values > 1 and distinct >= values:
        return cap
    want = max(2 * distinct, distinct + 1)
    return min(next(m * 10**k for k in range(19) for m in (1, 2, 5) if m * 10**k >= want), cap)


@dataclass
class Decision:
    """What one input column becomes, and why."""

    position: int
    column: str
    kind: Kind
    why: str
    details: str = ""
    feature: DenseFeature | CategoricalFeature | None = None


def _decide(sample: Sample, pos: int, p: Profile, guessed: Guess, max_rows: int) -> Decision:
    """The decision on column ``pos``, with its feature (a categorical's table sized from the profile)."""
    (kind, why, transform), column = guessed, sample.names[pos]
    name, ref = sample.feature_name(pos), sample.column_ref(pos)
    at = None if ref == name else ref
    if kind != "categorical":
        feat = DenseFeature(kind="dense", name=name, column=at, transform=transform) if kind == "dense" else None
        return Decision(pos, column, kind, why, transform or "", feat)
    rows = table_rows(p.distinct, p.values, max_rows)
    feat = CategoricalFeature(kind="categorical", name=name, column=at, encoding="string", rows=rows, separator=p.separator)
    bag = f", separator {p.separator!r}" if p.separator else ", lists" if p.bag else ""
    return Decision(pos, column, kind, why, f"string, {rows:,} rows{bag}", feat)


def _roles(sample: Sample, label: str, flags: dict[str, Sequence[str]]) -> tuple[int, dict[int, str]]:
    """(position of the label, the flag naming each forced column); an unknown name is an error (did you mean)."""
    names = sample.names

    def resolve(ref: str, flag: str) -> int:
        if ref in names or (ref.isdigit() and int(ref) < len(names)):
            return names.index(ref) if ref in names else int(ref)
        close = difflib.get_close_matches(ref, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        raise DataError(f"{sample.files[0]}: no column {ref!r}{hint}; {flag} takes one of: {shown}")
    label_pos = resolve(str(label), "--label")
    forced: dict[int, str] = {}
    for flag, refs in flags.items():
        for ref in refs:
            pos = resolve(str(ref), flag)
            if pos == label_pos:
                raise ConfigError(f"{flag} {ref}: that is the label column")
            if forced.setdefault(pos, flag) != flag:
                raise ConfigError(f"column {ref!r} is given to both {forced[pos]} and {flag}")
    return label_pos, forced


def check_label(sample: Sample, pos: int) -> float:
    """The share of 1s in the label column; a value not 0/1 (or true/false) is an error naming file, line, value."""
    column, name = sample.table.column(pos), sample.names[pos]
    if _storage(column.type) not in ("text", "integer", "float", "bool"):
        raise DataError(f"{sample.files[0]}: the label column {name!r} is {column.type}, not 0/1")
    labels, ok = parse_labels(column)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        shown = "empty" if column[row].as_py() in (None, "") else repr(column[row].as_py())
        raise DataError(f"{sample.where(row)}: the label {name!r} is {shown}, not 0 or 1 (or true/false)")
    return float(labels.mean())


def infer_schema(files: Sequence[Path], label: str, ignore: Sequence[str] = (), categorical: Sequence[str] = (),
                 dense: Sequence[str] = (), sample_rows: int = SAMPLE_ROWS, format: str = "auto",
                 max_rows: int = MAX_ROWS) -> InferredSchema:
    """Decide every column of ``files`` from a sample of their first ``sample_rows`` rows.

    Raises:
        DataError: an unreadable file, an unknown column, a label not 0/1, a forced kind that does not fit.
        ConfigError: a column given to two flags, or limits below 1.
    """
    if sample_rows < 1 or max_rows < 1:
        raise ConfigError("--sample-rows and --max-rows must be at least 1")
    sample = read_sample(files, format, sample_rows)
    label_pos, forced = _roles(sample, label, {"--ignore": ignore, "--categorical": categorical, "--dense": dense})
    share = check_label(sample, label_pos)
    decisions = []
    for pos, name in enumerate(sample.names):
        if pos == label_pos:
            decisions.append(Decision(pos, name, "label", "--label", f"0/1, {share:.1%} positive"))
        elif forced.get(pos) == "--ignore":
            decisions.append(Decision(pos, name, "ignored", "forced by --ignore"))
        else:
            p = profile(sample.table.column(pos), sample.delimiter)
            guessed = (_forced(p, forced[pos], f"{sample.files[0]}: column {name!r}") if pos in forced
                       else guess(p, sample.table.num_rows))
            decisions.append(_decide(sample, pos, p, guessed, max_rows))
    if not any(d.feature for d in decisions):
        raise DataError(f"{sample.files[0]}: no column looks like a feature; name some with --categorical or --dense")
    return InferredSchema(sample, label_pos, decisions)


@dataclass
class InferredSchema:
    """The decisions on every column of a sample, and the config they make."""

    sample: Sample
    label: int
    decisions: list[Decision]

    def config(self) -> dict:
        """The config's top level (format, label, ignore, header) and its ``features``."""
        s = self.sample
        doc: dict = {"format": s.format, "label": s.column_ref(self.label)}
        ignored = [s.column_ref(d.position) for d in self.decisions if d.kind == "ignored"]
        doc.update({"ignore": ignored} if ignored else {})
        if s.format != "parquet" and s.header != FORMAT_DEFAULTS[s.format][0]:
            doc["header"] = s.header
        keys = ("kind", "name", "column", "transform", "encoding", "rows", "separator")
        doc["features"] = [{k: v for k, v in d.feature.model_dump().items() if k in keys and v is not None}
                           for d in self.decisions if d.feature is not None]
        return doc

    def to_toml(self, command: str) -> str:
        """The config file: how it was made, the top level, a ``[[features]]`` table per feature (its reason above)."""
        features = (doc := self.config()).pop("features")
        head = [f"# Written by `{command}`", f"# from {self.sample.describe()}.",
                *[f"# ignored {d.column!r}: {d.why}" for d in self.decisions if d.kind == "ignored"],
                "# Check the kinds and table rows, then: dlrm train --config THIS_FILE --train ... --test ... --out DIR"]
        reasons = [d.why for d in self.decisions if d.feature is not None]
        return "\n".join(["\n".join(head) + "\n", tomli_w.dumps(doc)] + [
            f"# {why}\n[[features]]\n{tomli_w.dumps(f)}" for why, f in zip(reasons, features, strict=True)])

    def markdown(self) -> str:
        """A table of the decisions: column, kind, details, why."""
        kinds = [d.kind for d in self.decisions]
        summary = ", ".join(f"{kinds.count(k)} {k}" for k in ("categorical", "dense", "ignored"))
        lines = [f"Schema of {self.sample.describe()}: {summary}.", "",
                 "| column | kind | details | why |", "| --- | --- | --- | --- |"]
        for d in self.decisions:  # a "|" in a cell (a separator) is escaped
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in (d.column, d.kind, d.details, d.why)) + " |")
        return "\n".join(lines)
