"""Checkpoint files: atomic, checksummed, and loaded without executing pickled code.

A checkpoint is a directory ``step-<N>/`` of tensor files plus ``manifest.json`` (each file's
BLAKE2b digest and size, the step, free-form metadata). Its files are written (by one process,
or by every embedding server and the master trainer) into ``.step-<N>.partial/``, every file
fsynced; then the manifest is written, the directory renamed into place, and the ``latest``
pointer beside it replaced atomically last: a crash at any point leaves the previous checkpoint
intact and current.
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


def _save_file(path: Path, obj: Any) -> dict[str, Any]:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"blake2b": file_digest(path), "bytes": path.stat().st_size}


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


def save_file(directory: Path, name: str, obj: Any) -> dict[str, Any]:
    """Save one file of a checkpoint (fsynced); returns its manifest entry."""
    try:
        return _save_file(Path(directory) / name, obj)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot write checkpoint file {Path(directory) / name}: {exc}") from exc


def finalize_checkpoint(root: Path, step: int, meta: dict[str, Any], keep: int = 2) -> Path:
    """Make the partial checkpoint ``step`` complete and current.

    Every file already in the partial directory is digested into ``manifest.json``; then the
    directory is renamed to ``step-<N>`` and ``latest`` replaced, atomically, in that order.
    """
    root = Path(root)
    tmp = root / f".step-{step:010d}.partial"
    final = root / f"step-{step:010d}"
    try:
        files = {
            p.name: {"blake2b": file_digest(p), "bytes": p.stat().st_size}
            for p in sorted(tmp.iterdir())
            if p.is_file() and p.name != MANIFEST
        }
        manifest = {"format": 2, "step": step, "created": time.time(), "files": files, "meta": meta}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        with open(tmp / MANIFEST, "rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    atomic_write_bytes(root / LATEST, final.name.encode())
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
    tmp = partial_dir(root, step)
    try:
        for name, obj in files.items():
            save_file(tmp, name, obj)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finalize_checkpoint(root, step, meta, keep)


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``root/latest`` points to, or None when there is no checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
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
