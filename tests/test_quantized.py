"""int8 / int4 rows: fbgemm's row-wise layout in both stores, pooled by fbgemm's IntNBit TBE,
served AUC against fp32 on generated data."""

import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from fastapi.testclient import TestClient

from api.app import create_app
from api.quantized import QuantizedPooler
from api.settings import Settings
from dense_trainer.metrics import roc_auc
from dense_trainer.train import Trainer
from dlrm_core.schema import CategoricalFeature, FeatureSpec, TableSpec
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store
from embedding_server.wire import dequantize_rows, encode_rows, row_bytes

from .conftest import tiny_config
from .test_stores import checkpoint_tables


def test_bytes_per_row_and_fbgemm_layout():
    assert [row_bytes(16, d) for d in ("fp32", "fp16", "int8", "int4")] == [64, 32, 20, 12]
    rows = np.random.default_rng(0).normal(size=(50, 16)).astype(np.float32)
    for dtype, bits in (("int8", 8), ("int4", 4)):
        raw = encode_rows(rows, dtype)  # uint8 [n, W]
        assert raw.shape == (50, row_bytes(16, dtype)) and raw.dtype == np.uint8
        fbgemm = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(
            torch.from_numpy(raw), bits
        ).numpy()
        np.testing.assert_allclose(dequantize_rows(raw, 16, dtype), fbgemm, atol=1e-6)
        # half a quantization step, plus fp16 rounding
        step = (rows.max(1) - rows.min(1)) / (2**bits - 1)
        assert (np.abs(fbgemm - rows) <= step[:, None] * 0.51 + 2e-3).all()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_pooler_equals_embedding_bag_over_dequantized_rows(dtype):
    rng = np.random.default_rng(1)
    # features x, y, z over tables a (sum), b (mean), a: the sum group's columns come back in order
    tables = [
        TableSpec(name="a", rows=100, dim=8, pooling="sum"),
        TableSpec(name="b", rows=50, dim=4, pooling="mean"),
    ]
    spec = FeatureSpec(
        tables=tables,
        categorical=[
            CategoricalFeature(kind="categorical", name=n, table=t)
            for n, t in (("x", "a"), ("y", "b"), ("z", "a"))
        ],
    )
    batch, n_features = 5, len(spec.feature_tables)
    lengths = rng.integers(0, 4, size=n_features * batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [F * B + 1]
    # [9, W_t]
    rows = {
        t: encode_rows(rng.normal(size=(9, table.dim)), dtype) for t, table in enumerate(tables)
    }
    local, expected = {}, []
    for f, t in enumerate(spec.feature_tables):
        table = spec.tables[t]
        lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
        local[f] = rng.integers(0, 9, size=hi - lo)
        weight = torch.from_numpy(dequantize_rows(rows[t], table.dim, dtype))
        expected.append(
            nnf.embedding_bag(
                torch.from_numpy(local[f]),
                weight,
                torch.from_numpy(offsets[f * batch : (f + 1) * batch + 1] - lo),
                mode=table.pooling,
                include_last_offset=True,
            )
        )
    got = QuantizedPooler(spec, dtype)(rows, local, offsets, batch)  # [B, 8 + 4 + 8]
    np.testing.assert_allclose(got.numpy(), torch.cat(expected, dim=1).numpy(), atol=1e-5)


@pytest.fixture(scope="module")
def trained_synth(tmp_path_factory, synth_small):
    out = tmp_path_factory.mktemp("trained_synth")
    Trainer(tiny_config(train={"batch_size": 256}), out).fit(
        [synth_small / "train.txt"], [synth_small / "test.txt"]
    )
    return out


def served(url: str, test_file) -> np.ndarray:
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        lines, out = test_file.read_text().splitlines(), []
        for start in range(0, len(lines), 2500):
            r = client.post(
                "/v1/models/dlrm:predict_tsv",
                content="\n".join(lines[start : start + 2500]),
                headers={"content-type": "text/plain"},
            )
            assert r.status_code == 200, r.text
            out += r.json()["predictions"]
        return np.array(out)


def test_quantized_served_auc_close_to_fp32(trained_synth, synth_small, tmp_path, redis_server):
    url = f"file://{tmp_path / 'store'}"
    labels = np.array(
        [int(line[0]) for line in (synth_small / "test.txt").read_text().splitlines()]
    )
    auc, scores = {}, {}
    for dtype in ("fp32", "int8", "int4"):
        publish_checkpoint(
            trained_synth, open_store(url, keep_versions=5), version=dtype, row_dtype=dtype
        )
        scores[dtype] = served(url, synth_small / "test.txt")
        auc[dtype] = roc_auc(scores[dtype], labels)
    # a model that learnt something, so that the comparison means something
    assert auc["fp32"] > 0.6, auc
    assert abs(auc["int8"] - auc["fp32"]) <= 0.001, auc
    assert abs(auc["int4"] - auc["fp32"]) <= 0.003, auc
    # served int8 ~ served (== offline) fp32
    assert np.abs(scores["int8"] - scores["fp32"]).max() < 0.02
    # Redis holds the same bytes (blocks, row cache in uint8): the same scores as the file store
    redis_url = f"{redis_server.url}?prefix=q{uuid.uuid4().hex[:6]}"
    store = open_store(redis_url)
    publish_checkpoint(trained_synth, store, version="int8", row_dtype="int8")
    np.testing.assert_allclose(
        served(redis_url, synth_small / "test.txt"), scores["int8"], atol=1e-6
    )
    # single-instance requests, the second of each with every row cached, score as the batch did
    lines = (synth_small / "test.txt").read_text().splitlines()[:3]
    with TestClient(create_app(Settings(store=redis_url))) as client:
        for _ in range(2):
            for i, line in enumerate(lines):
                r = client.post(
                    "/v1/models/dlrm:predict_tsv",
                    content=line,
                    headers={"content-type": "text/plain"},
                )
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(
                    r.json()["predictions"], scores["int8"][i : i + 1], atol=1e-6
                )
    # read back and dequantized, the stored rows are the trained rows, nearly
    emb, _ = checkpoint_tables(trained_synth)
    got, present = store.get_rows("int8", "C3", np.arange(200))
    assert present.all()
    np.testing.assert_allclose(got, emb["C3.weight"][:200].numpy(), atol=0.02)
