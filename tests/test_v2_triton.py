"""Triton's own HTTP client (``tritonclient``, binary tensors by default) against ``dlrm serve``:
probes, metadata, infer in binary and JSON, a pinned version, all behind an API key."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from dense_trainer.distributed import free_port

from .conftest import REPO
from .test_api import to_instance
from .test_v2 import lines, store_url  # noqa: F401 (the module's fixtures)

TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.http as triton

url, key, rows_file = sys.argv[1:4]
features = json.load(open(rows_file))  # [[name, datatype, values], ...]
client = triton.InferenceServerClient(url=url)
auth = {"Authorization": "Bearer " + key}
assert client.is_server_live() and client.is_server_ready()  # the probes need no key
assert client.is_model_ready("dlrm", headers=auth)
meta = client.get_model_metadata("dlrm", headers=auth)
out = {"inputs": [i["name"] for i in meta["inputs"]], "versions": meta["versions"]}
for mode, binary in (("binary", True), ("json", False)):
    tensors = []
    for name, datatype, values in features:
        if not binary and datatype == "FP32":
            continue  # JSON has no NaN: missing dense values only travel in binary tensors
        array = np.array(values, dtype=object if datatype == "BYTES" else np.float32)
        tensor = triton.InferInput(name, [len(values)], datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        tensors.append(tensor)
    wanted = [triton.InferRequestedOutput("predictions", binary_data=binary)]
    # (a fresh dict each call: tritonclient adds Inference-Header-Content-Length to the one given)
    result = client.infer("dlrm", tensors, outputs=wanted, headers=dict(auth),
                          request_id="triton-1")
    out[mode] = result.as_numpy("predictions").tolist()
    out[mode + "_version"] = result.get_response()["model_version"]
pinned = client.infer("dlrm", tensors, model_version="old", headers=dict(auth))
out["pinned_version"] = pinned.get_response()["model_version"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_tritons_own_client(store_url, lines, tmp_path):
    """tritonclient (Triton's HTTP client, binary tensors by default) against `dlrm serve`."""
    pytest.importorskip("tritonclient.http")
    rows = [line.split("\t") for line in lines[:16]]
    features = [
        [f"I{i + 1}", "FP32", [float(r[1 + i]) if r[1 + i] else float("nan") for r in rows]]
        for i in range(13)
    ]
    features += [[f"C{i + 1}", "BYTES", [r[14 + i] for r in rows]] for i in range(26)]
    (tmp_path / "rows.json").write_text(json.dumps(features))
    (tmp_path / "keys").write_text("triton-key-0123456789\n")
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "dlrm_cli.py"),
            "serve",
            "--store",
            store_url,
            "--port",
            str(port),
            "--api-key-file",
            str(tmp_path / "keys"),
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer triton-key-0123456789"}
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, (
                tmp_path / "serve.log"
            ).read_text()[-2000:]
            time.sleep(0.2)
        full = httpx.post(
            base + "/v1/models/dlrm:predict",
            headers=auth,
            timeout=10,
            json={"instances": [to_instance(x) for x in lines[:16]]},
        ).json()["predictions"]
        only_c = [
            {k: v for k, v in to_instance(x, named=True).items() if k.startswith("C")}
            for x in lines[:16]
        ]
        cats = httpx.post(
            base + "/v1/models/dlrm:predict", headers=auth, timeout=10, json={"instances": only_c}
        ).json()["predictions"]
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                TRITON_CLIENT,
                f"127.0.0.1:{port}",
                "triton-key-0123456789",
                str(tmp_path / "rows.json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert got["inputs"][:2] == ["I1", "I2"] and got["versions"] == ["old", "new"]
    assert got["binary"] == pytest.approx(full, abs=1e-6) and got["binary_version"] == "new"
    assert got["json"] == pytest.approx(cats, abs=1e-6)
    assert got["pinned_version"] == "old"
