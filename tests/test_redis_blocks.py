"""The Redis store's block layout: blocks, gathers, rows left out, memory per row, full memory."""

import uuid

import numpy as np
import pytest
import redis

from dlrm_core.schema import CategoricalFeature, FeatureSpec, TableSpec
from embedding_server.stores import open_store
from embedding_server.stores.redis_blocks import ABSENT, BlockBuffer, block_rows
from embedding_server.wire import ModelVersion, row_bytes

from .redis_server import RedisServer


def meta_for(
    version: str, rows: int = 5000, dim: int = 16, row_dtype: str = "fp32"
) -> ModelVersion:
    tables = [
        TableSpec(name="a", rows=rows, dim=dim),
        TableSpec(name="b", rows=rows // 2 + 7, dim=dim),
    ]
    spec = FeatureSpec(
        tables=tables,
        categorical=[
            CategoricalFeature(kind="categorical", name=t.name, table=t.name) for t in tables
        ],
    )
    return ModelVersion(
        version=version, spec=spec, model={}, embedding_dim=dim, row_dtype=row_dtype
    )


def write_version(
    store, meta: ModelVersion, chunk: int = 777, keep_every: int = 0
) -> dict[str, np.ndarray]:
    """Random rows in chunks that do not line up with blocks; -> the rows written, by table."""
    rng = np.random.default_rng(0)
    out = {}
    with store.begin(meta) as writer:
        for t in meta.spec.tables:
            out[t.name] = rng.normal(size=(t.rows, t.dim)).astype(np.float32)
            for start in range(0, t.rows, chunk):
                part = out[t.name][start : start + chunk]
                keep = (
                    (np.arange(start, start + len(part)) % keep_every == 0) if keep_every else None
                )
                writer.write_rows(t.name, start, part, keep)
        writer.write_dense({})
        writer.commit()
    return out


def test_block_buffer_whatever_the_chunks():
    width = 64
    per = block_rows(width)  # 255 rows of 64 bytes in 16,368 bytes
    assert per == 255
    enc = np.random.default_rng(1).integers(0, 255, size=(1000, width), dtype=np.uint8)
    buf = BlockBuffer(1000, width)
    keep = np.arange(1000) < 300  # rows 0-299: blocks 0 and 1 hold kept rows, blocks 2 and 3 none
    got = {}
    for start in (0, 100, 130, 600):
        stop = {0: 100, 100: 130, 130: 600, 600: 1000}[start]
        got.update(buf.add(start, enc[start:stop], keep[start:stop]))
    got.update(buf.drain())
    assert sorted(got) == [0, 1]
    np.testing.assert_array_equal(np.frombuffer(got[0], np.uint8).reshape(-1, width), enc[:per])
    second = np.frombuffer(got[1], np.uint8).reshape(-1, width)
    np.testing.assert_array_equal(second[: 300 - per], enc[per:300])
    assert (second[300 - per :] == ABSENT).all()


@pytest.fixture
def store(redis_server):
    s = open_store(f"{redis_server.url}?prefix=b{uuid.uuid4().hex[:8]}", keep_versions=5)
    yield s
    s.close()


@pytest.mark.parametrize("row_dtype", ["fp32", "int8"])
def test_gather_reads_rows_and_leaves_out_absent_ones(store, row_dtype):
    written = write_version(store, meta_for("v", row_dtype=row_dtype), keep_every=3)
    ids = np.array([0, 1, 3, 254, 255, 256, 4998, 4999, 2000])
    rows, present = store.get_rows("v", "a", ids)
    np.testing.assert_array_equal(present, ids % 3 == 0)
    atol = 0 if row_dtype == "fp32" else 0.05
    np.testing.assert_allclose(rows[present], written["a"][ids[present]], atol=atol)
    # several tables, one round trip; the last (short) block of a table
    both = store.get_rows_many("v", {"a": np.array([4998]), "b": np.array([2506, 2505, 0])})
    np.testing.assert_array_equal(both["b"][1], [False, True, True])  # kept: ids % 3 == 0
    # a live update into a block nobody wrote creates it; its other rows stay absent
    store.update_rows("v", {"a": (np.array([4000]), np.ones((1, 16), np.float32))})
    rows, present = store.get_rows("v", "a", np.array([4000, 4001, 3999]))
    np.testing.assert_array_equal(present, [True, False, True])
    np.testing.assert_allclose(rows[0], 1.0, atol=0.01)


def memory_per_row(client, prefix: str) -> float:
    keys = list(client.scan_iter(match=f"{prefix}:v:*:t:*", count=1000))
    return sum(client.memory_usage(k, samples=0) for k in keys)


def test_memory_per_row_within_1_2x_payload(store):
    meta = meta_for("big", rows=60_000)
    write_version(store, meta, chunk=65536)
    rows = sum(t.rows for t in meta.spec.tables)
    used = memory_per_row(store.client, store.prefix) / rows
    payload = row_bytes(16, "fp32")
    assert used <= 1.2 * payload, (used, payload)


def test_a_full_redis_collects_old_versions_first(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        store = open_store(server.url, keep_versions=5)
        admin = redis.Redis.from_url(server.url)
        write_version(store, meta_for("v1", rows=40_000))
        write_version(store, meta_for("v2", rows=40_000))
        used = admin.info("memory")["used_memory"]
        # room for one more version only after collecting
        admin.config_set("maxmemory", used + 3_000_000)
        admin.config_set("maxmemory-policy", "noeviction")
        write_version(store, meta_for("v3", rows=40_000))
        assert store.current_version() == "v3"
        # v1 collected; v2 was current while v3 was written
        assert store.list_versions() == ["v2", "v3"]
        assert store.get_rows("v3", "a", np.array([1]))[1].all()
    finally:
        server.stop(save=False)
