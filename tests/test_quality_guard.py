"""The quality guard (issue 35, item 8): on a small generated table of a kind the defaults were
not tuned on, the default DLRM (the schema from ``dlrm data schema``, no other setting) beats our
logistic regression by a margin, and more epochs do not end worse.

MARGIN was measured (``python -m pytest tests/test_quality_guard.py -s`` prints the figures): on
2026-12-07, with per-element Adagrad on the rows, the default (3 epochs, the best kept) scored
test AUC 0.6970, one epoch 0.6925, the logistic regression 0.6879 (row-wise Adagrad, tables of
5x their values: 0.6911, 0.6881; at 2x rows: 0.6933, 0.6876, 0.6864; before the first-order
weights: 0.6904, 0.6832; before the wide part: 0.6888, 0.6803); the guard asks for about half of
the default's lead, so that noise does not fail it and a default that learns no better than the
baseline does. (On this 40k-row table 5x rows lowered the default by 0.0022; on the 100k-row
tables of bench/defaults.py they raised it.)
"""

from __future__ import annotations

import pytest

from dense_trainer.config import load_config
from dense_trainer.data.synth_table import synthesize_table
from dense_trainer.train import Trainer
from dlrm_core.schema_inference import infer_schema

MARGIN = 0.0045
QUIET = {"train": {"progress": False, "checkpoint_every_steps": 0}, "data": {"num_workers": 1}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard")
    synthesize_table(out, train_rows=40_000, test_rows=10_000, seed=11, format="csv", zipf=1.0)
    schema = out / "inferred.toml"
    schema.write_text(infer_schema([out / "train.csv"], "click").to_toml("dlrm data schema"))
    return out


def _fit(table, tmp_path, name, **over):
    cfg = load_config(table / "inferred.toml", [QUIET, over])
    return Trainer(cfg, tmp_path / name).fit([table / "train.csv"], [table / "test.csv"])


@pytest.mark.slow
def test_the_default_beats_the_logistic_regression_and_more_epochs_do_not_hurt(table, tmp_path):
    lr = _fit(table, tmp_path, "lr", model={"kind": "lr"}, train={"epochs": 5})
    one = _fit(table, tmp_path, "one", train={"epochs": 1})
    three = _fit(table, tmp_path, "three", train={"epochs": 3})
    print(
        f"lr {lr['test_auc']:.4f}, default 1 epoch {one['test_auc']:.4f}, "
        f"3 epochs {three['test_auc']:.4f}"
    )
    assert three["test_auc"] >= lr["test_auc"] + MARGIN
    assert three["valid_logloss"] <= one["valid_logloss"] + 1e-9
    assert three["test_auc"] >= one["test_auc"] - 0.002
