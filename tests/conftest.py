"""Shared fixtures: small generated data sets, the real Criteo sample, config helpers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dense_trainer.config import Config, load_config
from dense_trainer.data.synth import synthesize

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
CRITEO_SAMPLE = SHARED_DATA / "criteo-wideresdnn"


@pytest.fixture(autouse=True)
def _quiet_fbgemm():
    # fbgemm logs every TBE's argument list at INFO on the root logger.
    logging.getLogger().setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def synth_small(tmp_path_factory) -> Path:
    """20k train / 5k test rows from the planted teacher (seed 0)."""
    out = tmp_path_factory.mktemp("synth_small")
    synthesize(out, train_rows=20_000, test_rows=5_000, seed=0)
    return out


@pytest.fixture(scope="session")
def synth_medium(tmp_path_factory) -> Path:
    """100k train / 10k test rows from the planted teacher (seed 1)."""
    out = tmp_path_factory.mktemp("synth_medium")
    synthesize(out, train_rows=100_000, test_rows=10_000, seed=1)
    return out


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    if not (CRITEO_SAMPLE / "train.txt").exists():
        pytest.skip(f"real Criteo sample not found at {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE


def tiny_config(**overrides) -> Config:
    """configs/tiny.toml with nested-dict overrides; no progress bar, 1 parse worker."""
    base = [{"train": {"progress": False}, "data": {"num_workers": 1}}]
    return load_config(REPO / "configs" / "tiny.toml", base + [overrides] if overrides else base)
