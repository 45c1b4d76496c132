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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session (tests use distinct key prefixes)."""
    from .redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop(save=False)


@pytest.fixture(scope="session")
def trained_criteo(tmp_path_factory, criteo_sample) -> Path:
    """A tiny model trained on the real Criteo sample: its `dlrm train --out` directory."""
    from dense_trainer.train import Trainer

    out = tmp_path_factory.mktemp("trained_criteo")
    Trainer(tiny_config(train={"batch_size": 128}), out).fit(
        [criteo_sample / "train.txt"], [criteo_sample / "test.txt"]
    )
    return out


def tiny_config(**overrides) -> Config:
    """configs/tiny.toml with nested-dict overrides; no progress bar, 1 parse worker, and no
    validation split (the tests count every row; tests/test_validation.py turns it on)."""
    base = [{"train": {"progress": False, "validation": 0.0}, "data": {"num_workers": 1}}]
    return load_config(REPO / "configs" / "tiny.toml", base + [overrides] if overrides else base)
