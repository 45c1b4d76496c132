"""End-to-end training runs on generated and real data (tiny config, seconds each)."""

import json
import time

import pytest
import torch

from dense_trainer.train import Trainer
from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint.files import latest_checkpoint

from .conftest import tiny_config

pytestmark = pytest.mark.slow


def test_tiny_run_learns_fast(synth_medium, tmp_path):
    t0 = time.perf_counter()
    trainer = Trainer(tiny_config(), tmp_path / "run")
    metrics = trainer.fit([synth_medium / "train.txt"], [synth_medium / "test.txt"])
    elapsed = time.perf_counter() - t0
    assert metrics["test_auc"] > 0.70, metrics["test_auc"]
    assert elapsed < 30, f"tiny run took {elapsed:.1f}s"
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in [
        "test_auc",
        "test_logloss",
        "train_samples_per_s",
        "samples_seen",
        "epochs",
        "config",
    ]:
        assert key in written
    assert written["samples_seen"] == 100_000 and written["epochs"] == 1
    assert written["bayes_auc"] > written["test_auc"]
    assert written["embedding_kernel"] == "fbgemm"
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"emb.{k}": v.clone() for k, v in trainer.client.export_state().items() if k != "step"}
    out.update({f"dense.{k}": v.clone() for k, v in trainer.model.state_dict().items()})
    return out


@pytest.mark.parametrize("sparse_opt", ["rowwise_adagrad", "adam"])
def test_interrupted_and_resumed_run_matches_uninterrupted(synth_small, tmp_path, sparse_opt):
    files = ([synth_small / "train.txt"], [synth_small / "test.txt"])
    over = {
        "train": {"epochs": 2, "batch_size": 1024, "checkpoint_every_steps": 7},
        "embedding": {"optimizer": {"kind": sparse_opt}},
    }
    losses_a: list[float] = []
    a = Trainer(tiny_config(**over), tmp_path / "a")
    metrics_a = a.fit(*files, on_step=lambda step, loss: losses_a.append(loss))

    # Stop after 25 steps (mid epoch 2: 20 steps per epoch), then resume in a fresh trainer.
    stop = {**over, "train": {**over["train"], "max_steps": 25}}
    losses_b: list[float] = []
    b1 = Trainer(tiny_config(**stop), tmp_path / "b")
    b1.fit(*files, on_step=lambda step, loss: losses_b.append(loss))
    assert b1.state.step == 25
    b2 = Trainer(tiny_config(**over), tmp_path / "b")
    metrics_b = b2.fit(*files, resume=True, on_step=lambda step, loss: losses_b.append(loss))

    assert losses_b == losses_a  # bit-identical per-step losses
    sa, sb = state_of(a), state_of(b2)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert metrics_b["test_auc"] == metrics_a["test_auc"]
    assert metrics_b["samples_seen"] == metrics_a["samples_seen"] == 40_000


def test_real_criteo_sample(criteo_sample, tmp_path):
    trainer = Trainer(tiny_config(train={"batch_size": 256}), tmp_path / "real")
    metrics = trainer.fit([criteo_sample / "train.txt"], [criteo_sample / "test.txt"])
    assert metrics["samples_seen"] == 8000 and metrics["test_rows"] == 2000
    assert 0.65 < metrics["test_auc"] < 0.85
    assert (tmp_path / "real" / "curves.png").exists()


def test_lr_baseline_runs(synth_small, tmp_path):
    trainer = Trainer(tiny_config(model={"kind": "lr"}), tmp_path / "lr")
    metrics = trainer.fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    assert metrics["embedding_kernel"] == "torch"  # dim-1 tables: fbgemm needs multiples of 4
    assert metrics["test_auc"] > 0.6


def test_checkpoint_written_before_a_spec_field_existed_resumes(synth_small, tmp_path):
    """A checkpoint whose feature spec predates a field (here a table's ``dynamic``) is read with
    that field's default, and resumes; a real difference is still refused."""
    files = ([synth_small / "train.txt"], [synth_small / "test.txt"])
    cfg = tiny_config(train={"batch_size": 1024, "max_steps": 4})
    Trainer(cfg, tmp_path / "run").fit(*files)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    manifest = json.loads((path / "manifest.json").read_text())
    for table in manifest["meta"]["feature_spec"]["tables"]:
        table.pop("dynamic", None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    resumed = Trainer(tiny_config(train={"batch_size": 1024, "max_steps": 6}), tmp_path / "run")
    assert resumed.fit(*files, resume=True)["steps"] == 6
    other = Trainer(
        tiny_config(train={"batch_size": 1024}, embedding={"hash_size": 1234}), tmp_path / "run"
    )
    with pytest.raises(CheckpointError, match="feature_spec differs"):
        other.fit(*files, resume=True)


def test_a_checkpoint_of_another_optimizer_names_the_setting_that_resumes(synth_small, tmp_path):
    """A run checkpointed under row-wise Adagrad (the default before per-element) is refused by
    the new default, naming the flag that resumes it; that flag does."""
    files = ([synth_small / "train.txt"], [synth_small / "test.txt"])
    rowwise = {"optimizer": {"kind": "rowwise_adagrad"}}
    cfg = tiny_config(train={"batch_size": 1024, "max_steps": 4}, embedding=rowwise)
    Trainer(cfg, tmp_path / "run").fit(*files)
    now = Trainer(tiny_config(train={"batch_size": 1024, "max_steps": 6}), tmp_path / "run")
    hint = r"sparse_optimizer differs .*; resume with --set embedding\.optimizer\.kind="
    hint += "rowwise_adagrad"
    with pytest.raises(CheckpointError, match=hint):
        now.fit(*files, resume=True)
    again = tiny_config(train={"batch_size": 1024, "max_steps": 6}, embedding=rowwise)
    assert Trainer(again, tmp_path / "run").fit(*files, resume=True)["steps"] == 6
