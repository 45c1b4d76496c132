"""The serving logic: the loaded model, row lookups through the cache, scoring, live refresh.

The model being served is one :class:`ServingModel` reference on the service. A new version is
loaded off to the side and swapped in with one assignment; a request holds the reference it
started with, so version swaps under load fail no request. Live updates (rows rewritten in the
current version, new dense weights) invalidate cached rows and swap the dense network the same
way.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as nnf

from api.cache import RowCache
from api.metrics import ServingMetrics
from api.schemas import PositionalInstance
from api.settings import Settings
from dense_trainer.config import ModelConfig
from dense_trainer.model import build_served_model
from embedding_server.criteo_format import BlockParser, RawBlock
from embedding_server.features import FeatureSpec, featurize
from embedding_server.stores import ServingStore
from embedding_server.wire import ModelVersion

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A request that is well-typed but wrong for this model (the API answers 422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotReady(RuntimeError):
    """No model is loaded yet (nothing published, or the store unreachable at start)."""


def build_dense(meta: ModelVersion, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The dense network of a version, with its weights, in inference mode."""
    module = build_served_model(ModelConfig.model_validate(meta.model), meta.spec, meta.embedding_dim, meta.towers)
    module.load_state_dict(state)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


@torch.inference_mode()
def warm_up(dense: torch.nn.Module, meta: ModelVersion) -> None:
    """Run the network once at a few batch sizes before it takes traffic: the first calls of
    each kernel are slow, and would otherwise land on the first requests."""
    width = sum(t.dim for t in meta.spec.tables)
    for batch in (1, 8, 256):
        dense(torch.zeros(batch, len(meta.spec.dense)), torch.zeros(batch, width))


class ServingModel:
    """One loaded version: metadata, dense network, default rows, row cache."""

    def __init__(self, meta: ModelVersion, dense: torch.nn.Module, cache_bytes: float, remote: bool) -> None:
        self.meta = meta
        self.version = meta.version
        self.spec: FeatureSpec = meta.spec
        self.dense = dense
        self.defaults = {
            t.name: np.asarray(meta.default_rows.get(t.name, np.zeros(t.dim)), dtype=np.float32)
            for t in meta.spec.tables
        }
        self.cache_bytes = cache_bytes
        self.cache = self.new_cache() if remote and cache_bytes > 0 else None
        self.parser = BlockParser(meta.spec, ["request body"])

    def new_cache(self) -> RowCache:
        return RowCache([(t.name, t.rows, t.dim) for t in self.spec.tables], self.cache_bytes)


