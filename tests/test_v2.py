"""The Open Inference Protocol (KServe V2): health, metadata, infer (JSON and the binary
extension), pinned versions, errors in the protocol's own shape; V1 and V2 score identically."""

import json
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .test_api import to_instance


@pytest.fixture(scope="module")
def store_url(trained_criteo, tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('store')}"
    store = open_store(url)
    publish_checkpoint(trained_criteo, store, version="old")
    publish_checkpoint(trained_criteo, store, version="new")
    return url


@pytest.fixture(scope="module")
def client(store_url):
    with TestClient(create_app(Settings(store=store_url, poll_interval_s=0.1))) as c:
        yield c


@pytest.fixture(scope="module")
def lines(criteo_sample):
    return (criteo_sample / "test.txt").read_text().splitlines()[:64]


def v2_inputs(lines, nested=False, int_categoricals=False):
    """Criteo lines as one tensor per feature (null: missing)."""
    rows = [line.split("\t") for line in lines]
    n = len(rows)

    def shaped(values):
        return ([[v] for v in values], [n, 1]) if nested else (values, [n])

    inputs = []
    for i in range(13):
        data, shape = shaped([int(r[1 + i]) if r[1 + i] else None for r in rows])
        inputs.append(
            {
                "name": f"I{i + 1}",
                "shape": shape,
                "datatype": "INT64" if i % 2 else "FP32",
                "data": data,
            }
        )
    for i in range(26):
        cells = [r[14 + i] or None for r in rows]
        if int_categoricals:
            data, shape = shaped([int(c, 16) if c else None for c in cells])
            inputs.append({"name": f"C{i + 1}", "shape": shape, "datatype": "INT64", "data": data})
        else:
            data, shape = shaped(cells)
            inputs.append({"name": f"C{i + 1}", "shape": shape, "datatype": "BYTES", "data": data})
    return inputs


