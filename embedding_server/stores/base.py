"""The serving-store interface: versions, rows, dense weights, live updates.

Versions: a store holds complete versions and names one of them *current*; ``promote`` moves
current to another complete version (a rollback, atomic), ``collect_garbage`` deletes old ones
(never the current one). A version deleted while a reader still uses it is never mistaken for
rows that are merely missing: reads of a deleted version raise :class:`VersionNotFound`.

Live updates: each write to a published version (rows, dense weights) is one *generation*,
numbered 1, 2, ... per version by the store; readers follow them with ``poll_updates`` and learn
when some were lost (``UpdateBatch.lost``: reload the version).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from dlrm_core.errors import ConfigError, DlrmError
from embedding_server.idmap.view import NO_OWNER, IdMapDelta
from embedding_server.wire import ModelVersion, dequantize_rows


class StoreUnavailable(DlrmError):
    """The store cannot be reached right now (the API answers 503 with Retry-After)."""


class VersionNotFound(DlrmError):
    """The store has no such version (never published, collected, or being deleted)."""

    def __init__(self, message: str, version: str = "") -> None:
        super().__init__(message)
        self.version = version


@dataclass
class UpdateBatch:
    """What changed in a version since a reader's cursor.

    Attributes:
        cursor: pass back to the next ``poll_updates``.
        generation: live updates applied to the version up to this batch (0: none yet).
        rows: table -> row ids rewritten since the cursor.
        dense_changed: the dense weights were replaced.
        lost: updates since the cursor were dropped (a trimmed update stream): the reader
            cannot know which rows changed and must reload the version.
        written_at: Unix time the oldest update of the batch was written (None: no update).
        id_maps: dynamic tables: their id-map changes since the cursor, merged in order.
        maps_rebased: dynamic tables whose stored map was compacted since the cursor: read it
            again (:meth:`ServingStore.read_id_map`) instead of applying ``id_maps``.
    """

    cursor: str
    generation: int = 0
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    dense_changed: bool = False
    lost: bool = False
    written_at: float | None = None
    id_maps: dict[str, IdMapDelta] = field(default_factory=dict)
    maps_rebased: set[str] = field(default_factory=set)


class VersionWriter(ABC):
    """Writes one version; nothing is visible to readers before :meth:`commit`."""

    meta: ModelVersion

    @abstractmethod
    def write_rows(
        self, table: str, start: int, rows: np.ndarray, keep: np.ndarray | None = None
    ) -> None:
        """Rows ``[start, start + len(rows))`` of ``table`` (float [n, D]). ``keep`` (bool [n]):
        the rows to store, the others are served the table's default (None: all); a store may
        keep all of them anyway (the file store's tables are dense arrays)."""

    @abstractmethod
    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        """The dense model's weights."""

    @abstractmethod
    def write_id_map(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """A dynamic table's admitted ids (int64 [n], sorted) and their rows (int64 [n])."""

    @abstractmethod
    def commit(self) -> None:
        """Make the version complete and current (atomically), then collect old versions."""

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written."""

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class ServingStore(ABC):
    """Where published models live and where serving replicas read them."""

    remote: bool = False
    """Whether reads cross the network (a per-process row cache pays off)."""
    url: str = ""
    """Where the store is, for messages: redacted (no password), safe to log or show."""

    def __init__(self, keep_versions: int = 3) -> None:
        self.keep_versions = keep_versions
        self.compactions = 0
        """Dynamic tables' id-map overlays this instance folded into their base (live updates)."""

    # -- registry ---------------------------------------------------------------------------------
    @abstractmethod
    def current_version(self) -> str | None:
        """Name of the version readers should serve, or None when nothing is published."""

    @abstractmethod
    def read_meta(self, version: str) -> ModelVersion: ...

    @abstractmethod
    def list_versions(self) -> list[str]:
        """Complete versions, oldest first."""

    @abstractmethod
    def delete_version(self, version: str) -> None:
        """Delete a version that is not current (refused for the current one: ConfigError)."""

    @abstractmethod
    def promote(self, version: str) -> None:
        """Make a complete version current, atomically (a rollback when it is older).

        Raises:
            VersionNotFound: the store has no complete version of that name.
        """

    def describe(self) -> list[ModelVersion]:
        """Metadata of the complete versions, oldest first."""
        return [self.read_meta(v) for v in self.list_versions()]

    # -- reading -----------------------------------------------------------------------------------
    @abstractmethod
    def read_dense(self, version: str) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def get_stored_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows as stored, of several tables at once (remote stores: one round trip): table ->
        ids int64 [n] -> (``NUMPY_DTYPE[row_dtype]`` [n, ``row_width``], bool [n] present)."""

    def get_rows(self, version: str, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``table`` (int64 ids [n]) -> (float32 [n, D], bool [n] present)."""
        return self.get_rows_many(version, {table: ids})[table]

    @abstractmethod
    def read_id_map(self, version: str, table: str) -> tuple[np.ndarray, np.ndarray]:
        """A dynamic table's (ids int64 [n] sorted, rows int64 [n]): as
        :meth:`VersionWriter.write_id_map`
        wrote them, with every live update's changes applied."""

    @abstractmethod
    def read_owners(self, version: str, table: str, rows: np.ndarray) -> np.ndarray:
        """The id each of a dynamic table's ``rows`` (int64 [n]) holds now, int64 [n] (NO_OWNER:
        none)."""

    def get_checked_rows_many(
        self, version: str, requests: dict[str, np.ndarray], expect: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`get_stored_rows_many`, and for the tables in ``expect`` (int64 [n] per table: the
        id the reader's map says holds each row, NO_OWNER: unchecked) whether it still does,
        bool [n] (False: another id's row, or none; serve the id its shared row). Here the
        owners are read after the rows (a store whose rows and owners change together, owner
        cleared before a row is rewritten, so an owner still right after the read vouches for it);
        a remote store reads both in one atomic call."""
        stored = self.get_stored_rows_many(version, requests)
        out = {}
        for table, (raw, present) in stored.items():
            owned = np.ones(len(raw), dtype=bool)
            if table in expect:
                want = expect[table]
                check = want != NO_OWNER
                if check.any():
                    owned[check] = (
                        self.read_owners(version, table, requests[table][check]) == want[check]
                    )
            out[table] = (raw, present, owned)
        return out

    def mapped_table(self, version: str, table: str) -> np.ndarray | None:
        """The rows of ``table`` as an array in memory (float [rows, D], read-only, the store's
        own mapping), for stores that have one; None: read rows with :meth:`get_rows`."""
        return None

    def mapped_owners(self, version: str, table: str) -> np.ndarray | None:
        """A dynamic table's owners as an array in memory (int64 [R], read-only, live), for stores
        that have one (single requests then gather rows and check them directly); None: none."""
        return None

    def get_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows of several tables at once, as float32 [n, D] (quantized rows dequantized)."""
        meta = self.read_meta(version)
        dims = {t.name: t.dim for t in meta.spec.tables}
        stored = self.get_stored_rows_many(version, requests)
        return {
            table: (dequantize_rows(raw, dims[table], meta.row_dtype), present)
            for table, (raw, present) in stored.items()
        }

    # -- writing -----------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, meta: ModelVersion) -> VersionWriter:
        """Start writing a new version."""

    # -- live updates ------------------------------------------------------------------------------
    @abstractmethod
    def update_rows(
        self,
        version: str,
        updates: dict[str, tuple[np.ndarray, np.ndarray]],
        id_maps: dict[str, IdMapDelta] | None = None,
    ) -> None:
        """Rewrite rows of a published version: table -> (ids int64 [n], rows float [n, D]);
        ``id_maps``: dynamic tables' map changes, written so that a reader never takes a row for
        an id that does not hold it (the changed rows' owners are cleared before their rows are
        rewritten, and set after)."""

    @abstractmethod
    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        """Changes since ``cursor`` (None: start from now, nothing to report; the batch's
        generation is the version's current one).

        Raises:
            VersionNotFound: the version was deleted.
        """

    def collect_garbage(self, current: str | None = None, keep: int | None = None) -> list[str]:
        """Delete all but the newest ``keep`` (default ``keep_versions``) complete versions,
        never the current one; -> the deleted versions."""
        keep = self.keep_versions if keep is None else keep
        current = self.current_version() if current is None else current
        versions = self.list_versions()
        old = [v for v in versions[: max(0, len(versions) - keep)] if v != current]
        deleted = []
        for v in old:
            try:
                self.delete_version(v)
                deleted.append(v)
            except ConfigError:  # promoted meanwhile: it is current now, keep it
                pass
        return deleted

    def release(self, keep: Collection[str]) -> None:  # noqa: B027 (optional)
        """Drop what is held open for versions other than those in ``keep`` (memory maps)."""

    def exists(self, version: str) -> bool:
        return version in self.list_versions()

    def close(self) -> None:  # noqa: B027 (optional)
        """Release connections."""
