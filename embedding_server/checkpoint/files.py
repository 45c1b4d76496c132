"""Checkpoint files: atomic, checksummed, and loaded without executing pickled code.

A checkpoint is a directory ``step-<N>/`` of tensor files plus ``manifest.json`` (each file's
BLAKE2b digest and size, the step, free-form metadata). Its files are written (by one process,
or by every embedding server and the master trainer, each from a background thread) into
``.step-<N>.partial/``, every file fsynced and digested *as it is written*; each writer then
leaves a record of its files there (``writer-<name>.json``). The master merges the records into
the manifest (nothing is read back), renames the directory into place and replaces the
``latest`` pointer beside it atomically last: a crash at any point leaves the previous
checkpoint intact and current.

A checkpoint is *full* or a *delta*: a delta's manifest names its ``base``, the checkpoint it
adds to (tables: only the rows changed since the base); restoring one reads its chain, the full
checkpoint first (:func:`checkpoint_chain`). Pruning keeps the chain of ``latest``.
Loading verifies every digest, then deserialises with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dlrm_core.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
BEST = "best"
"""Names the checkpoint of the best validation log loss (``train.keep_best``): pruning keeps it."""
RECORD_PREFIX = "writer-"
_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class DigestWriter:
    """A binary file that digests what is written to it (one pass: nothing is read back), and
    paces itself to ``bytes_per_s`` when given (a rate limit on background checkpoint writes)."""

    def __init__(self, f, bytes_per_s: float = 0.0) -> None:
        self.f = f
        self.hash = hashlib.blake2b(digest_size=32)
        self.bytes = 0
        self.bytes_per_s = bytes_per_s
        self._t0 = time.monotonic()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        n = self.f.write(view)
        self.bytes += len(view)
        if self.bytes_per_s:
            ahead = self.bytes / self.bytes_per_s - (time.monotonic() - self._t0)
            if ahead > 0:
                time.sleep(ahead)
        return n

    def flush(self) -> None:
        self.f.flush()


def _save_file(path: Path, obj: Any, bytes_per_s: float = 0.0) -> dict[str, Any]:
    with open(path, "wb") as f:
        out = DigestWriter(f, bytes_per_s)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"blake2b": out.hash.hexdigest(), "bytes": out.bytes}


def partial_dir(root: Path, step: int, fresh: bool = False) -> Path:
    """Where the files of checkpoint ``step`` are written before it is complete. Several
    processes (embedding servers, the master trainer) write into it; the name is deterministic so
    that each finds it without being told. The master starts it ``fresh`` (emptied) before the
    others write: leftovers of a crashed run must not join the new checkpoint."""
    path = Path(root) / f".step-{step:010d}.partial"
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_file(directory: Path, name: str, obj: Any, bytes_per_s: float = 0.0) -> dict[str, Any]:
    """Save one file of a checkpoint (fsynced, digested while written); returns its manifest
    entry."""
    try:
        return _save_file(Path(directory) / name, obj, bytes_per_s)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(
            f"cannot write checkpoint file {Path(directory) / name}: {exc}"
        ) from exc


def write_record(directory: Path, writer: str, record: dict[str, Any]) -> None:
    """A writer's account of its part of a partial checkpoint (its files and their digests, or
    its error), written atomically once its files are durable."""
    atomic_write_bytes(
        Path(directory) / f"{RECORD_PREFIX}{writer}.json", json.dumps(record).encode()
    )


def read_record(directory: Path, writer: str) -> dict[str, Any] | None:
    path = Path(directory) / f"{RECORD_PREFIX}{writer}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        return {"error": f"unreadable record {path.name}: {exc}"}


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def finalize_checkpoint(
    root: Path,
    step: int,
    meta: dict[str, Any],
    keep: int = 2,
    files: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Make the partial checkpoint ``step`` complete and current.

    ``files`` (name -> entry) are the writers' own digests; without them every file in the
    partial directory is digested here. ``extra`` adds manifest fields (``kind``, ``base``,
    ``writers``). Then the directory is renamed to ``step-<N>``, ``latest`` replaced, atomically,
    in that order, and old checkpoints pruned (:func:`prune`).
    """
    root = Path(root)
    tmp = root / f".step-{step:010d}.partial"
    final = root / step_name(step)
    try:
        if files is None:
            files = {
                p.name: {"blake2b": file_digest(p), "bytes": p.stat().st_size}
                for p in sorted(tmp.iterdir())
                if p.is_file() and p.name != MANIFEST and not p.name.startswith(RECORD_PREFIX)
            }
        manifest = {
            "format": 3,
            "step": step,
            "created": time.time(),
            "kind": "full",
            "base": None,
            **(extra or {}),
            "files": files,
            "meta": meta,
        }
        atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    atomic_write_bytes(root / LATEST, final.name.encode())
    prune(root, keep, final)
    return final


