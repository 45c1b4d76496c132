"""Feature specs and feature processing, shared by training and serving.

Everything that turns a raw value into a model input lives here, so that an example scores the
same offline (``dense_trainer`` reading a Criteo file) and online (``api`` reading JSON):

* a categorical value is a hex string (``"68fd1e64"``) or a non-negative integer; its row in the
  feature's table is ``int(hex, 16) % rows`` (integers: ``value % rows``);
* a missing categorical (empty cell, JSON ``null``) is the value 0, i.e. row 0;
* a dense value ``x`` becomes ``log(1 + max(x, 0))``; a missing one becomes 0.

The vectorised functions take pyarrow arrays so that the reader can hash a whole parsed block at
once; the API builds the same arrays from a request, and goes through the very same code.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_HEX_DIGITS = 16
"""A categorical value is at most 16 hex digits (64 bits)."""

_HEX_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_NIBBLE[_c] = 10 + _i


class TableSpec(BaseModel):
    """One embedding table; each sparse feature owns exactly one table, named after it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Table (and feature) name, e.g. ``C1``."""
    rows: int = Field(gt=0)
    """Number of rows: raw values are hashed into ``[0, rows)``."""
    dim: int = Field(gt=0)
    """Embedding dimension of the table."""
    pooling: Literal["sum", "mean"] = "sum"
    """How the rows of a multi-hot bag are pooled into one vector."""

    @property
    def num_bytes(self) -> int:
        """Bytes of the fp32 weights (optimizer state not included)."""
        return self.rows * self.dim * 4


class FeatureSpec(BaseModel):
    """The model's input schema: label, dense columns, sparse columns and their tables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dense: list[str]
    """Names of the dense (integer) features, in column order, e.g. ``I1..I13``."""
    tables: list[TableSpec]
    """One table per sparse feature, in column order, e.g. ``C1..C26``."""
    multi_hot_sep: str | None = None
    """Separator of several values in one categorical cell (multi-hot); ``None``: one value."""

    @model_validator(mode="after")
    def _unique_names(self) -> FeatureSpec:
        names = self.dense + [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate feature names: {dup}")
        return self

    @property
    def sparse(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def num_columns(self) -> int:
        """Fields per line in the Criteo layout: label + dense + sparse."""
        return 1 + len(self.dense) + len(self.tables)

    @property
    def column_names(self) -> list[str]:
        return ["label", *self.dense, *self.sparse]


def criteo_spec(rows: list[int], dims: list[int], pooling: str = "sum") -> FeatureSpec:
    """The Criteo Kaggle/Terabyte schema: I1..I13 dense, C1..C26 sparse."""
    if len(rows) != 26 or len(dims) != 26:
        raise ValueError("the Criteo schema has 26 sparse features")
    tables = [
        TableSpec(name=f"C{i + 1}", rows=r, dim=d, pooling=pooling)
        for i, (r, d) in enumerate(zip(rows, dims, strict=True))
    ]
    return FeatureSpec(dense=[f"I{i + 1}" for i in range(13)], tables=tables)


def hex_to_uint64(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Parse hex strings to integers, vectorised.

    Args:
        values: pyarrow string array of length n; empty strings are missing values.

    Returns:
        ``(ints, ok)``: uint64 [n] (0 where missing or invalid) and bool [n], False where a value is
        not 1..16 hex digits. Empty strings are valid (missing) and parse to 0.
    """
    values = pc.fill_null(values, "")
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64), np.ones(0, bool)
    lengths = pc.utf8_length(values).to_numpy(zero_copy_only=False)
    ok = lengths <= MAX_HEX_DIGITS
    # Left-pad to 16 digits so that every value is a fixed-width row of bytes: n x 16.
    padded = pc.utf8_lpad(pc.if_else(pa.array(ok), values, ""), MAX_HEX_DIGITS, "0")
    padded = padded.combine_chunks() if isinstance(padded, pa.ChunkedArray) else padded
    raw = np.frombuffer(padded.buffers()[2], dtype=np.uint8)
    start = padded.offset * MAX_HEX_DIGITS
    nibbles = _HEX_NIBBLE[raw[start : start + n * MAX_HEX_DIGITS].reshape(n, MAX_HEX_DIGITS)]
    ok &= (nibbles != 255).all(axis=1)
    nibbles[~ok] = 0
    out = np.zeros(n, dtype=np.uint64)
    for j in range(MAX_HEX_DIGITS):  # 16 vector shifts; cheaper than any per-row Python
        out <<= np.uint64(4)
        out |= nibbles[:, j].astype(np.uint64)
    return out, ok


def hash_to_rows(values: np.ndarray, rows: int) -> np.ndarray:
    """Row of each raw categorical value in a table of ``rows`` rows: ``value % rows`` (int64)."""
    return (values.astype(np.uint64, copy=False) % np.uint64(rows)).astype(np.int64)


def transform_dense(values: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` elementwise as float32; NaN (missing) becomes 0."""
    x = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


def featurize(
    spec: FeatureSpec, dense: np.ndarray, sparse_values: list[str], lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Model inputs from raw request values (the API's JSON path).

    Args:
        dense: float64 [B, I] raw dense values, NaN where missing.
        sparse_values: the raw categorical values of every bag, row-major (example 0's feature 0
            bag, its feature 1 bag, ...), as hex strings ('' for missing).
        lengths: int [B, F] values per bag.

    Returns:
        ``(dense, values, offsets, bad)``: float32 [B, I] transformed dense features; int64 row
        ids of all bags in TBE (feature-major) order and their int64 [F*B + 1] offsets; the
        indices into ``sparse_values`` of values that are not valid hex.
    """
    b, f = lengths.shape
    raw, ok = hex_to_uint64(pa.array(sparse_values, type=pa.string()))
    bad = np.flatnonzero(~ok)
    table_rows = np.array([t.rows for t in spec.tables], dtype=np.uint64)
    feature_of_value = np.repeat(np.tile(np.arange(f), b), lengths.ravel())  # row-major bags
    rows = (raw % table_rows[feature_of_value]).astype(np.int64)
    if (lengths == 1).all():  # one-hot: a transpose
        values = rows.reshape(b, f).T.ravel()
    else:  # reorder bags from row-major (b, f) to feature-major (f, b)
        bag_rm = np.repeat(np.arange(b * f), lengths.ravel())
        bag_fm = (bag_rm % f) * b + bag_rm // f
        values = rows[np.argsort(bag_fm, kind="stable")]
    offsets = np.zeros(f * b + 1, dtype=np.int64)
    np.cumsum(lengths.T.ravel(), out=offsets[1:])
    return transform_dense(dense), values, offsets, bad
