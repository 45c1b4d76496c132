"""Row lookups of one request: the row cache, one round trip to the store for the misses, the
table defaults for rows the store lacks, then pooling per bag as in training."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as nnf

from api.metrics import ServingMetrics
from api.model import ServingModel
from embedding_server.stores import ServingStore


def embed(store: ServingStore, metrics: ServingMetrics, model: ServingModel, ids: np.ndarray, offsets: np.ndarray,
          batch: int) -> torch.Tensor:
    """Pooled embeddings float [B, sum(D_t)] of a feature-major id batch."""
    spec = model.spec
    uniques, inverses = {}, {}
    need: dict[str, np.ndarray] = {}
    cached: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for f, table in enumerate(spec.tables):
        t_ids = ids[offsets[f * batch] : offsets[(f + 1) * batch]]
        uniq, inv = np.unique(t_ids, return_inverse=True)
        uniques[table.name], inverses[table.name] = uniq, inv
        if model.cache is not None:
            rows, hit = model.cache.get(table.name, uniq)
            cached[table.name] = (rows, hit)
            if not hit.all():
                need[table.name] = uniq[~hit]
            if rows is None:  # a table the budget left uncached
                cached.pop(table.name)
        else:
            need[table.name] = uniq
    cache = model.cache  # this request's cache, whatever a refresh swaps in meanwhile
    epochs = {name: cache.epoch(name) for name in need} if cache is not None else {}
    n_unique = sum(len(u) for u in uniques.values())
    metrics.lookups.inc(n_unique)
    n_need = sum(len(v) for v in need.values())
    if model.cache is not None:
        metrics.cache_hits.inc(n_unique - n_need)
        metrics.cache_misses.inc(n_need)
    fetched = store.get_rows_many(model.version, need) if need else {}
    pooled = []
    for f, table in enumerate(spec.tables):
        name = table.name
        uniq = uniques[name]
        if name in cached and cached[name][0] is not None:
            rows, hit = cached[name]
            rows = rows.copy()
        else:
            rows, hit = np.empty((len(uniq), table.dim), np.float32), np.zeros(len(uniq), bool)
        if name in fetched:
            got, present = fetched[name]
            missing = ~present
            if missing.any():
                metrics.unknown_ids.inc(int(missing.sum()))
                got[missing] = model.defaults[name]
            rows[~hit] = got
            if cache is not None and present.any():
                cache.put(name, need[name][present], got[present], epochs[name])
        weight = torch.from_numpy(rows)  # [U, D_t]
        inv = torch.from_numpy(inverses[name])
        lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
        if hi - lo == batch:  # one id per bag
            pooled.append(weight[inv])  # [B, D_t]
        else:
            bag_offsets = torch.from_numpy(offsets[f * batch : (f + 1) * batch + 1] - lo)
            pooled.append(nnf.embedding_bag(inv, weight, bag_offsets, mode=table.pooling, include_last_offset=True))
    return torch.cat(pooled, dim=1)

