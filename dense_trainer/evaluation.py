"""Scoring a trainer on held-out rows: exact AUC and log loss, gathered from every trainer, and
the evaluation history the run's report plots.

Two kinds of held-out rows (:class:`HeldOut`): the validation rows, which every evaluation during
training reads (a share of the training rows, ``train.validation``, or ``--valid`` files), and
the test files, scored once, after the last evaluation, on the model the run keeps
(``best_model.py``). Nothing chooses an epoch or a setting by the test set.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dense_trainer.data.split import RowSplit
from dense_trainer.metrics import log_loss_from_logits, roc_auc
from dlrm_core.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldOut:
    """Rows an evaluation reads.

    Attributes:
        name: ``valid`` or ``test``: the prefix of its figures (``valid_auc``, ``test_logloss``).
        files: the files read.
        split: the side of the validation split kept (None: every row of ``files``).
    """

    name: str
    files: list[Path]
    split: RowSplit | None = None


def validation_of(cfg, train_files: list[Path]) -> HeldOut | None:
    """The run's validation rows: ``--valid`` files, else ``train.validation`` of the training
    rows, else None (no evaluation before the end)."""
    t = cfg.train
    if t.valid_files:
        return HeldOut("valid", [Path(f) for f in t.valid_files])
    if t.validation > 0:
        return HeldOut("valid", list(train_files), RowSplit(t.validation, "validation"))
    return None


def training_split(validation: HeldOut | None) -> RowSplit | None:
    """The training side of the validation split (None: every training row is trained on)."""
    split = validation.split if validation is not None else None
    return replace(split, side="train") if split is not None else None


def evaluate(trainer, held: HeldOut, max_rows: int = 0) -> dict[str, float]:
    """Exact AUC and log loss over ``held`` (its first ``max_rows`` rows when > 0); each trainer
    scores its share, and every trainer gets the same figures."""
    steps = trainer.steps_of(
        held.files, trainer.cfg.train.eval_batch_size, 1, max_rows=max_rows, split=held.split
    )
    logits, labels = [], []
    try:
        while (step := steps.next()) is not None:
            logits.append(trainer.predict(step.batch).float().cpu().numpy())
            labels.append(step.batch.labels.numpy())
    finally:
        steps.close()
    if trainer.trainers > 1:
        parts: list = [None] * trainer.trainers
        dist.all_gather_object(parts, (logits, labels), group=trainer.cluster.trainer_cpu_group)
        logits = [z for part in parts for z in part[0]]
        labels = [y for part in parts for y in part[1]]
    z = np.concatenate(logits) if logits else np.zeros(0, np.float32)
    y = np.concatenate(labels) if labels else np.zeros(0, np.float32)
    if not y.size:
        what = "validation rows of" if held.split is not None else f"{held.name} data"
        raise DataError(f"no valid rows in the {what} ({', '.join(map(str, held.files))})")
    n = held.name
    return {
        f"{n}_auc": roc_auc(z, y),
        f"{n}_logloss": log_loss_from_logits(z, y),
        f"{n}_rows": int(y.size),
    }


def evaluate_into_history(trainer, held: HeldOut, final: bool) -> dict[str, float]:
    """Evaluate on ``held`` (``final``: every row, the run's last evaluation) and record it."""
    max_rows = 0 if final else trainer.cfg.train.eval_max_rows
    t0 = time.perf_counter()
    result = evaluate(trainer, held, max_rows=max_rows)
    n = held.name
    log.info(
        "%s at %d samples: AUC %.4f, log loss %.4f over %d rows (%.1fs)",
        "test" if n == "test" else "validation",
        trainer.state.samples_seen,
        result[f"{n}_auc"],
        result[f"{n}_logloss"],
        result[f"{n}_rows"],
        time.perf_counter() - t0,
    )
    s = trainer.state
    s.history.append({"samples": s.samples_seen, "step": s.step, **result, "final": final})
    return result


def evaluation_due(trainer) -> bool:
    """Whether a periodic evaluation follows the step just taken (``train.eval_every_steps``)."""
    every = trainer.cfg.train.eval_every_steps
    return bool(every) and trainer.state.step % every == 0
