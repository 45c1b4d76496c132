"""The serving logic: which version scores a request (``versions.py``), ``predict`` for each input
kind (JSON instances, lines in the model's input layout, Open Inference Protocol tensors),
featurising in ``featurize.py``, row lookups in ``lookup.py``, errors in ``errors.py``.

A request takes the reference of its version once, at its start, and scores with it whatever a
refresh swaps in meanwhile: version swaps and promotions under load fail no request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import torch

from api import decode, inline
from api.batching import Batcher
from api.errors import InputError, ModelNotFound, TooLarge, clipped
from api.featurize import ModelInputs, featurize_instances, featurize_lines
from api.lookup import all_cached, embed
from api.metrics import ServingMetrics
from api.model import ServingModel, build_dense, warm_up
from api.schemas import PositionalInstance
from api.settings import Settings
from api.versions import Versions
from embedding_server.idmap.view import IdMapView
from embedding_server.stores import ServingStore, VersionNotFound

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A request decoded, validated and featurised, before its model call."""

    model: ServingModel
    """The version it is scored with (the reference it took at its start)."""
    inputs: ModelInputs
    """Its model inputs."""
    kind: str
    """Its input kind (the batch-size metric's label): instances, lines, tensors."""
    context: object = None
    """What its protocol needs to render the answer (V2: the parsed request)."""


@dataclass
class Scored:
    """The answer to one scoring request."""

    predictions: list[float]
    """Click probability of each example, in order."""
    version: str
    """The version that scored them."""
    generation: int
    """Live updates the version had received when the request started (0: none)."""


