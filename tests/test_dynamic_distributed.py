"""Dynamic ids on embedding servers (real processes over Gloo): each server owns the id maps of
the tables it holds; a run equals the single process; a checkpoint of 2 servers restores every
admitted id, with its row, onto 3. A dynamic table split by rows routes its ids by hash, each
piece mapping its own, and serves what the run evaluated."""

import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dense_trainer.data.loader import BatchLoader
from dense_trainer.distributed import launch_local
from dense_trainer.train import Trainer
from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.kernels.optimizers import SparseOptimizerConfig
from embedding_server.planner import plan_sharding
from embedding_server.publish import publish_checkpoint
from embedding_server.shard import EmbeddingShard
from embedding_server.stores import open_store

from .conftest import tiny_config

pytestmark = pytest.mark.slow

DYNAMIC = {"ids": "dynamic", "hash_size": 400, "admit_after": 2}


def files(d):
    return [d / "train.txt"], [d / "test.txt"]


def admitted(shard) -> dict[str, dict[int, torch.Tensor]]:
    """Per dynamic table: id -> its row's weights."""
    weights = shard.table_weights()
    return {
        name: {int(i): weights[name][r] for i, r in zip(*pair, strict=True)}
        for name, pair in shard.id_maps.id_rows().items()
    }


def test_two_servers_two_trainers_match_one_process_with_dynamic_ids(synth_small, tmp_path):
    over = {
        "train": {
            "log_step_losses": True,
            "max_steps": 40,
            "batch_size": 256,
            "checkpoint_every_steps": 40,
        },
        "embedding": DYNAMIC,
    }
    single = Trainer(
        tiny_config(**over, data={"block_bytes": 1 << 16, "interleave": 2}), tmp_path / "single"
    ).fit(*files(synth_small))
    cfg = tiny_config(
        **over,
        data={"block_bytes": 1 << 16},
        dist={"embedding_servers": 2, "trainers": 2, "sharding": "table_wise"},
    )
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
        shard = EmbeddingShard(
            [p.local_table(spec.tables[p.table_index]) for p in plan2.pieces_on(s)],
            SparseOptimizerConfig(),
        )
        ckpt.load_into(shard)
        before.update(admitted(shard))
    after = {}
    plan3 = plan_sharding(spec, 3, "rowwise_adagrad", "table_wise")
    for s in range(3):
        shard = EmbeddingShard(
            [p.local_table(spec.tables[p.table_index]) for p in plan3.pieces_on(s)],
            SparseOptimizerConfig(),
            seed=99,
        )
        ckpt.load_into(shard)
        after.update(admitted(shard))
    assert set(after) == set(before) and len(after) == 26
    for table, ids in before.items():
        assert ids.keys() == after[table].keys() and len(ids) > 0
        for i, row in ids.items():
            assert torch.equal(after[table][i], row), (table, i)


def split_shards(spec, plan) -> list[EmbeddingShard]:
    return [
        EmbeddingShard(
            [p.local_table(spec.tables[p.table_index]) for p in plan.pieces_on(s)],
            SparseOptimizerConfig(),
        )
        for s in range(plan.num_servers)
    ]


def split_config(dist: dict | None = None, **train):
    return tiny_config(
        train={"max_steps": 40, "batch_size": 256, "checkpoint_every_steps": 40, **train},
        embedding=DYNAMIC,
        data={"block_bytes": 1 << 16},
        dist={"embedding_servers": 2, "trainers": 1, "sharding": "row_wise", **(dist or {})},
    )


@pytest.fixture(scope="module")
def split_run(synth_small, tmp_path_factory):
    """Dynamic tables split by rows over 2 servers: a 40-step run, and one stopped at 20 and
    resumed."""
    out = tmp_path_factory.mktemp("split")
    full = launch_local(split_config(), *files(synth_small), out / "full", resume=False)
    launch_local(
        split_config(max_steps=20, checkpoint_every_steps=20),
        *files(synth_small),
        out / "part",
        resume=False,
    )
    resumed = launch_local(split_config(), *files(synth_small), out / "part", resume=True)
    return out, full, resumed


