"""The planted-teacher generator that ``dlrm data synth`` writes with: one teacher, two layouts.

A layout (``synth.py``: the Criteo layout; ``synth_table.py``: a user's own CSV/TSV/Parquet
table) says which columns a row has and how the teacher's logit depends on them; everything else
is here, written once:

    - popularity: ids drawn from a Zipf law over a vocabulary, popular ids not the small ones
      (:func:`zipf_cdf`, :func:`draw`);
    - calibration: the intercept solved for a target click rate (:func:`solve_intercept`);
    - labels: Bernoulli(sigmoid(logit)), drawn chunk by chunk with the rows so that any row count
      fits in memory, written through the layout's sink (:func:`write_split`);
    - the ceiling: the AUC and log loss of the true probabilities on the test split
      (:func:`bayes_record`, ``bayes.json``): what a perfect model would score.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from dense_trainer.metrics import log_loss, roc_auc


def zipf_cdf(v: int, zipf: float) -> np.ndarray:
    """float [v]: the CDF of a Zipf law of exponent ``zipf`` over popularity ranks 0..v-1."""
    w = 1.0 / np.arange(1, v + 1) ** zipf
    return np.cumsum(w) / w.sum()


def draw(cdf: np.ndarray, of_rank: np.ndarray, shape, rng: np.random.Generator) -> np.ndarray:
    """Ids of ``shape`` drawn by popularity rank (``cdf``), mapped to ids by ``of_rank``."""
    ranks = np.minimum(np.searchsorted(cdf, rng.random(shape)), len(cdf) - 1)
    return of_rank[ranks]


def solve_intercept(logit: np.ndarray, ctr: float) -> float:
    """The shift of ``logit`` (bisection) that makes the mean click probability ``ctr``."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(logit + mid)))) < ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class Sink(Protocol):
    """Where a split's rows go, one arrow table per chunk."""

    def write(self, table: pa.Table) -> None: ...

    def close(self) -> None: ...


def write_split(
    sample: Callable[[int, np.random.Generator], tuple[Any, np.ndarray]],
    table: Callable[[Any, np.ndarray, int], pa.Table],
    sink: Sink,
    rows: int,
    chunk_rows: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``rows`` rows chunk by chunk and write them; return (true probabilities, labels).

    Args:
        sample: ``(n, rng) -> (drawn rows, logit [n])``: the layout's rows and the teacher's logit.
        table: ``(drawn rows, labels [n], first row index) -> pa.Table``: the file's columns.
        sink: closed here, whatever happens.
    """
    probs, labels = [], []
    try:
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            drawn, logit = sample(n, rng)
            p = 1.0 / (1.0 + np.exp(-logit))
            y = (rng.random(n) < p).astype(np.int64)
            sink.write(table(drawn, y, start))
            probs.append(p)
            labels.append(y)
    finally:
        sink.close()
    return np.concatenate(probs), np.concatenate(labels)


def bayes_record(
    out: Path, probs: np.ndarray, labels: np.ndarray, test_file: str, **facts: Any
) -> dict:
    """Write ``out/bayes.json``, the scores of the true probabilities on the test split, and
    return it (``facts``: the generator's settings, recorded beside them)."""
    bayes = {
        "test_auc": roc_auc(probs, labels),
        "test_logloss": log_loss(probs, labels),
        "test_ctr": float(labels.mean()),
        **facts,
        "note": f"AUC and log loss of the teacher's true click probabilities on {test_file}: "
        "the Bayes-optimal scores no model can beat in expectation.",
    }
    (out / "bayes.json").write_text(json.dumps(bayes, indent=2) + "\n")
    return bayes
