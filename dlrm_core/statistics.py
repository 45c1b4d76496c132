"""What a schema learns from the training data before training: the column names of the input
(kept with the model, so that serving parses lines in the same layout) and the mean and standard
deviation of every ``standardize`` feature that does not state them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dlrm_core.formats import InputReader
from dlrm_core.schema import DenseFeature, FeatureSpec

SAMPLE_ROWS = 100_000
"""Rows of the first training files read to measure the statistics."""


def input_columns(spec: FeatureSpec, files: list[Path]) -> list[str]:
    """The column names of the first input file (its header, Parquet schema or the spec's)."""
    return InputReader(spec, files[:1]).format.column_names(Path(files[0]))


def dense_statistics(
    spec: FeatureSpec,
    files: list[Path],
    names: list[str],
    max_rows: int = SAMPLE_ROWS,
    block_bytes: int = 4 << 20,
) -> dict[str, tuple[float, float]]:
    """(mean, std) of the raw values of dense features ``names`` over the first ``max_rows`` rows
    (missing values left out; a constant feature gets std 1)."""
    raw = [
        f.model_copy(update={"transform": "none", "missing": float("nan")})
        if f.name in names
        else f
        for f in spec.dense
    ]
    reader = InputReader(spec.model_copy(update={"dense": raw}), files)
    cols = [i for i, f in enumerate(spec.dense) if f.name in names]
    parts, seen = [], 0
    for fi in range(len(files)):
        for block in reader.blocks(fi, block_bytes):
            parsed = reader.parse(block)
            parts.append(parsed.dense[:, cols].astype(np.float64))
            seen += parsed.num_rows
            if seen >= max_rows:
                break
        if seen >= max_rows:
            break
    values = np.concatenate(parts)[:max_rows] if parts else np.zeros((0, len(cols)))
    out = {}
    for j, name in zip(range(len(cols)), [spec.dense[i].name for i in cols], strict=True):
        x = values[:, j]
        x = x[~np.isnan(x)]
        mean = float(x.mean()) if x.size else 0.0
        std = float(x.std()) if x.size > 1 else 0.0
        out[name] = (mean, std if std > 1e-12 else 1.0)
    return out


def needs_statistics(features: list) -> list[str]:
    """Names of standardize features without a mean or std."""
    return [
        f.name
        for f in features
        if isinstance(f, DenseFeature)
        and f.transform == "standardize"
        and (f.mean is None or f.std is None)
    ]
