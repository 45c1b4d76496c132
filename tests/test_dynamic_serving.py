"""Dynamic tables published and served: the version carries each table's id map (file store:
sorted ids + searchsorted; Redis: the same arrays under one key), unknown ids read the default
row and are counted by table, and served predictions equal offline evaluation on both stores."""

import uuid

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dense_trainer.data.loader import BatchLoader
from dense_trainer.train import Trainer
from embedding_server.checkpoint import latest_checkpoint
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store
from embedding_server.stores.base import VersionNotFound
from embedding_server.table_checkpoint import CheckpointTables

from .conftest import tiny_config

pytestmark = pytest.mark.slow

DYNAMIC = {"ids": "dynamic", "hash_size": 500, "admit_after": 2, "tables": [{"name": "C2", "ids": "hashed"}]}


def config():
    return tiny_config(train={"batch_size": 128}, embedding=DYNAMIC)


@pytest.fixture(scope="module")
def trained_dynamic(tmp_path_factory, criteo_sample):
    out = tmp_path_factory.mktemp("trained_dynamic")
    Trainer(config(), out).fit([criteo_sample / "train.txt"], [criteo_sample / "test.txt"])
    return out


def offline_probabilities(out_dir, test_file) -> np.ndarray:
    trainer = Trainer(config(), out_dir / "offline-eval")
    trainer.load_checkpoint(latest_checkpoint(out_dir / "checkpoints"))
    logits = [trainer.predict(b) for b in BatchLoader([test_file], trainer.spec, 4096)]
    return torch.sigmoid(torch.cat(logits)).numpy()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_served_dynamic_model_equals_offline_evaluation(backend, trained_dynamic, criteo_sample, tmp_path, request):
    if backend == "redis":
        url = f"{request.getfixturevalue('redis_server').url}?prefix=dyn{uuid.uuid4().hex[:6]}"
    else:
        url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    publish_checkpoint(trained_dynamic, store, version="v1")
    ids, rows = store.read_id_map("v1", "C1")
    assert len(ids) > 0 and np.all(np.diff(ids) > 0) and rows.min() >= 125 and rows.max() < 500  # 125 shared
    saved = CheckpointTables(latest_checkpoint(trained_dynamic / "checkpoints")).id_map("C1")
    assert len(ids) == int((saved["C1.idmap.table.slots"] >= 0).sum())
    with pytest.raises(VersionNotFound):  # a hashed table has no id map
        store.read_id_map("v1", "C2")

    expected = offline_probabilities(trained_dynamic, criteo_sample / "test.txt")
    text = (criteo_sample / "test.txt").read_text()
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        r = client.post("/v1/models/dlrm:predict_tsv", content=text, headers={"content-type": "text/plain"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()["predictions"]), expected, atol=1e-5)
        metrics = client.get("/metrics").text
    unknown = [line for line in metrics.splitlines() if line.startswith('dlrm_unknown_ids_total{table="C1"}')]
    assert unknown and float(unknown[0].split()[-1]) > 0  # test ids never admitted: counted
    assert 'dlrm_unknown_ids_total{table="C2"}' not in metrics  # hashed: every row exists
