"""A real redis-server on a free loopback port, for the integration tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from dense_trainer.distributed import free_port


class RedisServer:
    """redis-server with its data in ``workdir``; ``stop`` saves (SHUTDOWN SAVE), ``start`` reloads.

    Args:
        password: requirepass (the default user's password).
        tls: a directory made by :func:`make_certificates`: TLS only (no plain port), client
            certificates required when ``client_certs``.
        acl_file: users file; ``admin`` = (user, password) of a user that may PING and SHUTDOWN.
    """

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        tls: Path | None = None,
        client_certs: bool = False,
        acl_file: Path | None = None,
        admin: tuple[str, str] | None = None,
        aof: bool = False,
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("DLRM_REQUIRE_REDIS"):
                pytest.fail("redis-server is not installed, and DLRM_REQUIRE_REDIS is set")
            pytest.skip("redis-server is not installed (make setup / .ci/run install it)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        self.tls, self.client_certs = tls, client_certs
        self.acl_file, self.admin = acl_file, admin
        self.aof = aof
        """Append-only file, fsynced on every write: a SIGKILL loses nothing acknowledged."""
        self.proc: subprocess.Popen | None = None

    def url_for(self, user: str | None = None, password: str | None = None) -> str:
        auth = f"{user or ''}:{password}@" if password else (f"{user}@" if user else "")
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = f"ssl_ca_certs={self.tls / 'ca.pem'}"
        if self.client_certs:
            query += (
                f"&ssl_certfile={self.tls / 'client.pem'}&ssl_keyfile={self.tls / 'client.key'}"
            )
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    @property
    def url(self) -> str:
        if self.admin is not None:
            return self.url_for(*self.admin)
        return self.url_for(None, self.password)

    def start(self) -> RedisServer:
        port = (
            ["--port", "0", "--tls-port", str(self.port)]
            if self.tls
            else ["--port", str(self.port)]
        )
        args = [
            self.exe,
            *port,
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            *(["--appendfsync", "always"] if self.aof else []),
            "--dbfilename",
            "dump.rdb",
            "--daemonize",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args += [
                "--tls-cert-file",
                str(self.tls / "server.pem"),
                "--tls-key-file",
                str(self.tls / "server.key"),
                "--tls-ca-cert-file",
                str(self.tls / "ca.pem"),
                "--tls-auth-clients",
                "yes" if self.client_certs else "no",
            ]
        if self.acl_file is not None:
            args += ["--aclfile", str(self.acl_file)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        deadline = time.time() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no save, no goodbye (what the append-only file holds survives)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, save: bool = True) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            redis.Redis.from_url(self.url, socket_timeout=5).shutdown(save=save, nosave=not save)
        except redis.exceptions.ConnectionError:
            pass  # shutdown closes the connection
        self.proc.wait(timeout=10)


def make_certificates(directory: Path) -> Path:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=dlrm-test-ca",
    )
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=dlrm-test-{name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            "san.cnf",
        )
    return directory
