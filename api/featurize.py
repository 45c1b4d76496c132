"""Requests -> model inputs: JSON instances and TSV lines, through the training code path.

Featurising (hashing categoricals into rows, transforming dense values) is the very code the
trainer runs (``dlrm_core``), so a row scores the same offline and online.
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa

from api.errors import InputError
from dlrm_core.features import FeatureSpec, featurize
from dlrm_core.formats.criteo import BlockParser, RawBlock


def instances_to_arrays(spec: FeatureSpec, instances: list) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Validated instances -> raw dense float64 [B, I] (NaN missing), bag values, lengths [B, F]."""
    n_dense, n_sparse = len(spec.dense), len(spec.tables)
    dense_rows: list[list] = []
    sparse_rows: list[list] = []
    index = {name: ("dense", j) for j, name in enumerate(spec.dense)}
    index.update({name: ("sparse", j) for j, name in enumerate(spec.sparse)})
    for i, inst in enumerate(instances):
        if isinstance(inst, dict):  # named
            dense, sparse = [None] * n_dense, [None] * n_sparse
            for key, value in inst.items():
                kind = index.get(key)
                if kind is None:
                    raise InputError(f"instances.{i}.{key}", "unknown feature name")
                if kind[0] == "dense":
                    if value is not None and not isinstance(value, float | int):
                        raise InputError(f"instances.{i}.{key}", "a dense feature must be a number or null")
                    dense[kind[1]] = value
                else:
                    if isinstance(value, float):
                        raise InputError(f"instances.{i}.{key}", "a categorical must be hex, an integer, a list or null")
                    sparse[kind[1]] = value
        else:
            dense, sparse = inst.dense, inst.sparse
            if len(dense) != n_dense:
                raise InputError(f"instances.{i}.dense", f"expected {n_dense} values, got {len(dense)}")
            if len(sparse) != n_sparse:
                raise InputError(f"instances.{i}.sparse", f"expected {n_sparse} values, got {len(sparse)}")
        dense_rows.append(dense)
        sparse_rows.append(sparse)
    dense_arr = pa.array(itertools.chain.from_iterable(dense_rows), type=pa.float64())
    dense_np = dense_arr.to_numpy(zero_copy_only=False).reshape(len(instances), n_dense)
    values: list[str] = []
    lengths = np.ones((len(instances), n_sparse), dtype=np.int64)
    for i, row in enumerate(sparse_rows):
        for j, v in enumerate(row):
            if isinstance(v, str):
                values.append(v)
            elif v is None:
                values.append("")
            elif isinstance(v, int):
                values.append(format(v, "x"))
            else:  # a multi-hot bag
                bag = [x if isinstance(x, str) else format(x, "x") for x in v] or [""]
                values.extend(bag)
                lengths[i, j] = len(bag)
    return dense_np, values, lengths



def featurize_instances(spec: FeatureSpec, instances: list):
    """JSON instances -> (dense float32 [B, I], ids int64 (feature-major), offsets [F*B + 1])."""
    dense, values, lengths = instances_to_arrays(spec, instances)
    dense_t, ids, offsets, bad = featurize(spec, dense, values, lengths)
    if len(bad):  # schema validation makes this unreachable for JSON; kept for safety
        raise InputError("instances", f"{len(bad)} categorical value(s) are not hex")
    return dense_t, ids, offsets



def featurize_tsv(spec: FeatureSpec, parser: BlockParser, text: bytes):
    """Criteo TSV lines (with or without the label column) -> model inputs."""
    lines = text.splitlines()
    if not lines or all(not line.strip() for line in lines):
        raise InputError("body", "no lines")
    width = spec.num_columns
    fixed = []
    for n, line in enumerate(lines, start=1):
        fields = line.count(b"\t") + 1
        if fields == width - 1:  # no label column
            line = b"0\t" + line
        elif fields != width:
            raise InputError(f"line {n}", f"expected {width - 1} or {width} tab-separated fields, got {fields}")
        fixed.append(line)
    parsed = parser.parse(RawBlock(0, 0, 1, b"\n".join(fixed) + b"\n", len(fixed)))
    if parsed.bad:
        b = parsed.bad[0]
        raise InputError(f"line {b.line}", b.reason)
    n = parsed.num_rows
    if parsed.ids is not None:
        ids = parsed.ids.reshape(-1)
        offsets = np.arange(ids.size + 1, dtype=np.int64)
    else:
        ids = np.concatenate(parsed.values)
        offsets = np.zeros(parsed.lengths.size + 1, dtype=np.int64)
        np.cumsum(parsed.lengths.reshape(-1), out=offsets[1:])
    return parsed.dense, ids, offsets, n

