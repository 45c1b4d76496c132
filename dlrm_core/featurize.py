"""Featurising: raw column values -> model inputs, written once for every input format, the
trainer and both serving protocols, so that a row scores the same offline and online.

Input: one pyarrow array per feature (strings from text formats and JSON; numbers, strings or
lists from Parquet), plus the label. Output: a :class:`ParsedBlock`:

* label: 0 or 1 (``"0"``, ``"1"``, ``1.0``, ``true``); anything else is a malformed row;
* dense: the number (missing: NaN), checked (finite; an integer where the feature says so),
  transformed (``log1p``, ``standardize``, ``none``), missing values replaced by ``missing``;
* categorical: each value -> a 64-bit id (``string``: a stable hash of its UTF-8 bytes, an integer
  hashed as its decimal spelling; ``int``: its value; ``hex``: its value in hex) -> row
  ``id % rows`` of the feature's table (a ``dynamic`` table: the raw id, which the parameter node
  maps to a row); a missing one-hot value is id 0; a multi-hot cell is split at the separator
  (or is a list), empty values dropped, so ``""``, ``[]`` and null are empty bags.

The string hash is defined on 8-byte little-endian words of the value, zero-padded, so it is the
same on every machine and process: ``h = S ^ len * K2``; per word ``h = (h ^ w) * K1;
h ^= h >> 29``; then murmur3's 64-bit finaliser. Vectorised over whole columns (numpy), no
per-value Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrm_core.schema import CategoricalFeature, DenseFeature, FeatureSpec

LABEL = "\x00label"
"""Key of the label column in a featuriser's input (no feature name can clash with it)."""
MAX_HEX_DIGITS = 16
_HEX_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_NIBBLE[_c] = 10 + _i
_first, _second = _HEX_NIBBLE[np.arange(65536) & 255], _HEX_NIBBLE[np.arange(65536) >> 8]
_HEX_PAIR = np.where((_first == 255) | (_second == 255), 0xFFFF, _first.astype(np.uint16) << 4 | _second).astype(np.uint16)
"""Two hex digits read as one little-endian uint16 (the first digit in the low byte) -> their byte
value; 0xFFFF when either is not a hex digit."""
_PAIR_HIGH_BYTES = np.uint64(0xFF00FF00FF00FF00)
_K1, _K2, _SEED = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x243F6A8885A308D3)
_F1, _F2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
DENSE_MAX_ABS = float(np.finfo(np.float32).max)
"""Largest magnitude of a dense value taken (the model computes in float32; beyond it a value
would become inf): larger ones are bad values, in files (file and line) and requests (422)."""
_NUMBER = r"^\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$"
_INTEGER = r"^\s*[+-]?[0-9]{1,18}\s*$"


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


# -- values -> 64-bit ids --------------------------------------------------------------------------------


