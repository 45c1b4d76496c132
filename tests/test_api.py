"""The serving API end to end: offline/online parity, bad input, auth, readiness, swaps, faults."""

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
from dense_trainer.data.loader import BatchLoader
from dense_trainer.train import Trainer
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .conftest import tiny_config
from .redis_server import RedisServer


def client_for(store_url: str, **settings) -> TestClient:
    return TestClient(create_app(Settings(store=store_url, poll_interval_s=0.1, **settings)))


def offline_probabilities(out_dir, test_file) -> np.ndarray:
    trainer = Trainer(tiny_config(train={"batch_size": 128}), out_dir / "offline-eval")
    trainer.load_checkpoint(latest_checkpoint(out_dir / "checkpoints"))
    logits = [trainer.predict(b) for b in BatchLoader([test_file], trainer.spec, 4096)]
    return torch.sigmoid(torch.cat(logits)).numpy()


def to_instance(line: str, named: bool = False):
    f = line.split("\t")
    dense = [int(x) if x else None for x in f[1:14]]
    sparse = [x or None for x in f[14:40]]
    if named:
        return {
            **{f"I{i + 1}": v for i, v in enumerate(dense)},
            **{f"C{i + 1}": v for i, v in enumerate(sparse)},
        }
    return {"dense": dense, "sparse": sparse}


@pytest.fixture(scope="module")
def file_store_url(trained_criteo, tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('store')}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    return url


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_api_scores_equal_offline_evaluation(
    backend, trained_criteo, criteo_sample, file_store_url, request
):
    if backend == "redis":
        url = f"{request.getfixturevalue('redis_server').url}?prefix=parity{uuid.uuid4().hex[:6]}"
        publish_checkpoint(trained_criteo, open_store(url), version="v1")
    else:
        url = file_store_url
    expected = offline_probabilities(trained_criteo, criteo_sample / "test.txt")
    text = (criteo_sample / "test.txt").read_text()
    with client_for(url) as client:
        r = client.post(
            "/v1/models/dlrm:predict_tsv", content=text, headers={"content-type": "text/plain"}
        )
        assert r.status_code == 200, r.text
        got = np.array(r.json()["predictions"])
        assert got.shape == (2000,)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        lines = text.splitlines()[:50]
        for named in (False, True):
            body = {"instances": [to_instance(line, named) for line in lines]}
            r = client.post("/v1/models/dlrm:predict", json=body)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["predictions"], expected[:50], atol=1e-5)
        # A TSV line without its label column, integers for hex values: same scores.
        unlabelled = "\n".join(line.split("\t", 1)[1] for line in lines[:5])
        r = client.post("/v1/models/dlrm:predict_tsv", content=unlabelled)
        np.testing.assert_allclose(r.json()["predictions"], expected[:5], atol=1e-5)
        inst = to_instance(lines[0])
        inst["sparse"] = [int(v, 16) if v else None for v in inst["sparse"]]
        r = client.post("/v1/models/dlrm:predict", json={"instances": [inst]})
        np.testing.assert_allclose(r.json()["predictions"], expected[:1], atol=1e-5)


