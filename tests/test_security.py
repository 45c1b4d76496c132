"""Keys on every route but the probes (checked before the body is read), rotation, the OpenAPI
security scheme; store passwords never shown (logs, errors, metrics, CLI), password files, TLS
to a real TLS redis-server, and the compose ACL: the API's Redis user cannot write."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import OPEN_PATHS
from api.docs import OPEN_PAGES
from api.settings import Settings
from dense_trainer.distributed import free_port
from dlrm_cli import main as dlrm
from dlrm_core.errors import ConfigError
from dlrm_core.secrets import redact_url
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import StoreUnavailable, open_store

from .conftest import REPO
from .redis_server import RedisServer, make_certificates

K1, K2 = "k1-0123456789abcdef", "k2-0123456789abcdef"
GOOD = {"dense": [1] * 13, "sparse": ["68fd1e64"] * 26}


@pytest.fixture(scope="module")
def store_url(trained_criteo, tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('store')}"
    publish_checkpoint(trained_criteo, open_store(url), version="v1")
    return url


def concrete(path: str) -> str:
    return path.replace("{name}", "dlrm").replace("{version}", "v1")


def test_every_route_but_the_probes_needs_a_key(store_url):
    """Every route but the probes and the documentation's static shells (which hold nothing of
    the model: /openapi.json, which does, needs a key)."""
    app = create_app(Settings(store=store_url, api_key=f"{K1}, {K2}"))
    routes = app.state.routes
    assert {"/metrics", "/docs", "/openapi.json", "/v2/models/{name}/infer"} <= {
        p for p, _ in routes
    }
    with TestClient(app) as client:
        for path, method in routes:
            r = client.request(method, concrete(path), content=b"{not json")
            if path in OPEN_PATHS or path in OPEN_PAGES:
                assert r.status_code != 401, path
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert r.json()["error"].endswith("bearer API key")
        for key in (K1, K2):  # both keys of a rotation are valid
            r = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert client.get("/docs", headers={"Authorization": f"Bearer {K2}"}).status_code == 200
        r = client.post(
            "/v1/models/dlrm:predict",
            json={"instances": [GOOD]},
            headers={"Authorization": "Bearer k3-not-a-valid-key-at-all"},
        )
        assert r.status_code == 401 and r.json()["field"] == "Authorization"
        r = client.post("/v2/models/dlrm/infer", json={}, headers={"Authorization": f"Basic {K1}"})
        assert r.status_code == 401 and set(r.json()) == {"error"}  # the V2 error shape


def test_the_key_is_checked_before_the_body_is_read(store_url):
    read = []

    def body():
        read.append(1)
        yield json.dumps({"instances": [GOOD]}).encode()

    with TestClient(create_app(Settings(store=store_url, api_key=K1))) as client:
        r = client.post(
            "/v1/models/dlrm:predict", content=body(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 401
        assert read == []  # never pulled
        r = client.post(
            "/v1/models/dlrm:predict",
            content=b"x" * (32 << 20),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 401  # not 413, not 422: nothing was parsed


def test_key_file_rotation_without_restart(store_url, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# current keys\nold-key-0123456789ab\n")
    with TestClient(create_app(Settings(store=store_url, api_key_file=keys))) as client:

        def status(key):
            return client.get(
                "/v1/models/dlrm", headers={"Authorization": f"Bearer {key}"}
            ).status_code

        assert status("old-key-0123456789ab") == 200 and status("new-key-0123456789ab") == 401
        keys.write_text("old-key-0123456789ab\nnew-key-0123456789ab\n")  # step 1: both
        deadline = time.time() + 5
        while status("new-key-0123456789ab") != 200 and time.time() < deadline:
            time.sleep(0.2)
        assert status("new-key-0123456789ab") == 200 and status("old-key-0123456789ab") == 200
        keys.write_text("new-key-0123456789ab\n")  # step 2: the old one is gone
        while status("old-key-0123456789ab") != 401 and time.time() < deadline + 5:
            time.sleep(0.2)
        assert status("old-key-0123456789ab") == 401 and status("new-key-0123456789ab") == 200
        # an emptied file keeps the keys it had (logged), never locks everyone out
        keys.write_text("")
        time.sleep(1.2)
        assert status("new-key-0123456789ab") == 200
        keys.write_text("short\n")  # and so does one with a short key
        time.sleep(1.2)
        assert status("new-key-0123456789ab") == 200 and status("short") == 401
    with pytest.raises(ConfigError, match="at least 16 are needed"):  # at start both are refused
        create_app(Settings(store=store_url, api_key_file=keys))
    keys.write_text("")
    with pytest.raises(ConfigError, match="no key"):
        create_app(Settings(store=store_url, api_key_file=keys))


def test_openapi_declares_the_bearer_scheme(store_url):
    with TestClient(create_app(Settings(store=store_url, api_key=K1))) as client:
        doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {K1}"}).json()
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert doc["paths"]["/v2/health/ready"]["get"]["security"] == []
    assert "401" in doc["paths"]["/v1/models/{name}:predict"]["post"]["responses"]
    with TestClient(create_app(Settings(store=store_url))) as client:  # no keys: no scheme
        assert "security" not in client.get("/openapi.json").json()


def test_redact_url():
    assert redact_url("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert (
        redact_url("rediss://api:s3cret@h:1/0?ssl_ca_certs=/ca.pem&password=x")
        == "rediss://api:***@h:1/0?ssl_ca_certs=/ca.pem&password=***"
    )
    assert redact_url("redis://h:1/0?prefix=m") == "redis://h:1/0?prefix=m"
    assert redact_url("file:///srv/store") == "file:///srv/store"


SECRET = "s3cr3t-Pa55w0rd"


def _serve(args: list[str], port: int, env: dict, log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, str(REPO / "dlrm_cli.py"), "serve", "--port", str(port), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_http(port: int, path: str = "/healthz", timeout: float = 60) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"nothing answered on port {port}")


@pytest.mark.slow
def test_a_store_password_appears_nowhere(tmp_path, trained_criteo, capfd):
    import httpx

    dead = free_port()  # nothing listens there: every store call fails
    pw_file = tmp_path / "pw"
    pw_file.write_text(SECRET + "\n")
    seen = []
    for i, (url, extra) in enumerate(
        [
            (f"redis://:{SECRET}@127.0.0.1:{dead}/0", []),
            (f"redis://dlrm@127.0.0.1:{dead}/0", ["--store-password-file", str(pw_file)]),
        ]
    ):
        port = free_port()
        log_path = tmp_path / f"serve{i}.log"
        workers = "2" if i == 0 else "1"
        proc = _serve(
            ["--store", url, "--workers", workers, "--log-level", "debug", "--access-log", *extra],
            port,
            {
                "DLRM_POLL_INTERVAL_S": "0.1",
                "DLRM_STORE_TIMEOUT_S": "0.2",
                "DLRM_LOG_FORMAT": "json",
            },
            log_path,
        )
        try:
            _wait_http(port)
            base = f"http://127.0.0.1:{port}"
            for method, path, body in [
                ("POST", "/v1/models/dlrm:predict", {"instances": [GOOD]}),
                (
                    "POST",
                    "/v2/models/dlrm/infer",
                    {"inputs": [{"name": "I1", "shape": [1], "datatype": "FP32", "data": [1]}]},
                ),
                ("GET", "/v1/models/dlrm", None),
                ("GET", "/readyz", None),
                ("GET", "/v2/health/ready", None),
                ("GET", "/openapi.json", None),
                ("GET", "/metrics", None),
                ("GET", "/v2/models/dlrm", None),
            ]:
                r = httpx.request(method, base + path, json=body, timeout=5)
                assert r.status_code < 500 or r.status_code == 503, (path, r.status_code, r.text)
                seen.append(f"{path} {r.status_code} {dict(r.headers)} {r.text}")
            time.sleep(1.0)  # several failed polls per worker, each logged
        finally:
            _stop(proc)
        text = log_path.read_text()
        assert "store refresh failed" in text and "unavailable" in text, text[-2000:]
        seen.append(text)
    for cmd in (
        [
            "publish",
            "--checkpoint",
            str(trained_criteo),
            "--store",
            f"redis://:{SECRET}@127.0.0.1:{dead}/0",
        ],
        ["store", "list", "--store", f"redis://:{SECRET}@127.0.0.1:{dead}/0"],
        ["store", "gc", "--store", f"rediss://u:{SECRET}@127.0.0.1:{dead}/0"],
        [
            "store",
            "list",
            "--store",
            f"redis://u@127.0.0.1:{dead}/0",
            "--store-password-file",
            str(pw_file),
        ],
        ["store", "list", "--store", f"bogus://:{SECRET}@x/0"],
    ):
        assert dlrm(["-v", *cmd]) == 2  # debug logging on: nothing may leak there either
        out, err = capfd.readouterr()
        assert err.strip().splitlines()[-1].startswith(f"dlrm {cmd[0]}: error:"), err
        seen.append(out + err)
    everything = "\n".join(seen)
    assert "***" in everything  # the URLs were shown, redacted
    assert SECRET not in everything


def test_password_file_and_redacted_errors(tmp_path, trained_criteo):
    server = RedisServer(tmp_path, password=SECRET).start()
    try:
        pw = tmp_path / "pw"
        pw.write_text(SECRET + "\n")
        store = open_store(f"redis://127.0.0.1:{server.port}/0", password_file=pw)
        assert store.current_version() is None and SECRET not in store.url
        os.environ["DLRM_STORE_PASSWORD_FILE"] = str(pw)  # what every process reads (trainers too)
        try:
            assert open_store(f"redis://127.0.0.1:{server.port}/0").current_version() is None
        finally:
            del os.environ["DLRM_STORE_PASSWORD_FILE"]
        with pytest.raises(ConfigError, match="give it once"):
            open_store(f"redis://:{SECRET}@127.0.0.1:{server.port}/0", password_file=pw)
        with pytest.raises(ConfigError, match="cannot read"):
            open_store(f"redis://127.0.0.1:{server.port}/0", password_file=tmp_path / "missing")
        wrong = open_store(f"redis://:not-{SECRET}@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreUnavailable) as err:
            wrong.current_version()
        assert SECRET not in str(err.value) and "***" in str(err.value)
    finally:
        server.stop(save=False)


@pytest.mark.parametrize("client_certs", [False, True])
def test_rediss_to_a_tls_redis_server(tmp_path, trained_criteo, criteo_sample, client_certs):
    certs = make_certificates(tmp_path / "tls")
    server = RedisServer(tmp_path, tls=certs, client_certs=client_certs).start()
    try:
        url = server.url + "&prefix=tls"
        publish_checkpoint(trained_criteo, open_store(url), version="v1")
        with TestClient(create_app(Settings(store=url))) as client:
            line = (criteo_sample / "test.txt").read_text().splitlines()[0]
            r = client.post("/v1/models/dlrm:predict_tsv", content=line)
            assert r.status_code == 200 and r.json()["model_version"] == "v1"
        plain = open_store(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.5)  # no TLS: refused
        with pytest.raises(StoreUnavailable):
            plain.current_version()
        other_ca = make_certificates(tmp_path / "other")
        wrong = open_store(
            f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={other_ca / 'ca.pem'}", timeout_s=0.5
        )
        with pytest.raises(StoreUnavailable, match="certificate verify failed|CERTIFICATE"):
            wrong.current_version()
    finally:
        server.stop(save=False)


def test_compose_acl_the_api_user_only_reads(tmp_path, trained_criteo, criteo_sample):
    sys.path.insert(0, str(REPO / "scripts"))
    from compose_secrets import make

    files = make(tmp_path / "secrets")
    admin_pw = uuid.uuid4().hex
    acl = tmp_path / "users.acl"
    acl.write_text(files["users.acl"].read_text() + f"user admin on >{admin_pw} ~* &* +@all\n")
    server = RedisServer(tmp_path, acl_file=acl, admin=("admin", admin_pw)).start()
    try:
        base = f"redis://{{}}@127.0.0.1:{server.port}/0"
        writer = open_store(base.format("dlrm"), password_file=files["store-password"])
        publish_checkpoint(trained_criteo, writer, version="v1")
        publish_checkpoint(trained_criteo, writer, version="v2")
        writer.promote("v1")
        writer.update_rows("v1", {"C1": (np.array([1]), np.zeros((1, 8), np.float32))})
        reader_url = base.format("dlrm-api")
        reader = open_store(reader_url, password_file=files["api-store-password"])
        with pytest.raises(StoreUnavailable, match="permission"):
            reader.promote("v2")
        with pytest.raises(StoreUnavailable, match="permission"), reader.errors():
            reader.client.set("dlrm:current", "v2")
        with pytest.raises(StoreUnavailable, match="permission"):
            reader.delete_version("v2")
        assert writer.current_version() == "v1"
        settings = Settings(
            store=reader_url, store_password_file=files["api-store-password"], poll_interval_s=0.1
        )
        with TestClient(create_app(settings)) as client:
            line = (criteo_sample / "test.txt").read_text().splitlines()[0]
            r = client.post("/v1/models/dlrm:predict_tsv", content=line)
            assert r.status_code == 200 and r.json()["model_version"] == "v1"
            assert r.json()["model_generation"] == 1
            r = client.post("/v1/models/dlrm/versions/v2:predict_tsv", content=line)
            assert r.status_code == 200 and r.json()["model_version"] == "v2"
            assert "store_errors_total{" not in client.get("/metrics").text
        default = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1)
        # no default user
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
            default.get("dlrm:current")
    finally:
        server.stop(save=False)