def _combined(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def hex_to_uint64(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Hex strings -> (uint64 [n], ok [n]); empty or null is 0 and valid; >16 digits or a non-hex
    character is not ok."""
    values = _combined(pc.fill_null(values, ""))
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64), np.ones(0, bool)
    lengths = pc.utf8_length(values).to_numpy(zero_copy_only=False)
    ok = lengths <= MAX_HEX_DIGITS
    if not pc.all(pc.string_is_ascii(values)).as_py():  # padding counts characters: bytes must be chars
        ok &= pc.string_is_ascii(values).to_numpy(zero_copy_only=False)
    if not ok.all():
        values = pc.if_else(pa.array(ok), values, "")
    padded = _combined(pc.utf8_lpad(values, MAX_HEX_DIGITS, "0"))
    # Every value is now 16 digits: n x 8 digit pairs, each looked up as one uint16.
    raw = np.frombuffer(padded.buffers()[2], dtype=np.uint8)
    start = padded.offset * MAX_HEX_DIGITS
    pairs = _HEX_PAIR[raw[start : start + n * MAX_HEX_DIGITS].view("<u2")].reshape(n, MAX_HEX_DIGITS // 2)
    words = pairs.view("<u8")  # n x 2: a high byte set in any pair is a non-hex digit
    ok &= ((words[:, 0] | words[:, 1]) & _PAIR_HIGH_BYTES) == 0
    out = pairs.astype(np.uint8).view(">u8").reshape(n).astype(np.uint64)  # the 8 bytes, big-endian
    if not ok.all():
        out[~ok] = 0
    return out, ok


def _mix_words(h: np.ndarray, words: np.ndarray, nwords: np.ndarray) -> np.ndarray:
    """Fold word k of each value into its hash, for the values that have a word k."""
    for k in range(words.shape[1]):
        hk = h ^ words[:, k]
        hk *= _K1
        hk ^= hk >> np.uint64(29)
        h = np.where(nwords > k, hk, h)
    return h


def _finish(h: np.ndarray) -> np.ndarray:
    h ^= h >> np.uint64(33)
    h *= _F1
    h ^= h >> np.uint64(33)
    h *= _F2
    h ^= h >> np.uint64(33)
    return h


def hash_strings(values: pa.Array) -> np.ndarray:
    """The stable 64-bit hash of each string (UTF-8 bytes), uint64 [n]; null hashes as ``""``."""
    values = _combined(pc.fill_null(values, ""))
    if pa.types.is_large_string(values.type) or pa.types.is_binary(values.type):
        values = pc.cast(values, pa.string())
    n = len(values)
    lengths = pc.binary_length(values).to_numpy(zero_copy_only=False).astype(np.int64)
    h = np.full(n, _SEED, dtype=np.uint64) ^ (lengths.astype(np.uint64) * _K2)
    if n == 0:
        return h
    nwords = (lengths + 7) // 8
    width = 8 * max(1, int(nwords.max()))
    if width <= 64 and pc.all(pc.string_is_ascii(values)).as_py():
        # Fast path: pad every value with zero bytes to one width: an [n, width / 8] word matrix.
        padded = _combined(pc.utf8_rpad(values, width, "\x00"))
        data = np.frombuffer(padded.buffers()[2], dtype="<u8")
        first = padded.offset * width // 8
        words = data[first : first + n * width // 8].reshape(n, width // 8)
        return _finish(_mix_words(h, words, nwords))
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[values.offset : values.offset + n + 1]
    raw = np.frombuffer(values.buffers()[2], dtype=np.uint8) if values.buffers()[2] is not None else np.zeros(0, np.uint8)
    buf = np.zeros(len(raw) + 16, dtype=np.uint8)
    buf[: len(raw)] = raw
    unaligned = np.ndarray(shape=(len(buf) - 8,), dtype="<u8", buffer=buf, strides=(1,))  # word at any byte
    words = np.zeros((n, width // 8), dtype=np.uint64)
    for k in range(width // 8):
        rows = np.flatnonzero(nwords > k)
        w = unaligned[offsets[rows].astype(np.int64) + 8 * k]
        rest = lengths[rows] - 8 * k
        short = rest < 8
        w[short] &= (np.uint64(1) << (rest[short] * 8).astype(np.uint64)) - np.uint64(1)
        words[rows, k] = w
    return _finish(_mix_words(h, words, nwords))


def _ints(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer strings -> (int64 [n], ok [n]); null/empty is 0 and ok."""
    values = _combined(values)
    try:
        return pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False), np.ones(len(values), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        good = pc.or_kleene(pc.match_substring_regex(values, _INTEGER), pc.equal(values, ""))
        good = pc.fill_null(good, True)
        trimmed = pc.replace_substring_regex(pc.utf8_trim_whitespace(values), r"^\+", "")  # arrow reads no "+"
        cleaned = pc.if_else(good, trimmed, pa.scalar(None, pa.string()))
        cleaned = pc.if_else(pc.equal(cleaned, ""), pa.scalar(None, pa.string()), cleaned)
        out = pc.fill_null(pc.cast(cleaned, pa.int64()), 0).to_numpy(zero_copy_only=False)
        return out, good.to_numpy(zero_copy_only=False)


def raw_ids(values: pa.Array, encoding: str) -> tuple[np.ndarray, np.ndarray]:
    """One categorical value per entry -> (uint64 ids [n], ok [n]); a missing value is id 0."""
    values = _combined(values)
    t = values.type
    if pa.types.is_dictionary(t):
        values, t = values.dictionary_decode(), t.value_type
    if pa.types.is_integer(t):
        if encoding != "string":  # the value itself, as 64 bits (uint64 above 2^63 included)
            wide = pa.uint64() if pa.types.is_unsigned_integer(t) else pa.int64()
            ints = pc.fill_null(pc.cast(values, wide), 0).to_numpy(zero_copy_only=False)
            return ints.view(np.uint64), np.ones(len(ints), bool)
        # Integer codes repeat: hash each distinct value's spelling once, then index (null: id 0).
        coded = pc.dictionary_encode(values)
        ids = np.append(hash_strings(pc.cast(coded.dictionary, pa.string())), np.uint64(0))
        index = pc.fill_null(coded.indices, len(ids) - 1).to_numpy(zero_copy_only=False)
        return ids[index], np.ones(len(values), bool)
    if encoding == "hex":
        return hex_to_uint64(values)
    if encoding == "int":
        ints, ok = _ints(values)
        return ints.view(np.uint64), ok
    ids = hash_strings(values)
    missing = pc.fill_null(pc.equal(values, ""), True).to_numpy(zero_copy_only=False)
    ids[missing] = 0
    return ids, np.ones(len(ids), bool)


def _bags(values: pa.Array, sep: str | None) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A multi-hot column -> (the non-empty values, flattened; the row of each; bag lengths [n])."""
    values = _combined(values)
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


RESERVED_ID = -(1 << 63)
"""The one 64-bit key no dynamic table holds: the id maps' and published owner maps' "no id" mark
(``NO_OWNER``). A raw id of these 64 bits (2^63 unsigned) is read as its neighbour ``RESERVED_ID + 1``
by every featurizing path, so the two share a row (the only two ids that ever do)."""


def to_rows(ids: np.ndarray, rows: int | None) -> np.ndarray:
    """Row of each 64-bit id in a table of ``rows`` rows: ``id % rows`` (int64); ``rows`` None
    (a dynamic table): the raw id itself, its 64 bits as int64 (the table's id map finds the row;
    ``RESERVED_ID`` read as ``RESERVED_ID + 1``)."""
    if rows is None:
        keys = ids.astype(np.uint64, copy=False).view(np.int64)
        reserved = keys == RESERVED_ID
        return np.where(reserved, RESERVED_ID + 1, keys) if reserved.any() else keys
    return (ids.astype(np.uint64, copy=False) % np.uint64(rows)).astype(np.int64)


# -- dense values -----------------------------------------------------------------------------------------


def parse_numbers(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Numbers (or number strings) -> (float64 [n] with NaN where missing, ok [n])."""
    values = _combined(values)
    if pa.types.is_boolean(values.type) or pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
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
        x = pc.cast(pc.utf8_trim_whitespace(cleaned), pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
        return x, good.to_numpy(zero_copy_only=False)


def transform_dense(x: np.ndarray, feature: DenseFeature) -> np.ndarray:
    """Raw values float64 [n] (NaN missing) -> model inputs float32 [n]."""
    return transform_dense_block(x[:, None], [feature])[:, 0]


def transform_dense_block(x: np.ndarray, features: list[DenseFeature]) -> np.ndarray:
    """Raw values float64 [n, I] (NaN missing) of the dense features in order -> model inputs
    float32 [n, I]; one call per kind of transform (the column and the value path share it)."""
    x = np.asarray(x, dtype=np.float64)
    log, std, mean, scale, missing = _dense_plan(tuple((f.transform, f.mean, f.std, f.missing) for f in features))
    if len(log) == x.shape[1]:  # every feature log1p (Criteo): no column selection
        y = np.log1p(np.fmax(x, 0.0))  # fmax: NaN -> 0 (replaced below)
    else:
        y = x.copy()
        if len(log):
            y[:, log] = np.log1p(np.fmax(x[:, log], 0.0))
        if len(std):
            y[:, std] = (x[:, std] - mean) / scale
    return np.where(np.isnan(x), missing, y).astype(np.float32)


@lru_cache(maxsize=64)
def _dense_plan(kinds: tuple) -> tuple[np.ndarray, ...]:
    """(transform, mean, std, missing) per feature -> (log1p columns, standardized columns, their
    means, their scales, the missing value of every column)."""
    log = np.array([j for j, k in enumerate(kinds) if k[0] == "log1p"], dtype=np.intp)
    std = np.array([j for j, k in enumerate(kinds) if k[0] == "standardize"], dtype=np.intp)
    mean = np.array([kinds[j][1] or 0.0 for j in std], dtype=np.float64)
    scale = np.array([kinds[j][2] or 1.0 for j in std], dtype=np.float64)
    return log, std, mean, scale, np.array([k[3] for k in kinds], dtype=np.float64)


def parse_labels(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Labels -> (float32 [n], ok [n]): 0/1, or true/false."""
    values = _combined(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        lowered = pc.utf8_lower(pc.utf8_trim_whitespace(values))
        values = pc.if_else(pc.equal(lowered, "true"), "1", pc.if_else(pc.equal(lowered, "false"), "0", values))
    x, ok = parse_numbers(values)
    ok &= (x == 0) | (x == 1)
    return np.where(ok, x, 0).astype(np.float32), ok


# -- a block -----------------------------------------------------------------------------------------------


class Featurizer:
    """Turns raw columns into model inputs for one feature spec (thread-safe, stateless)."""

    def __init__(self, spec: FeatureSpec, with_label: bool = True, dense_max_abs: float = DENSE_MAX_ABS) -> None:
        self.spec = spec
        self.with_label = with_label
        self.dense_max_abs = dense_max_abs
        tables = [spec.table_of(f) for f in range(len(spec.categorical))]
        self.table_rows = [t.rows if t.dynamic is None else None for t in tables]  # None: raw ids
        self.multi_hot = any(f.separator is not None for f in spec.categorical)

    def __call__(self, columns: Mapping[str, pa.Array], n: int, lines: np.ndarray, file: str,
                 bad: list[BadLine] | None = None, multi_hot: bool | None = None) -> ParsedBlock:
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
            reasons.append((good & (np.abs(x) > self.dense_max_abs),
                            f"{feat.name} is out of range (at most {self.dense_max_abs:.7g} in magnitude)", feat.name))
            if feat.integer:
                reasons.append((good & ~np.isnan(x) & (x != np.floor(x)), f"{feat.name} is not an integer", feat.name))
            raw[:, j] = x
        dense = transform_dense_block(raw, self.spec.dense)
        if multi_hot is None:
            multi_hot = self.multi_hot or any(_is_list(columns[f.name]) for f in self.spec.categorical)
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


def _joined_raw_ids(columns, feats: list[CategoricalFeature]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per one-hot feature f, ``raw_ids`` of its column, computed for all columns of the same
    encoding and arrow type at once (``raw_ids`` is element-wise: the same ids as one by one)."""
    groups: dict[tuple, list[int]] = {}
    for f, feat in enumerate(feats):
        col = _combined(columns[feat.name])
        if feat.separator is None and (pa.types.is_string(col.type) or pa.types.is_integer(col.type)):
            groups.setdefault((feat.encoding, col.type), []).append(f)
    out = {}
    for (encoding, _), members in groups.items():
        if len(members) < 2:
            continue
        cols = [_combined(columns[feats[f].name]) for f in members]
        raw, ok = raw_ids(pa.concat_arrays(cols), encoding)
        cuts = np.cumsum([len(c) for c in cols])[:-1]
        out.update(zip(members, zip(np.split(raw, cuts), np.split(ok, cuts), strict=True), strict=True))
    return out


def _is_list(values: pa.Array) -> bool:
    return pa.types.is_list(values.type) or pa.types.is_large_list(values.type)


def _bad_value(feat: CategoricalFeature) -> str:
    return f"{feat.name} is not {'hex' if feat.encoding == 'hex' else 'an integer'}"
