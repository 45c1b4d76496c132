"""Progressive validation: each batch scored before it is trained on (predict-then-train).

Online learning has no held-out set, yet every row is seen by the model before the model has
learnt from it: the logits of a training step's forward pass, computed before its update, are
honest predictions. Their AUC and log loss, over all rows so far and over the rows since the
last report, are the figures of online training (Monolith, and every ad system since McMahan et
al. 2013, report these). With dropout on, the training pass drops units, so the figures are a
little pessimistic.

AUC is computed from histograms of the logit (``BINS`` bins over ``[-LIMIT, LIMIT]``; two scores
in one bin count as a tie), so memory is constant however long the stream runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

BINS = 4096
LIMIT = 16.0


class Scores:
    """Label counts per logit bin, and the summed log loss."""

    def __init__(self) -> None:
        self.pos = torch.zeros(BINS, dtype=torch.float64)
        self.neg = torch.zeros(BINS, dtype=torch.float64)
        self.loss_sum = 0.0
        self.rows = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """``logits``, ``labels``: float [B]."""
        logits, labels = logits.detach().float().cpu(), labels.float().cpu()
        self.loss_sum += float(
            nnf.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        )
        self.rows += labels.numel()
        b = (
            ((logits.clamp(-LIMIT, LIMIT) + LIMIT) * (BINS / (2 * LIMIT)))
            .long()
            .clamp_(0, BINS - 1)
        )
        ones = torch.ones_like(labels, dtype=torch.float64)
        self.pos.index_add_(0, b[labels > 0.5], ones[labels > 0.5])
        self.neg.index_add_(0, b[labels <= 0.5], ones[labels <= 0.5])

    def auc(self) -> float:
        p, n = float(self.pos.sum()), float(self.neg.sum())
        if p == 0 or n == 0:
            return math.nan
        below = torch.cumsum(self.neg, 0) - self.neg  # negatives in lower bins
        return float((self.pos * (below + 0.5 * self.neg)).sum()) / (p * n)

    def logloss(self) -> float:
        return self.loss_sum / self.rows if self.rows else math.nan

    def state(self) -> dict:
        return {"pos": self.pos.tolist(), "neg": self.neg.tolist(), "loss_sum": self.loss_sum}

    @classmethod
    def from_state(cls, d: dict) -> Scores:
        s = cls()
        s.pos = torch.tensor(d["pos"], dtype=torch.float64)
        s.neg = torch.tensor(d["neg"], dtype=torch.float64)
        s.loss_sum, s.rows = float(d["loss_sum"]), int(s.pos.sum() + s.neg.sum())
        return s


class Progressive:
    """Cumulative and recent (since the last :meth:`take_recent`) progressive figures."""

    def __init__(self, total: Scores | None = None) -> None:
        self.total = total or Scores()
        self.recent = Scores()

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.total.add(logits, labels)
        self.recent.add(logits, labels)

    def take_recent(self) -> dict[str, float]:
        r, self.recent = self.recent, Scores()
        return {"auc": r.auc(), "logloss": r.logloss(), "rows": r.rows}

    def summary(self) -> dict[str, float]:
        return {"auc": self.total.auc(), "logloss": self.total.logloss(), "rows": self.total.rows}
