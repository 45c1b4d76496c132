"""The compose topology, proven without a Docker engine: every service of docker/compose.yaml
runs its own command and environment (read from the compose file, not restated here) in its own
network namespace, with its own address on a bridge and service names resolvable as in
compose; a real redis-server runs in its namespace. The job trains across hosts, publishes to
Redis, and a client in yet another namespace gets predictions from the API."""

import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from . import netns
from .conftest import REPO

pytestmark = pytest.mark.slow

COMPOSE = REPO / "docker" / "compose.yaml"


def test_compose_file_validates():
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("DLRM_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is not installed, and DLRM_REQUIRE_COMPOSE is set")
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's)")
    for profiles in ("cpu", "gpu"):
        r = subprocess.run(
            [exe, "-f", str(COMPOSE), "config", "-q"],
            capture_output=True,
            text=True,
            env={**os.environ, "COMPOSE_PROFILES": profiles},
        )
        assert r.returncode == 0, r.stderr


def active_services(profile: str = "cpu") -> dict:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {name: s for name, s in services.items() if profile in s.get("profiles", [profile])}


def test_compose_publishes_only_the_api_and_mounts_secrets():
    services = active_services()
    assert [name for name, s in services.items() if s.get("ports")] == ["api"]
    env = services["api"]["environment"]
    assert env["DLRM_STORE"].startswith("redis://dlrm-api@") and env[
        "DLRM_API_KEY_FILE"
    ].startswith("/run/secrets/")
    for name, s in services.items():  # no password in any URL or variable, only files
        for value in (s.get("environment") or {}).values():
            assert ":" not in str(value).split("@")[0].removeprefix("redis://"), (name, value)
    assert "--aclfile" in services["redis"]["command"]


def test_compose_cluster_in_network_namespaces(synth_small, tmp_path):
    why_not = netns.available()
    if why_not is not None:
        pytest.skip(f"network namespaces unavailable here ({why_not})")
    services = active_services()
    assert {
        "redis",
        "embedding-server-0",
        "embedding-server-1",
        "trainer-0",
        "trainer-1",
        "publish",
        "api",
    } <= set(services)
    run_dir = tmp_path / "var-lib-dlrm"
    run_dir.mkdir()
    sys.path.insert(0, str(REPO / "scripts"))
    from compose_secrets import make

    made = make(tmp_path / "secrets")  # what `make compose-secrets` writes to docker/secrets/
    declared = yaml.safe_load(COMPOSE.read_text())["secrets"]
    mounts = {
        "/data": str(synth_small),
        "/var/lib/dlrm": str(run_dir),
        "/opt/dlrm/configs": str(REPO / "configs"),
        **{
            f"/run/secrets/{name}": str(made[spec["file"].rsplit("/", 1)[1]])
            for name, spec in declared.items()
        },
    }

    def host_path(value: str) -> str:
        for inside, outside in mounts.items():
            value = value.replace(inside, outside)
        return value

    def argv(name: str) -> list[str]:
        command = services[name]["command"]
        if name == "redis":  # the image's entrypoint adds --protected-mode no; data in a tmp dir
            return [
                shutil.which("redis-server") or pytest.skip("redis-server missing"),
                *(host_path(c) for c in command[1:]),
                "--protected-mode",
                "no",
                "--dir",
                str(tmp_path),
            ]
        # the image's ENTRYPOINT is `dlrm`
        return [sys.executable, str(REPO / "dlrm_cli.py"), *command]

    def env(name: str) -> dict:
        mine = {k: host_path(str(v)) for k, v in (services[name].get("environment") or {}).items()}
        return {**os.environ, **mine, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(REPO)}

    names = [
        "redis",
        "embedding-server-0",
        "embedding-server-1",
        "trainer-0",
        "trainer-1",
        "publish",
        "api",
        "client",
    ]
    procs: dict[str, subprocess.Popen] = {}
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in names}
    with netns.Hosts(len(names), net=78, hostnames=names) as hosts:

        def start(name: str) -> None:
            i = names.index(name)
            procs[name] = subprocess.Popen(
                hosts.command(i, argv(name)),
                cwd=REPO,
                env=env(name),
                stdout=logs[name],
                stderr=subprocess.STDOUT,
            )

        def log_of(name: str) -> str:
            logs[name].flush()
            return (tmp_path / f"{name}.log").read_text()[-3000:]

        try:
            # Deliberately out of order: servers and the API before the master trainer and Redis.
            for name in [
                "embedding-server-1",
                "api",
                "embedding-server-0",
                "publish",
                "trainer-1",
                "redis",
                "trainer-0",
            ]:
                start(name)
                time.sleep(0.3)
            for name in [
                "trainer-0",
                "trainer-1",
                "embedding-server-0",
                "embedding-server-1",
                "publish",
            ]:
                assert procs[name].wait(timeout=300) == 0, f"{name} failed:\n{log_of(name)}"
            # it started first and waited
            assert "waiting for the master" in log_of("embedding-server-1")
            key = (tmp_path / "secrets" / "api-keys").read_text().split()[0]
            reader_pw = (tmp_path / "secrets" / "api-store-password").read_text().split()[0]
            client = hosts.command(
                names.index("client"),
                [sys.executable, "-c", CLIENT, str(synth_small / "test.txt"), key, reader_pw],
            )
            r = subprocess.run(client, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr + "\napi log:\n" + log_of("api")
            print(r.stdout)
            assert '"predictions"' in r.stdout and '"model_version"' in r.stdout
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            for f in logs.values():
                f.close()


CLIENT = r"""
import json, sys, time, urllib.request, urllib.error
base = "http://api:8000"
deadline = time.time() + 90
while True:  # bounded wait until the API has loaded the published model
    try:
        if urllib.request.urlopen(base + "/readyz", timeout=2).status == 200:
            break
    except (urllib.error.URLError, OSError):
        pass
    if time.time() > deadline:
        sys.exit("api never became ready")
    time.sleep(0.5)
lines = open(sys.argv[1]).read().splitlines()[:3]
req = urllib.request.Request(base + "/v1/models/dlrm:predict_tsv", data="\n".join(lines).encode(),
                             headers={"content-type": "text/plain"})
try:
    urllib.request.urlopen(req, timeout=10)
    sys.exit("answered without a key")
except urllib.error.HTTPError as exc:
    assert exc.code == 401, exc.code
req.add_header("Authorization", "Bearer " + sys.argv[2])
body = json.loads(urllib.request.urlopen(req, timeout=10).read())
import redis
try:  # Redis: no password-less user; the API's user only reads
    redis.Redis(host="redis", socket_timeout=3).get("dlrm:current")
    sys.exit("redis answered without a password")
except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError):
    pass
reader = redis.Redis(host="redis", username="dlrm-api", password=sys.argv[3], socket_timeout=3)
assert reader.get("dlrm:current") is not None
try:
    reader.set("dlrm:current", "x")
    sys.exit("the API's redis user could write")
except redis.exceptions.NoPermissionError:
    pass
assert len(body["predictions"]) == 3, body
print(json.dumps(body))
"""
