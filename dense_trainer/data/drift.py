"""A drifting click log: ``dlrm data synth --drift K`` (Criteo layout, issue 37).

The training rows come in K segments, in time order, each drawn from the teacher of its time:
between segments every value's preferences move (a share ``change`` of the variance of each
bias and latent vector, and of the dense weights, is drawn anew) and new values arrive (a share
``new_ids`` of each vocabulary gets new hashes and fresh parameters at the same popularity
ranks, so new ids are seen from the next segment on as often as the ones they replace). The
click rate is recalibrated to ``ctr`` for every segment. ``drift.json`` records each segment's
Bayes-optimal AUC and log loss (of the true probabilities of its own rows), and ``test.txt`` is
drawn from the last teacher.

A model trained once on the first segment and served unchanged falls behind; online training
follows (``bench/online.py`` measures by how much).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dense_trainer.data.synth import VOCAB, Teacher, _calibrate, _write_split, make_teacher
from dense_trainer.metrics import log_loss, roc_auc


def drift_teacher(t: Teacher, rng: np.random.Generator, change: float, new_ids: float) -> None:
    """Move ``t`` in place by one step of drift (see the module's docstring)."""
    keep, fresh = np.sqrt(1.0 - change), np.sqrt(change)
    for j, v in enumerate(VOCAB):
        rank = t.latent[j].shape[1]
        t.bias[j] = keep * t.bias[j] + fresh * rng.normal(0, 0.25, size=t.bias[j].shape)
        t.latent[j] = keep * t.latent[j] + fresh * rng.normal(
            0, 1.0 / np.sqrt(rank), size=t.latent[j].shape
        )
        m = int(round(new_ids * v))
        if m:
            idx = rng.choice(v, size=m, replace=False)  # values replaced by new ones
            t.hexes[j][idx] = rng.integers(0, 2**32, size=m, dtype=np.uint64).astype(np.uint32)
            t.bias[j][idx] = rng.normal(0, 0.25, size=m)
            t.latent[j][idx] = rng.normal(0, 1.0 / np.sqrt(rank), size=(m, rank))
    t.dense_w = keep * t.dense_w + fresh * rng.normal(0, 0.25, size=t.dense_w.shape)


def synthesize_drifting(
    out: Path,
    train_rows: int,
    test_rows: int,
    segments: int,
    seed: int = 0,
    ctr: float = 0.25,
    zipf: float = 1.1,
    change: float = 0.5,
    new_ids: float = 0.2,
) -> dict:
    """Write ``out/segment-NNN.txt`` (``train_rows`` in all, in time order), ``out/test.txt``
    (the last teacher's) and ``out/drift.json``; return the record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = make_teacher(seed, zipf=zipf)
    rng = np.random.default_rng([seed, 99])
    record: dict = {
        "segments": [],
        "seed": seed,
        "zipf": zipf,
        "ctr": ctr,
        "change": change,
        "new_ids": new_ids,
    }
    for k in range(segments):
        if k:
            drift_teacher(teacher, rng, change, new_ids)
        teacher.intercept = 0.0  # solved afresh: the click rate stays ctr
        _calibrate(teacher, ctr, seed + k)
        rows = train_rows * (k + 1) // segments - train_rows * k // segments
        name = f"segment-{k:03d}.txt"
        probs, labels = _write_split(teacher, out / name, rows, np.random.default_rng([seed, 1, k]))
        record["segments"].append(
            {
                "file": name,
                "rows": rows,
                "bayes_auc": roc_auc(probs, labels),
                "bayes_logloss": log_loss(probs, labels),
            }
        )
    probs, labels = _write_split(
        teacher, out / "test.txt", test_rows, np.random.default_rng([seed, 2])
    )
    record["test"] = {"rows": test_rows, "bayes_auc": roc_auc(probs, labels)}
    (out / "drift.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
