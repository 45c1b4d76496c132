"""Serving stores (file and a real redis-server) and publishing."""

import uuid

import numpy as np
import pytest
import torch

from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint.files import latest_checkpoint, load_file
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import StoreUnavailable, open_store

from .redis_server import RedisServer


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'store'}", keep_versions=2)
    else:
        server = request.getfixturevalue("redis_server")
        s = open_store(f"{server.url}?prefix=t{uuid.uuid4().hex[:8]}", keep_versions=2)
    yield s
    s.close()


class _Tables:
    """table.weight of a checkpoint as a dict-like of full tensors."""

    def __init__(self, path):
        self.ct = CheckpointTables(path)

    def __getitem__(self, key):
        table, _ = key.split(".")
        return self.ct.read(table, "weight", 0, self.ct.tables[table].rows)


def checkpoint_tables(out):
    ckpt = latest_checkpoint(out / "checkpoints")
    return _Tables(ckpt), load_file(ckpt, "dense.pt")


def test_publish_round_trip(store, trained_criteo):
    meta = publish_checkpoint(trained_criteo, store, version="v1")
    assert store.current_version() == "v1"
    assert store.read_meta("v1").spec == meta.spec
    emb, dense = checkpoint_tables(trained_criteo)
    for table in meta.spec.tables[:5]:
        ids = np.array([0, 1, table.rows - 1, 7, 7])
        rows, present = store.get_rows("v1", table.name, ids)
        assert present.all()
        np.testing.assert_array_equal(rows, emb[f"{table.name}.weight"][ids].numpy())
    got = store.read_dense("v1")
    assert all(torch.equal(got[k], v) for k, v in dense.items())
    # The default embedding is the mean of the trained rows.
    c1 = emb["C1.weight"]
    assert len(meta.default_rows["C1"]) == c1.shape[1]


def test_fp16_rows(store, trained_criteo):
    publish_checkpoint(trained_criteo, store, version="half", row_dtype="fp16")
    emb, _ = checkpoint_tables(trained_criteo)
    rows, _ = store.get_rows("half", "C3", np.arange(100))
    np.testing.assert_allclose(rows, emb["C3.weight"][:100].numpy(), rtol=1e-3, atol=1e-4)


def test_crash_mid_publish_leaves_previous_version_serving(store, trained_criteo, monkeypatch):
    publish_checkpoint(trained_criteo, store, version="good")
    calls = []

    def dying_write(self, table, start, rows, keep=None):
        calls.append(table)
        if len(calls) == 3:
            raise RuntimeError("publisher killed")
        return original(self, table, start, rows, keep)

    writer = store.begin(store.read_meta("good").model_copy(update={"version": "bad"}))
    original = type(writer).write_rows
    writer.abort()
    monkeypatch.setattr(type(writer), "write_rows", dying_write)
    with pytest.raises(RuntimeError, match="killed"):
        publish_checkpoint(trained_criteo, store, version="bad")
    assert store.current_version() == "good"
    assert store.list_versions() == ["good"]
    rows, present = store.get_rows("good", "C1", np.array([1, 2]))
    assert present.all()


def test_a_version_name_is_never_reused(store, trained_criteo):
    from dlrm_core.errors import ConfigError

    publish_checkpoint(trained_criteo, store, version="once")
    with pytest.raises(ConfigError, match="already has a version 'once'"):
        publish_checkpoint(trained_criteo, store, version="once")
    assert store.current_version() == "once"


def test_old_versions_are_collected(store, trained_criteo):
    for v in ["a", "b", "c"]:
        publish_checkpoint(trained_criteo, store, version=v)
    assert store.list_versions() == ["b", "c"] and store.current_version() == "c"


def test_live_updates(store, trained_criteo):
    publish_checkpoint(trained_criteo, store, version="live")
    cursor = store.poll_updates("live", None).cursor
    new = np.full((2, 8), 0.5, dtype=np.float32)
    store.update_rows("live", {"C2": (np.array([3, 9]), new)})
    rows, _ = store.get_rows("live", "C2", np.array([3, 9, 4]))
    np.testing.assert_array_equal(rows[:2], new)
    assert not np.array_equal(rows[2], new[0])
    _, dense = checkpoint_tables(trained_criteo)
    bumped = {k: v + 1 for k, v in dense.items()}
    store.update_dense("live", bumped)
    batch = store.poll_updates("live", cursor)
    assert batch.dense_changed
    if store.remote:  # the file store needs no invalidation: readers map the written pages
        assert batch.rows["C2"].tolist() == [3, 9]
    assert torch.equal(
        store.read_dense("live")["over_arch.model.0.weight"], bumped["over_arch.model.0.weight"]
    )


def test_missing_checkpoint_is_a_clear_error(store, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        publish_checkpoint(tmp_path / "nope", store)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        publish_checkpoint(tmp_path, store)


def test_redis_password_and_unreachable(tmp_path):
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        ok = open_store(server.url)
        assert ok.current_version() is None
        wrong = open_store(f"redis://:nope@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreUnavailable, match="authentication|unavailable"):
            wrong.current_version()
    finally:
        server.stop(save=False)
    dead = open_store(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match="unavailable"):
        dead.current_version()
