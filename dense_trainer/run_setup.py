"""Where a training run goes: the device it computes on and the directory it writes (both checked
before anything is read, so a wrong flag fails at once, naming it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dlrm_core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available")
    return torch.device(name)


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and check that it is writable, or fail naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: not writable ({exc.strerror or exc})") from None
