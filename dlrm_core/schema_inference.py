"""Schema inference (``dlrm data schema``): take a sample of the input (``schema_sample``),
decide what each column is and why, and write the config that trains on it. The rules, in order
(flags override them): always empty ->
ignored; multi-hot (``|``, ``;``, ``,`` or a space in >= 10% of the cells, tokens repeating; Parquet
lists) -> categorical; unique per row -> ignored, an id; decimals -> dense (log1p when non-negative
and skewed, else standardize); integers -> dense log1p when they look like counts, else categorical;
other text -> categorical, hashed as a string (``"123"`` in CSV, ``123`` in JSON: one row).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tomli_w

from dlrm_core.errors import ConfigError, DataError
from dlrm_core.featurize import parse_labels
from dlrm_core.schema import FORMAT_DEFAULTS, CategoricalFeature, DenseFeature
from dlrm_core.schema_sample import NUMBER, SAMPLE_ROWS, Sample, read_sample

MAX_ROWS = 1_000_000  # cap of a table's rows (the default embedding.hash_size)
ID_SHARE, ID_MIN_ROWS = 0.9, 1000  # >= 90% distinct over >= 1000 sampled rows: an id, not a feature
SEPARATORS = ("|", ";", ",", " ")  # multi-hot separators tried (not the file's own delimiter)
MULTI_HOT_SHARE = 0.1  # share of the non-empty cells holding the separator in a multi-hot column
FEW_DISTINCT = 100  # integers with at most this many distinct values are categories unless counts
COUNT_MIN_DISTINCT = 5  # fewer distinct integers than this are categories even when they run 0..k
SKEWNESS = 2.0  # non-negative numbers more skewed than this get log1p rather than standardize
Kind = Literal["label", "ignored", "dense", "categorical"]
Guess = tuple[Kind, str, str | None]  # (kind, why, dense transform)
INTEGER, LEADING_ZERO = r"^\s*[+-]?[0-9]+\s*$", r"^\s*[+-]?0[0-9]"


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
    gaps: bool = False  # some cells empty or null


def _storage(t: pa.DataType) -> str:
    """text, integer, float, bool, list (of text or integers), null or other."""
    if pa.types.is_dictionary(t):
        return _storage(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list" if _storage(t.value_type) in ("text", "integer") else "other"
    tests = {
        "null": pa.types.is_null,
        "bool": pa.types.is_boolean,
        "integer": pa.types.is_integer,
        "float": lambda t: pa.types.is_floating(t) or pa.types.is_decimal(t),
        "text": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
    }
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
    p = Profile(storage, str(column.type), len(values), len(values), gaps=len(values) < len(column))
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
        # multi-hot: a separator in >= 10% of the cells, tokens repeating, not all of one arity (a
        # date and a time)
        shares = {
            sep: pc.sum(pc.match_substring(values, sep)).as_py() / len(values)
            for sep in SEPARATORS
            if sep != delimiter
        }
        sep = max(shares, key=lambda s: shares[s])
        bags = pc.split_pattern(values, sep)
        tokens, sizes = (
            _non_empty(pc.list_flatten(bags)),
            pc.min_max(pc.list_value_length(bags)).as_py(),
        )
        distinct = pc.count_distinct(tokens).as_py()
        if (
            shares[sep] >= MULTI_HOT_SHARE
            and 2 * distinct <= len(tokens)
            and (shares[sep] < 1 or sizes["min"] != sizes["max"])
        ):
            p.separator, p.bag, p.values, p.distinct = sep, True, len(tokens), distinct
        return p
    p.numbers = pc.cast(pc.utf8_trim_whitespace(values), pa.float64()).to_numpy(
        zero_copy_only=False
    )
    p.integral = bool(pc.all(pc.match_substring_regex(values, INTEGER)).as_py())
    p.whole = p.integral or _whole(p.numbers)
    p.leading_zeros = p.integral and bool(
        pc.any(pc.match_substring_regex(values, LEADING_ZERO)).as_py()
    )
    return p


def _whole(x: np.ndarray) -> bool:
    """Whether every value is a whole number (exactly representable): ``126.0`` counts as an
    integer whether a file stores it as a float (Parquet) or as text (``126`` or ``126.0``), so
    that CSV and Parquet copies of one table get one schema."""
    return (
        bool(len(x))
        and bool(np.isfinite(x).all())
        and float(np.abs(x).max()) < 2.0**53
        and bool((x == np.floor(x)).all())
    )


def looks_like_counts(x: np.ndarray, distinct: int) -> bool:
    """Integers that count something: 0 or 1 among them, small negatives at most; with many distinct
    values, skewed (median 10x below the maximum), unlike ids spread evenly over a range; with few,
    the
    median in the lowest quarter, 0..10 mostly there, frequencies falling after one mode (Criteo's
    I10),
    unlike codes (Avazu's C18: 0..3 of frequencies 70, 0.2, 12, 19%) or an hour of the day."""
    lo, hi = float(x.min()), float(x.max())
    if lo < -3 or distinct < COUNT_MIN_DISTINCT or not ((x == 0) | (x == 1)).any():
        return False
    if distinct > FEW_DISTINCT or np.median(x) * 4 > hi:
        return distinct > FEW_DISTINCT and (np.median(x) + 1) * 10 <= hi + 1
    base = max(lo, 0.0)
    counts = np.bincount((x[(x >= base) & (x <= base + 20)] - base).astype(np.int64))
    # rising to one mode, falling after it, within noise:
    mode, tol = int(np.argmax(counts)), 0.01 * len(x)
    # no count > twice the lowest
    unimodal = all(
        (side[1:] <= 2 * np.minimum.accumulate(side)[:-1] + tol).all()
        # between it and the mode, plus 1% of the rows
        for side in (counts[mode:], counts[mode::-1])
    )
    return (counts[: int(min(hi - base, 10)) + 1] > 0).mean() >= 0.8 and unimodal


def _transform(p: Profile) -> str:
    """log1p for counts and skewed non-negative numbers, else standardize."""
    x, std = p.numbers, p.numbers.std()
    skewness = float(np.mean(((x - x.mean()) / std) ** 3)) if std > 0 else 0.0
    return (
        "log1p"
        if (p.integral and looks_like_counts(x, p.distinct))
        or (x.min() >= 0 and skewness > SKEWNESS)
        else "standardize"
    )


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
    if (
        (p.numbers is None or p.whole)
        and rows >= ID_MIN_ROWS
        and p.distinct >= ID_SHARE * p.non_empty
    ):
        return (
            "ignored",
            f"unique per row ({p.distinct:,} distinct of {p.non_empty:,}): an id",
            None,
        )
    if p.numbers is None:
        return "categorical", f"text, {p.distinct:,} distinct values", None
    x, lo, hi = p.numbers, float(p.numbers.min()), float(p.numbers.max())
    span = "..".join(
        str(int(v)) if v.is_integer() and abs(v) < 1e18 else f"{v:g}" for v in (lo, hi)
    )
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
        return (
            "dense",
            f"counts {span}{', skewed' if p.distinct > FEW_DISTINCT else ', falling frequencies'}",
            "log1p",
        )
    if p.distinct <= FEW_DISTINCT:
        return "categorical", f"{p.distinct} distinct integers ({span})", None
    return "categorical", f"{p.distinct:,} integers {span}, evenly spread: ids", None


def _forced(p: Profile, flag: str, where: str) -> Guess:
    """The guess for a column named by --categorical or --dense, or an error when it cannot be."""
    if flag == "--categorical":
        if p.storage in ("float", "bool", "other"):
            raise DataError(
                f"{where} is {p.type}, which cannot be categorical (integers, strings or lists can)"
            )
        return "categorical", "forced by --categorical", None
    if p.bag or p.storage in ("list", "other") or p.example is not None:
        shown = f"e.g. {p.example!r}" if p.example is not None else p.type
        raise DataError(f"{where} is not numeric ({shown}): it cannot be --dense")
    return "dense", "forced by --dense", "none" if p.numbers is None else _transform(p)


ROWS_PER_VALUE = 5
"""Hashed rows per distinct value seen: ids land on rows by hash, so a table of 2x its values
puts ~40% of them on a row with another (5x: ~18%); on the six generated CSV tables of
bench/defaults.py (missing flags on) 5x raised the default's mean test AUC by 0.0026 over 2x
(higher on 5 of 6), on the Avazu sample by 0.005."""


def table_rows(distinct: int, values: int, cap: int) -> int:
    """Rows for ``distinct`` values among ``values`` seen: about ROWS_PER_VALUE x distinct (at
    least one more), rounded up to 1, 2 or 5 x 10^k, at most ``cap``; ``cap`` when every value
    seen was new."""
    if values > 1 and distinct >= values:
        return cap
    want = max(ROWS_PER_VALUE * distinct, distinct + 1)
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


def _decide(
    sample: Sample, pos: int, p: Profile, guessed: Guess, max_rows: int, missing_flags: bool
) -> Decision:
    """The decision on column ``pos``, with its feature (a categorical's table sized from the
    profile; a dense one flagging its gaps where ``missing_flags``)."""
    (kind, why, transform), column = guessed, sample.names[pos]
    name, ref = sample.feature_name(pos), sample.column_ref(pos)
    at = None if ref == name else ref
    if kind != "categorical":
        feat = (
            DenseFeature(
                kind="dense",
                name=name,
                column=at,
                transform=transform,
                missing_flag=missing_flags and p.gaps,
            )
            if kind == "dense"
            else None
        )
        flagged = ", missing flag" if feat is not None and feat.missing_flag else ""
        return Decision(pos, column, kind, why, (transform or "") + flagged, feat)
    rows = table_rows(p.distinct, p.values, max_rows)
    feat = CategoricalFeature(
        kind="categorical",
        name=name,
        column=at,
        encoding="string",
        rows=rows,
        separator=p.separator,
    )
    bag = f", separator {p.separator!r}" if p.separator else ", lists" if p.bag else ""
    return Decision(pos, column, kind, why, f"string, {rows:,} rows{bag}", feat)


def _roles(
    sample: Sample, label: str, flags: dict[str, Sequence[str]]
) -> tuple[int, dict[int, str]]:
    """(position of the label, the flag naming each forced column); an unknown name is an error (did
    you mean)."""
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
    """The share of 1s in the label column; a value not 0/1 (or true/false) is an error naming file,
    line, value."""
    column, name = sample.table.column(pos), sample.names[pos]
    if _storage(column.type) not in ("text", "integer", "float", "bool"):
        raise DataError(f"{sample.files[0]}: the label column {name!r} is {column.type}, not 0/1")
    labels, ok = parse_labels(column)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        shown = "empty" if column[row].as_py() in (None, "") else repr(column[row].as_py())
        raise DataError(
            f"{sample.where(row)}: the label {name!r} is {shown}, not 0 or 1 (or true/false)"
        )
    return float(labels.mean())


def infer_schema(
    files: Sequence[Path],
    label: str,
    ignore: Sequence[str] = (),
    categorical: Sequence[str] = (),
    dense: Sequence[str] = (),
    sample_rows: int = SAMPLE_ROWS,
    format: str = "auto",
    max_rows: int = MAX_ROWS,
    missing_flags: bool = False,
) -> InferredSchema:
    """Decide every column of ``files`` from a sample of their first ``sample_rows`` rows
    (``missing_flags``: set ``missing_flag`` on each dense column with gaps).

    Raises:
        DataError: an unreadable file, an unknown column, a label not 0/1, a forced kind that does
        not fit.
        ConfigError: a column given to two flags, or limits below 1.
    """
    if sample_rows < 1 or max_rows < 1:
        raise ConfigError("--sample-rows and --max-rows must be at least 1")
    sample = read_sample(files, format, sample_rows)
    label_pos, forced = _roles(
        sample, label, {"--ignore": ignore, "--categorical": categorical, "--dense": dense}
    )
    share = check_label(sample, label_pos)
    decisions = []
    for pos, name in enumerate(sample.names):
        if pos == label_pos:
            decisions.append(Decision(pos, name, "label", "--label", f"0/1, {share:.1%} positive"))
        elif forced.get(pos) == "--ignore":
            decisions.append(Decision(pos, name, "ignored", "forced by --ignore"))
        else:
            p = profile(sample.table.column(pos), sample.delimiter)
            guessed = (
                _forced(p, forced[pos], f"{sample.files[0]}: column {name!r}")
                if pos in forced
                else guess(p, sample.table.num_rows)
            )
            decisions.append(_decide(sample, pos, p, guessed, max_rows, missing_flags))
    if not any(d.feature for d in decisions):
        raise DataError(
            f"{sample.files[0]}: no column looks like a feature; name some with --categorical or "
            "--dense"
        )
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
        doc["features"] = [
            {
                k: v
                for k, v in d.feature.model_dump().items()
                if (k in keys and v is not None) or (k == "missing_flag" and v)
            }
            for d in self.decisions
            if d.feature is not None
        ]
        return doc

    def to_toml(self, command: str) -> str:
        """The config file: how it was made, the top level, a ``[[features]]`` table per feature
        (its reason above)."""
        features = (doc := self.config()).pop("features")
        head = [
            f"# Written by `{command}`",
            f"# from {self.sample.describe()}.",
            *[f"# ignored {d.column!r}: {d.why}" for d in self.decisions if d.kind == "ignored"],
            "# Check the kinds and table rows, then: dlrm train --config THIS_FILE --train ... "
            "--test ... --out DIR",
        ]
        reasons = [d.why for d in self.decisions if d.feature is not None]
        return "\n".join(
            ["\n".join(head) + "\n", tomli_w.dumps(doc)]
            + [
                f"# {why}\n[[features]]\n{tomli_w.dumps(f)}"
                for why, f in zip(reasons, features, strict=True)
            ]
        )

    def markdown(self) -> str:
        """A table of the decisions: column, kind, details, why."""
        kinds = [d.kind for d in self.decisions]
        summary = ", ".join(f"{kinds.count(k)} {k}" for k in ("categorical", "dense", "ignored"))
        lines = [
            f"Schema of {self.sample.describe()}: {summary}.",
            "",
            "| column | kind | details | why |",
            "| --- | --- | --- | --- |",
        ]
        for d in self.decisions:  # a "|" in a cell (a separator) is escaped
            lines.append(
                "| "
                + " | ".join(c.replace("|", "\\|") for c in (d.column, d.kind, d.details, d.why))
                + " |"
            )
        return "\n".join(lines)
