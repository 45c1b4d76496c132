"""The serving logic: the loaded model, live refresh, and ``predict`` (featurising in
``featurize.py``, row lookups in ``lookup.py``, errors in ``errors.py``).

The model being served is one :class:`ServingModel` reference on the service. A new version is
loaded off to the side and swapped in with one assignment; a request holds the reference it
started with, so version swaps under load fail no request. Live updates (rows rewritten in the
current version, new dense weights) invalidate cached rows and swap the dense network the same
way.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from api.errors import InputError, ModelNotFound, NotReady
from api.featurize import featurize_instances, featurize_lines
from api.lookup import embed
from api.metrics import ServingMetrics
from api.model import ServingModel, build_dense, warm_up
from api.schemas import PositionalInstance
from api.settings import Settings
from embedding_server.stores import ServingStore

log = logging.getLogger(__name__)


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
        empty = PositionalInstance(dense=[None] * len(meta.spec.dense), sparse=[None] * len(meta.spec.categorical))
        self.score(model, *featurize_instances(meta.spec, model.featurizer, [empty]))
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

    # -- requests ------------------------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ModelNotFound(f"no model named {name!r} (this server serves {self.settings.model_name!r})")

    def predict(self, name: str, instances: list) -> tuple[list[float], str]:
        """Click probabilities of JSON instances, and the version that scored them."""
        self.check_name(name)
        if len(instances) > self.settings.max_instances:
            raise InputError("instances", f"{len(instances)} instances, at most {self.settings.max_instances} per request")
        model = self.current()
        predictions = self.score(model, *featurize_instances(model.spec, model.featurizer, instances))
        self.metrics.batch_size.observe(len(predictions))
        return predictions, model.version

    def predict_tsv(self, name: str, text: bytes) -> tuple[list[float], str]:
        """Click probabilities of lines in the model's input layout, and the scoring version."""
        self.check_name(name)
        model = self.current()
        if model.lines is None:
            raise InputError("body", f"version {model.version} does not record its input columns; send JSON instances")
        (dense, ids, offsets), n = featurize_lines(model.lines, text, self.settings.max_instances)
        if n > self.settings.max_instances:
            raise InputError("body", f"{n} lines, at most {self.settings.max_instances} per request")
        predictions = self.score(model, dense, ids, offsets)
        self.metrics.batch_size.observe(n)
        return predictions, model.version

    def embed(self, model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int) -> torch.Tensor:
        """Pooled embeddings float [B, sum(D_t)] (``api/lookup.py``; benchmarks swap it)."""
        return embed(self.store, self.metrics, model, ids, offsets, batch)

    @torch.inference_mode()
    def score(self, model: ServingModel, dense: np.ndarray, ids: np.ndarray, offsets: np.ndarray) -> list[float]:
        batch = dense.shape[0]
        embedded = self.embed(model, ids, offsets, batch)
        network = model.dense  # the reference of this request, whatever a refresh does meanwhile
        logits = network(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), embedded)
        return torch.sigmoid(logits).tolist()
