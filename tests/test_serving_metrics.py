"""Observability of the serving API: metric values that follow the traffic, one view over two
workers, request ids, JSON logs, the access log and the JSON 500 of last resort."""

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.settings import Settings
from dense_trainer.distributed import free_port
from dlrm_core.logs import JsonFormatter, RequestIdFilter
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .conftest import REPO
from .test_api import GOOD

PREDICT = "/v1/models/{name}:predict"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def test_metric_values_follow_the_traffic(redis_server, trained_criteo, criteo_sample):
    url = f"{redis_server.url}?prefix=met{uuid.uuid4().hex[:6]}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    line = (criteo_sample / "test.txt").read_text().splitlines()[0]
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        before = client.get("/metrics").text
        for _ in range(3):
            assert (
                client.post("/v1/models/dlrm:predict", json={"instances": [GOOD, GOOD]}).status_code
                == 200
            )
        assert client.post("/v1/models/dlrm:predict_tsv", content=line).status_code == 200
        v2 = {
            "inputs": [
                {"name": "C1", "shape": [3], "datatype": "BYTES", "data": ["a1", "b2", "c3"]}
            ]
        }
        assert client.post("/v2/models/dlrm/infer", json=v2).status_code == 200
        assert client.post("/v1/models/dlrm:predict", json={"instances": []}).status_code == 422
        assert client.get("/v1/models/nope").status_code == 404
        assert client.get("/no/such/path").status_code == 404
        after = client.get("/metrics").text
        # A live update: the generation and the lag gauges move once the replica applies it.
        open_store(url).update_rows(
            "v1", {"C1": (np.array([1, 2, 3]), np.zeros((3, 8), np.float32))}
        )
        deadline = time.time() + 5
        while (
            value(live := client.get("/metrics").text, "dlrm_model_generation") != 1
            and time.time() < deadline
        ):
            time.sleep(0.05)
    assert (
        value(live, "dlrm_model_generation") == 1
        and value(live, "dlrm_live_row_updates_total") == 3
    )
    assert 0 <= value(live, "dlrm_live_update_lag_seconds") < 5
    latency = "dlrm_request_latency_seconds_count"
    assert value(before, latency, route=PREDICT, method="POST", status="200") == 0
    assert value(after, latency, route=PREDICT, method="POST", status="200") == 3
    assert value(after, latency, route=PREDICT, method="POST", status="422") == 1
    assert value(after, latency, route="/v2/models/{name}/infer", method="POST", status="200") == 1
    assert value(after, latency, route="/v1/models/{name}", method="GET", status="404") == 1
    # never the raw path
    assert value(after, latency, route="unmatched", method="GET", status="404") == 1
    assert value(after, "dlrm_batch_instances_count", input="instances") == 3
    assert value(after, "dlrm_batch_instances_sum", input="instances") == 6
    assert value(after, "dlrm_batch_instances_sum", input="lines") == 1
    assert value(after, "dlrm_batch_instances_sum", input="tensors") == 3
    # GOOD's rows were missed once, then hit: the ratio moves with the traffic.
    hits, misses = value(after, "dlrm_cache_hits_total"), value(after, "dlrm_cache_misses_total")
    assert (
        hits > 0
        and misses > 0
        and value(after, "dlrm_cache_hit_ratio") == pytest.approx(hits / (hits + misses))
    )
    # One store round trip per request that missed some row: the first predict, the line, the
    # tensors.
    lookups = "dlrm_store_seconds_count"
    assert (
        value(after, lookups, operation="lookup") - value(before, lookups, operation="lookup") == 3
    )
    # it kept polling
    assert value(live, lookups, operation="poll") > value(before, lookups, operation="poll")
    assert value(after, "dlrm_model_version_info", version="v1") == 1
    assert 0 < value(after, "dlrm_model_age_seconds") < 3600
    assert 0 <= value(after, "dlrm_store_staleness_seconds") < 5
    assert value(after, "process_resident_memory_bytes") > 0
    assert value(after, "dlrm_unknown_ids_total") == 0


