"""The learning-rate schedule ([schedule], dense_trainer/lr_schedule.py): its factors, and that
it reaches both optimizers, in one process and on embedding servers (where the factor travels
with each step's training lookup, also when that lookup was sent a step ahead)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dense_trainer.distributed import launch_local
from dense_trainer.lr_schedule import ScheduleConfig, lr_factor
from dense_trainer.train import Trainer
from dlrm_core.errors import ConfigError
from embedding_server.wire import lr_arg, lr_of

from .conftest import tiny_config


def files(d):
    return [d / "train.txt"], [d / "test.txt"]


def test_factors():
    warm = ScheduleConfig(warmup_steps=4)
    assert [lr_factor(warm, s, 0) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    lin = ScheduleConfig(decay="linear", decay_start_step=10, decay_steps=10, min_factor=0.1)
    assert lr_factor(lin, 5, 0) == 1.0 and lr_factor(lin, 10, 0) == 1.0
    assert math.isclose(lr_factor(lin, 15, 0), 0.55) and lr_factor(lin, 99, 3) == 0.1
    cos = ScheduleConfig(decay="cosine", decay_steps=100)
    assert math.isclose(lr_factor(cos, 50, 0), 0.5) and math.isclose(lr_factor(cos, 100, 0), 0.0)
    per_epoch = ScheduleConfig(decay="epoch", epoch_gamma=0.5, min_factor=0.2, warmup_steps=2)
    assert [lr_factor(per_epoch, 50, e) for e in (0, 1, 2, 3)] == [1.0, 0.5, 0.25, 0.2]
    assert lr_factor(per_epoch, 1, 0) == 0.5
    assert ScheduleConfig().constant and not warm.constant


def test_the_wire_carries_the_factor():
    for f in (1.0, 0.0, 0.125, 0.37, 2.5):
        assert abs(lr_of(lr_arg(f)) - f) < 1e-6
    assert lr_arg(1.0) == 0  # what every other sender of a training lookup sends


def test_a_decay_without_its_length_is_a_config_error():
    with pytest.raises(ConfigError, match="decay_steps"):
        tiny_config(schedule={"decay": "linear"})


@pytest.mark.parametrize("kind", ["dlrm", "lr"])  # fbgemm's kernel; the PyTorch one (dim 1)
def test_a_zero_rate_leaves_both_sides_untouched(kind, synth_small, tmp_path):
    zero = {"decay": "linear", "decay_steps": 1, "min_factor": 0.0}
    cfg = tiny_config(model={"kind": kind}, schedule=zero, train={"max_steps": 12})
    trainer = Trainer(cfg, tmp_path / kind)
    dense = {k: v.clone() for k, v in trainer.net.state_dict().items()}
    tables = {k: v.clone() for k, v in trainer.client.shard.table_weights().items()}
    trainer.fit(*files(synth_small))
    assert trainer.state.step == 12
    for k, v in trainer.net.state_dict().items():
        assert torch.equal(v, dense[k]), k
    for k, v in trainer.client.shard.table_weights().items():
        assert torch.equal(v, tables[k]), k


def test_a_schedule_changes_training(synth_small, tmp_path):
    over = {"train": {"log_step_losses": True, "max_steps": 30, "batch_size": 256}}
    flat = Trainer(tiny_config(**over), tmp_path / "flat").fit(*files(synth_small))
    warm = Trainer(tiny_config(**over, schedule={"warmup_steps": 20}), tmp_path / "warm").fit(
        *files(synth_small)
    )
    assert flat["step_losses"][0] == warm["step_losses"][0]  # the first step's forward
    assert flat["step_losses"][1:] != warm["step_losses"][1:]


@pytest.mark.slow
def test_servers_apply_each_steps_rate(synth_small, tmp_path):
    """Two servers and two trainers, pipelined (the next step's ids, and its factor, sent during
    this step): the same losses as one process with the same schedule."""
    over = {
        "train": {"log_step_losses": True, "max_steps": 40, "batch_size": 256},
        "schedule": {"warmup_steps": 10, "decay": "linear", "decay_start_step": 20,
                     "decay_steps": 20},
    }  # fmt: skip
    single = Trainer(
        tiny_config(**over, data={"block_bytes": 1 << 16, "interleave": 2}), tmp_path / "one"
    ).fit(*files(synth_small))
    cfg = tiny_config(
        **over,
        data={"block_bytes": 1 << 16},
        dist={"embedding_servers": 2, "trainers": 2, "pipeline": "exact"},
    )
    dist = launch_local(cfg, *files(synth_small), tmp_path / "dist", resume=False)
    a, b = np.array(single["step_losses"]), np.array(dist["step_losses"])
    assert len(a) == len(b) == 40
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-4
