"""The scoring routes' lean path (api/fastpath.py) answers exactly as FastAPI's router does:
same status, body and headers for good requests and every kind of error, same latency labels,
authentication and body cap still applied, and the request id on the handler's log lines."""

import json
import threading

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.fastpath import FastScoring, get_route_path
from api.service import ModelService
from api.settings import Settings
from dlrm_core.logs import REQUEST_ID
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

KEY = "k-fast-1-0123456789"


@pytest.fixture(scope="module")
def store_url(trained_criteo, tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('fast-store')}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    return url


@pytest.fixture(scope="module")
def lines(criteo_sample):
    return (criteo_sample / "test.txt").read_text().splitlines()[:5]


def instance(line: str) -> dict:
    f = line.split("\t")
    return {
        "dense": [int(x) if x else None for x in f[1:14]],
        "sparse": [x or None for x in f[14:40]],
    }


def requests(lines) -> list[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments): answers and errors of every scoring route."""
    one = json.dumps({"instances": [instance(lines[0])]})
    tensor = [
        {"name": "I1", "shape": [2], "datatype": "FP32", "data": [1, 2]},
        {"name": "C1", "shape": [2], "datatype": "BYTES", "data": ["68fd1e64", "x"]},
    ]
    bad_sparse = {"instances": [{"dense": [1] * 13, "sparse": ["a"] * 25}]}
    return [
        ("POST", "/v1/models/dlrm:predict", {"content": one}),
        ("POST", "/v1/models/dlrm:predict", {"json": {"instances": [instance(x) for x in lines]}}),
        ("POST", "/v1/models/dlrm/versions/v1:predict", {"content": one}),
        ("POST", "/v1/models/dlrm/versions/gone:predict", {"content": one}),  # 404 version
        ("POST", "/v1/models/nope:predict", {"content": one}),  # 404 name
        ("POST", "/v1/models/dlrm:predict", {"json": bad_sparse}),  # 422 naming the field
        ("POST", "/v1/models/dlrm:predict", {"content": b"{not json"}),  # 422 body
        ("POST", "/v1/models/dlrm:predict", {"json": {"instances": []}}),
        # over the test's 4 KiB cap: 413
        ("POST", "/v1/models/dlrm:predict", {"content": b"x" * 5000}),
        ("POST", "/v1/models/dlrm:predict_tsv", {"content": "\n".join(lines[:3]).encode()}),
        ("POST", "/v1/models/dlrm/versions/v1:predict_tsv", {"content": lines[0].encode()}),
        ("POST", "/v1/models/dlrm:predict_tsv", {"content": b"1\t2\n"}),
        ("POST", "/v2/models/dlrm/infer", {"json": {"id": "r1", "inputs": tensor}}),
        ("POST", "/v2/models/dlrm/versions/v1/infer", {"json": {"inputs": tensor}}),
        (
            "POST",
            "/v2/models/dlrm/infer",
            {"json": {"inputs": [{"name": "I99", "shape": [1], "datatype": "FP32", "data": [1]}]}},
        ),
        ("POST", "/v2/models/nope/infer", {"json": {"inputs": tensor}}),
        ("GET", "/v1/models/dlrm:predict", {}),  # 405 from FastAPI either way
        ("POST", "/v1/models/dlrm", {"content": one}),  # no POST route: 405
        ("POST", "/v1/models/dlrm:predictx", {"content": one}),  # no route
        ("POST", "/v1/models/a/b:predict", {"content": one}),  # {name} holds no slash: no route
    ]


def answers(client: TestClient, lines, auth: dict) -> list[tuple]:
    out = []
    for method, path, kwargs in requests(lines):
        r = client.request(method, path, headers={**auth, **kwargs.pop("headers", {})}, **kwargs)
        headers = {k: v for k, v in r.headers.items() if k not in ("x-request-id", "date")}
        out.append((path, r.status_code, r.content, headers))
    return out


def latency_labels(client: TestClient) -> list[str]:
    text = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sorted(
        line.split(" ")[0]
        for line in text.splitlines()
        if line.startswith("dlrm_request_latency_seconds_count")
    )


@pytest.mark.parametrize(("auth", "inline"), [(False, 0), (True, 0), (False, 4096)])
def test_fast_path_answers_as_fastapi_does(store_url, lines, auth, inline, monkeypatch):
    keys = {"api_key": KEY} if auth else {}
    headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
    runs, threads = {}, []
    real = ModelService.prepare_json

    def spy(self, name, body, version=None):
        threads.append((threading.current_thread().name, version))
        return real(self, name, body, version)

    monkeypatch.setattr(ModelService, "prepare_json", spy)
    for fast in (False, True):
        threads.clear()
        settings = Settings(
            store=store_url, fast_path=fast, max_body_bytes=4096, inline_max_bytes=inline, **keys
        )
        with TestClient(create_app(settings)) as client:
            runs[fast] = (answers(client, lines, headers), latency_labels(client))
        # FastAPI: anyio's threads; the lean path: its pool, or the loop for small bodies when
        # inline, unless they name a version not loaded (its load reads the store: the pool)
        assert {t.startswith("score") for t, v in threads if v != "gone"} == {fast and not inline}
        assert {t.startswith("score") for t, v in threads if v == "gone"} == {fast}
    (slow, slow_labels), (quick, quick_labels) = runs[False], runs[True]
    for a, b in zip(slow, quick, strict=True):
        assert a == b, a[0]
    assert {s for _, s, _, _ in quick} >= {200, 404, 405, 413, 422}
    assert slow_labels == quick_labels
    assert any(
        'route="/v1/models/{name}:predict"' in x and 'status="200"' in x for x in quick_labels
    )


def test_fast_path_keeps_authentication(store_url, lines):
    with TestClient(create_app(Settings(store=store_url, api_key=KEY))) as client:
        body = {"instances": [instance(lines[0])]}
        r = client.post("/v1/models/dlrm:predict", json=body)
        assert r.status_code == 401 and r.json()["field"] == "Authorization"
        r = client.post(
            "/v1/models/dlrm:predict", json=body, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        assert (
            client.post(
                "/v1/models/dlrm:predict", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ).status_code
            == 200
        )


def test_handler_log_lines_carry_the_request_id(store_url, lines, monkeypatch):
    """The handler runs in a pool thread with the request's context variables."""
    seen = []
    real = ModelService.prepare_json

    def logged(self, *args, **kwargs):
        seen.append(REQUEST_ID.get(None))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelService, "prepare_json", logged)
    with TestClient(create_app(Settings(store=store_url))) as client:
        r = client.post(
            "/v1/models/dlrm:predict",
            json={"instances": [instance(lines[0])]},
            headers={"X-Request-ID": "req-fast-42"},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-fast-42"
    assert seen == ["req-fast-42"]


def test_routing_follows_the_apps_post_routes_in_order():
    def handler(*_):
        raise AssertionError("not called")

    layer = FastScoring(
        None, [("/a/{x}", "GET"), ("/a/{x}", "POST"), ("/a/{x}:go", "POST")], {"/a/{x}:go": handler}
    )
    # "/a/{x}" comes first and its {x} matches "k:go": FastAPI's route, not the fast one.
    assert layer.match({"type": "http", "path": "/a/k:go", "root_path": ""}) is None
    layer = FastScoring(None, [("/a/{x}:go", "POST"), ("/a/{x}", "POST")], {"/a/{x}:go": handler})
    route, params = layer.match({"type": "http", "path": "/a/k:go", "root_path": ""})
    assert route.path == "/a/{x}:go" and params == {"x": "k"}
    assert get_route_path({"path": "/api/a/k:go", "root_path": "/api"}) == "/a/k:go"
    with pytest.raises(ValueError, match="without a POST route"):
        FastScoring(None, [("/b", "GET")], {"/b": handler})


def _metric(client: TestClient, name: str) -> float:
    text = client.get("/metrics").text
    return sum(
        float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def test_redis_requests_with_every_row_cached_are_scored_on_the_loop(
    trained_criteo, redis_server, lines, monkeypatch
):
    """A lone small request on Redis runs on the event loop when the row cache holds all its rows;
    one that would read Redis (a miss, a pinned version not loaded yet) goes to the pool, scored
    once there (metrics counted once), and every answer is the one the pool alone gives."""
    url = redis_server.url + "?prefix=fast-inline"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    publish_checkpoint(trained_criteo, open_store(url), version="v2")  # current: v2
    threads = []
    real = ModelService.score

    def spy(self, model, inputs):
        threads.append(threading.current_thread().name.startswith("score"))
        return real(self, model, inputs)

    monkeypatch.setattr(ModelService, "score", spy)
    bodies = [
        ("dlrm", lines[1]),
        ("dlrm", lines[1]),
        ("dlrm", lines[2]),
        ("dlrm", lines[2]),
        ("dlrm/versions/v1", lines[1]),
        ("dlrm/versions/v1", lines[1]),
    ]
    runs = {}
    for inline in (0, 4096):
        with TestClient(create_app(Settings(store=url, inline_max_bytes=inline))) as client:
            threads.clear()
            runs[inline] = [
                client.post(
                    f"/v1/models/{path}:predict",
                    content=json.dumps({"instances": [instance(line)]}),
                ).content
                for path, line in bodies
            ]
            scored = list(threads)  # a pinned version's load scores one warm-up request too
            requests_counted = _metric(client, "dlrm_model_batch_requests_count")
            hits = _metric(client, "dlrm_cache_hits_total")
        if inline:
            # miss: pool; all cached: loop; v1 not loaded: pool (its load, then the request);
            # cached: loop
            assert scored == [True, False, True, False, True, True, False]
        else:
            assert all(scored)
        assert requests_counted == len(bodies)  # an offloaded request is scored once
        if not inline:
            hits_in_pool = hits
    assert hits == hits_in_pool
    assert runs[0] == runs[4096]


def test_each_scoring_route_is_declared_once():
    """Every POST route that scores (V1 and V2, current and pinned) comes from one
    ``ScoringRoute``: its FastAPI endpoint, its fast-path handler and its staged split."""
    from api.router import SCORING as V1
    from api.scoring import fast_handlers, staged_handlers
    from api.v2.router import SCORING as V2

    app = create_app(Settings(store="file:///nonexistent"))
    posts = {t for t, method in app.state.routes if method == "POST"}
    scoring = {t for t in posts if t.endswith((":predict", ":predict_tsv", "/infer"))}
    declared = [path for r in [*V1, *V2] for path in r.paths]
    assert len(declared) == len(set(declared)) == 6
    assert set(declared) == scoring == set(fast_handlers([*V1, *V2]))
    assert set(staged_handlers([*V1, *V2])) == scoring
    layer = FastScoring(None, app.state.routes, fast_handlers([*V1, *V2]))
    assert {r.path for r in layer.routes if r.handler is not None} == scoring