@pytest.mark.slow
def test_two_workers_count_every_request(tmp_path, trained_criteo):
    url = f"file://{tmp_path / 'store'}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    port, metrics_dir = free_port(), tmp_path / "prom"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "dlrm_cli.py"),
            "serve",
            "--store",
            url,
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:  # bounded wait: both workers up with the model
            try:
                r = httpx.get(base + "/readyz", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, (
                tmp_path / "serve.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        assert r.json()["workers"] == 2
        n = 40
        for _ in range(n):  # a new connection each: the kernel spreads them over the workers
            assert (
                httpx.post(
                    base + "/v1/models/dlrm:predict", json={"instances": [GOOD]}, timeout=10
                ).status_code
                == 200
            )
        for _ in range(6):  # whichever worker answers, it counts every worker's requests
            text = httpx.get(base + "/metrics", timeout=10).text
            assert (
                value(
                    text,
                    "dlrm_request_latency_seconds_count",
                    route=PREDICT,
                    method="POST",
                    status="200",
                )
                == n
            )
            assert value(text, "dlrm_batch_instances_sum", input="instances") == n
        pids = {
            s.labels["pid"]
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "process_resident_memory_bytes"
        }
        assert len(pids) == 2
        per_worker = {}
        for pid in pids:  # each worker's own files: both took part
            own = tmp_path / f"only-{pid}"
            own.mkdir()
            for f in metrics_dir.glob(f"*_{pid}.db"):
                shutil.copy(f, own)
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(own))
            per_worker[pid] = sum(
                s.value
                for fam in registry.collect()
                for s in fam.samples
                if s.name == "dlrm_batch_instances_count"
            )
        assert sum(per_worker.values()) == n and min(per_worker.values()) > 0, per_worker
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_request_ids_json_logs_and_the_json_500(tmp_path, trained_criteo):
    url = f"file://{tmp_path / 'store'}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    api_log = logging.getLogger("api")
    api_log.addHandler(handler)
    old_level = api_log.level
    api_log.setLevel(logging.INFO)
    try:
        with TestClient(create_app(Settings(store=url, access_log=True))) as client:
            r = client.post(
                "/v1/models/dlrm:predict",
                json={"instances": [GOOD]},
                headers={"X-Request-ID": "abc-123"},
            )
            assert r.status_code == 200 and r.headers["X-Request-ID"] == "abc-123"
            r = client.get("/healthz", headers={"X-Request-ID": "bad id forged: line"})
            assert (
                r.headers["X-Request-ID"] != "bad id forged: line"
                and len(r.headers["X-Request-ID"]) == 32
            )
            assert client.get("/x%0A12:00:00 INFO forged").status_code == 404  # logged on one line

            def boom(*_):
                raise RuntimeError("a bug")

            client.app.state.service.score = boom
            r = client.post(
                "/v1/models/dlrm:predict",
                json={"instances": [GOOD]},
                headers={"X-Request-ID": "req-500"},
            )
            assert r.status_code == 500 and r.headers["content-type"] == "application/json"
            assert r.json() == {
                "error": "internal server error",
                "field": None,
                "request_id": "req-500",
            }
            r = client.post(
                "/v2/models/dlrm/infer",
                json={"inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]}]},
            )
            assert r.status_code == 500 and set(r.json()) == {"error", "request_id"}
    finally:
        api_log.removeHandler(handler)
        api_log.setLevel(old_level)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    access = [r for r in records if r["logger"] == "api.access"]
    assert {
        "method": "POST",
        "route": PREDICT,
        "status": 200,
        "request_id": "abc-123",
    }.items() <= access[0].items()
    crash = [r for r in records if r["level"] == "ERROR"]
    assert crash[0]["request_id"] == "req-500" and "RuntimeError: a bug" in crash[0]["exc"]
    assert any(r.get("request_id") == "req-500" and r["status"] == 500 for r in access)
    assert any(r["path"] == "/x\\n12:00:00 INFO forged" for r in access)


def test_generated_request_ids_are_unique_across_calls_and_forks():
    from api.middleware import _request_id

    ids = [_request_id([]) for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh prefix, so its ids cannot repeat the parent's
        os.write(write, _request_id([]).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    assert len(child) == 32 and child[:16] != ids[-1][:16] and child not in ids
