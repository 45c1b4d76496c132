"""Versions: `dlrm store list|promote|gc`, promotion (rollback) under load, pinned versions,
generations; replicas after garbage collection never serve a vanished version's holes, live
pushes never recreate a deleted version, a trimmed update stream forces a reload."""

import json
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dlrm_cli import main as dlrm
from dlrm_core.errors import ConfigError
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import VersionNotFound, open_store
from embedding_server.stores.live import LivePusher

from .test_api import GOOD


@pytest.fixture(params=["file", "redis"])
def store_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    return f"{request.getfixturevalue('redis_server').url}?prefix=ver{uuid.uuid4().hex[:8]}"


def bump_dense(store, version: str, delta: float) -> None:
    """Make a version's scores differ from its siblings' (one dense live update)."""
    store.update_dense(version, {k: v + delta for k, v in store.read_dense(version).items()})


def test_store_cli_list_promote_gc(store_url, trained_criteo, capsys):
    store = open_store(store_url, keep_versions=5)
    for v in ("a", "b", "c"):
        publish_checkpoint(trained_criteo, store, version=v)
    capsys.readouterr()
    assert dlrm(["store", "list", "--store", store_url]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["version"], x["current"]) for x in listed] == [
        ("a", False),
        ("b", False),
        ("c", True),
    ]
    assert dlrm(["store", "promote", "a", "--store", store_url]) == 0  # rollback
    assert json.loads(capsys.readouterr().out) == {
        "current": "a",
        "previous": "c",
        "store": store.url,
    }
    assert store.current_version() == "a"
    assert dlrm(["store", "promote", "zzz", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "version 'zzz'" in err
    assert dlrm(["store", "gc", "--keep", "1", "--store", store_url]) == 0  # never the current one
    assert json.loads(capsys.readouterr().out)["deleted"] == ["b"]
    assert store.list_versions() == ["a", "c"] and store.current_version() == "a"
    with pytest.raises(ConfigError, match="current version"):
        store.delete_version("a")
    assert dlrm(["store", "promote", "--store", store_url]) == 2


def test_deleted_versions_raise_and_are_never_recreated(store_url, trained_criteo):
    store = open_store(store_url, keep_versions=1)
    publish_checkpoint(trained_criteo, store, version="old")
    pusher = LivePusher(
        store, "old", [("C1", 0, 100)], lambda: [torch.ones(100, 8)], push_every_s=0
    )
    pusher.mark(0, np.array([1, 2]))
    pusher.push_rows()
    publish_checkpoint(trained_criteo, store, version="new")  # keep 1: "old" is collected
    assert store.list_versions() == ["new"]
    with pytest.raises(VersionNotFound):
        store.get_rows_many("old", {"C1": np.array([1, 2])})
    with pytest.raises(VersionNotFound):
        store.update_rows("old", {"C1": (np.array([3]), np.ones((1, 8), np.float32))})
    with pytest.raises(VersionNotFound):
        store.poll_updates("old", None)
    pusher.mark(0, np.array([5]))
    pusher.push_rows()
    pusher.push_dense({"x": torch.zeros(1)})
    pusher.close()
    assert pusher.gone and pusher.pushes == 1
    if store.remote:
        # no orphan keys
        assert list(store.client.scan_iter(match=store.key("v", "old", "*"))) == []
    else:
        assert not (store.versions_dir / "old").exists()
    assert store.current_version() == "new" and store.list_versions() == ["new"]


def test_promotion_under_load_fails_no_request(store_url, trained_criteo):
    store = open_store(store_url, keep_versions=5)
    publish_checkpoint(trained_criteo, store, version="v1")
    publish_checkpoint(trained_criteo, store, version="v2")
    bump_dense(store, "v2", 0.05)  # v2 scores differ from v1's: a mislabelled answer is caught
    body = {"instances": [GOOD] * 4}
    answers, stop = [], threading.Event()
    with TestClient(create_app(Settings(store=store_url, poll_interval_s=0.05))) as client:
        truth = {
            v: client.post(f"/v1/models/dlrm/versions/{v}:predict", json=body).json()["predictions"]
            for v in ("v1", "v2")
        }
        assert truth["v1"] != truth["v2"]

        def hammer():
            while not stop.is_set():
                answers.append(client.post("/v1/models/dlrm:predict", json=body))

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(8):  # roll back and forth
            store.promote("v1" if i % 2 == 0 else "v2")
            time.sleep(0.25)
        stop.set()
        for t in threads:
            t.join()
    assert answers and {r.status_code for r in answers} == {200}
    seen = {r.json()["model_version"] for r in answers}
    assert seen == {"v1", "v2"}
    for r in answers:  # every answer is the reported version's own
        assert r.json()["predictions"] == pytest.approx(truth[r.json()["model_version"]], abs=1e-7)
        assert r.json()["model_generation"] == (1 if r.json()["model_version"] == "v2" else 0)


def test_a_collected_version_never_yields_default_rows(redis_server, trained_criteo, criteo_sample):
    url = f"{redis_server.url}?prefix=gc{uuid.uuid4().hex[:8]}"
    store = open_store(url, keep_versions=5)
    publish_checkpoint(trained_criteo, store, version="v1")
    lines = (criteo_sample / "test.txt").read_text().splitlines()
    # never polls by itself
    lagging = TestClient(create_app(Settings(store=url, poll_interval_s=3600, cache_mb=0)))
    prompt = TestClient(create_app(Settings(store=url, poll_interval_s=0.05)))
    with lagging as a, prompt as b:
        assert (
            a.post("/v1/models/dlrm:predict_tsv", content=lines[0]).json()["model_version"] == "v1"
        )
        publish_checkpoint(trained_criteo, store, version="v2")
        bump_dense(store, "v2", 0.05)
        store.collect_garbage(keep=1)  # `dlrm store gc --keep 1`: v1 is gone
        assert store.list_versions() == ["v2"]
        r = a.post("/v1/models/dlrm:predict_tsv", content="\n".join(lines[1:9]))
        assert (
            r.status_code == 503
            and "left the store" in r.json()["error"]
            and "Retry-After" in r.headers
        )
        deadline, r = time.time() + 10, None
        while time.time() < deadline:  # the lagging replica loads the current version at once
            r = a.post("/v1/models/dlrm:predict_tsv", content="\n".join(lines[1:9]))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["model_version"] == "v2"
        deadline = time.time() + 5
        while b.get("/readyz").json().get("model_version") != "v2" and time.time() < deadline:
            time.sleep(0.05)
        other = b.post("/v1/models/dlrm:predict_tsv", content="\n".join(lines[1:9])).json()
        assert other["model_version"] == "v2"
        assert r.json()["predictions"] == pytest.approx(other["predictions"], abs=1e-6)
        metrics = a.get("/metrics").text
        assert "dlrm_unknown_ids_total{" not in metrics  # no id of any table went unknown
        assert 'dlrm_version_loads_total{reason="vanished"} 1.0' in metrics
        # A pinned version that is collected answers 404, never its holes.
        publish_checkpoint(trained_criteo, store, version="v3")
        assert (
            b.post("/v1/models/dlrm/versions/v2:predict", json={"instances": [GOOD]}).status_code
            == 200
        )
        assert store.collect_garbage(keep=1) == ["v2"]
        deadline = time.time() + 5
        while time.time() < deadline:
            r = b.post("/v1/models/dlrm/versions/v2:predict", json={"instances": [GOOD]})
            if r.status_code == 404:
                break
            # its cached rows, until dropped
            assert r.status_code == 200 and r.json()["model_version"] == "v2"
            time.sleep(0.02)
        assert r.status_code == 404 and r.json()["field"] == "version"


def test_a_trimmed_update_stream_forces_a_reload(redis_server, trained_criteo, criteo_sample):
    url = f"{redis_server.url}?prefix=trim{uuid.uuid4().hex[:8]}"
    store = open_store(url)
    publish_checkpoint(trained_criteo, store, version="v1")
    line = (criteo_sample / "test.txt").read_text().splitlines()[0]
    ids = store.read_meta("v1").spec.tables[0]
    with TestClient(create_app(Settings(store=url, poll_interval_s=3600))) as client:
        service = client.app.state.service
        before = client.post("/v1/models/dlrm:predict_tsv", content=line).json()  # rows now cached
        stream = store.key("v", "v1", "updates")
        for k, trim in enumerate((2, 0)):  # some entries lost, then every entry lost
            generation = service.model.generation
            for _ in range(5):  # rewrite every row of the first table: cached rows are stale now
                rows = np.full((ids.rows, ids.dim), 0.3 * (k + 1), np.float32)
                store.update_rows("v1", {ids.name: (np.arange(ids.rows), rows)})
            store.client.xtrim(stream, maxlen=trim, approximate=False)
            service.refresh()
            assert service.model.generation == generation + 5
            after = client.post("/v1/models/dlrm:predict_tsv", content=line).json()
            assert after["model_generation"] == generation + 5
            # the stale cached rows were dropped
            assert after["predictions"] != before["predictions"]
            before = after
        assert 'dlrm_version_loads_total{reason="lost"} 2.0' in client.get("/metrics").text
