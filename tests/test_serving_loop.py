"""The event loop never blocks: bodies decoded in short slices off the loop (same answers as
pydantic's own parser), the ids cap in each protocol's error shape, and ``/healthz`` answering
within 50 ms on a real uvicorn server while maximum-size requests are being scored."""

import gc
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import create_app
from api.decode import infer_request, predict_request
from api.schemas import PredictRequest
from api.settings import Settings
from api.v2.protocol import InferRequest
from dense_trainer.distributed import free_port

from .conftest import REPO
from .test_api import GOOD, file_store_url, to_instance  # noqa: F401 - file_store_url is a fixture

BODIES = [
    b'{"instances": [{"dense": [1, 2.5, null], "sparse": ["a", 5, ["x", 3], null]}]}',
    b' \n{ "instances" :[ {"I1": 3, "C1": "68fd1e64"} , {"C2": []} ] } \n',
    b'{"instances": [{"I1": true}]}',
    b'{"instances": [{"dense": ["1"], "sparse": []}]}',
    b'{"instances": [NaN]}',
    b'{"instances": [{"I1": Infinity}]}',
    b'{"instances": [1, "x", null, []]}',
    b'{"instances": []}',
    b"{}",
    b"[]",
    b"{oops",
    b'{"instances": [{"C1": "a"}]} trailing',
    b'{"instances": [{"C1": "a"}], "instances": [{"C1": "b"}]}',
    b'{"instances": [{"C1": "a"}], "x": 1}',
    b'{"instances": [{"C1": "\\ud800"}]}',
    b'{"instances": [{"C1": "caf\\u00e9"}]}',
    b"\xff\xfe",
    b'{"instances": [' + b",".join([b'{"I1": 1}'] * 300 + [b'{"I1": "a"}']) + b"]}",
    json.dumps({"instances": [{"dense": [1] * 3, "sparse": ["a"] * 2, "x": 1}] * 600}).encode(),
]


def _outcome(parse, body):
    """The parsed request, or its first 20 errors (all that an error answer reports)."""
    try:
        parsed = parse(body)
        return "ok", {k: repr(getattr(parsed, k)) for k in type(parsed).model_fields}
    except ValidationError as exc:
        return "invalid", [(e["loc"], e["type"]) for e in exc.errors()][:20]
    except RequestValidationError as exc:
        return "invalid", [(tuple(e["loc"]), e["type"]) for e in exc.errors()][:20]


@pytest.mark.parametrize("body", BODIES)
def test_sliced_decoding_answers_as_pydantic_does(body):
    assert _outcome(predict_request, body) == _outcome(PredictRequest.model_validate_json, body)