def test_v1_and_v2_give_identical_predictions(client, lines):
    v1 = client.post("/v1/models/dlrm:predict", json={"instances": [to_instance(x) for x in lines]})
    assert v1.status_code == 200, v1.text
    expected = v1.json()["predictions"]
    for nested in (False, True):
        for ints in (False, True):
            r = client.post(
                "/v2/models/dlrm/infer",
                json={"id": "req-7", "inputs": v2_inputs(lines, nested, ints)},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            out = body["outputs"][0]
            assert (out["name"], out["datatype"], out["shape"]) == (
                "predictions",
                "FP32",
                [len(lines)],
            )
            assert out["data"] == pytest.approx(expected, abs=1e-6)
            assert (
                body["model_name"] == "dlrm"
                and body["model_version"] == "new"
                and body["id"] == "req-7"
            )
            assert body["parameters"] == {"model_generation": 0}
    # Features left out are missing, as absent names of a V1 named instance.
    r = client.post(
        "/v2/models/dlrm/infer",
        json={"inputs": [{"name": "C1", "shape": [1], "datatype": "BYTES", "data": ["68fd1e64"]}]},
    )
    v1 = client.post("/v1/models/dlrm:predict", json={"instances": [{"C1": "68fd1e64"}]})
    assert r.json()["outputs"][0]["data"] == pytest.approx(v1.json()["predictions"], abs=1e-6)


def binary_request(inputs: list[dict], outputs_binary: bool) -> tuple[bytes, dict]:
    """A request in the binary extension's layout, as Triton's client writes it."""
    raw, header = (
        b"",
        {
            "inputs": [],
            "outputs": [{"name": "predictions", "parameters": {"binary_data": outputs_binary}}],
        },
    )
    for t in inputs:
        if t["datatype"] == "BYTES":
            blob = b"".join(
                struct.pack("<I", len(v.encode())) + v.encode()
                for v in (x or "" for x in t["data"])
            )
        else:
            dtype = {"FP32": "<f4", "INT64": "<i8"}[t["datatype"]]
            values = (
                [np.nan if v is None else v for v in t["data"]]
                if t["datatype"] == "FP32"
                else [v or 0 for v in t["data"]]
            )
            blob = np.asarray(values, dtype=dtype).tobytes()
        header["inputs"].append(
            {
                "name": t["name"],
                "shape": t["shape"],
                "datatype": t["datatype"],
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        raw += blob
    head = json.dumps(header).encode()
    return head + raw, {
        "Inference-Header-Content-Length": str(len(head)),
        "content-type": "application/octet-stream",
    }


def test_binary_tensor_extension(client, lines):
    # FP32 (NaN: missing) and BYTES
    inputs = [t for t in v2_inputs(lines) if t["datatype"] != "INT64"]
    expected = client.post("/v2/models/dlrm/infer", json={"inputs": inputs}).json()["outputs"][0][
        "data"
    ]
    body, headers = binary_request(inputs, outputs_binary=False)
    r = client.post("/v2/models/dlrm/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == pytest.approx(expected, abs=1e-6)
    body, headers = binary_request(inputs, outputs_binary=True)
    r = client.post("/v2/models/dlrm/infer", content=body, headers=headers)
    n = int(r.headers["Inference-Header-Content-Length"])
    head = json.loads(r.content[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 4 * len(lines)
    np.testing.assert_allclose(np.frombuffer(r.content[n:], "<f4"), expected, atol=1e-6)
    r = client.post("/v2/models/dlrm/infer", content=body[:-3], headers=headers)
    assert r.status_code == 422 and set(r.json()) == {"error"}


def test_health_metadata_and_versions(client, lines):
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get("/v2/models/dlrm/ready").json() == {"name": "dlrm", "ready": True}
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    meta = client.get("/v2/models/dlrm").json()
    assert meta["versions"] == ["old", "new"]
    assert meta["inputs"][0] == {"name": "I1", "datatype": "FP32", "shape": [-1]}
    assert meta["inputs"][13] == {"name": "C1", "datatype": "BYTES", "shape": [-1]}
    assert len(meta["inputs"]) == 39 and meta["outputs"] == [
        {"name": "predictions", "datatype": "FP32", "shape": [-1]}
    ]
    r = client.post("/v2/models/dlrm/versions/old/infer", json={"inputs": v2_inputs(lines[:3])})
    assert r.status_code == 200 and r.json()["model_version"] == "old"
    v1 = client.post(
        "/v1/models/dlrm/versions/old:predict",
        json={"instances": [to_instance(x) for x in lines[:3]]},
    )
    assert v1.json()["model_version"] == "old"
    assert r.json()["outputs"][0]["data"] == pytest.approx(v1.json()["predictions"], abs=1e-6)
    assert client.get("/v2/models/dlrm/versions/old/ready").json()["ready"] is True
    assert client.get("/v1/models/dlrm/versions/old").json()["model_version"] == "old"
    assert client.get("/v1/models").json() == {"models": ["dlrm"]}


@pytest.mark.parametrize(
    "path, body, status, starts",
    [
        (
            "/v2/models/nope/infer",
            {"inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]}]},
            404,
            "name:",
        ),
        (
            "/v2/models/dlrm/versions/gone/infer",
            {"inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]}]},
            404,
            "version:",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I99", "shape": [1], "datatype": "FP32", "data": [1]}]},
            422,
            "inputs.0.name: unknown feature 'I99' (did you mean 'I9'?)",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [1], "datatype": "BYTES", "data": ["1"]}]},
            422,
            "inputs.0.datatype",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "C1", "shape": [1], "datatype": "FP32", "data": [1]}]},
            422,
            "inputs.0.datatype",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [2], "datatype": "FP32", "data": [1]}]},
            422,
            "inputs.0.data: 1 values for shape [2]",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]},
            422,
            "inputs.0.shape",
        ),
        (
            "/v2/models/dlrm/infer",
            {
                "inputs": [
                    {"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]},
                    {"name": "I2", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                ]
            },
            422,
            "inputs.1.shape",
        ),
        (
            "/v2/models/dlrm/infer",
            {
                "inputs": [
                    {"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]},
                    {"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]},
                ]
            },
            422,
            "inputs.1.name",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "C3", "shape": [2], "datatype": "BYTES", "data": ["a1", "xyz"]}]},
            422,
            "inputs.0.data.1",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [1], "datatype": "INT64", "data": [1.5]}]},
            422,
            "inputs.0.data.0",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": ["a"]}]},
            422,
            "inputs.0.data.0",
        ),
        ("/v2/models/dlrm/infer", {"inputs": []}, 422, "inputs"),
        (
            "/v2/models/dlrm/infer",
            {
                "inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]}],
                "outputs": [{"name": "scores"}],
            },
            422,
            "outputs.0.name",
        ),
        (
            "/v2/models/dlrm/infer",
            {"inputs": [{"name": "I1", "shape": [5000], "datatype": "FP32", "data": [1] * 5000}]},
            422,
            "inputs.0.shape",
        ),
    ],
)
def test_errors_in_the_v2_shape(client, path, body, status, starts):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"].startswith(starts), r.json()


