"""Disaggregated training: embedding servers and trainers as real processes over Gloo."""

import numpy as np
import pytest
import torch

from dense_trainer.distributed import launch_local
from dense_trainer.train import Trainer
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.kernels.optimizers import SparseOptimizerConfig
from embedding_server.planner import plan_sharding
from embedding_server.shard import EmbeddingShard

from .conftest import tiny_config

pytestmark = pytest.mark.slow


def files(d):
    return [d / "train.txt"], [d / "test.txt"]


@pytest.mark.parametrize(
    "sharding, optimizer",
    [
        ("table_wise", "rowwise_adagrad"),
        ("row_wise", "rowwise_adagrad"),
        ("column_wise", "adagrad"),
    ],
)
def test_two_servers_two_trainers_match_one_process(sharding, optimizer, synth_small, tmp_path):
    """Each trainer parses its own blocks; one process reading the same way (interleave = 2)
    trains on the same global batches, and the losses match."""
    over = {
        "train": {"log_step_losses": True, "max_steps": 50, "batch_size": 256},
        "embedding": {"optimizer": {"kind": optimizer}},
    }
    single = Trainer(
        tiny_config(**over, data={"block_bytes": 1 << 16, "interleave": 2}), tmp_path / "single"
    ).fit(*files(synth_small))
    cfg = tiny_config(
        **over,
        data={"block_bytes": 1 << 16},
        dist={"embedding_servers": 2, "trainers": 2, "sharding": sharding},
    )
    distributed = launch_local(cfg, *files(synth_small), tmp_path / "dist", resume=False)
    a, b = np.array(single["step_losses"]), np.array(distributed["step_losses"])
    assert len(a) == len(b) == 50
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-4
    assert abs(single["test_auc"] - distributed["test_auc"]) < 0.002
    assert distributed["embedding_servers"] == 2 and distributed["trainers"] == 2
    traffic = distributed["alltoall_bytes_per_sample"]
    assert traffic["servers_to_trainers"] >= traffic["analytical_minimum"]["pooled"]
    assert set(distributed["step_time_breakdown_ms"]) >= {
        "embedding_forward",
        "dense_forward",
        "backward",
        "optimizer",
    }
    parsed = distributed["rows_parsed_by_trainer"]  # each trainer parsed its own blocks only
    assert len(parsed) == 2 and max(parsed) <= 0.55 * sum(parsed) and sum(parsed) >= 50 * 256


def test_pipelined_steps_equal_lockstep_bit_for_bit(synth_small, tmp_path):
    """``exact`` sends the next batch's ids during the current step, yet every loss and every
    table row equals the lockstep run's; ``semi-sync`` lookups run one update stale."""
    over = {"train": {"log_step_losses": True, "max_steps": 50, "batch_size": 256}}
    runs = {}
    for mode, chunks in (("off", 1), ("exact", 1), ("semi-sync", 1), ("exact", 3)):
        cfg = tiny_config(
            **over,
            dist={
                "embedding_servers": 2,
                "trainers": 2,
                "pipeline": mode,
                "exchange_chunks": chunks,
            },
        )
        name = mode if chunks == 1 else f"{mode}-{chunks}"
        runs[name] = launch_local(cfg, *files(synth_small), tmp_path / name, resume=False)
    assert runs["exact"]["step_losses"] == runs["off"]["step_losses"]
    assert runs["exact-3"]["step_losses"] == runs["off"]["step_losses"]  # chunks: the same maths
    traffic = {name: runs[name]["alltoall_bytes_per_sample"] for name in ("off", "exact")}
    for direction in ("trainers_to_servers", "servers_to_trainers"):
        assert traffic["exact"][direction] == traffic["off"][direction]
    # exact looks the next batch up before the update, then sends the bags it changed again
    assert traffic["off"]["corrections"] == 0 < traffic["exact"]["corrections"]
    assert 0 < runs["exact"]["corrected_bag_share"] < 1
    a = CheckpointTables(latest_checkpoint(tmp_path / "off" / "checkpoints"))
    b = CheckpointTables(latest_checkpoint(tmp_path / "exact" / "checkpoints"))
    for name in ["C1", "C3", "C26"]:
        assert torch.equal(a.read(name, "weight", 0, 20000), b.read(name, "weight", 0, 20000))
    assert runs["semi-sync"]["step_losses"] != runs["off"]["step_losses"]
    assert abs(runs["semi-sync"]["test_auc"] - runs["off"]["test_auc"]) < 0.02


def test_checkpoint_of_two_servers_restores_onto_one_and_three(synth_small, tmp_path):
    cfg = tiny_config(
        train={"max_steps": 20},
        dist={"embedding_servers": 2, "trainers": 1, "sharding": "row_wise"},
    )
    launch_local(cfg, *files(synth_small), tmp_path / "run", resume=False)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = CheckpointTables(ckpt)
    # one file per piece that trained rows, named after its writer: both servers wrote theirs
    assert {p.name.split(".")[0] for p in ckpt.glob("embeddings-server-*.pt")} == {
        "embeddings-server-0",
        "embeddings-server-1",
    }
    spec = cfg.feature_spec()
    for servers, strategy in [(1, "auto"), (3, "row_wise"), (3, "table_wise"), (2, "column_wise")]:
        plan = plan_sharding(spec, servers, "rowwise_adagrad", strategy)
        for s in range(servers):
            pieces = plan.pieces_on(s)
            shard = EmbeddingShard(
                [p.local_table(spec.tables[p.table_index]) for p in pieces],
                # other init: restore must overwrite it
                SparseOptimizerConfig(),
                seed=99,
            )
            saved.load_into(shard)
            weights = shard.table_weights()
            for p in pieces:
                full = saved.read(p.table, "weight", 0, spec.tables[p.table_index].rows)
                assert torch.equal(
                    weights[p.table],
                    full[p.row_start : p.row_start + p.rows, p.col_start : p.col_start + p.dim],
                )
    # and a real resume onto three servers trains on
    cfg3 = tiny_config(train={"max_steps": 30}, dist={"embedding_servers": 3, "trainers": 1})
    metrics = launch_local(cfg3, *files(synth_small), tmp_path / "run", resume=True)
    assert metrics["steps"] == 30


def test_interrupted_distributed_run_resumes_exactly(synth_small, tmp_path):
    dist_cfg = {"embedding_servers": 2, "trainers": 2}
    full = launch_local(
        tiny_config(dist=dist_cfg), *files(synth_small), tmp_path / "a", resume=False
    )
    launch_local(
        tiny_config(dist=dist_cfg, train={"max_steps": 15}),
        *files(synth_small),
        tmp_path / "b",
        resume=False,
    )
    resumed = launch_local(
        tiny_config(dist=dist_cfg), *files(synth_small), tmp_path / "b", resume=True
    )
    assert resumed["samples_seen"] == full["samples_seen"] == 20_000
    assert resumed["test_auc"] == full["test_auc"]
    a = CheckpointTables(latest_checkpoint(tmp_path / "a" / "checkpoints"))
    b = CheckpointTables(latest_checkpoint(tmp_path / "b" / "checkpoints"))
    for name in ["C1", "C13", "C26"]:
        assert torch.equal(a.read(name, "weight", 0, 20000), b.read(name, "weight", 0, 20000))