def checkpoint_chain(path: Path) -> list[Path]:
    """The checkpoints that ``path`` is made of, oldest first: a full one, then its deltas."""
    chain = [Path(path)]
    while (base := read_manifest(chain[0]).get("base")) is not None:
        prev = chain[0].parent / base
        if not (prev / MANIFEST).exists():
            raise CheckpointError(
                f"checkpoint {chain[0].name} is a delta of {base}, which is missing"
            )
        chain.insert(0, prev)
    return chain


def prune(root: Path, keep: int, latest: Path) -> None:
    """Delete the checkpoints no longer needed: all but the chain of ``latest`` and the newest
    ``keep - 1`` full checkpoints before it (deltas are compacted into the next full one), and
    partial directories older than ``latest`` (abandoned)."""
    root = Path(root)
    needed = {p.name for p in checkpoint_chain(latest)}
    if (best := _named_by(root, BEST)) is not None and (best / MANIFEST).exists():
        needed.update(p.name for p in checkpoint_chain(best))
    older_full = [
        p
        for p in sorted(root.glob("step-*"), reverse=True)
        if p.name < latest.name and p.name not in needed and _is_full(p)
    ]
    needed.update(p.name for p in older_full[: max(keep - 1, 0)])
    for old in root.glob("step-*"):
        if old.name not in needed and old.name < latest.name:
            shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob(".step-*.partial"):
        if partial.name[1:16] < latest.name:
            shutil.rmtree(partial, ignore_errors=True)


def _is_full(path: Path) -> bool:
    try:
        return read_manifest(path).get("base") is None
    except CheckpointError:
        return False


def write_checkpoint(
    root: Path, step: int, files: dict[str, Any], meta: dict[str, Any], keep: int = 2
) -> Path:
    """Write ``files`` (name -> tensors/dicts of tensors) as checkpoint ``root/step-<step>``.

    Args:
        root: the checkpoints directory (created if needed).
        step: the training step the state belongs to.
        files: file name (e.g. ``dense.pt``) -> object made of tensors, numbers, strings,
            lists and dicts (what ``weights_only`` loading accepts).
        meta: JSON-serialisable metadata stored in the manifest.
        keep: how many checkpoints to keep; older ones are deleted after the new one is current.

    Returns:
        The checkpoint directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(root, step, fresh=True)
    try:
        entries = {name: save_file(tmp, name, obj) for name, obj in files.items()}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finalize_checkpoint(root, step, meta, keep, files=entries)


def mark_best(root: Path, path: Path) -> None:
    """Name ``path`` the run's best checkpoint (kept by :func:`prune` from now on)."""
    atomic_write_bytes(Path(root) / BEST, Path(path).name.encode())


def make_latest(root: Path, path: Path) -> None:
    """Make the earlier checkpoint ``path`` the run's last: ``latest`` points to it (what a
    resume restores and ``dlrm publish`` publishes) and the checkpoints after it are removed."""
    root, path = Path(root), Path(path)
    read_manifest(path)  # it must be complete
    atomic_write_bytes(root / LATEST, path.name.encode())
    for later in root.glob("step-*"):
        if later.name > path.name:
            shutil.rmtree(later, ignore_errors=True)


def _named_by(root: Path, pointer: str) -> Path | None:
    """The checkpoint directory a pointer file (``latest``, ``best``) names; None without it."""
    file = Path(root) / pointer
    return Path(root) / file.read_text().strip() if file.exists() else None


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``root/latest`` points to, or None when there is no checkpoint."""
    path = _named_by(root, LATEST)
    if path is None:
        return None
    pointer = Path(root) / LATEST
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{pointer} points to {path.name}, which has no {MANIFEST}")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path / MANIFEST} is corrupt: {exc}") from None


def load_file(path: Path, name: str, verify: bool = True, mmap: bool = False) -> Any:
    """Load one file of a checkpoint after checking its digest; never runs pickled code."""
    path = Path(path)
    entry = read_manifest(path)["files"].get(name)
    if entry is None:
        raise CheckpointError(f"checkpoint {path} has no file {name}")
    file = path / name
    if not file.exists():
        raise CheckpointError(f"checkpoint file {file} is missing")
    if verify and file_digest(file) != entry["blake2b"]:
        raise CheckpointError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"cannot load {file}: {exc}") from None