def test_not_json_and_not_ready(tmp_path):
    with TestClient(create_app(Settings(store=f"file://{tmp_path}"))) as client:
        assert client.get("/v2/health/live").status_code == 200
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and set(r.json()) == {"error"} and "Retry-After" in r.headers
        assert client.get("/v2/models/dlrm/ready").status_code == 503
        r = client.post("/v2/models/dlrm/infer", content=b"{oops")
        assert r.status_code == 503  # no model: nothing to parse against yet


def test_concurrent_small_infer_requests_are_batched_and_answer_as_alone(client, lines):
    """Small infer requests arriving together are featurised on the event loop and coalesced by
    the batcher (``fastpath.Staged``): each answer as alone, with its own id, JSON or binary as
    asked."""

    def body(k: int) -> tuple[bytes, dict]:
        inputs = [t for t in v2_inputs([lines[k]]) if t["datatype"] != "INT64"]
        if k % 2:
            return binary_request(inputs, outputs_binary=True)
        return json.dumps({"id": f"r{k}", "inputs": inputs}).encode(), {
            "content-type": "application/json"
        }

    def prediction(r) -> float:
        if r.headers["content-type"] == "application/octet-stream":
            n = int(r.headers["Inference-Header-Content-Length"])
            return float(np.frombuffer(r.content[n:], "<f4")[0])
        return r.json()["outputs"][0]["data"][0]

    alone = [
        prediction(client.post("/v2/models/dlrm/infer", content=body(k)[0], headers=body(k)[1]))
        for k in range(12)
    ]
    service = client.app.state.service
    score, sizes = service.score, []

    def slow_first(model, inputs):
        sizes.append(len(inputs[0]))
        if len(sizes) == 1:
            time.sleep(0.3)  # the first call holds the batcher: the rest queue behind it
        return score(model, inputs)

    service.score = slow_first
    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(
                pool.map(
                    lambda k: client.post(
                        "/v2/models/dlrm/infer", content=body(k)[0], headers=body(k)[1]
                    ),
                    range(12),
                )
            )
    finally:
        service.score = score
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
    assert [answers[k].json()["id"] for k in range(0, 12, 2)] == [f"r{k}" for k in range(0, 12, 2)]
    np.testing.assert_allclose([prediction(a) for a in answers], alone, atol=1e-6)
    assert max(sizes) > 1, f"no batch formed: {sizes}"


def test_a_pinned_version_is_loaded_off_the_event_loop(store_url, lines):
    """Concurrent small requests for a pinned version not loaded yet: its load (a store read,
    hundreds of ms) runs in a pool thread, never on the event loop that prepares staged requests;
    every request gets that version's answer."""
    with TestClient(create_app(Settings(store=store_url))) as c:
        versions = c.app.state.service.versions
        load, threads = versions._load, []

        def recorded(version):
            threads.append(threading.current_thread().name)
            time.sleep(0.2)  # requests keep arriving while it loads
            return load(version)

        versions._load = recorded
        inputs = v2_inputs(lines[:1])
        loop_thread = c.portal.call(lambda: threading.current_thread().name)
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda _: c.post("/v2/models/dlrm/versions/old/infer", json={"inputs": inputs}),
                    range(8),
                )
            )
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert {a.json()["model_version"] for a in answers} == {"old"}
    assert threads and loop_thread not in threads, (loop_thread, threads)
