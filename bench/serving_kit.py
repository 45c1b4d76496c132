"""What the serving benches share: the stores they publish (file and Redis, per row dtype), the
request bodies, a ``dlrm serve`` (or baseline) process, and the C load generator
(``bench/loadgen.c``) driving it at a fixed rate or with N clients."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]


def store_dir(work: Path, row_dtype: str) -> Path:
    """The file store holding the version published with ``row_dtype``."""
    return work / "store" if row_dtype == "fp32" else work / f"store-{row_dtype}"


def redis_url(url: str, row_dtype: str) -> str:
    """``url`` with the key prefix of the version published with ``row_dtype``."""
    return (
        url if row_dtype == "fp32" else f"{url}{'&' if '?' in url else '?'}prefix=dlrm-{row_dtype}"
    )


def server_key(kind: str, row_dtype: str) -> str:
    """The results key of one server kind serving one row dtype: ``file``, ``redis-int8``."""
    return kind if row_dtype == "fp32" else f"{kind}-{row_dtype}"


def prepare(work: Path, row_dtypes: tuple[str, ...] | list[str] = ("fp32",)) -> tuple[Path, Path]:
    """Data, a trained model and a published file store per row dtype (cached in ``work``)."""
    data, run = work / "data", work / "run"
    if not (data / "bayes.json").exists():
        subprocess.run(
            [
                *DLRM,
                "data",
                "synth",
                "--train-rows",
                "200000",
                "--test-rows",
                "20000",
                "--seed",
                "3",
                "--out",
                data,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if not (run / "checkpoints" / "latest").exists():
        subprocess.run(
            [
                *DLRM,
                "train",
                "--train",
                data / "train.txt",
                "--test",
                data / "test.txt",
                "--out",
                run,
                "--hash-size",
                "100000",
                "--no-progress",
                "--set",
                "train.checkpoint_every_steps=0",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    for row_dtype in row_dtypes:
        store = store_dir(work, row_dtype)
        if not (store / "CURRENT").exists():
            subprocess.run(
                [
                    *DLRM,
                    "publish",
                    "--checkpoint",
                    run,
                    "--store",
                    f"file://{store}",
                    "--row-dtype",
                    row_dtype,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    return data, run


def instances(test_file: Path, n: int, offset: int = 0) -> list[dict]:
    out = []
    with open(test_file) as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(out) == n:
                break
            x = line.rstrip("\n").split("\t")
            out.append(
                {
                    "dense": [int(v) if v else None for v in x[1:14]],
                    "sparse": [v or None for v in x[14:40]],
                }
            )
    return out


class Server:
    def __init__(self, kind: str, store_url: str, port: int, workers: int, env: dict) -> None:
        self.kind, self.port = kind, port
        # The server's log goes to a file: a pipe nobody reads fills up with access-log lines
        # (~650 requests) and then blocks the server's logging call, i.e. the server.
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"serving-{kind}-", suffix=".log", delete=False
        )
        if kind == "naive":
            cmd = [
                sys.executable,
                str(HERE / "naive_serve.py"),
                "--store",
                store_url,
                "--port",
                str(port),
                "--workers",
                str(workers),
            ]
        else:
            cmd = [
                *DLRM,
                "serve",
                "--store",
                store_url,
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--log-level",
                "warning",
            ]
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    # every worker must be ready: a few more probes hit both
                    if all(
                        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
                        for _ in range(8)
                    ):
                        return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{kind} server exited: {Path(self.log.name).read_text()[-2000:]}"
                )
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{kind} server not ready in 120 s")

    def stop(self) -> None:
        self.log.close()
        os.unlink(self.log.name)
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def build_loadgen(work: Path) -> Path:
    """bench/loadgen.c compiled into ``work`` (when the source is newer than the binary)."""
    binary = work / "loadgen"
    source = HERE / "loadgen.c"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-Wall", "-o", binary, source, "-lm"], check=True)
    return binary


class LoadGen:
    """The C load generator against one port: open loop (``rate``) or closed loop (``conns``)."""

    def __init__(self, binary: Path, port: int, path: str, work: Path) -> None:
        self.binary, self.port, self.path, self.work = binary, port, path, work

    def bodies(self, name: str, bodies: list[bytes]) -> Path:
        file = self.work / f"bodies-{name}.txt"
        # one JSON body per line (json.dumps has no newline)
        file.write_bytes(b"\n".join(bodies) + b"\n")
        return file

    def run(
        self, bodies: Path, seconds: float, rate: float | None = None, conns: int | None = None
    ) -> dict:
        mode = ["--rate", str(rate)] if rate is not None else ["--conns", str(conns)]
        out = subprocess.run(
            [
                self.binary,
                "--port",
                str(self.port),
                "--path",
                self.path,
                "--bodies",
                bodies,
                "--seconds",
                str(seconds),
                *mode,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 60,
        )
        result = json.loads(out.stdout)
        result["errors"] += result["timeouts"]
        result["instances_per_s"] = (result["requests"] - result["errors"]) / result["elapsed_s"]
        return result


async def closed_loop(
    url: str, body: bytes, per_request: int, seconds: float, concurrency: int = 4
) -> dict:
    done, errors, lat = 0, 0, []
    async with httpx.AsyncClient(timeout=30) as client:
        stop = time.perf_counter() + seconds

        async def worker():
            nonlocal done, errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = await client.post(
                    url, content=body, headers={"content-type": "application/json"}
                )
                lat.append(time.perf_counter() - t0)
                if r.status_code == 200:
                    done += per_request
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {
        "instances_per_s": done / elapsed,
        "requests": len(lat),
        "errors": errors,
        "p50_ms": 1e3 * statistics.median(lat) if lat else None,
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
