"""``dlrm plan-towers``: measure how strongly the features interact, then group them into towers.

Interaction strength comes from a short warm-up of the flat model on the first rows of the
training data (one process, tables in memory): after it, for features i and j,

    S[i, j] = mean_B |<e_i, e_j>|  x  || W_over[:, pair(i, j)] ||

the typical magnitude of their learned dot interaction, times how much the over arch's first
layer listens to it. Features whose pairs the model relies on end up in the same tower
(``embedding_server.towers.interaction_towers``), so the interactions that tower modules keep
are the ones that matter; what crosses towers is only seen through compressed outputs.

Cost of a feature, for balance: half its share of table memory (weights and optimizer state),
half its share of lookups (pooling factor), so that every tower's servers hold and serve alike.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

from dense_trainer.config import Config
from embedding_server.errors import ConfigError, DataError
from embedding_server.planner import piece_bytes

log = logging.getLogger(__name__)


def feature_costs(cfg: Config, pooling_factors: list[float] | None = None) -> np.ndarray:
    """Per feature: 0.5 x share of table bytes + 0.5 x share of lookups."""
    spec = cfg.feature_spec()
    nbytes = np.array([piece_bytes(t.rows, t.dim, cfg.embedding.optimizer.kind) for t in spec.tables], dtype=float)
    lookups = np.array(pooling_factors or [1.0] * len(spec.tables), dtype=float) * [t.dim for t in spec.tables]
    return 0.5 * nbytes / nbytes.sum() + 0.5 * lookups / max(lookups.sum(), 1e-12)


def interaction_strength(cfg: Config, files: list[Path], warmup_rows: int, probe_rows: int = 4096) -> np.ndarray:
    """S [F, F] from a warm-up of the flat model on the first ``warmup_rows`` rows of ``files``."""
    from dense_trainer.train import Trainer

    if cfg.model.kind != "dlrm" or cfg.model.interaction != "dot":
        raise ConfigError("plan-towers measures the dot interaction: needs model.kind = dlrm, interaction = dot")
    cfg = cfg.model_copy(deep=True)
    cfg.train.progress = False
    cfg.dist.embedding_servers, cfg.dist.trainers, cfg.dist.towers = 0, 1, None
    with tempfile.TemporaryDirectory(prefix="dlrm-plan-towers-") as tmp:
        trainer = Trainer(cfg, Path(tmp))
        steps = 0
        for batch in trainer._loader(files, cfg.train.batch_size, epochs=1, max_rows=warmup_rows):
            trainer.train_step(batch)
            steps += 1
        if steps == 0:
            raise DataError(f"plan-towers: no valid rows in {', '.join(map(str, files))}")
        probe = next(iter(trainer._loader(files, probe_rows, epochs=1, max_rows=probe_rows)))
        model = trainer.model
        with torch.no_grad():
            embedded = trainer.client.lookup(probe.sparse)  # [B, F * D]
            b, f = embedded.shape[0], len(trainer.spec.tables)
            if model.project is not None:
                parts = torch.split(embedded, model.table_dims, dim=1)
                z = torch.stack([p(e) for p, e in zip(model.project, parts, strict=True)], 1)
            else:
                z = embedded.view(b, f, -1)  # [B, F, D]
            dots = torch.bmm(z, z.transpose(1, 2)).abs().mean(dim=0)  # [F, F]
            first = next(m for m in model.over_arch.model if isinstance(m, torch.nn.Linear))
            d = model.dense_arch.model[-2].out_features  # the dense vector's D: pairs start after it
            n = f + 1
            rows, cols = torch.triu_indices(n, n, offset=1)
            weight = first.weight[:, d:].norm(dim=0)  # [P]
            listen = torch.zeros(n, n)
            listen[rows, cols] = weight
            listen = (listen + listen.T)[1:, 1:]  # sparse-sparse pairs only: [F, F]
    log.info("plan-towers: warm-up of %d steps on %d rows", steps, min(warmup_rows, steps * cfg.train.batch_size))
    strength = (dots * listen).numpy().astype(float)
    np.fill_diagonal(strength, 0.0)
    return strength
