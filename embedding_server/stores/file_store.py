"""``file://DIR``: the embedded serving store. No server needed.

    DIR/CURRENT                          name of the current version (replaced atomically)
    DIR/.lock                            flock held while CURRENT moves or a version is deleted
    DIR/versions/<v>/meta.json           ModelVersion
    DIR/versions/<v>/dense.pt            dense weights (loaded with weights_only)
    DIR/versions/<v>/tables/<name>.npy   rows, float32 or float16 [rows, D], or int8/int4 bytes in
                                         fbgemm's row-wise layout [rows, row_width]; memory-mapped
    DIR/versions/<v>/idmaps/<name>.npy   dynamic tables: int64 [2, n], admitted ids (sorted) over
                                         their rows; readers ``searchsorted`` them
    DIR/versions/<v>/idmaps/<name>.overlay.npy   live updates: int64 [2, k], the ids changed since
                                         (sorted) over their rows now (-1: evicted); rewritten
                                         whole by each push (O(k + c)), folded into the base past
                                         ``view.compact_at(n)`` entries (O(n), amortised O(1) a
                                         change)
    DIR/versions/<v>/idmaps/<name>.rebased   generation of the last fold (absent: none)
    DIR/versions/<v>/idmaps/<name>.owner.npy   int64 [R], the id each row holds (memory-mapped,
                                         rewritten in place: cleared before a changed row is)
    DIR/versions/<v>/GENERATION          live updates written to the version so far

A version is written under ``DIR/versions/.tmp-*`` and renamed into place when complete, and only
then does CURRENT move: readers never see a partial version, and a crash mid-publish leaves the
previous version serving. Readers memory-map the tables (the OS page cache is the row cache), so
live row updates written into the same mapping are visible at once. A deleted version is first
renamed out of ``versions/`` (under the lock, so that it cannot become current meanwhile), so a
live update never writes into a version being deleted.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dlrm_core.errors import ConfigError
from embedding_server.checkpoint.files import atomic_write_bytes, fsync_dir
from embedding_server.idmap.view import (
    NO_OWNER,
    IdMapDelta,
    compact_at,
    fold,
    merge_overlay,
    owners_of,
)
from embedding_server.stores.base import ServingStore, UpdateBatch, VersionNotFound, VersionWriter
from embedding_server.wire import (
    NUMPY_DTYPE,
    ModelVersion,
    decode_state,
    encode_rows,
    encode_state,
    row_width,
)

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_version_name(version: str) -> str:
    if not VERSION_RE.match(version):
        raise ConfigError(f"version {version!r}: use 1-100 letters, digits, '.', '_' or '-'")
    return version


class FileVersionWriter(VersionWriter):
    def __init__(self, store: FileStore, meta: ModelVersion) -> None:
        self.store = store
        self.meta = meta
        store.versions_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=store.versions_dir, prefix=f".tmp-{meta.version}-"))
        (self.tmp / "tables").mkdir()
        self._arrays: dict[str, np.memmap] = {}
        self._dims = {t.name: (t.rows, t.dim) for t in meta.spec.tables}

    def _array(self, table: str) -> np.memmap:
        if table not in self._arrays:
            rows, dim = self._dims[table]
            self._arrays[table] = np.lib.format.open_memmap(
                self.tmp / "tables" / f"{table}.npy",
                mode="w+",
                dtype=NUMPY_DTYPE[self.meta.row_dtype],
                shape=(rows, row_width(dim, self.meta.row_dtype)),
            )
        return self._arrays[table]

    def write_rows(
        self, table: str, start: int, rows: np.ndarray, keep: np.ndarray | None = None
    ) -> None:
        arr = self._array(table)
        arr[start : start + len(rows)] = encode_rows(rows, self.meta.row_dtype)

    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        (self.tmp / "dense.pt").write_bytes(encode_state(state))

    def write_id_map(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        (self.tmp / "idmaps").mkdir(exist_ok=True)
        np.save(self.tmp / "idmaps" / f"{table}.npy", np.stack([ids, rows]).astype(np.int64))
        np.save(
            self.tmp / "idmaps" / f"{table}.owner.npy", owners_of(self._dims[table][0], ids, rows)
        )
        self.meta.owners = True

    def commit(self) -> None:
        for name in self._dims:  # tables never written are all zeros
            self._array(name)
        for arr in self._arrays.values():
            arr.flush()
        self._arrays.clear()
        (self.tmp / "meta.json").write_text(self.meta.model_dump_json(indent=1))
        for path in self.tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(self.tmp / "tables")
        fsync_dir(self.tmp)
        final = self.store.versions_dir / self.meta.version
        if final.exists():
            shutil.rmtree(final)
        os.replace(self.tmp, final)
        fsync_dir(self.store.versions_dir)
        with self.store.locked():
            atomic_write_bytes(self.store.root / "CURRENT", self.meta.version.encode())
        self.store.collect_garbage(self.meta.version)

    def abort(self) -> None:
        self._arrays.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


class FileStore(ServingStore):
    remote = False

    def __init__(self, path: str | Path, keep_versions: int = 3) -> None:
        super().__init__(keep_versions)
        self.root = Path(path)
        self.url = f"file://{self.root}"
        self.versions_dir = self.root / "versions"
        self._maps: dict[tuple[str, str], np.ndarray] = {}
        self._lock = threading.Lock()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The store-wide lock (flock, so across processes): CURRENT, deletions, generations."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _vdir(self, version: str) -> Path:
        path = self.versions_dir / check_version_name(version)
        if not (path / "meta.json").exists():
            raise VersionNotFound(f"{self.url} has no version {version!r}", version)
        return path

    def current_version(self) -> str | None:
        try:
            return (self.root / "CURRENT").read_text().strip() or None
        except FileNotFoundError:
            return None

    def read_meta(self, version: str) -> ModelVersion:
        return ModelVersion.model_validate_json((self._vdir(version) / "meta.json").read_text())

    def list_versions(self) -> list[str]:
        if not self.versions_dir.exists():
            return []
        done = [
            p
            for p in self.versions_dir.iterdir()
            if (p / "meta.json").exists() and not p.name.startswith(".")
        ]
        return [p.name for p in sorted(done, key=lambda p: (p / "meta.json").stat().st_mtime)]

    def delete_version(self, version: str) -> None:
        path = self.versions_dir / check_version_name(version)
        with self.locked():
            if self.current_version() == version:
                raise ConfigError(
                    f"{self.url}: {version!r} is the current version; promote another first"
                )
            if not path.exists():
                return
            doomed = self.versions_dir / f".deleting-{version}-{os.getpid()}"
            os.replace(path, doomed)  # gone for readers and live updates at once
        with self._lock:
            for key in [k for k in self._maps if k[0] == version]:
                del self._maps[key]
        shutil.rmtree(doomed, ignore_errors=True)

    def promote(self, version: str) -> None:
        with self.locked():
            self._vdir(version)  # complete (meta.json is written last) and not being deleted
            atomic_write_bytes(self.root / "CURRENT", version.encode())

    def read_dense(self, version: str) -> dict[str, torch.Tensor]:
        return decode_state((self._vdir(version) / "dense.pt").read_bytes())

    def _map(
        self, version: str, table: str, writable: bool = False, folder: str = "tables"
    ) -> np.ndarray:
        if writable:
            return np.load(self._vdir(version) / folder / f"{table}.npy", mmap_mode="r+")
        key = (version, table)
        arr = self._maps.get(key)
        if arr is None:
            with self._lock:
                arr = self._maps.get(key)
                if arr is None:
                    arr = np.load(self._vdir(version) / folder / f"{table}.npy", mmap_mode="r")
                    self._maps[key] = arr
        return arr

    def _id_map_parts(self, vdir: Path, table: str) -> tuple[np.ndarray, ...]:
        """(base ids, base rows, overlay ids, overlay rows) of a dynamic table (hold the lock). The
        base is memory-mapped: a push or a poll reads its length, not its millions of ids."""
        try:
            base = np.load(vdir / "idmaps" / f"{table}.npy", mmap_mode="r")
        except FileNotFoundError:
            raise VersionNotFound(
                f"{self.url}: version {vdir.name!r} has no id map of table {table}", vdir.name
            ) from None
        path = vdir / "idmaps" / f"{table}.overlay.npy"
        over = np.load(path) if path.exists() else np.zeros((2, 0), np.int64)
        return base[0], base[1], over[0], over[1]

    def read_id_map(self, version: str, table: str) -> tuple[np.ndarray, np.ndarray]:
        with self.locked():
            return fold(*self._id_map_parts(self._vdir(version), table))

    def read_owners(self, version: str, table: str, rows: np.ndarray) -> np.ndarray:
        return self._owners(version, table)[rows]

    def _owners(self, version: str, table: str, writable: bool = False) -> np.ndarray:
        """A dynamic table's owners, int64 [R] (memory-mapped, cached like the tables)."""
        return self._map(version, f"{table}.owner", writable, folder="idmaps")

    def mapped_owners(self, version: str, table: str) -> np.ndarray:
        """The owners' mapping, read-only (single requests check the rows they gather against
        it)."""
        return np.asarray(self._owners(version, table))

    def get_stored_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        # A mapping outlives the deletion of its file: the rows read are the version's own.
        return {
            table: (self._map(version, table)[ids], np.ones(len(ids), dtype=bool))
            for table, ids in requests.items()
        }

    def mapped_table(self, version: str, table: str) -> np.ndarray | None:
        # the mapping, as a plain ndarray (no memmap per gather)
        return np.asarray(self._map(version, table))

    def begin(self, meta: ModelVersion) -> VersionWriter:
        check_version_name(meta.version)
        if (self.versions_dir / meta.version).exists():
            raise ConfigError(
                f"{self.url} already has a version {meta.version!r}: publish under a new name"
            )
        return FileVersionWriter(self, meta)

    def release(self, keep: Collection[str]) -> None:
        keep = {keep} if isinstance(keep, str) else set(keep)
        with self._lock:
            for key in [k for k in self._maps if k[0] not in keep]:
                del self._maps[key]

    # -- live updates: written under the lock, so never into a version being deleted ---------------
    def _generation(self, vdir: Path) -> int:
        try:
            return int((vdir / "GENERATION").read_text() or 0)
        except FileNotFoundError:
            return 0

    def _bump(self, vdir: Path) -> None:
        atomic_write_bytes(vdir / "GENERATION", str(self._generation(vdir) + 1).encode())

    def update_rows(
        self,
        version: str,
        updates: dict[str, tuple[np.ndarray, np.ndarray]],
        id_maps: dict[str, IdMapDelta] | None = None,
    ) -> None:
        # Readers see rows the moment they are written (the same pages): a changed row's owner is
        # cleared first, its map entry moves, the row is rewritten, then the new owner is set.
        with self.locked():
            vdir = self._vdir(version)
            meta = self.read_meta(version)
            owners = {table: self._owners(version, table, writable=True) for table in id_maps or {}}
            for table, delta in (id_maps or {}).items():
                owners[table][delta.slots] = NO_OWNER
                self._write_overlay(vdir, table, delta)
            for table, (ids, rows) in updates.items():
                arr = self._map(version, table, writable=True)
                arr[ids] = encode_rows(rows, meta.row_dtype)
                arr.flush()
            for table, delta in (id_maps or {}).items():
                owners[table][delta.slots] = delta.owners
                owners[table].flush()
            self._bump(vdir)

    def _write_overlay(self, vdir: Path, table: str, delta: IdMapDelta) -> None:
        """Merge a push's map changes into the table's overlay (rewritten atomically); fold it into
        the base once it is past ``compact_at`` entries (hold the lock)."""
        base_ids, base_rows, over_ids, over_rows = self._id_map_parts(vdir, table)
        over_ids, over_rows = merge_overlay(over_ids, over_rows, delta.ids, delta.rows)
        folder = vdir / "idmaps"
        if len(over_ids) > compact_at(len(base_ids)):
            atomic_write_bytes(
                folder / f"{table}.npy",
                _npy(np.stack(fold(base_ids, base_rows, over_ids, over_rows))),
            )
            atomic_write_bytes(
                folder / f"{table}.rebased", str(self._generation(vdir) + 1).encode()
            )
            over_ids = over_rows = np.zeros(0, np.int64)
            self.compactions += 1
        atomic_write_bytes(folder / f"{table}.overlay.npy", _npy(np.stack([over_ids, over_rows])))

    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None:
        with self.locked():
            vdir = self._vdir(version)
            atomic_write_bytes(vdir / "dense.pt", encode_state(state))
            self._bump(vdir)

    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        # Rows need no invalidation (readers map the very pages the writer updates); the dense
        # weights changed when dense.pt did. Cursor: "<generation>:<dense.pt mtime>".
        vdir = self._vdir(version)
        try:
            stamp = str((vdir / "dense.pt").stat().st_mtime_ns)
        except FileNotFoundError:
            raise VersionNotFound(f"{self.url}: version {version!r} was deleted", version) from None
        generation = self._generation(vdir)
        dense_changed = cursor is not None and cursor.partition(":")[2] != stamp
        written_at = None
        if cursor is not None and cursor.partition(":")[0] != str(generation):
            written_at = (vdir / "GENERATION").stat().st_mtime  # (the newest write: a lower bound)
        batch = UpdateBatch(
            cursor=f"{generation}:{stamp}",
            generation=generation,
            dense_changed=dense_changed,
            written_at=written_at,
        )
        if written_at is not None:
            self._map_changes(version, vdir, int(cursor.partition(":")[0] or 0), batch)
        return batch

    def _map_changes(self, version: str, vdir: Path, seen: int, batch: UpdateBatch) -> None:
        """Dynamic tables' changes since generation ``seen``: the whole overlay (every id changed
        since the base, O(k)), or a re-read where the base was folded since."""
        dynamic = [t.name for t in self.read_meta(version).spec.tables if t.dynamic is not None]
        with self.locked():
            for table in dynamic:
                rebased = vdir / "idmaps" / f"{table}.rebased"
                if rebased.exists() and int(rebased.read_text() or 0) > seen:
                    batch.maps_rebased.add(table)
                    continue
                _, _, ids, rows = self._id_map_parts(vdir, table)
                if len(ids):
                    batch.id_maps[table] = IdMapDelta(
                        ids, rows, np.zeros(0, np.int64), np.zeros(0, np.int64)
                    )


def _npy(arr: np.ndarray) -> bytes:
    """``arr`` as the bytes of a .npy file."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()
