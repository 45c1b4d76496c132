"""What bench/quality.py runs: our trainer on a config, the plain PyTorch DLRM beside it, and the
mean over seeds of their figures."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plain_dlrm import PlainDLRM  # noqa: E402

from dense_trainer.config import Config  # noqa: E402
from dense_trainer.data.loader import BatchLoader  # noqa: E402
from dense_trainer.metrics import log_loss_from_logits, roc_auc  # noqa: E402
from dense_trainer.train import Trainer  # noqa: E402

PLAIN_LR = 1e-3  # SparseAdam's and Adam's default


def run_ours(cfg: Config, train: Path, test: Path) -> dict:
    # checkpoints: ~400 MB a run
    with tempfile.TemporaryDirectory(prefix="dlrm-quality-") as run_dir:
        m = Trainer(cfg, Path(run_dir)).fit([train], [test])
    return {k: m[k] for k in ("test_auc", "test_logloss", "train_samples_per_s", "samples_seen")}


def run_plain(cfg: Config, train: Path, test: Path, init_scale: float | None = None) -> dict:
    """The plain PyTorch DLRM with the default config's shape and batch size, fed by our reader.

    Its tables start as the DLRM reference initialises them (uniform +-sqrt(1/rows)) unless
    ``init_scale`` is given.
    """
    torch.manual_seed(cfg.train.seed)
    spec = cfg.feature_spec()
    model = PlainDLRM(
        [t.rows for t in spec.tables],
        cfg.embedding.dim,
        cfg.model.dense_arch_layer_sizes,
        cfg.model.over_arch_layer_sizes,
        init_scale=init_scale,
    )
    opts = model.optimizers(PLAIN_LR, PLAIN_LR)
    seen, t0 = 0, time.perf_counter()
    for batch in BatchLoader([train], spec, cfg.train.batch_size):
        logits = model(batch.dense, batch.sparse.values, batch.sparse.offsets)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        seen += batch.batch_size
    elapsed = time.perf_counter() - t0
    z, y = [], []
    with torch.no_grad():
        for batch in BatchLoader([test], spec, cfg.train.eval_batch_size):
            z.append(model(batch.dense, batch.sparse.values, batch.sparse.offsets).numpy())
            y.append(batch.labels.numpy())
    z, y = np.concatenate(z), np.concatenate(y)
    return {
        "test_auc": roc_auc(z, y),
        "test_logloss": log_loss_from_logits(z, y),
        "train_samples_per_s": seen / elapsed,
        "samples_seen": seen,
    }


def mean_of(runs: list[dict]) -> dict:
    out = {
        k: float(np.mean([r[k] for r in runs]))
        for k in ("test_auc", "test_logloss", "train_samples_per_s")
    }
    out["seeds"] = [round(r["test_auc"], 4) for r in runs]
    out["samples_seen"] = runs[0]["samples_seen"]
    return out