GOOD = {"dense": [1] * 13, "sparse": ["68fd1e64"] * 26}


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"instances": []}, 422, "instances"),
        ({}, 422, "instances"),
        ({"instances": [GOOD], "extra": 1}, 422, "extra"),
        ({"instances": [{**GOOD, "dense": [1] * 12}]}, 422, "instances.0.dense"),
        ({"instances": [GOOD, {**GOOD, "sparse": ["1"] * 27}]}, 422, "instances.1.sparse"),
        ({"instances": [{**GOOD, "dense": ["1"] + [1] * 12}]}, 422, "instances.0.dense.0"),
        ({"instances": [{**GOOD, "dense": [True] + [1] * 12}]}, 422, "instances.0.dense.0"),
        ({"instances": [{**GOOD, "dense": [1e400] + [1] * 12}]}, 422, "instances.0.dense.0"),
        ({"instances": [{**GOOD, "sparse": ["xyz"] + ["1"] * 25}]}, 422, "instances.0.sparse.0"),
        ({"instances": [{**GOOD, "sparse": [-5] + ["1"] * 25}]}, 422, "instances.0.sparse.0"),
        ({"instances": [{**GOOD, "sparse": ["1" * 17] + ["1"] * 25}]}, 422, "instances.0.sparse.0"),
        ({"instances": [{**GOOD, "sparse": [1.5] + ["1"] * 25}]}, 422, "instances.0.sparse.0"),
        ({"instances": [{"I1": 3, "C99": "a"}]}, 422, "instances.0.C99"),
        ({"instances": [{"I1": "a"}]}, 422, "instances.0.I1"),
        ({"instances": [{"C1": 2.5}]}, 422, "instances.0.C1"),
        ({"instances": [GOOD] * 4097}, 422, "instances"),
        ({"instances": "nope"}, 422, "instances"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(file_store_url, body, status, field):
    # json.dumps writes inf as Infinity, as some clients do
    with client_for(file_store_url) as client:
        r = client.post(
            "/v1/models/dlrm:predict",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
    assert r.status_code == status, r.text
    assert r.json()["field"] == field, r.json()
    assert field in r.json()["error"]


def test_other_bad_requests(file_store_url):
    with client_for(file_store_url, max_body_bytes=10_000) as client:
        r = client.post(
            "/v1/models/dlrm:predict",
            content=b'{"instances": [NaN]}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422 and r.json()["field"].startswith("instances")
        r = client.post(
            "/v1/models/dlrm:predict",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422 and r.json()["field"] == "body"
        r = client.post("/v1/models/dlrm:predict", json={"instances": [GOOD] * 100})
        assert r.status_code == 413 and r.json()["field"] == "body"
        chunked = (
            json.dumps({"instances": [GOOD] * 100})[i : i + 1000].encode()
            for i in range(0, 200_000, 1000)
        )
        r = client.post(
            "/v1/models/dlrm:predict", content=chunked, headers={"content-type": "application/json"}
        )
        # no Content-Length: counted while read
        assert r.status_code == 413 and r.json()["field"] == "body"
        r = client.post("/v1/models/nope:predict", json={"instances": [GOOD]})
        assert r.status_code == 404 and r.json()["field"] == "name"
        r = client.post("/v1/models/dlrm:predict_tsv", content="1\t2\t3")
        assert r.status_code == 422 and r.json()["field"] == "line 1"
        bad_hex = "\t".join(["1"] * 14 + ["zz"] + ["a"] * 25)
        r = client.post("/v1/models/dlrm:predict_tsv", content=bad_hex)
        assert r.status_code == 422 and "C1 is not hex" in r.json()["error"]
        r = client.post("/v1/models/dlrm:predict_tsv", content="")
        assert r.status_code == 422
        r = client.get("/v1/models/dlrm:predict")
        assert r.status_code in (404, 405)


def test_health_readiness_metrics_docs(tmp_path, trained_criteo):
    url = f"file://{tmp_path / 'store'}"
    with client_for(url) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        r = client.get("/readyz")
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert client.post("/v1/models/dlrm:predict", json={"instances": [GOOD]}).status_code == 503
        publish_checkpoint(trained_criteo, open_store(url), version="first")
        deadline = time.time() + 5
        while client.get("/readyz").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        assert client.get("/readyz").json()["model_version"] == "first"
        info = client.get("/v1/models/dlrm").json()
        assert info["model_version"] == "first" and len(info["sparse_features"]) == 26
        client.post("/v1/models/dlrm:predict", json={"instances": [GOOD] * 3})
        text = client.get("/metrics").text
        # Samples, not HELP lines: values that only this traffic explains
        # (tests/test_serving_metrics.py has more).
        for sample in [
            'dlrm_batch_instances_sum{input="instances"} 3.0',
            'dlrm_model_version_info{version="first"} 1.0',
            'dlrm_request_latency_seconds_count{method="POST",'
            'route="/v1/models/{name}:predict",status="503"} 1.0',
        ]:
            assert sample in text, sample
        assert client.get("/docs").status_code == 200
        assert "/v1/models/{name}:predict" in client.get("/openapi.json").json()["paths"]


def test_api_key(file_store_url, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k3y-0123456789abc\n")
    with client_for(file_store_url, api_key_file=key_file) as client:
        assert client.post("/v1/models/dlrm:predict", json={"instances": [GOOD]}).status_code == 401
        r = client.post(
            "/v1/models/dlrm:predict",
            json={"instances": [GOOD]},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        r = client.post(
            "/v1/models/dlrm:predict",
            json={"instances": [GOOD]},
            headers={"Authorization": "Bearer k3y-0123456789abc"},
        )
        assert r.status_code == 200
        assert client.get("/healthz").status_code == 200


def test_stale_reads_are_not_cached_after_an_invalidation():
    from api.cache import RowCache

    cache = RowCache([("t", 100, 4)], 1 << 20)
    epoch = cache.epoch("t")  # a request reads row 7 from the store...
    cache.invalidate("t", np.array([7]))  # ...a live update rewrites it meanwhile...
    # ...the stale read is dropped
    cache.put("t", np.array([7]), np.ones((1, 4), np.float32), epoch)
    assert not cache.get("t", np.array([7]))[1].any()
    cache.put("t", np.array([7]), np.ones((1, 4), np.float32), cache.epoch("t"))
    assert cache.get("t", np.array([7]))[1].all()


def test_version_swaps_under_load_fail_no_request(tmp_path, trained_criteo):
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url, keep_versions=2)
    publish_checkpoint(trained_criteo, store, version="v0")
    statuses, versions = [], set()
    stop = threading.Event()
    with client_for(url) as client:

        def hammer():
            while not stop.is_set():
                r = client.post("/v1/models/dlrm:predict", json={"instances": [GOOD] * 8})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    versions.add(r.json()["model_version"])

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(1, 5):
            publish_checkpoint(trained_criteo, store, version=f"v{i}")
            time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
    assert statuses and set(statuses) == {200}, set(statuses)
    assert len(versions) >= 3, versions


def test_redis_outage_cached_rows_answer_then_recovery(tmp_path, trained_criteo, criteo_sample):
    server = RedisServer(tmp_path).start()
    try:
        publish_checkpoint(trained_criteo, open_store(server.url), version="v1")
        lines = (criteo_sample / "test.txt").read_text().splitlines()
        warm, cold = to_instance(lines[0]), to_instance(lines[1])
        with client_for(server.url, store_timeout_s=0.5) as client:
            assert (
                client.post("/v1/models/dlrm:predict", json={"instances": [warm]}).status_code
                == 200
            )
            server.stop(save=True)
            t0 = time.perf_counter()
            r = client.post("/v1/models/dlrm:predict", json={"instances": [warm]})
            assert r.status_code == 200  # every row cached
            r = client.post("/v1/models/dlrm:predict", json={"instances": [cold]})
            assert r.status_code == 503 and r.headers["Retry-After"] == "2"
            assert time.perf_counter() - t0 < 3  # fails fast, never hangs
            assert 'dlrm_store_errors_total{operation="lookup"}' in client.get("/metrics").text
            server.start()
            r = client.post("/v1/models/dlrm:predict", json={"instances": [cold]})
            assert r.status_code == 200, r.text
    finally:
        server.stop(save=False)
