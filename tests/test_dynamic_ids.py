"""Dynamic ids end to end: config, featurising (raw ids), the shard's remapping around the fused
kernel (training admits, evaluation reads, reused rows reset), training, metrics and exact
resume."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from dense_trainer.train import Trainer
from dlrm_core.batch import SparseFeatures
from dlrm_core.featurize import LABEL, Featurizer
from dlrm_core.schema import DynamicIds, TableSpec
from embedding_server.idmap.dynamic import shared_rows_of
from embedding_server.idmap.remap import init_for_ids
from embedding_server.kernels.optimizers import SparseOptimizerConfig
from embedding_server.local_table import LocalTable
from embedding_server.shard import EmbeddingShard

from .conftest import tiny_config


def test_config_switches_every_table_and_overrides_per_table():
    spec = tiny_config(
        embedding={
            "ids": "dynamic",
            "admit_after": 3,
            "hash_size": 500,
            "tables": [{"name": "C2", "ids": "hashed"}, {"name": "C3", "evict": "lfu"}],
        }
    ).feature_spec()
    by_name = {t.name: t for t in spec.tables}
    assert by_name["C1"].dynamic == DynamicIds(
        admit_after=3, evict="lru", shared_rows=0.1, start_from_shared=True
    )
    assert by_name["C2"].dynamic is None and by_name["C2"].ids == "hashed"
    assert by_name["C3"].dynamic.evict == "lfu" and by_name["C3"].rows == 500  # capacity = rows
    assert all(t.dynamic is None for t in tiny_config().feature_spec().tables)  # default: hashed


def test_featurizer_gives_dynamic_tables_raw_ids():
    hashed = tiny_config(embedding={"hash_size": 1000}).feature_spec()
    dynamic = tiny_config(embedding={"hash_size": 1000, "ids": "dynamic"}).feature_spec()
    cols = {LABEL: pa.array(["1", "0"])}
    cols.update({n: pa.array(["1", "2"]) for n in hashed.dense_names})
    cols.update({n: pa.array(["ffffffffffffffff", "3039"]) for n in hashed.sparse_names})
    lines = np.arange(1, 3)
    rows = Featurizer(hashed)(cols, 2, lines, "x").ids
    raw = Featurizer(dynamic)(cols, 2, lines, "x").ids
    assert rows[0].tolist() == [(2**64 - 1) % 1000, 0x3039 % 1000]  # hashed: unchanged
    assert raw[0].tolist() == [-1, 0x3039]  # dynamic: the 64 bits, no modulo


def dynamic_shard(rows=4, kind="adagrad", **ids) -> EmbeddingShard:
    table = TableSpec(name="t", rows=rows, dim=4, dynamic=DynamicIds(**ids))
    opt = SparseOptimizerConfig(kind=kind, lr=0.5)
    return EmbeddingShard([LocalTable(table, 0)], opt, init_scale=0.1)


def test_training_lookup_admits_and_the_fused_update_reaches_the_row():
    shard = dynamic_shard(start_from_shared=False)
    ids = torch.tensor([[2**62 + 5, -7]])  # [F=1, B=2]
    before = shard.table_weights()["t"].clone()
    out = shard(SparseFeatures.one_hot(ids))
    out.sum().backward()  # fused Adagrad on the mapped rows
    after = shard.table_weights()["t"]
    changed = (after != before).any(dim=1).nonzero().squeeze(1).tolist()
    assert changed == [1, 2]  # two admitted rows, not row 0
    key = LocalTable(TableSpec(name="t", rows=4, dim=4, dynamic=DynamicIds()), 0)
    fresh = init_for_ids(torch.tensor([2**62 + 5, -7]), key, seed=0, init_scale=0.1)
    assert torch.allclose(out.detach(), fresh)  # new ids start from their id-seeded rows
    with torch.no_grad():  # evaluation: reads, admits nothing, unknown ids read row 0
        again = shard(SparseFeatures.one_hot(torch.tensor([[2**62 + 5, 99]])))
    # -7: row 1, 2**62 + 5: row 2
    assert torch.equal(again[1], after[0]) and torch.equal(again[0], after[2])
    assert shard.id_stats()["t"] == {
        "rows_used": 3,
        "admitted": 2,
        "evicted": 0,
        "default_lookups": 0,
    }


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_a_reused_row_gets_fresh_weights_and_optimizer_state(kind):
    shard = dynamic_shard(rows=2, kind=kind, start_from_shared=False)  # one row for ids
    state = lambda: shard.export_state()["t.momentum1"].reshape(2, -1)  # noqa: E731 [rows, 1|D]
    train = lambda i: shard(SparseFeatures.one_hot(torch.tensor([[i]])))  # noqa: E731
    for _ in range(3):  # id 1 trains row 1: its accumulator grows
        train(1).sum().backward()
    assert bool((state()[1] > 0).all())
    train(2).sum().backward()  # full, and id 1 was in the last two lookups: row 0
    assert shard.id_stats()["t"]["evicted"] == 0
    out = train(2)  # id 1 goes, id 2 takes row 1: fresh weights and state before the lookup
    assert shard.id_stats()["t"]["evicted"] == 1
    local = LocalTable(TableSpec(name="t", rows=2, dim=4, dynamic=DynamicIds()), 0)
    assert torch.allclose(out.detach(), init_for_ids(torch.tensor([2]), local, 0, 0.1))
    fresh = torch.full_like(state()[1], SparseOptimizerConfig().initial_accumulator)
    assert torch.allclose(state()[1], fresh)
    out.sum().backward()
    assert bool((state()[1] > 0).all())


def test_an_admitted_id_starts_from_its_shared_row_and_unseen_ids_read_theirs():
    # S = 10
    shard = dynamic_shard(rows=40, admit_after=2, shared_rows=0.25, start_from_shared=True)
    ids = torch.tensor([[2**40 + 3, 2**40 + 3, 77]])  # [F=1, B=3]: the first seen twice
    shared = shared_rows_of(ids[0], 10)
    before = shard.table_weights()["t"].clone()
    out = shard(SparseFeatures.one_hot(ids))
    assert torch.equal(out.detach()[0], before[shared[0]]) and torch.equal(
        out.detach()[2], before[shared[2]]
    )
    assert shard.id_stats()["t"]["rows_used"] == 11  # 10 shared + the admitted id
    with torch.no_grad():  # evaluation: an unseen id reads its own shared row
        unseen = torch.tensor([[5, 6, 2**50]])
        got = shard(SparseFeatures.one_hot(unseen))
    assert torch.equal(got, before[shared_rows_of(unseen[0], 10)])


@pytest.mark.slow
def test_dynamic_run_reports_rows_and_resumes_exactly(synth_small, tmp_path):
    from .test_train import state_of

    files = ([synth_small / "train.txt"], [synth_small / "test.txt"])
    over = {
        "train": {"epochs": 2, "batch_size": 1024, "checkpoint_every_steps": 7},
        "embedding": {
            "ids": "dynamic",
            "hash_size": 300,
            "admit_after": 2,
            "tables": [{"name": "C3", "evict": "lfu"}, {"name": "C4", "ids": "hashed"}],
        },
    }
    losses_a: list[float] = []
    a = Trainer(tiny_config(**over), tmp_path / "a")
    metrics_a = a.fit(*files, on_step=lambda step, loss: losses_a.append(loss))
    stop = {**over, "train": {**over["train"], "max_steps": 25}}
    losses_b: list[float] = []
    Trainer(tiny_config(**stop), tmp_path / "b").fit(
        *files, on_step=lambda step, loss: losses_b.append(loss)
    )
    b2 = Trainer(tiny_config(**over), tmp_path / "b")
    metrics_b = b2.fit(*files, resume=True, on_step=lambda step, loss: losses_b.append(loss))
    assert losses_b == losses_a
    sa, sb = state_of(a), state_of(b2)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert metrics_b["test_auc"] == metrics_a["test_auc"]
    written = json.loads((tmp_path / "a" / "metrics.json").read_text())
    used = written["embedding_rows_used"]
    assert "C4" not in used and len(used) == 25 and all(n <= 300 for n in used.values())
    assert max(written["embedding_ids_evicted"].values()) > 0  # vocabularies beyond 300 rows
    assert written["embedding_default_row_lookups"]["C1"] > 0
    assert written["embedding_ids_admitted"] == metrics_b["embedding_ids_admitted"]


def test_specs_before_shared_rows_keep_one_default_row_and_configs_get_shared_rows():
    """A published version or checkpoint written before ``shared_rows`` existed keeps its meaning
    (row 0 for every id without a row); a config asking for dynamic ids gets shared rows."""
    old = TableSpec(name="t", rows=100, dim=4, dynamic=DynamicIds()).model_dump(mode="json")
    del old["dynamic"]["shared_rows"], old["dynamic"]["start_from_shared"]
    table = TableSpec.model_validate_json(json.dumps(old))
    assert (
        table.dynamic.shared_rows == 0
        and not table.dynamic.start_from_shared
        and table.shared_row_count == 1
    )
    spec = tiny_config(embedding={"ids": "dynamic"}).feature_spec()
    assert all(t.dynamic.shared_rows == 0.1 and t.dynamic.start_from_shared for t in spec.tables)


def test_remapping_the_next_batch_ahead_equals_remapping_at_its_lookup(
    synth_small, tmp_path, monkeypatch
):
    """One process, pipeline exact: the maps remap batch i+1 while batch i computes, its fresh
    rows reset at its lookup; losses, tables, optimizer state and maps equal those of lockstep
    (pipeline off), bit for bit, with every policy and both ways of starting a fresh row."""
    from embedding_server.idmap import ahead

    from .test_train import state_of

    started = []
    init = ahead.RemapAhead.__init__
    monkeypatch.setattr(
        ahead.RemapAhead, "__init__", lambda self, *a: (started.append(1), init(self, *a))[1]
    )
    # whatever cores this machine has
    monkeypatch.setattr("dense_trainer.train.overlaps", lambda device: True)
    files = ([synth_small / "train.txt"], [synth_small / "test.txt"])
    embedding = {
        "ids": "dynamic",
        "hash_size": 300,
        "admit_after": 2,
        "tables": [
            {"name": "C3", "evict": "lfu"},
            {"name": "C5", "evict": "ttl", "ttl_steps": 3},
            {"name": "C6", "start_from_shared": False},
            {"name": "C4", "ids": "hashed"},
        ],
    }
    runs = {}
    for pipeline in ("off", "exact"):
        losses: list[float] = []
        cfg = tiny_config(
            embedding=embedding,
            train={"batch_size": 256, "max_steps": 60},
            dist={"pipeline": pipeline},
        )
        trainer = Trainer(cfg, tmp_path / pipeline)
        before = len(started)
        metrics = trainer.fit(*files, on_step=lambda step, loss, losses=losses: losses.append(loss))
        runs[pipeline] = (
            losses,
            state_of(trainer),
            trainer.client.id_stats(),
            metrics,
            len(started) - before,
        )
    (la, sa, ia, ma, none), (lb, sb, ib, mb, ahead_runs) = runs["off"], runs["exact"]
    assert len(la) == 60 and lb == la
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert ib == ia and mb["test_auc"] == ma["test_auc"]
    assert max(s["evicted"] for s in ia.values()) > 0  # rows were freed and given again meanwhile
    assert none == 0 and ahead_runs > 50  # every step but the last few remapped its successor ahead
    assert trainer.client._ahead is None  # none was left running


def test_the_remap_runs_ahead_only_beside_the_dense_step(monkeypatch):
    """Ahead where it overlaps (a GPU dense step, or a core the step's threads leave free); in
    the lookup where the dense step takes every core (a remap thread would preempt its threads)."""
    from embedding_server.idmap.ahead import overlaps

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert not overlaps(torch.device("cpu")) and overlaps(torch.device("cuda", 0))
        torch.set_num_threads(3)
        assert overlaps(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
