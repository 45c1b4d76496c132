"""``dlrm tune`` (issue 35, item 5): a search on the validation rows that never reads a test
file, whose best config reproduces the best trial."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from dense_trainer.config import load_config
from dense_trainer.train import Trainer

from .conftest import REPO

pytest.importorskip("optuna")
pytestmark = pytest.mark.slow


def tune(data, out, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``dlrm tune`` of configs/tiny.toml on ``data``'s training file into ``out``."""
    cmd = [
        sys.executable,
        str(REPO / "dlrm_cli.py"),
        "tune",
        "--config",
        "configs/tiny.toml",
        "--train",
        str(data / "train.txt"),
        "--out",
        str(out),
        *flags,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_tune_writes_a_best_config_that_reproduces_its_trial(synth_small, tmp_path):
    out = tmp_path / "tune"
    limits = ["--set", "train.max_steps=30", "--set", "train.eval_every_steps=10"]
    done = tune(synth_small, out, "--trials", "3", *limits)
    assert done.returncode == 0, done.stderr[-3000:]
    progress = [line for line in done.stdout.splitlines() if line.startswith("trial ")]
    assert len(progress) == 3 and all("valid AUC" in line for line in progress)
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and {"embedding_lr", "batch_size", "interaction"} <= set(rows[0])
    best = json.loads((out / "best.json").read_text())
    complete = [r for r in rows if r["state"] == "complete"]
    assert best["valid_logloss"] == min(float(r["valid_logloss"]) for r in complete)
    # dlrm train --config best.toml: the same validation figures as the best trial
    cfg = load_config(out / "best.toml")
    assert cfg.train.batch_size == best["batch_size"] and not cfg.train.progress
    again = Trainer(cfg, tmp_path / "again").fit([synth_small / "train.txt"], [])
    assert again["valid_logloss"] == pytest.approx(best["valid_logloss"], abs=1e-6)
    assert again["test_auc"] is None  # no test file was given, none was read


def test_tune_refuses_a_run_without_validation_rows(synth_small, tmp_path):
    done = tune(synth_small, tmp_path / "t", "--set", "train.validation=0", timeout=120)
    assert done.returncode != 0 and "validation" in done.stderr
    assert "Traceback" not in done.stderr