class ModelService:
    def __init__(self, store: ServingStore, settings: Settings, metrics: ServingMetrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.versions = Versions(store, settings, metrics, self.load)
        # Looked up per call: benchmarks and tests swap ``score`` on the instance.
        self.batcher = Batcher(
            lambda model, inputs: self.score(model, inputs),
            settings.batch_max_size,
            settings.batch_max_delay_us * 1e-6,
            metrics,
        )
        """Coalesces concurrent requests' model calls (started only with ``settings.batching``)."""

    # -- loading -----------------------------------------------------------------------------------
    def load(self, version: str) -> ServingModel:
        """Build one version (benchmarks override it to hold tables in memory)."""
        meta = self.store.read_meta(version)
        start = self.store.poll_updates(version, None)  # updates after this are applied later
        dense = build_dense(meta, self.store.read_dense(version))
        warm_up(dense, meta)
        dynamic = [t.name for t in meta.spec.tables if t.dynamic is not None]
        id_maps = {name: IdMapView(*self.store.read_id_map(version, name)) for name in dynamic}
        mapped = [self.store.mapped_table(version, t.name) for t in meta.spec.tables]
        owners = (
            {name: self.store.mapped_owners(version, name) for name in dynamic}
            if meta.owners
            else None
        )
        model = ServingModel(
            meta,
            dense,
            self.settings.cache_mb * 2**20,
            self.store.remote,
            cursor=start.cursor,
            generation=start.generation,
            id_maps=id_maps,
            mapped=mapped,
            owners=owners,
            dense_max_abs=self.settings.dense_max_abs,
        )
        # One request through the whole path (featurising, lookups, network) before real ones.
        empty = PositionalInstance(
            dense=[None] * len(meta.spec.dense), sparse=[None] * len(meta.spec.categorical)
        )
        self.score(model, featurize_instances(meta.spec, model.featurizer, [empty]))
        return model

    @property
    def model(self) -> ServingModel | None:
        """The current version (None until one is loaded)."""
        return self.versions.current

    def refresh(self) -> None:
        self.versions.refresh()

    def start(self) -> None:
        self.versions.start()
        if self.settings.batching:
            self.batcher.start()

    def stop(self) -> None:
        self.versions.stop()
        self.batcher.stop()

    # -- requests ----------------------------------------------------------------------------------
    def check_name(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ModelNotFound(
                f"no model named {clipped(name)} (this server serves {self.settings.model_name!r})"
            )

    def resolve(self, name: str, version: str | None = None) -> ServingModel:
        """The model a request names: ``name`` must be the served one; ``version`` None is the
        current version, else one the store still holds."""
        self.check_name(name)
        return self.versions.get(version)

    def predict_json(self, name: str, body: bytes, version: str | None = None) -> Scored:
        """Click probabilities of a V1 JSON body (decoded here, off the event loop)."""
        with self.batcher.coming():
            return self.finish(self.prepare_json(name, body, version))

    def prepare_json(self, name: str, body: bytes, version: str | None = None) -> Pending:
        """A V1 JSON body decoded, validated and featurised: everything but the model call."""
        return self._prepare(name, decode.predict_request(body).instances, version)

    def _prepare(self, name: str, instances: list, version: str | None) -> Pending:
        """Validated JSON instances featurised."""
        if len(instances) > self.settings.max_instances:
            raise InputError(
                "instances",
                f"{len(instances)} instances, at most {self.settings.max_instances} per request",
            )
        model = self.resolve(name, version)
        return self.prepared(
            Pending(
                model,
                featurize_instances(model.spec, model.featurizer, instances, model.values),
                "instances",
            )
        )

    def predict_tsv(self, name: str, text: bytes, version: str | None = None) -> Scored:
        """Click probabilities of lines in the model's input layout."""
        with self.batcher.coming():
            return self.finish(self.prepare_tsv(name, text, version))

    def prepare_tsv(self, name: str, text: bytes, version: str | None = None) -> Pending:
        """Lines in the model's input layout parsed and featurised: everything but the model
        call."""
        model = self.resolve(name, version)
        if model.lines is None:
            raise InputError(
                "body",
                f"version {model.version} does not record its input columns; send JSON instances",
            )
        inputs, n = featurize_lines(model.lines, text, self.settings.max_instances)
        if n > self.settings.max_instances:
            raise InputError(
                "body", f"{n} lines, at most {self.settings.max_instances} per request"
            )
        return self.prepared(Pending(model, inputs, "lines"))

    def prepared(self, pending: Pending) -> Pending:
        """``pending`` unless it carries more ids than ``max_ids_per_request``.

        Raises:
            TooLarge: it does.
        """
        n_ids, cap = len(pending.inputs[1]), self.settings.max_ids_per_request
        if n_ids > cap:
            raise TooLarge(
                "body",
                f"{n_ids} categorical ids, at most max_ids_per_request={cap} per request "
                "(DLRM_MAX_IDS_PER_REQUEST)",
            )
        return pending

    def finish(self, pending: Pending) -> Scored:
        """The model call of a prepared request, in this thread (or coalesced with concurrent
        requests' by the batcher).

        Raises:
            Offload: a request on the event loop (``api/inline.py``) whose rows are not all cached.
        """
        model, inputs = pending.model, pending.inputs
        if inline.on_loop() and not all_cached(model, inputs[1], inputs[2], inputs[0].shape[0]):
            raise inline.Offload  # it would read the remote store: not on the event loop
        generation = model.generation
        try:
            predictions = self.batcher.score(model, inputs)
        except VersionNotFound:
            raise self.versions.vanished(model) from None
        return self._answer(pending, predictions, generation)

    async def finish_queued(self, pending: Pending) -> Scored:
        """The model call of a prepared request made by the batcher thread, awaited (the event
        loop's concurrent small requests: ``api/fastpath.py``); batching must be running."""
        generation = pending.model.generation
        try:
            predictions = await asyncio.wrap_future(
                self.batcher.submit(pending.model, pending.inputs)
            )
        except VersionNotFound:
            raise self.versions.vanished(pending.model) from None
        return self._answer(pending, predictions, generation)

    def _answer(self, pending: Pending, predictions: list[float], generation: int) -> Scored:
        self.metrics.batch_size.labels(input=pending.kind).observe(len(predictions))
        return Scored(predictions, pending.model.version, generation)

    def embed(
        self, model: ServingModel, ids: np.ndarray, offsets: np.ndarray, batch: int
    ) -> torch.Tensor:
        """Pooled embeddings float [B, sum(D_t)] (``api/lookup.py``; benchmarks swap it)."""
        return embed(self.store, self.metrics, model, ids, offsets, batch)

    @torch.inference_mode()
    def score(self, model: ServingModel, inputs: ModelInputs) -> list[float]:
        if torch.get_num_threads() != self.settings.threads:
            # OpenMP's thread count is per calling thread: each worker thread starts at one per
            # core, and the idle workers spin-wait after every op (measured: a second core busy
            # ~5 ms per single-instance request).
            torch.set_num_threads(self.settings.threads)
        dense, ids, offsets = inputs
        batch = dense.shape[0]
        embedded = self.embed(model, ids, offsets, batch)
        network = model.dense  # the reference of this request, whatever a refresh does meanwhile
        logits = network(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), embedded)
        return torch.sigmoid(logits).tolist()
