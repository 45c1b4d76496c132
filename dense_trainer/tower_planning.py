"""``dlrm plan-towers``: measure how strongly the features interact, then group them into towers.

Interaction strength comes from a short warm-up of the flat model on the first rows of the
training data (one process, tables in memory); then, on a probe batch, each pair's dot is
replaced by its batch mean, one pair at a time:

    S[i, j] = mean_B | logit - logit with <e_i, e_j> ablated |

how much the model's predictions rest on that interaction. Features whose pairs the model relies on
end up in the same tower
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
from dlrm_core.errors import ConfigError, DataError
from embedding_server.planner import piece_bytes

log = logging.getLogger(__name__)


def feature_costs(cfg: Config, pooling_factors: list[float] | None = None) -> np.ndarray:
    """Per feature: 0.5 x share of table bytes + 0.5 x share of lookups (``pooling_factors``: mean
    ids per example of each feature). Features sharing a table each count the table."""
    spec = cfg.feature_spec()
    tables = [spec.table_of(f) for f in range(len(spec.categorical))]
    nbytes = np.array(
        [piece_bytes(t.rows, t.dim, cfg.embedding.optimizer.kind) for t in tables], dtype=float
    )
    lookups = np.array(pooling_factors or [1.0] * len(tables), dtype=float) * [
        t.dim for t in tables
    ]
    return 0.5 * nbytes / nbytes.sum() + 0.5 * lookups / max(lookups.sum(), 1e-12)


def interaction_strength(
    cfg: Config, files: list[Path], warmup_rows: int, probe_rows: int = 4096
) -> np.ndarray:
    """S [F, F] from a warm-up of the flat model on the first ``warmup_rows`` rows of ``files``."""
    from dense_trainer.train import Trainer

    if cfg.model.kind != "dlrm" or cfg.model.interaction != "dot":
        raise ConfigError(
            "plan-towers measures the dot interaction: needs model.kind = dlrm, interaction = dot"
        )
    cfg = cfg.model_copy(deep=True)
    cfg.train.progress = False
    cfg.dist.embedding_servers, cfg.dist.trainers, cfg.dist.towers = 0, 1, None
    cfg.model.first_order = False  # as the tower model will run: whole vectors
    with tempfile.TemporaryDirectory(prefix="dlrm-plan-towers-") as tmp:
        trainer = Trainer(cfg, Path(tmp))
        steps = 0
        for batch in trainer.loader(files, cfg.train.batch_size, max_rows=warmup_rows):
            trainer.train_step(batch)
            steps += 1
        if steps == 0:
            raise DataError(f"plan-towers: no valid rows in {', '.join(map(str, files))}")
        probe = next(iter(trainer.loader(files, probe_rows, max_rows=probe_rows)))
        strength = pair_reliance(trainer.model, trainer.client.lookup, probe)
    log.info(
        "plan-towers: warm-up of %d steps on %d rows",
        steps,
        min(warmup_rows, steps * cfg.train.batch_size),
    )
    return strength


@torch.no_grad()
def pair_reliance(model, lookup, probe, chunk: int = 16) -> np.ndarray:
    """S[i, j] = mean_B |logit - logit with pair (i, j)'s dot replaced by its batch mean|: how
    much the trained model's predictions rest on that pair's interaction (an ablation per pair,
    not the raw size of the dot, which first-order effects inflate)."""
    model.eval()
    f = len(model.table_dims)
    embedded = lookup(probe.sparse)  # [B, F * D]
    b = embedded.shape[0]
    if model.project is not None:
        parts = torch.split(embedded, model.table_dims, dim=1)
        z = torch.stack([p(e) for p, e in zip(model.project, parts, strict=True)], 1)
    else:
        z = embedded.view(b, f, -1)  # [B, F, D]
    b = embedded.shape[0]
    # [B, D]
    x = (
        model.dense_arch(probe.dense)
        if model.dense_arch is not None
        else model.dense_vector.expand(b, -1)
    )
    inter = model.inter_arch(x, z)  # [B, D + P], pairs over (dense, C1..CF) in triu order
    base = model.over_arch(inter)  # [B, 1]
    lead = 1  # the dense vector comes first
    d = x.shape[1]
    n = f + lead
    rows, cols = torch.triu_indices(n, n, offset=1)
    # not the dense vector's pairs
    sparse_pairs = [k for k in range(rows.numel()) if rows[k] >= lead]
    strength = np.zeros((f, f))
    for lo in range(0, len(sparse_pairs), chunk):
        ks = sparse_pairs[lo : lo + chunk]
        ablated = inter.unsqueeze(0).repeat(len(ks), 1, 1)  # [k, B, D + P]
        for i, k in enumerate(ks):
            ablated[i, :, d + k] = inter[:, d + k].mean()
        delta = (
            (model.over_arch(ablated.view(-1, inter.shape[1])).view(len(ks), b) - base.view(1, b))
            .abs()
            .mean(1)
        )
        for k, v in zip(ks, delta.tolist(), strict=True):
            i, j = int(rows[k]) - lead, int(cols[k]) - lead
            strength[i, j] = strength[j, i] = v
    return strength
