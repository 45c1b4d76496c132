"""The value path of featurising: a few examples given as Python values (a JSON request's
instances, Open Inference Protocol tensors, a split line) -> model inputs, without building
arrow columns (for a single-instance request, the column path's ~100 arrow and numpy calls were
most of its cost).

Same results as the column path (:class:`dlrm_core.featurize.Featurizer`) by construction: the
dense transform is the same function (:func:`transform_dense_block`), strings are hashed by
:func:`hash_strings`, and hex / int values are parsed only in the spellings whose value the column
path reads the same way. Any value outside them (a bag, a number as a string, whitespace, a sign
on a hex value, more than 18 digits, a non-integer count, ...) makes
:meth:`ValueFeaturizer.__call__`
return None: the caller then featurises the request through the column path, which also
reports what is wrong with it. ``tests/test_featurize_values.py`` checks the two paths agree.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa

from dlrm_core.featurize import DENSE_MAX_ABS, transform_dense_block
from dlrm_core.ids import RESERVED_ID, hash_strings
from dlrm_core.schema import FeatureSpec

MAX_EXAMPLES = 16
"""Larger requests take the column path (vectorised over examples, faster beyond a few)."""
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_INT = re.compile(r"-?[0-9]{1,18}")
_U64 = (1 << 64) - 1
_EXACT = 2**53
"""Integers up to this are exact as float64 (JSON integers become float64 in the column path)."""


class ValueFeaturizer:
    """One-hot examples as Python values -> model inputs, for one feature spec (thread-safe).

    Shapes: n examples, I dense and F categorical features.
    """

    def __init__(self, spec: FeatureSpec, dense_max_abs: float = DENSE_MAX_ABS) -> None:
        self.spec = spec
        self.dense_max_abs = dense_max_abs
        """Larger dense values take the column path, which reports them."""
        self.enabled = not any(f.separator is not None for f in spec.categorical)
        """A spec with multi-hot features always takes the column path."""
        self.encodings = [f.encoding for f in spec.categorical]
        self.rows = [
            t.rows if t.dynamic is None else None
            for t in (spec.table_of(f) for f in range(len(spec.categorical)))
        ]
        self.integer = [f.integer for f in spec.dense]

    def __call__(
        self, dense: list[list], cats: list[list], n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Per dense feature its n values (numbers or None), per categorical feature its n
        values (str, int or None) -> (dense float32 [n, I], ids int64 [F*n] feature-major,
        offsets int64 [F*n + 1]), or None where the column path must take the request."""
        if not self.enabled or n > MAX_EXAMPLES:
            return None
        x = self._numbers(dense, n)
        if x is None:
            return None
        ids = self._ids(cats, n)
        if ids is None:
            return None
        return (
            transform_dense_block(x, self.spec.dense),
            ids,
            np.arange(ids.size + 1, dtype=np.int64),
        )

    def _numbers(self, dense: list[list], n: int) -> np.ndarray | None:
        """-> float64 [n, I], NaN where missing; None for a value the column path reads
        otherwise."""
        x = np.empty((n, len(dense)), dtype=np.float64)
        top = self.dense_max_abs
        for j, values in enumerate(dense):
            integer = self.integer[j]
            for i, v in enumerate(values):
                t = type(v)
                if v is None:
                    x[i, j] = math.nan
                elif t is int and -_EXACT <= v <= _EXACT and -top <= v <= top:
                    x[i, j] = v
                elif t is float and -top <= v <= top and (not integer or v.is_integer()):
                    x[i, j] = v
                else:
                    return None
        return x

    def _ids(self, cats: list[list], n: int) -> np.ndarray | None:
        """-> rows int64 [F*n] feature-major; None for a value the column path reads otherwise."""
        out = [0] * (len(cats) * n)
        strings: list[tuple[int, str]] = []  # (position in out, value) of string-encoded values
        for f, values in enumerate(cats):
            encoding = self.encodings[f]
            for i, v in enumerate(values):
                k = f * n + i
                if v is None or v == "":
                    continue  # id 0, whatever the encoding
                t = type(v)
                if encoding == "hex":
                    if t is str and _HEX.fullmatch(v):
                        out[k] = int(v, 16)
                    elif t is int and 0 <= v <= _U64:
                        out[k] = v
                    else:
                        return None
                elif encoding == "int":
                    if (t is str and _INT.fullmatch(v)) or (t is int and -(10**18) < v < 10**18):
                        out[k] = int(v)
                    else:
                        return None
                elif t is str or t is int:
                    strings.append((k, str(v)))
                else:
                    return None
        if strings:
            hashed = hash_strings(pa.array([s for _, s in strings], type=pa.string())).tolist()
            for (k, _), h in zip(strings, hashed, strict=True):
                out[k] = h
        for f, rows in enumerate(self.rows):  # row id % rows; a dynamic table: the raw id as int64
            for k in range(f * n, (f + 1) * n):
                v = out[k] & _U64
                if rows is not None:
                    out[k] = v % rows
                else:  # the 64 bits as int64; RESERVED_ID read as its neighbour (dlrm_core/ids.py)
                    out[k] = (
                        v if v < 1 << 63 else (v - (1 << 64) if v != 1 << 63 else RESERVED_ID + 1)
                    )
        return np.array(out, dtype=np.int64)