@pytest.mark.parametrize(
    "body",
    [
        {
            "inputs": [{"name": "C1", "shape": [2], "datatype": "BYTES", "data": ["a", None]}],
            "id": "x",
        },
        {
            "inputs": [{"name": "I1", "shape": [2, 1], "datatype": "FP32", "data": [[1], [2]]}],
            "outputs": [{"name": "predictions", "parameters": {"binary_data": True}}],
        },
        {"inputs": [{"name": "C1", "shape": [1], "datatype": "NOPE", "data": ["a"]}]},
        {
            "inputs": [
                {"name": "C1", "shape": [1], "datatype": "BYTES"},
                {"name": "C2", "shape": [-1], "datatype": "BYTES"},
            ]
        },
        {"inputs": [{"name": "C1", "shape": [1], "datatype": "BYTES", "data": ["a"]}], "extra": 1},
        {"inputs": []},
        {"id": 5, "inputs": [{"name": "C1", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
    ],
)
def test_sliced_v2_decoding_answers_as_pydantic_does(body):
    raw = json.dumps(body).encode()
    assert _outcome(infer_request, raw) == _outcome(InferRequest.model_validate_json, raw)


def test_ids_cap_is_a_413_in_each_protocols_shape(file_store_url, criteo_sample):
    line = (criteo_sample / "test.txt").read_text().splitlines()[0]
    settings = Settings(store=file_store_url, max_ids_per_request=52)  # two one-hot Criteo examples
    with TestClient(create_app(settings)) as client:
        assert (
            client.post("/v1/models/dlrm:predict", json={"instances": [GOOD, GOOD]}).status_code
            == 200
        )
        r = client.post("/v1/models/dlrm:predict", json={"instances": [GOOD] * 3})
        assert r.status_code == 413 and r.json()["field"] == "body", r.text
        assert (
            "78 categorical ids" in r.json()["error"]
            and "max_ids_per_request=52" in r.json()["error"]
        )
        # one bag
        r = client.post("/v1/models/dlrm:predict", json={"instances": [{"C1": ["a"] * 60}]})
        assert r.status_code == 413 and "max_ids_per_request=52" in r.json()["error"]
        r = client.post("/v1/models/dlrm:predict_tsv", content="\n".join([line] * 3))
        assert r.status_code == 413 and r.json()["field"] == "body"
        v2 = {
            "inputs": [{"name": "C1", "shape": [3], "datatype": "BYTES", "data": ["a", "b", "c"]}]
        }
        r = client.post("/v2/models/dlrm/infer", json=v2)
        assert r.status_code == 413 and set(r.json()) == {"error"}, r.text
        assert r.json()["error"].startswith("body: 78 categorical ids")


BIG_REQUESTS = """
import json, sys, time
from pathlib import Path
import httpx
base, bodies, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
reqs = [("/v1/models/dlrm:predict", (bodies / "v1").read_bytes()),
        ("/v1/models/dlrm:predict_tsv", (bodies / "tsv").read_bytes()),
        ("/v2/models/dlrm/infer", (bodies / "v2").read_bytes())]
busy, failures = [], []
with httpx.Client(base_url=base, timeout=60) as client:
    (bodies / "started").touch()
    while not (bodies / "stop").exists() and len(busy) < 200:
        for path, body in reqs:
            t0 = time.time()
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            answer = r.json() if r.status_code == 200 else {}
            got = answer["outputs"][0]["data"] if "outputs" in answer else answer.get("predictions")
            got = got or []
            if r.status_code != 200 or len(got) != n:
                failures.append(r.text[:300])
            busy.append((t0, time.time()))
print(json.dumps({"busy": busy, "failures": failures}))
"""


def _serve(store_url: str, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "DLRM_STORE": store_url,
        "DLRM_ACCESS_LOG": "false",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "api.main:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=REPO,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready in 60 s")


def test_healthz_answers_within_50ms_while_max_size_requests_are_scored(
    file_store_url, criteo_sample, tmp_path
):
    lines = (criteo_sample / "test.txt").read_text().splitlines()
    n = Settings().max_instances  # the largest request the server takes
    rows = [lines[i % len(lines)] for i in range(n)]
    json_body = json.dumps({"instances": [to_instance(x, named=True) for x in rows]}).encode()
    tsv_body = "\n".join(rows).encode()
    named = [to_instance(x, named=True) for x in rows]
    v2_body = json.dumps(
        {
            "inputs": [
                {
                    "name": k,
                    "shape": [n],
                    "datatype": "FP32" if k.startswith("I") else "BYTES",
                    "data": [i[k] for i in named],
                }
                for k in named[0]
            ]
        }
    ).encode()
    port = free_port()
    proc = _serve(file_store_url, port)
    base = f"http://127.0.0.1:{port}"
    bodies = tmp_path / "bodies"
    bodies.mkdir()
    for name, body in (("v1", json_body), ("tsv", tsv_body), ("v2", v2_body)):
        (bodies / name).write_bytes(body)
    # The big requests come from a process of their own: from a thread of this one, their
    # encoding and decoding would hold this process's GIL and time the probes' own stalls.
    sender = subprocess.Popen(
        [sys.executable, "-c", BIG_REQUESTS, base, str(bodies), str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    gc.collect()
    gc.disable()  # this process's own collections would count as the server's latency
    try:
        with httpx.Client(base_url=base, timeout=10) as probe:
            probe.get("/healthz")
            probes = []
            deadline = time.perf_counter() + 60
            while not (bodies / "started").exists() and time.perf_counter() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            t_end = time.perf_counter() + 6
            while time.perf_counter() < t_end and sender.poll() is None:
                t0 = time.time()
                assert probe.get("/healthz").status_code == 200
                probes.append((t0, time.time() - t0))
                time.sleep(0.01)
        (bodies / "stop").touch()
        out, _ = sender.communicate(timeout=60)
    finally:
        gc.enable()
        (bodies / "stop").touch()
        if sender.poll() is None:
            sender.kill()
        proc.terminate()
        proc.wait(timeout=20)
    report = json.loads(out.strip().splitlines()[-1])
    failures, busy = report["failures"], report["busy"]
    assert not failures, failures
    assert len(busy) >= 4, "too few big requests were scored to test anything"
    during = [s for t0, s in probes if any(a <= t0 <= b for a, b in busy)]
    assert len(during) >= 50
    slowest = sorted(during)[-5:]
    print(
        f"healthz during big requests: {len(during)} probes, slowest "
        f"{[round(x * 1e3, 1) for x in slowest]} ms"
    )
    # Every probe within 50 ms but for the other tenants of the machine: its 2 cores are shared,
    # and a busy neighbour can keep any thread off a core for tens of ms, so the test allows 1%
    # over 50 ms (none over 150). A loop blocked by decoding fails it: each max-size JSON body,
    # decoded on the loop (before this change), stalled /healthz for 50-80 ms.
    p99 = sorted(during)[int(0.99 * len(during))]
    assert p99 < 0.050 and max(during) < 0.150, (
        f"slowest /healthz {[round(x * 1e3, 1) for x in slowest]} ms"
    )
