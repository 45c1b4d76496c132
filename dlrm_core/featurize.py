"""Featurising: raw column values -> model inputs, written once for every input format, the
trainer and both serving protocols, so that a row scores the same offline and online.

Input: one pyarrow array per feature (strings from text formats and JSON; numbers, strings or
lists from Parquet), plus the label. Output: a :class:`ParsedBlock`:

* label: 0 or 1 (``"0"``, ``"1"``, ``1.0``, ``true``); anything else is a malformed row;
* dense: the number (missing: NaN), checked (finite; an integer where the feature says so),
  transformed (``log1p``, ``standardize``, ``none``), missing values replaced by ``missing``
  (and flagged in a column of their own where the feature has ``missing_flag``);
* categorical: each value -> a 64-bit id (``string``: a stable hash of its UTF-8 bytes, an integer
  hashed as its decimal spelling; ``int``: its value; ``hex``: its value in hex) -> row
  ``id % rows`` of the feature's table (a ``dynamic`` table: the raw id, which the parameter node
  maps to a row); a missing one-hot value is id 0; a multi-hot cell is split at the separator
  (or is a list), empty values dropped, so ``""``, ``[]`` and null are empty bags.

Values become 64-bit ids, and ids rows, in ``dlrm_core/ids.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrm_core.ids import combined, raw_ids, to_rows
from dlrm_core.schema import CategoricalFeature, DenseFeature, FeatureSpec

LABEL = "\x00label"
"""Key of the label column in a featuriser's input (no feature name can clash with it)."""
DENSE_MAX_ABS = float(np.finfo(np.float32).max)
"""Largest magnitude of a dense value taken (the model computes in float32; beyond it a value
would become inf): larger ones are bad values, in files (file and line) and requests (422)."""
_NUMBER = r"^\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$"


@dataclass
class BadLine:
    """A malformed input row: where it is and why."""

    file: str
    line: int
    reason: str
    field: str | None = None
    """The feature (or ``label``) whose value is bad, when one is."""


@dataclass
class ParsedBlock:
    """The valid rows of one block (or request), ready to batch.

    Attributes:
        labels: float32 [n] (zeros when the input has no label).
        dense: float32 [n, I], transformed.
        ids: int64 [F, n] rows, when every feature has one id per row; else None.
        values: otherwise, per feature, int64 rows of all its bags in row order.
        lengths: otherwise, int32 [F, n] bag lengths.
        lines: int64 [n], 1-based line (row) number of each row in its file.
        bad: the rows left out, with the reason.
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

    def model_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense float32 [n, I], ids int64 of all bags feature-major, offsets int64 [F*n + 1])."""
        if self.ids is not None:
            ids = self.ids.reshape(-1)
            return self.dense, ids, np.arange(ids.size + 1, dtype=np.int64)
        ids = np.concatenate(self.values) if self.values else np.zeros(0, np.int64)
        offsets = np.zeros(self.lengths.size + 1, dtype=np.int64)
        np.cumsum(self.lengths.reshape(-1), out=offsets[1:])
        return self.dense, ids, offsets

    def select(self, keep: np.ndarray) -> ParsedBlock:
        """The rows where ``keep`` (bool [n]) holds, in order; the bad lines stay as they are."""
        if keep.all():
            return self
        values = lengths = ids = None
        if self.ids is not None:
            ids = self.ids[:, keep]  # [F, n']
        else:
            values = [v[np.repeat(keep, self.lengths[f])] for f, v in enumerate(self.values)]
            lengths = self.lengths[:, keep]  # [F, n']
        return ParsedBlock(
            self.labels[keep], self.dense[keep], ids, values, lengths, self.lines[keep], self.bad
        )


def _bags(values: pa.Array, sep: str | None) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A multi-hot column -> (the non-empty values, flattened; the row of each; bag lengths [n])."""
    values = combined(values)
    n = len(values)
    if not pa.types.is_list(values.type) and not pa.types.is_large_list(values.type):
        values = pc.split_pattern(pc.fill_null(pc.cast(values, pa.string()), ""), sep or "\x00")
    flat = pc.list_flatten(values)
    rows = pc.list_parent_indices(values).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
        keep = pc.fill_null(pc.not_equal(flat, ""), False)
    else:
        keep = pc.is_valid(flat)
    mask = keep.to_numpy(zero_copy_only=False)
    if not mask.all():
        flat, rows = pc.filter(flat, keep), rows[mask]
    return flat, rows, np.bincount(rows, minlength=n).astype(np.int32)


# -- dense values ----------------------------------------------------------------------------------


def parse_numbers(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Numbers (or number strings) -> (float64 [n] with NaN where missing, ok [n])."""
    values = combined(values)
    if (
        pa.types.is_boolean(values.type)
        or pa.types.is_integer(values.type)
        or pa.types.is_floating(values.type)
    ):
        x = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
        return x, ~np.isinf(x)
    if pa.types.is_null(values.type):
        return np.full(len(values), np.nan), np.ones(len(values), bool)
    values = pc.if_else(pc.equal(values, ""), pa.scalar(None, values.type), values)
    try:
        x = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
        return x, np.isfinite(x) | np.isnan(x) & ~pc.is_valid(values).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        good = pc.fill_null(pc.match_substring_regex(values, _NUMBER), True)
        cleaned = pc.if_else(good, values, pa.scalar(None, pa.string()))
        x = (
            pc.cast(pc.utf8_trim_whitespace(cleaned), pa.float64())
            .to_numpy(zero_copy_only=False)
            .astype(np.float64)
        )
        return x, good.to_numpy(zero_copy_only=False)


