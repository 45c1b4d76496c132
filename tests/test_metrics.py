import itertools

import numpy as np
import pytest

from dense_trainer.metrics import log_loss, log_loss_from_logits, roc_auc


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return total / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_exact_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 8, 300).astype(float)  # many ties
    labels = rng.integers(0, 2, 300)
    assert roc_auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_auc_known_values():
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert roc_auc(np.array([1, 2, 3]), np.array([0, 1, 1])) == 1.0
    assert np.isnan(roc_auc(np.array([1.0, 2.0]), np.array([1, 1])))


def test_log_loss_agrees():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, 1000)
    y = rng.integers(0, 2, 1000)
    p = 1 / (1 + np.exp(-z))
    assert log_loss_from_logits(z, y) == pytest.approx(log_loss(p, y), rel=1e-9)
    assert log_loss(np.array([0.5]), np.array([1])) == pytest.approx(np.log(2))
