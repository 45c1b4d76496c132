"""The versions a serving process holds: the store's current one and the versions requests pin
(``/versions/{v}``), each loaded beside the others and swapped in with one assignment.

A background thread polls the store (``DLRM_POLL_INTERVAL_S``): a new current version is loaded
off to the side and swapped in; live updates of every loaded version invalidate their cached
rows, move their dynamic tables' id maps (ids admitted and evicted), and swap their dense
networks; updates that were lost (a trimmed update stream) reload the
version. A version deleted from the store (collected while this replica lagged) is never served
from what is left of it: its reads raise, a request then gets 503 while the current version
loads at once (``vanished`` wakes the poller), or 404 when it had pinned that version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from api import inline
from api.errors import ModelNotFound, NotReady, clipped
from api.metrics import ServingMetrics
from api.model import ServingModel, build_dense
from api.settings import Settings
from embedding_server.idmap.view import IdMapView
from embedding_server.stores import ServingStore, VersionNotFound

log = logging.getLogger(__name__)


class Versions:
    """The loaded versions of one process.

    Args:
        load: builds (and warms up) a version, given its name and its store cursor.
    """

    def __init__(
        self,
        store: ServingStore,
        settings: Settings,
        metrics: ServingMetrics,
        load: Callable[[str], ServingModel],
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._load = load
        self.current: ServingModel | None = None
        self.pinned: OrderedDict[str, ServingModel] = OrderedDict()
        self._refresh_lock = threading.Lock()
        self._pin_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._vanished: str | None = None
        """The current version a request found deleted (the next load's reason)."""

    # -- requests ----------------------------------------------------------------------------------
    def holds(self, version: str) -> bool:
        """Whether ``version`` is loaded (current or pinned): ``get`` returns it without a store
        read."""
        current = self.current
        return (current is not None and current.version == version) or version in self.pinned

    def get(self, version: str | None = None) -> ServingModel:
        """The current version (``version`` None), or a pinned one, loaded on first use.

        Raises:
            NotReady: no current version loaded yet.
            ModelNotFound: the store does not hold ``version`` (field ``version``).
        """
        current = self.current
        if version is None or (current is not None and current.version == version):
            if current is None:
                raise NotReady("no model loaded yet")
            return current
        model = self.pinned.get(version)
        if model is not None:
            return model
        # loading reads the store: not on the event loop (remote stores; staged requests)
        inline.need_store()
        with self._pin_lock:  # one load per version, however many requests wait for it
            model = self.pinned.get(version)
            if model is None:
                model = self._load_pinned(version)
            return model

    def _load_pinned(self, version: str) -> ServingModel:
        if not self.store.exists(version):
            raise ModelNotFound(f"the store holds no version {clipped(version)}", "version")
        try:
            model = self._timed_load(version, "new")
        except VersionNotFound:
            raise ModelNotFound(
                f"the store holds no version {clipped(version)}", "version"
            ) from None
        self.pinned[version] = model
        while len(self.pinned) > self.settings.max_pinned_versions:
            self.pinned.popitem(last=False)  # the least recently loaded
        self._release()
        return model

    def vanished(self, model: ServingModel) -> Exception:
        """A request found ``model``'s version deleted: the error to answer with (503 for the
        current version, loading the new current one right away; 404 for a pinned one)."""
        if model is self.current:
            self._vanished = model.version
            self._wake.set()
            return NotReady(f"version {model.version} left the store; loading the current one")
        self.pinned.pop(model.version, None)
        return ModelNotFound(f"version {model.version!r} left the store", "version")

    # -- refreshing --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Load the store's current version if it moved, then follow live updates."""
        with self._refresh_lock:
            t0 = time.perf_counter()
            version = self.store.current_version()
            if version is not None:
                model = self.current
                if model is None or model.version != version:
                    vanished = model is not None and self._vanished == model.version
                    self._install(version, "vanished" if vanished else "new")
                elif self._follow(model) == "reload":
                    self._install(version, "lost")
            for name, model in list(self.pinned.items()):
                if self._follow(model) is not None:  # deleted, or updates lost: load again on use
                    self.pinned.pop(name, None)
            self.metrics.store_latency.labels(operation="poll").observe(time.perf_counter() - t0)
            self.metrics.last_sync.set(time.time())

    def _follow(self, model: ServingModel) -> str | None:
        """Apply ``model``'s live updates; -> "reload" / "gone" when that cannot be done."""
        try:
            batch = self.store.poll_updates(model.version, model.cursor)
        except VersionNotFound:
            return "gone"
        if batch.lost:
            log.warning(
                "live updates of %s were trimmed before this replica read them: reloading it",
                model.version,
            )
            return "reload"
        try:  # everything read before anything changes: a failed read leaves the model as it was
            # the store folded it
            rebased = {
                table: IdMapView(*self.store.read_id_map(model.version, table))
                for table in batch.maps_rebased & set(model.id_maps)
            }
            dense = (
                build_dense(model.meta, self.store.read_dense(model.version))
                if batch.dense_changed
                else None
            )
        except VersionNotFound:
            return "gone"
        if model.cache is not None:
            for table, ids in batch.rows.items():
                model.cache.invalidate(table, ids)
        for table, delta in batch.id_maps.items():  # admitted and evicted ids (rows carry owners)
            if table in model.id_maps and table not in batch.maps_rebased:
                model.id_maps[table].apply(delta)
        model.id_maps.update(rebased)
        self.metrics.live_updates.inc(sum(len(ids) for ids in batch.rows.values()))
        if dense is not None:
            model.dense = dense
            log.info("dense weights of %s refreshed", model.version)
        if batch.generation != model.generation and batch.written_at is not None:
            self.metrics.update_lag.set(max(0.0, time.time() - batch.written_at))
        model.cursor, model.generation = batch.cursor, batch.generation
        if model is self.current:
            self.metrics.generation.set(batch.generation)
        return None

    def _timed_load(self, version: str, reason: str) -> ServingModel:
        t0 = time.perf_counter()
        model = self._load(version)
        seconds = time.perf_counter() - t0
        self.metrics.store_latency.labels(operation="load").observe(seconds)
        self.metrics.reloads.labels(reason=reason).inc()
        log.info(
            "loaded version %s (%s, %.2fs, generation %d)",
            version,
            reason,
            seconds,
            model.generation,
        )
        return model

    def _install(self, version: str, reason: str) -> None:
        model = self._timed_load(version, reason)
        old, self.current = self.current, model  # the swap: one reference
        self.pinned.pop(version, None)
        self._release()
        if old is not None and old.version != version:
            self.metrics.model_version.labels(version=old.version).set(0)
        self.metrics.model_version.labels(version=version).set(1)
        self.metrics.published_at.set(model.meta.created_at)
        self.metrics.generation.set(model.generation)
        self.metrics.set_ready(True)
        log.info("serving version %s", version)

    def _release(self) -> None:
        keep = {m.version for m in (self.current, *self.pinned.values()) if m is not None}
        self.store.release(keep)

    # -- the poller --------------------------------------------------------------------------------
    def start(self) -> None:
        """Poll the store in a background thread until :meth:`stop`."""
        self.metrics.set_ready(self.current is not None)
        self._thread = threading.Thread(target=self._loop, name="store-refresh", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception as exc:  # the store may be down: keep serving what we have
                self.metrics.store_errors.labels(operation="refresh").inc()
                log.warning("store refresh failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
