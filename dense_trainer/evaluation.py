"""Scoring a trainer on held-out rows: exact AUC and log loss, gathered from every trainer,
and the evaluation history the run's report plots."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dense_trainer.metrics import log_loss_from_logits, roc_auc
from dlrm_core.errors import DataError

log = logging.getLogger(__name__)


def evaluate(trainer, files: list[Path], max_rows: int = 0) -> dict[str, float]:
    """Exact AUC and log loss over ``files`` (the first ``max_rows`` rows when > 0); each
    trainer scores its share, the master sees them all."""
    steps = trainer.steps_of(files, trainer.cfg.train.eval_batch_size, 1, max_rows=max_rows)
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
    z, y = np.concatenate(logits), np.concatenate(labels)
    if not y.size:
        raise DataError(f"no valid rows in the test data ({', '.join(map(str, files))})")
    return {
        "test_auc": roc_auc(z, y),
        "test_logloss": log_loss_from_logits(z, y),
        "test_rows": int(y.size),
    }


def evaluate_into_history(trainer, test_files: list[Path], final: bool) -> dict[str, float]:
    max_rows = 0 if final else trainer.cfg.train.eval_max_rows
    t0 = time.perf_counter()
    result = evaluate(trainer, test_files, max_rows=max_rows)
    log.info(
        "eval at %d samples: AUC %.4f, log loss %.4f over %d rows (%.1fs)",
        trainer.state.samples_seen,
        result["test_auc"],
        result["test_logloss"],
        result["test_rows"],
        time.perf_counter() - t0,
    )
    trainer.state.history.append({"samples": trainer.state.samples_seen, **result, "final": final})
    return result


def evaluation_due(trainer) -> bool:
    """Whether a periodic evaluation follows the step just taken (``train.eval_every_steps``)."""
    every = trainer.cfg.train.eval_every_steps
    return bool(every) and trainer.state.step % every == 0