def transform_dense(x: np.ndarray, feature: DenseFeature) -> np.ndarray:
    """Raw values float64 [n] (NaN missing) -> model inputs float32 [n]."""
    return transform_dense_block(x[:, None], [feature])[:, 0]


def transform_dense_block(x: np.ndarray, features: list[DenseFeature]) -> np.ndarray:
    """Raw values float64 [n, len(features)] (NaN missing) of the dense features in order ->
    model inputs float32 [n, I]: each feature's transformed value, then a 0/1 column per
    ``missing_flag`` feature (1: missing); one call per kind of transform (the column and the
    value path share it)."""
    x = np.asarray(x, dtype=np.float64)
    log, std, mean, scale, missing, flags = _dense_plan(
        tuple((f.transform, f.mean, f.std, f.missing, f.missing_flag) for f in features)
    )
    if len(log) == x.shape[1]:  # every feature log1p (Criteo): no column selection
        y = np.log1p(np.fmax(x, 0.0))  # fmax: NaN -> 0 (replaced below)
    else:
        y = x.copy()
        if len(log):
            y[:, log] = np.log1p(np.fmax(x[:, log], 0.0))
        if len(std):
            y[:, std] = (x[:, std] - mean) / scale
    y = np.where(np.isnan(x), missing, y).astype(np.float32)
    if len(flags):
        y = np.concatenate([y, np.isnan(x[:, flags]).astype(np.float32)], axis=1)
    return y


@lru_cache(maxsize=64)
def _dense_plan(kinds: tuple) -> tuple[np.ndarray, ...]:
    """(transform, mean, std, missing, missing_flag) per feature -> (log1p columns, standardized
    columns, their means, their scales, the missing value of every column, flagged columns)."""
    log = np.array([j for j, k in enumerate(kinds) if k[0] == "log1p"], dtype=np.intp)
    std = np.array([j for j, k in enumerate(kinds) if k[0] == "standardize"], dtype=np.intp)
    mean = np.array([kinds[j][1] or 0.0 for j in std], dtype=np.float64)
    scale = np.array([kinds[j][2] or 1.0 for j in std], dtype=np.float64)
    flags = np.array([j for j, k in enumerate(kinds) if k[4]], dtype=np.intp)
    return log, std, mean, scale, np.array([k[3] for k in kinds], dtype=np.float64), flags


