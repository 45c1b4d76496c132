"""Dynamic ids on embedding servers (real processes over Gloo): each server owns the id maps of
the tables it holds; a run equals the single process; a checkpoint of 2 servers restores every
admitted id, with its row, onto 3."""

import numpy as np
import pytest
import torch

from dense_trainer.distributed import launch_local
from dense_trainer.train import Trainer
from dlrm_core.errors import ConfigError
from embedding_server.checkpoint import latest_checkpoint
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.planner import plan_sharding
from embedding_server.shard import EmbeddingShard
from embedding_server.table_checkpoint import CheckpointTables

from .conftest import tiny_config

pytestmark = pytest.mark.slow

DYNAMIC = {"ids": "dynamic", "hash_size": 400, "admit_after": 2}


def files(d):
    return [d / "train.txt"], [d / "test.txt"]


def admitted(shard) -> dict[str, dict[int, torch.Tensor]]:
    """Per dynamic table: id -> its row's weights."""
    weights = shard.table_weights()
    return {name: {int(i): weights[name][r] for i, r in zip(*pair, strict=True)}
            for name, pair in shard.id_maps.id_rows().items()}


def test_two_servers_two_trainers_match_one_process_with_dynamic_ids(synth_small, tmp_path):
    over = {"train": {"log_step_losses": True, "max_steps": 40, "batch_size": 256, "checkpoint_every_steps": 40},
            "embedding": DYNAMIC}
    single = Trainer(tiny_config(**over, data={"block_bytes": 1 << 16, "interleave": 2}),
                     tmp_path / "single").fit(*files(synth_small))
    cfg = tiny_config(**over, data={"block_bytes": 1 << 16},
                      dist={"embedding_servers": 2, "trainers": 2, "sharding": "table_wise"})
    distributed = launch_local(cfg, *files(synth_small), tmp_path / "dist", resume=False)
    a, b = np.array(single["step_losses"]), np.array(distributed["step_losses"])
    assert len(a) == len(b) == 40
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-4
    # The servers' maps made the same decisions as the single process's.
    for key in ("embedding_rows_used", "embedding_ids_admitted", "embedding_ids_evicted"):
        assert distributed[key] == single[key], key
    assert max(single["embedding_ids_evicted"].values()) > 0

    # Resharding: the 2-server checkpoint onto 3 servers; every admitted id keeps its row values.
    ckpt = CheckpointTables(latest_checkpoint(tmp_path / "dist" / "checkpoints"))
    spec = cfg.feature_spec()
    before = {}
    plan2 = plan_sharding(spec, 2, "rowwise_adagrad", "table_wise")
    for s in range(2):
        shard = EmbeddingShard([p.local_table(spec.tables[p.table_index]) for p in plan2.pieces_on(s)],
                               SparseOptimizerConfig())
        ckpt.load_into(shard)
        before.update(admitted(shard))
    after = {}
    plan3 = plan_sharding(spec, 3, "rowwise_adagrad", "table_wise")
    for s in range(3):
        shard = EmbeddingShard([p.local_table(spec.tables[p.table_index]) for p in plan3.pieces_on(s)],
                               SparseOptimizerConfig(), seed=99)
        ckpt.load_into(shard)
        after.update(admitted(shard))
    assert set(after) == set(before) and len(after) == 26
    for table, ids in before.items():
        assert ids.keys() == after[table].keys() and len(ids) > 0
        for i, row in ids.items():
            assert torch.equal(after[table][i], row), (table, i)


def test_dynamic_tables_refuse_row_wise_placement():
    spec = tiny_config(embedding=DYNAMIC).feature_spec()
    with pytest.raises(ConfigError, match="dynamic ids and cannot be split row-wise"):
        plan_sharding(spec, 2, "rowwise_adagrad", "row_wise")
