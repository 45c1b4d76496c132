"""Quality metrics over a whole test set: exact ROC AUC (ties averaged, no binning) and log loss."""

from __future__ import annotations

import numpy as np


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact area under the ROC curve (Mann-Whitney U with average ranks for ties).

    Args:
        scores: float [n], any monotone score (logits or probabilities).
        labels: [n] of 0/1.

    Returns:
        AUC in [0, 1]; NaN when only one class is present.

    Example:
        >>> roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
        0.75
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel().astype(bool)
    n = scores.size
    n_pos = int(labels.sum())
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    cuts = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [n]])
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.repeat(avg_rank, ends - starts)
    pos_rank_sum = ranks[labels[order]].sum()
    return float((pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss_from_logits(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of sigmoid(logits), computed stably."""
    z = np.asarray(logits, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=np.float64).ravel()
    # -[y log s(z) + (1-y) log(1-s(z))] = max(z,0) - z*y + log(1 + exp(-|z|))
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def log_loss(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-15) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps])."""
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64).ravel()
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))
