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
    """redis-server with its data in ``workdir``; ``stop`` saves (SHUTDOWN SAVE), ``start`` reloads."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("DLRM_REQUIRE_REDIS"):
                pytest.fail("redis-server is not installed, and DLRM_REQUIRE_REDIS is set")
            pytest.skip("redis-server is not installed (make setup / .ci/run install it)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--dbfilename", "dump.rdb", "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
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

    def stop(self, save: bool = True) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            redis.Redis.from_url(self.url, socket_timeout=5).shutdown(save=save, nosave=not save)
        except redis.exceptions.ConnectionError:
            pass  # shutdown closes the connection
        self.proc.wait(timeout=10)