def test_dynamic_tables_split_by_rows_route_ids_by_hash_and_resume_exactly(split_run):
    out, run, resumed = split_run
    assert run["test_auc"] > 0.6
    # Every piece maps the ids routed to it, within its own rows; the table's counts add up.
    spec = split_config().feature_spec()
    plan = plan_sharding(spec, 2, "rowwise_adagrad", "row_wise")
    ckpt = CheckpointTables(latest_checkpoint(out / "full" / "checkpoints"))
    used = {}
    for s, shard in enumerate(split_shards(spec, plan)):
        ckpt.load_into(shard)
        for name, (ids, rows) in shard.id_maps.id_rows().items():
            table = spec.tables[[t.name for t in spec.tables].index(name)]
            assert torch.equal(
                PieceLayout.of(table.rows, table.dynamic, 2).piece_of(ids), torch.full_like(ids, s)
            )
            assert rows.numel() == 0 or int(rows.max()) < 200
        for name, stats in shard.id_stats().items():
            used[name] = used.get(name, 0) + stats["rows_used"]
    assert used == run["embedding_rows_used"] and max(used.values()) == 400
    assert sum(run["embedding_ids_evicted"].values()) > 0
    # A run stopped and resumed (each server restoring its pieces' maps) is the uninterrupted one.
    for key in (
        "test_auc",
        "test_logloss",
        "embedding_rows_used",
        "embedding_ids_admitted",
        "embedding_ids_evicted",
    ):
        assert resumed[key] == run[key], key
    again = CheckpointTables(latest_checkpoint(out / "part" / "checkpoints"))
    for name in ("C1", "C13", "C26"):
        assert torch.equal(again.read(name, "weight", 0, 400), ckpt.read(name, "weight", 0, 400))
    # Resharded onto 3 servers and onto one (whole tables): each id moves to the piece its hash
    # routes it to now, with its row; shared index j keeps its row's values wherever it lands.
    shards = split_shards(spec, plan)
    before, shared = {}, {}
    for shard in shards:
        ckpt.load_into(shard)
        for name, rows in admitted(shard).items():
            before.setdefault(name, {}).update(rows)
    for s, shard in enumerate(shards):
        for name, w in shard.table_weights().items():
            _, _, first = PieceLayout.of(400, spec.tables[0].dynamic, 2).span(200 * s)
            shared.update({(name, first + j): w[j] for j in range(20)})  # S = 40: 20 a piece
    for n in (3, 1):
        after = {}
        for shard in split_shards(spec, plan_sharding(spec, n, "rowwise_adagrad", "row_wise")):
            shard.reset_parameters(99)  # nothing kept from a fresh shard's own start
            ckpt.load_into(shard)
            # a delta over this checkpoint rewrites them
            for i, local in enumerate(shard.local_tables):
                assert shard.touched.since(i, ckpt.last_step).numel() == local.spec.rows
            for name, rows in admitted(shard).items():
                after.setdefault(name, {}).update(rows)
            if n == 1:
                for name, w in shard.table_weights().items():
                    assert all(torch.equal(w[j], shared[(name, j)]) for j in range(40)), name
        for name, ids in before.items():
            assert after[name].keys() <= ids.keys() and len(after[name]) >= (
                0.9 if n == 3 else 1.0
            ) * len(ids)
            for i, row in after[name].items():
                assert torch.equal(row, ids[i]), (n, name, i)
    # only load_into moves ids
    with pytest.raises(CheckpointError, match="no piece of rows 0..134"):
        ckpt.id_map("C1", 0, 134)


def test_a_split_dynamic_run_resumes_on_three_servers(split_run, synth_small):
    """Resumed over 3 servers, the run trains on; its checkpoints hold the 3-way split and read
    back whole, onto one process as well."""
    out, _, _ = split_run
    shutil.copytree(out / "full" / "checkpoints", out / "three" / "checkpoints")
    cfg = split_config(dist={"embedding_servers": 3}, max_steps=60, checkpoint_every_steps=10)
    run = launch_local(cfg, *files(synth_small), out / "three", resume=True)
    assert (
        run["steps"] == 60
        and run["test_auc"] > 0.6
        and max(run["embedding_rows_used"].values()) <= 400
    )
    spec = cfg.feature_spec()
    ckpt = CheckpointTables(latest_checkpoint(out / "three" / "checkpoints"))
    assert ckpt.row_pieces("C1") == [(0, 134), (134, 134), (268, 132)]
    three, one = {}, {}
    for n, into in ((3, three), (1, one)):
        for shard in split_shards(spec, plan_sharding(spec, n, "rowwise_adagrad", "row_wise")):
            ckpt.load_into(shard)
            for name, rows in admitted(shard).items():
                into.setdefault(name, {}).update(rows)
    for name, ids in one.items():
        assert ids.keys() == three[name].keys()
        assert all(torch.equal(row, three[name][i]) for i, row in ids.items()), name


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_dynamic_tables_split_by_rows_serve_what_the_run_evaluated(
    split_run, synth_small, tmp_path, backend, request
):
    out, run, _ = split_run
    url = (
        f"{request.getfixturevalue('redis_server').url}?prefix=split{backend}"
        if backend == "redis"
        else f"file://{tmp_path / 'store'}"
    )
    store = open_store(url)
    meta = publish_checkpoint(out / "full", store, version="v1")
    assert meta.id_pieces == {t.name: 2 for t in split_config().feature_spec().tables}
    lines = (synth_small / "test.txt").read_bytes().splitlines(keepends=True)
    labels = np.array([int(line.split(b"\t", 1)[0]) for line in lines])
    predictions = []
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        for part in (lines[:2500], lines[2500:]):
            r = client.post(
                "/v1/models/dlrm:predict_tsv",
                content=b"".join(part),
                headers={"content-type": "text/plain"},
            )
            assert r.status_code == 200, r.text
            predictions += r.json()["predictions"]
    # Ids without a row read their shared row where the run's servers put it (P = 1's rule: 2.5e-4
    # off).
    p = np.clip(np.array(predictions, dtype=np.float64), 1e-7, 1 - 1e-7)
    served = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    assert abs(served - run["test_logloss"]) < 2e-5, (served, run["test_logloss"])
    # ... and what one process computes from the checkpoint (its ids moved onto whole tables).
    trainer = Trainer(split_config(dist={"embedding_servers": 0}), tmp_path / "offline")
    trainer.load_checkpoint(latest_checkpoint(out / "full" / "checkpoints"))
    logits = [
        trainer.predict(b) for b in BatchLoader([synth_small / "test.txt"], trainer.spec, 4096)
    ]
    np.testing.assert_allclose(predictions, torch.sigmoid(torch.cat(logits)).numpy(), atol=1e-5)
