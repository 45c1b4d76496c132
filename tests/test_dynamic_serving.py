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
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store
from embedding_server.stores.base import VersionNotFound

from .conftest import tiny_config

pytestmark = pytest.mark.slow

DYNAMIC = {
    "ids": "dynamic",
    "hash_size": 500,
    "admit_after": 2,
    "tables": [{"name": "C2", "ids": "hashed"}],
}


def config():
    return tiny_config(train={"batch_size": 128}, embedding=DYNAMIC)


@pytest.fixture(scope="module")
def trained_dynamic(tmp_path_factory, criteo_sample):
    out = tmp_path_factory.mktemp("trained_dynamic")
    Trainer(config(), out).fit([criteo_sample / "train.txt"], [criteo_sample / "test.txt"])
    return out


def store_url(backend: str, tmp_path, request) -> str:
    if backend == "redis":
        return f"{request.getfixturevalue('redis_server').url}?prefix=dyn{uuid.uuid4().hex[:6]}"
    return f"file://{tmp_path / 'store'}"


def offline_probabilities(out_dir, test_file) -> np.ndarray:
    trainer = Trainer(config(), out_dir / "offline-eval")
    trainer.load_checkpoint(latest_checkpoint(out_dir / "checkpoints"))
    logits = [trainer.predict(b) for b in BatchLoader([test_file], trainer.spec, 4096)]
    return torch.sigmoid(torch.cat(logits)).numpy()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_served_dynamic_model_equals_offline_evaluation(
    backend, trained_dynamic, criteo_sample, tmp_path, request
):
    url = store_url(backend, tmp_path, request)
    store = open_store(url)
    publish_checkpoint(trained_dynamic, store, version="v1")
    ids, rows = store.read_id_map("v1", "C1")
    # 50 shared (0.1)
    assert len(ids) > 0 and np.all(np.diff(ids) > 0) and rows.min() >= 50 and rows.max() < 500
    saved = CheckpointTables(latest_checkpoint(trained_dynamic / "checkpoints")).id_map("C1")
    assert len(ids) == int((saved["C1.idmap.table.slots"] >= 0).sum())
    with pytest.raises(VersionNotFound):  # a hashed table has no id map
        store.read_id_map("v1", "C2")

    expected = offline_probabilities(trained_dynamic, criteo_sample / "test.txt")
    text = (criteo_sample / "test.txt").read_text()
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        r = client.post(
            "/v1/models/dlrm:predict_tsv", content=text, headers={"content-type": "text/plain"}
        )
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()["predictions"]), expected, atol=1e-5)
        metrics = client.get("/metrics").text
    unknown = [
        line
        for line in metrics.splitlines()
        if line.startswith('dlrm_unknown_ids_total{table="C1"}')
    ]
    assert unknown and float(unknown[0].split()[-1]) > 0  # test ids never admitted: counted
    assert 'dlrm_unknown_ids_total{table="C2"}' not in metrics  # hashed: every row exists


def strip_owners(store, version: str) -> None:
    """Make ``version`` look published before owners were stored: no owners, no flag."""
    meta = store.read_meta(version)
    assert meta.owners
    old = meta.model_dump_json(exclude={"owners"})
    if store.remote:
        for table in ("C1", "C3"):
            keys = list(store.client.scan_iter(match=store.owners_key(version, table, "") + "*"))
            assert keys
            store.client.delete(*keys)
        store.client.set(store.key("v", version, "meta"), old)
    else:
        owners = list((store._vdir(version) / "idmaps").glob("*.owner.npy"))
        assert owners
        for path in owners:
            path.unlink()
        (store._vdir(version) / "meta.json").write_text(old)


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_version_published_before_owners_were_stored_serves_the_same(
    backend, trained_dynamic, criteo_sample, tmp_path, request
):
    """Versions of dynamic tables published before rows carried owners (their maps never change)
    load and serve what offline evaluation computes, batched and one instance at a time."""
    url = store_url(backend, tmp_path, request)
    store = open_store(url)
    publish_checkpoint(trained_dynamic, store, version="v1")
    strip_owners(store, "v1")
    assert not open_store(url).read_meta("v1").owners
    expected = offline_probabilities(trained_dynamic, criteo_sample / "test.txt")
    lines = (criteo_sample / "test.txt").read_text().splitlines(keepends=True)
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        r = client.post(
            "/v1/models/dlrm:predict_tsv",
            content="".join(lines),
            headers={"content-type": "text/plain"},
        )
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()["predictions"]), expected, atol=1e-5)
        for i in (0, 7, 42):  # single requests: the direct gathers
            r = client.post(
                "/v1/models/dlrm:predict_tsv",
                content=lines[i],
                headers={"content-type": "text/plain"},
            )
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["predictions"], expected[i : i + 1], atol=1e-5)
