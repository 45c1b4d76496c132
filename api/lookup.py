"""Row lookups of one request: per table, the distinct rows its features ask for go through the
row cache, the misses of every table to the store in one round trip, the table's default row
where the store lacks one (a row missing from a version the store still holds: a deleted version
raises instead); then each feature's bags are pooled as in training. A dynamic table's raw ids
first become rows through the version's id map (sorted ids, ``searchsorted``): an id it does not
hold reads its shared row, hash(id) % S (S from the version's spec; placed by the version's
``id_pieces`` when the table was split by rows), as in training's evaluation, and is counted."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as nnf

from api import inline
from api.metrics import ServingMetrics
from api.model import ServingModel
from embedding_server.idmap.view import NO_OWNER
from embedding_server.stores import ServingStore
from embedding_server.wire import NUMPY_DTYPE, QUANTIZED_BITS, dequantize_rows


def dynamic_rows(
    model: ServingModel,
    metrics: ServingMetrics | None,
    ids: np.ndarray,
    offsets: np.ndarray,
    batch: int,
    demote: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """ids int64 [N] with each dynamic table's raw ids replaced by their rows (not admitted: the
    id's shared row) -> (rows [N], the id each row must hold int64 [N], NO_OWNER where any:
    shared rows, hashed tables; None without dynamic tables, or in a version without owners, whose
    maps never change). ``demote`` (bool [N]): ids whose
    row turned out to hold another id (a map lagging a live update): they read their shared row.
    ``metrics``: where ids without a row are counted (None: a request's later pass, not counted)."""
    if not model.id_maps:
        return ids, None
    out = ids.copy()
    expect = np.full(len(ids), NO_OWNER, dtype=np.int64)
    spec = model.spec
    for f, t in enumerate(spec.feature_tables):
        table = spec.tables[t]
        name = table.name
        if name not in model.id_maps:
            continue
        lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
        raw = ids[lo:hi]
        rows = model.id_maps[name].lookup(raw)  # [n], -1: no row
        if demote is not None:
            rows = np.where(demote[lo:hi], -1, rows)
        known = rows >= 0
        shared = model.layouts[name].shared_row(torch.from_numpy(np.ascontiguousarray(raw))).numpy()
        out[lo:hi] = np.where(known, rows, shared)
        expect[lo:hi] = np.where(known, raw, NO_OWNER)
        if metrics is not None and not known.all():
            metrics.unknown_ids.labels(table=name).inc(int((~known).sum()))
    return out, expect if model.meta.owners else None


def _table_rows(model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int):
    """Per table: its distinct rows over all its features, and each feature's ids as indices into
    them.

    One ``np.unique`` over every table at once, on keys ``table << 40 | row``: -> (uniques per
    table, per feature its indices into its table's uniques, the same indices into all tables'
    uniques concatenated in table order).
    """
    tables = model.feature_tables
    # ids per feature [F]
    counts = np.diff(offsets[::batch]) if batch else np.zeros(len(tables), np.int64)
    keys = (np.repeat(np.asarray(tables, dtype=np.int64), counts) << ROW_BITS) | ids
    uniq, inverse = np.unique(keys, return_inverse=True)
    # table t: bounds[t:t+2]
    bounds = np.searchsorted(uniq >> ROW_BITS, np.arange(len(model.spec.tables) + 1))
    rows = uniq & ROW_MASK
    uniques = {t: rows[bounds[t] : bounds[t + 1]] for t in set(tables)}
    local, start = {}, 0
    for f, (t, n) in enumerate(zip(tables, counts.tolist(), strict=True)):
        local[f] = inverse[start : start + n] - bounds[t]
        start += n
    return uniques, local, inverse


ROW_BITS = 40
"""Rows of a table are below 2^40 (checked when a version loads): the key's low bits."""
ROW_MASK = (1 << ROW_BITS) - 1


def _fetch(
    store: ServingStore,
    metrics: ServingMetrics,
    model: ServingModel,
    uniques: dict[int, np.ndarray],
    expect: dict[int, np.ndarray],
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Rows as stored [U_t, W_t] of every table's distinct ids: cache, store, defaults; ``expect``
    (dynamic tables: the id each row must hold [U_t], NO_OWNER: any) -> (rows, per dynamic
    table the rows that hold another id now, bool [U_t])."""
    tables = model.spec.tables
    cache = model.cache  # this request's cache, whatever a refresh swaps in meanwhile
    out: dict[int, np.ndarray] = {}
    hits: dict[int, np.ndarray] = {}
    need: dict[str, np.ndarray] = {}
    for t, uniq in uniques.items():
        rows, hit = (
            cache.get(tables[t].name, uniq, expect.get(t))
            if cache is not None
            else (None, np.zeros(len(uniq), bool))
        )
        out[t] = (
            rows
            if rows is not None
            else np.empty(  # (a gather: the cache's own copy)
                (len(uniq), len(model.stored_defaults[tables[t].name])),
                NUMPY_DTYPE[model.row_dtype],
            )
        )
        hits[t] = hit
        if not hit.all():
            need[tables[t].name] = uniq[~hit]
    if need:
        inline.need_store()  # on the event loop: a row left the cache since the check (Offload)
    epochs = {name: cache.epoch(name) for name in need} if cache is not None else {}
    n_unique = sum(len(u) for u in uniques.values())
    n_need = sum(len(v) for v in need.values())
    metrics.lookups.inc(n_unique)
    if cache is not None:
        metrics.cache_hits.inc(n_unique - n_need)
        metrics.cache_misses.inc(n_need)
    fetched, stale, checks = {}, {}, {}
    if need:
        t0 = time.perf_counter()
        checks = {tables[t].name: e[~hits[t]] for t, e in expect.items() if tables[t].name in need}
        if checks:  # dynamic tables: each row with the id it holds (a map may lag the rows)
            fetched = store.get_checked_rows_many(model.version, need, checks)
        else:
            fetched = {
                k: (*v, None) for k, v in store.get_stored_rows_many(model.version, need).items()
            }
        metrics.store_latency.labels(operation="lookup").observe(time.perf_counter() - t0)
    for t in uniques:
        name = tables[t].name
        if name not in fetched:
            continue
        got, present, owned = fetched[name]
        owned = owned if name in checks else None  # (checked: dynamic tables)
        missing = ~present
        if missing.any():
            metrics.unknown_ids.labels(table=name).inc(int(missing.sum()))
            got[missing] = model.stored_defaults[name]
        out[t][~hits[t]] = got
        keep = np.ones(len(got), bool) if owned is None else owned
        if owned is not None and not owned.all():
            stale[t] = np.zeros(len(uniques[t]), bool)
            stale[t][np.flatnonzero(~hits[t])[~owned]] = True
        if cache is not None:  # default rows too: a row absent now stays absent until a live
            # update writes it (and invalidates it)
            tags = checks[name][keep] if owned is not None else None
            cache.put(name, need[name][keep], got[keep], epochs[name], tags)
    return out, stale


STALE_PASSES = 3
"""Lookups of a request whose dynamic rows changed hands meanwhile: the ids found stale read
their shared row and the rest are checked again; past this many passes every id of a table still
changing reads its shared row (which no id owns: the passes end)."""
FEW = 16
"""One-hot requests of at most this many examples try the direct gathers below first."""


def _one_hot(
    model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int, most: int | None
) -> bool:
    """At most ``most`` examples (None: any number), one id in every bag (ids [F * B], offsets
    [F * B + 1] = 0, 1, ..., F * B)."""
    n = len(model.feature_tables) * batch
    return (
        (most is None or batch <= most)
        and len(ids) == n
        and len(offsets) == n + 1
        and int(offsets[-1]) == n
        and (n == 0 or bool((offsets[1:] > offsets[:-1]).all()))
    )


def all_cached(model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int) -> bool:
    """Whether a request's rows are all in the row cache, so that ``embed`` takes the direct
    gather and reads nothing from the store (no dynamic table, few one-hot examples)."""
    return (
        model.cache is not None
        and not model.id_maps
        and _one_hot(model, ids, offsets, batch, FEW)
        and model.cache.holds(model.table_names, ids.tolist(), batch)
    )


def _direct(
    metrics: ServingMetrics,
    model: ServingModel,
    ids: np.ndarray,
    offsets: np.ndarray,
    batch: int,
    expect: np.ndarray | None = None,
) -> torch.Tensor | None:
    """Pooled embeddings float [B, sum(D_f)] of one-hot examples gathered straight into one
    array (int8 / int4 rows: their bytes, dequantized with numpy): from the tables' mappings
    (file store, any number of examples: one gather per table; dynamic tables' rows checked
    against their owners after the gather), or, for a few examples, from the row cache when it
    holds every row (hashed tables only); None: take the general path (a miss, bags, no mapping,
    a row that holds another id)."""
    if model.mapped is None and model.cache is None:
        return None
    if not _one_hot(model, ids, offsets, batch, None if model.mapped is not None else FEW):
        return None
    columns = model.stored_columns  # feature f: columns[f]:columns[f + 1] of a row as stored
    # a row view per feature, one copy of them all (no fancy index per table)
    if model.mapped and batch == 1:
        out = np.concatenate(list(map(np.ndarray.__getitem__, model.mapped, ids.tolist())))[None]
    else:
        out = np.empty((batch, columns[-1]), dtype=NUMPY_DTYPE[model.row_dtype])  # [B, sum W_f]
        for f, table in enumerate(model.mapped or ()):
            out[:, columns[f] : columns[f + 1]] = table[ids[f * batch : (f + 1) * batch]]
    if model.mapped is not None:
        if expect is not None and not _owned(model, ids, expect, batch):
            return None
    elif expect is not None or not model.cache.gather(
        model.table_names, ids.tolist(), out, columns
    ):
        return None
    distinct = _distinct_rows(model, ids, batch)
    metrics.lookups.inc(distinct)
    if model.cache is not None:
        metrics.cache_hits.inc(distinct)
    return torch.from_numpy(_as_float(model, out))


def _distinct_rows(model: ServingModel, ids: np.ndarray, batch: int) -> int:
    """Distinct (table, row) pairs of a one-hot batch (ids [F * B], feature-major)."""
    if batch == 1 and model.distinct_tables:  # one row per table
        return len(ids)
    if batch <= FEW:
        return len(
            set(zip(np.repeat(model.feature_tables, batch).tolist(), ids.tolist(), strict=True))
        )
    keys = (np.repeat(np.asarray(model.feature_tables, dtype=np.int64), batch) << ROW_BITS) | ids
    return len(np.unique(keys))


def _as_float(model: ServingModel, out: np.ndarray) -> np.ndarray:
    """One-hot rows as stored [B, sum W_f] -> float32 [B, sum D_f] (a one-id bag pools to its
    row, summed or averaged): quantized rows dequantized, value * scale + bias, fp16 widened."""
    if model.row_dtype == "fp32":
        return out
    if model.row_dtype not in QUANTIZED_BITS:
        return out.astype(np.float32)
    batch, dims = out.shape[0], model.spec.feature_dims
    if model.uniform_dim:  # one dequantization of all B * F rows
        rows = out.reshape(batch * len(dims), -1)  # [B * F, W]
        return dequantize_rows(rows, dims[0], model.row_dtype).reshape(batch, -1)
    stored = model.stored_columns
    return np.concatenate(
        [
            dequantize_rows(out[:, stored[f] : stored[f + 1]], d, model.row_dtype)
            for f, d in enumerate(dims)
        ],
        axis=1,
    )


def _owned(model: ServingModel, ids: np.ndarray, expect: np.ndarray, batch: int) -> bool:
    """Whether every gathered row of a dynamic table still holds the id the map gave it (the
    owners read after the rows: a store clears a row's owner before rewriting it)."""
    if model.owners is None:
        return False
    for f, owners in enumerate(model.owners):
        if owners is not None:
            rows, want = ids[f * batch : (f + 1) * batch], expect[f * batch : (f + 1) * batch]
            check = want != NO_OWNER
            if (owners[rows[check]] != want[check]).any():
                return False
    return True


def _expected(
    model: ServingModel,
    uniques: dict[int, np.ndarray],
    inverse: dict[int, np.ndarray],
    expect: np.ndarray | None,
    offsets: np.ndarray,
    batch: int,
) -> dict[int, np.ndarray]:
    """The id each distinct row of a dynamic table must hold, int64 [U_t] per table (NO_OWNER:
    any)."""
    if expect is None:
        return {}
    out: dict[int, np.ndarray] = {}
    for f, t in enumerate(model.feature_tables):
        if model.spec.tables[t].name in model.id_maps:
            e = out.setdefault(t, np.full(len(uniques[t]), NO_OWNER, dtype=np.int64))
            e[inverse[f]] = expect[offsets[f * batch] : offsets[(f + 1) * batch]]
    return out


def embed(
    store: ServingStore,
    metrics: ServingMetrics,
    model: ServingModel,
    ids: np.ndarray,
    offsets: np.ndarray,
    batch: int,
) -> torch.Tensor:
    """Pooled embeddings float [B, sum(D_f)] of a feature-major id batch."""
    spec = model.spec
    raw = ids
    ids, expect = dynamic_rows(model, metrics, raw, offsets, batch)
    direct = _direct(metrics, model, ids, offsets, batch, expect)
    if direct is not None:
        return direct
    uniques, inverse, joint = _table_rows(model, ids, offsets, batch)
    rows, stale = _fetch(
        store, metrics, model, uniques, _expected(model, uniques, inverse, expect, offsets, batch)
    )
    demote, passes = np.zeros(len(ids), bool), 1
    # rows given to other ids than this replica's map says: those ids read their shared row
    while stale:
        # (checked again: live updates go on meanwhile)
        for f, t in enumerate(model.feature_tables):
            if t in stale:
                lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
                demote[lo:hi] |= stale[t][inverse[f]] if passes < STALE_PASSES else True
        ids, expect = dynamic_rows(model, None, raw, offsets, batch, demote)
        uniques, inverse, joint = _table_rows(model, ids, offsets, batch)
        rows, stale = _fetch(
            store,
            metrics,
            model,
            uniques,
            _expected(model, uniques, inverse, expect, offsets, batch),
        )
        passes += 1
    if not len(spec.categorical):
        return torch.zeros(batch, 0)
    if model.pooler is not None:  # int8 / int4: fbgemm pools the rows as stored
        return model.pooler(rows, inverse, offsets, batch)
    if model.row_dtype != "fp32":
        rows = {t: r.astype(np.float32) for t, r in rows.items()}
    # one-hot, one D: one gather
    if model.uniform_dim and len(ids) == len(spec.categorical) * batch:
        table_rows = np.concatenate([rows[t] for t in sorted(rows)])  # [sum U_t, D], table order
        gathered = table_rows[joint].reshape(len(spec.categorical), batch, -1)  # [F, B, D]
        return torch.from_numpy(
            np.ascontiguousarray(gathered.transpose(1, 0, 2)).reshape(batch, -1)
        )
    pooled = []
    for f, t in enumerate(model.feature_tables):
        weight = torch.from_numpy(rows[t])  # [U_t, D_t]
        inv = torch.from_numpy(inverse[f])
        lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
        if hi - lo == batch:  # one id per bag
            pooled.append(weight[inv])  # [B, D_t]
        else:
            bag_offsets = torch.from_numpy(offsets[f * batch : (f + 1) * batch + 1] - lo)
            pooled.append(
                nnf.embedding_bag(
                    inv, weight, bag_offsets, mode=spec.tables[t].pooling, include_last_offset=True
                )
            )
    return torch.cat(pooled, dim=1)
