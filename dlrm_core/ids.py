"""Categorical values -> 64-bit ids -> table rows, vectorised over whole columns (numpy and
pyarrow compute, no per-value Python), for every featurizing path.

The string hash is defined on 8-byte little-endian words of the value, zero-padded, so it is the
same on every machine and process: ``h = S ^ len * K2``; per word ``h = (h ^ w) * K1;
h ^= h >> 29``; then murmur3's 64-bit finaliser. ``hex`` values are read as their 64-bit value
(at most 16 digits), ``int`` values as theirs; a missing value is id 0.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MAX_HEX_DIGITS = 16
_HEX_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_NIBBLE[_c] = 10 + _i
_first, _second = _HEX_NIBBLE[np.arange(65536) & 255], _HEX_NIBBLE[np.arange(65536) >> 8]
_HEX_PAIR = np.where(
    (_first == 255) | (_second == 255), 0xFFFF, _first.astype(np.uint16) << 4 | _second
).astype(np.uint16)
"""Two hex digits read as one little-endian uint16 (the first digit in the low byte) -> their byte
value; 0xFFFF when either is not a hex digit."""
_PAIR_HIGH_BYTES = np.uint64(0xFF00FF00FF00FF00)
_K1, _K2, _SEED = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x243F6A8885A308D3),
)
_F1, _F2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_INTEGER = r"^\s*[+-]?[0-9]{1,18}\s*$"


def combined(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def hex_to_uint64(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Hex strings -> (uint64 [n], ok [n]); empty or null is 0 and valid; >16 digits or a non-hex
    character is not ok."""
    values = combined(pc.fill_null(values, ""))
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64), np.ones(0, bool)
    lengths = pc.utf8_length(values).to_numpy(zero_copy_only=False)
    ok = lengths <= MAX_HEX_DIGITS
    # padding counts characters: bytes must be chars
    if not pc.all(pc.string_is_ascii(values)).as_py():
        ok &= pc.string_is_ascii(values).to_numpy(zero_copy_only=False)
    if not ok.all():
        values = pc.if_else(pa.array(ok), values, "")
    padded = combined(pc.utf8_lpad(values, MAX_HEX_DIGITS, "0"))
    # Every value is now 16 digits: n x 8 digit pairs, each looked up as one uint16.
    raw = np.frombuffer(padded.buffers()[2], dtype=np.uint8)
    start = padded.offset * MAX_HEX_DIGITS
    pairs = _HEX_PAIR[raw[start : start + n * MAX_HEX_DIGITS].view("<u2")].reshape(
        n, MAX_HEX_DIGITS // 2
    )
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
    values = combined(pc.fill_null(values, ""))
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
        padded = combined(pc.utf8_rpad(values, width, "\x00"))
        data = np.frombuffer(padded.buffers()[2], dtype="<u8")
        first = padded.offset * width // 8
        words = data[first : first + n * width // 8].reshape(n, width // 8)
        return _finish(_mix_words(h, words, nwords))
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[
        values.offset : values.offset + n + 1
    ]
    raw = (
        np.frombuffer(values.buffers()[2], dtype=np.uint8)
        if values.buffers()[2] is not None
        else np.zeros(0, np.uint8)
    )
    buf = np.zeros(len(raw) + 16, dtype=np.uint8)
    buf[: len(raw)] = raw
    # word at any byte
    unaligned = np.ndarray(shape=(len(buf) - 8,), dtype="<u8", buffer=buf, strides=(1,))
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
    values = combined(values)
    try:
        return pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False), np.ones(
            len(values), bool
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        good = pc.or_kleene(pc.match_substring_regex(values, _INTEGER), pc.equal(values, ""))
        good = pc.fill_null(good, True)
        # arrow reads no "+"
        trimmed = pc.replace_substring_regex(pc.utf8_trim_whitespace(values), r"^\+", "")
        cleaned = pc.if_else(good, trimmed, pa.scalar(None, pa.string()))
        cleaned = pc.if_else(pc.equal(cleaned, ""), pa.scalar(None, pa.string()), cleaned)
        out = pc.fill_null(pc.cast(cleaned, pa.int64()), 0).to_numpy(zero_copy_only=False)
        return out, good.to_numpy(zero_copy_only=False)


def raw_ids(values: pa.Array, encoding: str) -> tuple[np.ndarray, np.ndarray]:
    """One categorical value per entry -> (uint64 ids [n], ok [n]); a missing value is id 0."""
    values = combined(values)
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


RESERVED_ID = -(1 << 63)
"""The one 64-bit key no dynamic table holds: the id maps' and published owner maps' "no id" mark
(``NO_OWNER``). A raw id of these 64 bits (2^63 unsigned) is read as its neighbour ``RESERVED_ID +
1``
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
