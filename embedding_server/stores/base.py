"""The serving-store interface: versions, rows, dense weights, live updates."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from dlrm_core.errors import DlrmError
from embedding_server.wire import ModelVersion


class StoreUnavailable(DlrmError):
    """The store cannot be reached right now (the API answers 503 with Retry-After)."""


class VersionNotFound(DlrmError):
    """The store has no such version (or no current one)."""


@dataclass
class UpdateBatch:
    """What changed in a version since a reader's cursor.

    Attributes:
        cursor: pass back to the next ``poll_updates``.
        rows: table -> row ids rewritten since the cursor.
        dense_changed: the dense weights were replaced.
        reset: the reader fell too far behind: drop every cached row.
    """

    cursor: str
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    dense_changed: bool = False
    reset: bool = False


class VersionWriter(ABC):
    """Writes one version; nothing is visible to readers before :meth:`commit`."""

    meta: ModelVersion

    @abstractmethod
    def write_rows(self, table: str, start: int, rows: np.ndarray) -> None:
        """Rows ``[start, start + len(rows))`` of ``table`` (float [n, D])."""

    @abstractmethod
    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        """The dense model's weights."""

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

    def __init__(self, keep_versions: int = 3) -> None:
        self.keep_versions = keep_versions

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
    def delete_version(self, version: str) -> None: ...

    # -- reading ------------------------------------------------------------------------------------
    @abstractmethod
    def read_dense(self, version: str) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def get_rows(self, version: str, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``table`` (int64 ids [n]) -> (float32 [n, D], bool [n] present)."""

    def get_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows of several tables at once (remote stores do it in one round trip)."""
        return {table: self.get_rows(version, table, ids) for table, ids in requests.items()}

    # -- writing ------------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, meta: ModelVersion) -> VersionWriter:
        """Start writing a new version."""

    # -- live updates -------------------------------------------------------------------------------
    @abstractmethod
    def update_rows(self, version: str, updates: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Rewrite rows of a published version: table -> (ids int64 [n], rows float [n, D])."""

    @abstractmethod
    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        """Changes since ``cursor`` (None: start from now, nothing to report)."""

    def collect_garbage(self, current: str) -> list[str]:
        """Delete versions older than the newest ``keep_versions`` (never ``current``)."""
        versions = self.list_versions()
        old = [v for v in versions[: max(0, len(versions) - self.keep_versions)] if v != current]
        for v in old:
            self.delete_version(v)
        return old

    def release(self, keep: str) -> None:  # noqa: B027 (optional)
        """Drop what is held open for versions other than ``keep`` (memory maps)."""

    def exists(self, version: str) -> bool:
        return version in self.list_versions()

    def close(self) -> None:  # noqa: B027 (optional)
        """Release connections."""