class ModelService:
    def __init__(self, store: ServingStore, settings: Settings, metrics: ServingMetrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.model: ServingModel | None = None
        self._cursor: str | None = None
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- loading and refreshing --------------------------------------------------------------------

    def refresh(self) -> None:
        """Load the store's current version if it changed, else apply live updates."""
        with self._refresh_lock:
            version = self.store.current_version()
            if version is None:
                return
            model = self.model
            if model is None or model.version != version:
                self._load(version)
                return
            batch = self.store.poll_updates(version, self._cursor)
            self._cursor = batch.cursor
            if batch.reset and model.cache is not None:
                model.cache = model.new_cache()
            if model.cache is not None:
                for table, ids in batch.rows.items():
                    model.cache.invalidate(table, ids)
            self.metrics.live_updates.inc(sum(len(ids) for ids in batch.rows.values()))
            if batch.dense_changed:
                model.dense = build_dense(model.meta, self.store.read_dense(version))
                log.info("dense weights of %s refreshed", version)

    def _load(self, version: str) -> None:
        t0 = time.perf_counter()
        meta = self.store.read_meta(version)
        cursor = self.store.poll_updates(version, None).cursor  # updates after this are applied later
        dense = build_dense(meta, self.store.read_dense(version))
        warm_up(dense, meta)
        model = ServingModel(meta, dense, self.settings.cache_mb * 2**20, self.store.remote)
        # One request through the whole path (featurising, lookups, network) before real ones.
        empty = PositionalInstance(dense=[None] * len(meta.spec.dense), sparse=[None] * len(meta.spec.tables))
        self.score(model, *self.featurize_instances(model, [empty]))
        old = self.model
        self.model, self._cursor = model, cursor  # the swap: one reference
        self.store.release(keep=version)
        if old is not None:
            self.metrics.model_version.remove(old.version)
        self.metrics.model_version.labels(version=version).set(1)
        log.info("serving version %s (loaded in %.2fs)", version, time.perf_counter() - t0)

    def start(self) -> None:
        """Poll the store in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="store-refresh", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            try:
                self.refresh()
            except Exception as exc:  # the store may be down: keep serving what we have
                self.metrics.store_errors.labels(operation="refresh").inc()
                log.warning("store refresh failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def current(self) -> ServingModel:
        model = self.model
        if model is None:
            raise NotReady("no model loaded yet")
        return model

    # -- requests -> model inputs -------------------------------------------------------------------

    @staticmethod
    def instances_to_arrays(spec: FeatureSpec, instances: list) -> tuple[np.ndarray, list[str], np.ndarray]:
        """Validated instances -> raw dense float64 [B, I] (NaN missing), bag values, lengths [B, F]."""
        n_dense, n_sparse = len(spec.dense), len(spec.tables)
        dense_rows: list[list] = []
        sparse_rows: list[list] = []
        index = {name: ("dense", j) for j, name in enumerate(spec.dense)}
        index.update({name: ("sparse", j) for j, name in enumerate(spec.sparse)})
        for i, inst in enumerate(instances):
            if isinstance(inst, dict):  # named
                dense, sparse = [None] * n_dense, [None] * n_sparse
                for key, value in inst.items():
                    kind = index.get(key)
                    if kind is None:
                        raise InputError(f"instances.{i}.{key}", "unknown feature name")
                    if kind[0] == "dense":
                        if value is not None and not isinstance(value, float | int):
                            raise InputError(f"instances.{i}.{key}", "a dense feature must be a number or null")
                        dense[kind[1]] = value
                    else:
                        if isinstance(value, float):
                            raise InputError(f"instances.{i}.{key}", "a categorical must be hex, an integer, a list or null")
                        sparse[kind[1]] = value
            else:
                dense, sparse = inst.dense, inst.sparse
                if len(dense) != n_dense:
                    raise InputError(f"instances.{i}.dense", f"expected {n_dense} values, got {len(dense)}")
                if len(sparse) != n_sparse:
                    raise InputError(f"instances.{i}.sparse", f"expected {n_sparse} values, got {len(sparse)}")
            dense_rows.append(dense)
            sparse_rows.append(sparse)
        dense_arr = pa.array(itertools.chain.from_iterable(dense_rows), type=pa.float64())
        dense_np = dense_arr.to_numpy(zero_copy_only=False).reshape(len(instances), n_dense)
        values: list[str] = []
        lengths = np.ones((len(instances), n_sparse), dtype=np.int64)
        for i, row in enumerate(sparse_rows):
            for j, v in enumerate(row):
                if isinstance(v, str):
                    values.append(v)
                elif v is None:
                    values.append("")
                elif isinstance(v, int):
                    values.append(format(v, "x"))
                else:  # a multi-hot bag
                    bag = [x if isinstance(x, str) else format(x, "x") for x in v] or [""]
                    values.extend(bag)
                    lengths[i, j] = len(bag)
        return dense_np, values, lengths

    def featurize_instances(self, model: ServingModel, instances: list):
        dense, values, lengths = self.instances_to_arrays(model.spec, instances)
        dense_t, ids, offsets, bad = featurize(model.spec, dense, values, lengths)
        if len(bad):  # schema validation makes this unreachable for JSON; kept for safety
            raise InputError("instances", f"{len(bad)} categorical value(s) are not hex")
        return dense_t, ids, offsets

    @staticmethod
    def featurize_tsv(model: ServingModel, text: bytes):
        """Criteo TSV lines (with or without the label column) -> model inputs."""
        lines = text.splitlines()
        if not lines or all(not line.strip() for line in lines):
            raise InputError("body", "no lines")
        width = model.spec.num_columns
        fixed = []
        for n, line in enumerate(lines, start=1):
            fields = line.count(b"\t") + 1
            if fields == width - 1:  # no label column
                line = b"0\t" + line
            elif fields != width:
                raise InputError(f"line {n}", f"expected {width - 1} or {width} tab-separated fields, got {fields}")
            fixed.append(line)
        parsed = model.parser.parse(RawBlock(0, 0, 1, b"\n".join(fixed) + b"\n", len(fixed)))
        if parsed.bad:
            b = parsed.bad[0]
            raise InputError(f"line {b.line}", b.reason)
        n = parsed.num_rows
        if parsed.ids is not None:
            ids = parsed.ids.reshape(-1)
            offsets = np.arange(ids.size + 1, dtype=np.int64)
        else:
            ids = np.concatenate(parsed.values)
            offsets = np.zeros(parsed.lengths.size + 1, dtype=np.int64)
            np.cumsum(parsed.lengths.reshape(-1), out=offsets[1:])
        return parsed.dense, ids, offsets, n

    # -- scoring ------------------------------------------------------------------------------------

    def embed(self, model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int) -> torch.Tensor:
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
        self.metrics.lookups.inc(n_unique)
        n_need = sum(len(v) for v in need.values())
        if model.cache is not None:
            self.metrics.cache_hits.inc(n_unique - n_need)
            self.metrics.cache_misses.inc(n_need)
        fetched = self.store.get_rows_many(model.version, need) if need else {}
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
                    self.metrics.unknown_ids.inc(int(missing.sum()))
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

    @torch.inference_mode()
    def score(self, model: ServingModel, dense: np.ndarray, ids: np.ndarray, offsets: np.ndarray) -> list[float]:
        batch = dense.shape[0]
        embedded = self.embed(model, ids, offsets, batch)
        network = model.dense  # the reference of this request, whatever a refresh does meanwhile
        logits = network(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), embedded)
        return torch.sigmoid(logits).tolist()