def parse_labels(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Labels -> (float32 [n], ok [n]): 0/1, or true/false."""
    values = combined(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        lowered = pc.utf8_lower(pc.utf8_trim_whitespace(values))
        values = pc.if_else(
            pc.equal(lowered, "true"), "1", pc.if_else(pc.equal(lowered, "false"), "0", values)
        )
    x, ok = parse_numbers(values)
    ok &= (x == 0) | (x == 1)
    return np.where(ok, x, 0).astype(np.float32), ok


# -- a block ---------------------------------------------------------------------------------------


class Featurizer:
    """Turns raw columns into model inputs for one feature spec (thread-safe, stateless)."""

    def __init__(
        self, spec: FeatureSpec, with_label: bool = True, dense_max_abs: float = DENSE_MAX_ABS
    ) -> None:
        self.spec = spec
        self.with_label = with_label
        self.dense_max_abs = dense_max_abs
        tables = [spec.table_of(f) for f in range(len(spec.categorical))]
        self.table_rows = [t.rows if t.dynamic is None else None for t in tables]  # None: raw ids
        self.multi_hot = any(f.separator is not None for f in spec.categorical)

    def __call__(
        self,
        columns: Mapping[str, pa.Array],
        n: int,
        lines: np.ndarray,
        file: str,
        bad: list[BadLine] | None = None,
        multi_hot: bool | None = None,
    ) -> ParsedBlock:
        """``columns``: the label under :data:`LABEL`, each feature under its name (n rows each).

        ``multi_hot`` forces the bag layout (a request whose values are lists); default: when a
        feature has a separator.
        """
        bad = list(bad or [])
        ok = np.ones(n, dtype=bool)
        reasons: list[tuple[np.ndarray, str]] = []
        labels = np.zeros(n, dtype=np.float32)
        if self.with_label:
            labels, label_ok = parse_labels(columns[LABEL])
            reasons.append((~label_ok, "label is not 0 or 1", "label"))
        raw = np.empty((n, len(self.spec.dense)), dtype=np.float64)
        for j, feat in enumerate(self.spec.dense):
            x, good = parse_numbers(columns[feat.name])
            reasons.append((~good, f"{feat.name} is not a number", feat.name))
            reasons.append(
                (
                    good & (np.abs(x) > self.dense_max_abs),
                    f"{feat.name} is out of range (at most {self.dense_max_abs:.7g} in magnitude)",
                    feat.name,
                )
            )
            if feat.integer:
                reasons.append(
                    (
                        good & ~np.isnan(x) & (x != np.floor(x)),
                        f"{feat.name} is not an integer",
                        feat.name,
                    )
                )
            raw[:, j] = x
        dense = transform_dense_block(raw, self.spec.dense)
        if multi_hot is None:
            multi_hot = self.multi_hot or any(
                _is_list(columns[f.name]) for f in self.spec.categorical
            )
        multi = multi_hot
        ids, values, lengths = self._categorical(columns, n, multi, reasons)
        for mask, reason, name in reasons:
            if mask.any():
                for i in np.flatnonzero(mask & ok):
                    bad.append(BadLine(file, int(lines[i]), reason, name))
                ok &= ~mask
        if not ok.all():
            keep = np.flatnonzero(ok)
            labels, dense, lines = labels[keep], dense[keep], lines[keep]
            if multi:
                values = [v[np.repeat(ok, lengths[f])] for f, v in enumerate(values)]
                lengths = lengths[:, keep]
            else:
                ids = ids[:, keep]
        bad.sort(key=lambda b: b.line)
        return ParsedBlock(labels, dense, ids, values if multi else None, lengths, lines, bad)

    def _categorical(self, columns, n: int, multi: bool, reasons: list):
        """-> (ids [F, n] | None, values per feature | None, lengths [F, n] | None)."""
        feats = self.spec.categorical
        joined = _joined_raw_ids(columns, feats) if n <= SMALL_BLOCK else {}
        ids = None if multi else np.empty((len(feats), n), dtype=np.int64)
        values: list[np.ndarray] = []
        lengths = np.ones((len(feats), n), dtype=np.int32) if multi else None
        for f, feat in enumerate(feats):
            col = columns[feat.name]
            bag = feat.separator is not None or _is_list(col)
            if bag:
                flat, row_of, lengths[f] = _bags(col, feat.separator)
                raw, valid = raw_ids(flat, feat.encoding)
                bad_rows = np.zeros(n, dtype=bool)
                bad_rows[row_of[~valid]] = True
                reasons.append((bad_rows, _bad_value(feat), feat.name))
                values.append(to_rows(raw, self.table_rows[f]))
                continue
            raw, valid = joined[f] if f in joined else raw_ids(col, feat.encoding)
            reasons.append((~valid, _bad_value(feat), feat.name))
            rows = to_rows(raw, self.table_rows[f])
            if multi:
                values.append(rows)
            else:
                ids[f] = rows
        return ids, values, lengths


SMALL_BLOCK = 1024
"""Blocks of at most this many rows (requests) parse their one-hot columns of one encoding in one
call: for a single-instance request, 26 calls' overhead was most of the featurising time."""


def _joined_raw_ids(
    columns, feats: list[CategoricalFeature]
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per one-hot feature f, ``raw_ids`` of its column, computed for all columns of the same
    encoding and arrow type at once (``raw_ids`` is element-wise: the same ids as one by one)."""
    groups: dict[tuple, list[int]] = {}
    for f, feat in enumerate(feats):
        col = combined(columns[feat.name])
        if feat.separator is None and (
            pa.types.is_string(col.type) or pa.types.is_integer(col.type)
        ):
            groups.setdefault((feat.encoding, col.type), []).append(f)
    out = {}
    for (encoding, _), members in groups.items():
        if len(members) < 2:
            continue
        cols = [combined(columns[feats[f].name]) for f in members]
        raw, ok = raw_ids(pa.concat_arrays(cols), encoding)
        cuts = np.cumsum([len(c) for c in cols])[:-1]
        out.update(
            zip(members, zip(np.split(raw, cuts), np.split(ok, cuts), strict=True), strict=True)
        )
    return out


def _is_list(values: pa.Array) -> bool:
    return pa.types.is_list(values.type) or pa.types.is_large_list(values.type)


def _bad_value(feat: CategoricalFeature) -> str:
    return f"{feat.name} is not {'hex' if feat.encoding == 'hex' else 'an integer'}"
