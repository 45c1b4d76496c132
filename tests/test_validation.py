"""The validation split, early stopping and the best model (issue 35, items 1 and 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dense_trainer.best_model as best_model
from dense_trainer.data.loader import BatchLoader
from dense_trainer.data.split import RowSplit
from dense_trainer.distributed import launch_local
from dense_trainer.evaluation import HeldOut, evaluate
from dense_trainer.train import Trainer
from dlrm_core.formats import InputReader
from embedding_server.checkpoint.files import latest_checkpoint, step_name

from .conftest import tiny_config


def test_a_split_is_the_same_whatever_the_grid_the_trainers_and_the_run(synth_small):
    files, spec = [synth_small / "train.txt"], tiny_config().feature_spec()
    held = RowSplit(0.1, "validation")

    def lines(split, **kw):
        return list(BatchLoader(files, spec, 997, num_workers=1, split=split, **kw))

    valid = lines(held)
    n_valid = sum(b.batch_size for b in valid)
    n_train = sum(b.batch_size for b in lines(RowSplit(0.1, "train")))
    assert n_valid + n_train == 20_000 and 1_700 < n_valid < 2_300  # about a tenth

    def keys(batches) -> set[tuple]:
        return {
            tuple(r) for b in batches for r in np.c_[b.labels.numpy(), b.dense.numpy()].tolist()
        }

    same = keys(lines(held, block_bytes=1 << 13))  # another block grid
    parts = keys(lines(held, parts=2, part=0)) | keys(lines(held, parts=2, part=1))  # 2 trainers
    assert keys(valid) == same == parts
    assert not keys(valid) & keys(lines(RowSplit(0.1, "train")))  # never trained on


def test_validation_rows_report_no_bad_line_twice(tmp_path, synth_small):
    text = (synth_small / "train.txt").read_text().splitlines()[:3000]
    text[10] = "not\ta\trow"
    (tmp_path / "t.txt").write_text("\n".join(text) + "\n")
    spec = tiny_config().feature_spec()
    counts = {}
    for side in ("train", "validation"):
        loader = BatchLoader([tmp_path / "t.txt"], spec, 500, split=RowSplit(0.2, side))
        list(loader)
        counts[side] = loader.bad_lines.state().get("count", 0)
    assert counts == {"train": 1, "validation": 0}


def _overfitting(**train):
    """A model that overfits the 20k rows within an epoch or two (large embedding steps)."""
    return tiny_config(
        train={
            "batch_size": 256,
            "epochs": 6,
            "eval_every_steps": 0,
            "validation": 0.1,
            "patience": 1,
            "checkpoint_every_steps": 0,
            **train,
        },
        embedding={"dim": 16, "optimizer": {"lr": 1.0}},
    )


def test_early_stopping_keeps_the_best_model_and_publishes_it(tmp_path, synth_small, monkeypatch):
    events = []  # the order in which validation evaluations and test-file parses happen
    real_eval, real_parse = best_model.evaluate_into_history, InputReader.parse

    def eval_(trainer, held, final):
        events.append(("eval", held.name))
        return real_eval(trainer, held, final)

    def parse(self, raw):
        events.append(("parse", self.files[raw.file_index].name))
        return real_parse(self, raw)

    monkeypatch.setattr(best_model, "evaluate_into_history", eval_)
    monkeypatch.setattr(InputReader, "parse", parse)
    test = synth_small / "test.txt"
    trainer = Trainer(_overfitting(), tmp_path / "run")
    m = trainer.fit([synth_small / "train.txt"], [test])
    v = m["validation"]
    evals = [h for h in m["history"] if "valid_logloss" in h]
    best = min(evals, key=lambda h: h["valid_logloss"])
    assert v["stopped_early_at_step"] is not None and len(evals) < 6  # it stopped early
    assert v["kept_step"] == best["step"] < m["steps"]  # and kept the best, not the last
    assert m["valid_logloss"] == best["valid_logloss"]
    # No test row is read before the last validation evaluation; the test set is read once.
    test_parses = [i for i, e in enumerate(events) if e == ("parse", test.name)]
    last_eval = max(i for i, e in enumerate(events) if e == ("eval", "valid"))
    assert test_parses and min(test_parses) > last_eval
    # The best checkpoint is the run's last (what dlrm publish publishes), and it scores the
    # test set as the run reported.
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == step_name(best["step"])
    assert not [p for p in latest.parent.glob("step-*") if p.name > latest.name]
    fresh = Trainer(_overfitting(), tmp_path / "check")
    fresh.load_checkpoint(latest)
    again = evaluate(fresh, HeldOut("test", [test]))
    assert abs(again["test_auc"] - m["test_auc"]) < 1e-6
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["test_auc"] == m["test_auc"] and saved["validation"]["kept_step"] == best["step"]


def test_more_epochs_never_end_worse_than_fewer(tmp_path, synth_small):
    files = [synth_small / "train.txt"], [synth_small / "test.txt"]
    one = Trainer(_overfitting(epochs=1), tmp_path / "one").fit(*files)
    many = Trainer(_overfitting(patience=0), tmp_path / "many").fit(*files)  # all 6 epochs
    assert many["valid_logloss"] <= one["valid_logloss"]
    assert many["test_auc"] >= one["test_auc"] - 0.002


def test_without_keep_best_the_last_model_is_kept(tmp_path, synth_small):
    cfg = _overfitting(keep_best=False, patience=0, epochs=3)
    m = Trainer(cfg, tmp_path / "run").fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    assert m["validation"]["kept_step"] == m["steps"]
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == step_name(m["steps"])


@pytest.mark.slow
def test_servers_restore_the_best_model_at_the_end(tmp_path, synth_small):
    """Embedding servers and two trainers: the same stop, the same best model brought back
    from the servers (the RESTORE command), the same test figures as one process."""
    over = {"data": {"block_bytes": 1 << 16}}
    files = [synth_small / "train.txt"], [synth_small / "test.txt"]
    cfg = _overfitting(**{"epochs": 4})
    single = Trainer(
        cfg.model_copy(
            update={"data": cfg.data.model_copy(update={"interleave": 2, **over["data"]})}
        ),
        tmp_path / "single",
    ).fit(*files)
    dist_cfg = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update=over["data"]),
            "dist": cfg.dist.model_copy(update={"embedding_servers": 2, "trainers": 2}),
        }
    )
    m = launch_local(dist_cfg, *files, tmp_path / "dist", resume=False)
    assert m["validation"]["kept_step"] == single["validation"]["kept_step"] < m["steps"]
    assert abs(m["test_auc"] - single["test_auc"]) < 2e-3
    latest = latest_checkpoint(tmp_path / "dist" / "checkpoints")
    assert latest.name == step_name(m["validation"]["kept_step"])
    fresh = Trainer(cfg, tmp_path / "check")
    fresh.load_checkpoint(latest)  # written by two servers, read by one process
    again = evaluate(fresh, HeldOut("test", files[1]))
    assert abs(again["test_auc"] - m["test_auc"]) < 1e-4
