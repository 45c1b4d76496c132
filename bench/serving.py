"""Serving latency and throughput on loopback, side by side in one run.

Servers (started one at a time; 1 uvicorn worker for the latency passes, 2 for throughput):
    file   `dlrm serve --store file://...`   rows memory-mapped (page cache)
    redis  `dlrm serve --store redis://...`  rows fetched with pipelined HMGETs, hot-row cache
    naive  the same app whose service holds every table in memory as nn.EmbeddingBag modules
           (the "load the whole model into the API" baseline)

Load (an asyncio httpx client in this process, bounded in count and time):
    single  open loop at a fixed rate (default 200 requests/s) of one-instance requests;
            latency is measured from each request's scheduled send time (no coordinated
            omission); p50, p99, errors. Run twice on a fresh server over the same distinct
            requests: "cold" (first sight of every row) then "warm".
    batch   closed loop, 4 connections, 256-instance requests: instances/s.

Model: the default DLRM (dim 16, MLPs 512-256-64 / 512-256) with 26 tables x 100k rows, trained
one epoch on 200k generated rows. Writes bench/results/serving.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]


def prepare(work: Path) -> tuple[Path, Path]:
    """Data, a trained model and a published file store (cached in ``work``)."""
    data, run, store = work / "data", work / "run", work / "store"
    if not (data / "bayes.json").exists():
        subprocess.run([*DLRM, "data", "synth", "--train-rows", "200000", "--test-rows", "20000", "--seed", "3",
                        "--out", data], check=True, stdout=subprocess.DEVNULL)
    if not (store / "CURRENT").exists():
        subprocess.run([*DLRM, "train", "--train", data / "train.txt", "--test", data / "test.txt", "--out", run,
                        "--hash-size", "100000", "--no-progress", "--set", "train.checkpoint_every_steps=0"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*DLRM, "publish", "--checkpoint", run, "--store", f"file://{store}"], check=True,
                       stdout=subprocess.DEVNULL)
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
            out.append({"dense": [int(v) if v else None for v in x[1:14]], "sparse": [v or None for v in x[14:40]]})
    return out


class Server:
    def __init__(self, kind: str, store_url: str, port: int, workers: int, env: dict) -> None:
        self.kind, self.port = kind, port
        if kind == "naive":
            cmd = [sys.executable, str(HERE / "naive_serve.py"), "--store", store_url, "--port", str(port),
                   "--workers", str(workers)]
        else:
            cmd = [*DLRM, "serve", "--store", store_url, "--port", str(port), "--workers", str(workers),
                   "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    # every worker must be ready: a few more probes hit both
                    if all(httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200 for _ in range(8)):
                        return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{kind} server not ready in 120 s")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


async def open_loop(url: str, bodies: list[bytes], rate: float) -> dict:
    """Send ``bodies`` at ``rate``/s; latency from each scheduled send time."""
    lat, errors = [], 0
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=10) as client:
        start = time.perf_counter() + 0.05

        async def one(k: int, body: bytes):
            nonlocal errors
            scheduled = start + k / rate
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            try:
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                if r.status_code != 200:
                    errors += 1
            except httpx.HTTPError:
                errors += 1
            lat.append(time.perf_counter() - scheduled)

        await asyncio.gather(*(one(k, b) for k, b in enumerate(bodies)))
    lat_ms = np.array(lat) * 1e3
    return {"requests": len(bodies), "rate": rate, "p50_ms": float(np.percentile(lat_ms, 50)),
            "p99_ms": float(np.percentile(lat_ms, 99)), "max_ms": float(lat_ms.max()), "errors": errors}


async def closed_loop(url: str, body: bytes, per_request: int, seconds: float, concurrency: int = 4) -> dict:
    done, errors, lat = 0, 0, []
    async with httpx.AsyncClient(timeout=30) as client:
        stop = time.perf_counter() + seconds

        async def worker():
            nonlocal done, errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                lat.append(time.perf_counter() - t0)
                if r.status_code == 200:
                    done += per_request
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"instances_per_s": done / elapsed, "requests": len(lat), "errors": errors,
            "p50_ms": 1e3 * statistics.median(lat) if lat else None}


def run_server(kind, store_url, args, singles, batch_body, env) -> dict:
    """Single-instance passes on a fresh 1-worker server (tail latency: the load generator shares
    the 2 cores), then the batched run on a fresh ``--workers`` server (throughput)."""
    url = f"http://127.0.0.1:{args.port}/v1/models/dlrm:predict"
    server = Server(kind, store_url, args.port, 1, env)
    try:
        cold = asyncio.run(open_loop(url, singles, args.rate))
        warm = asyncio.run(open_loop(url, singles, args.rate))
    finally:
        server.stop()
    server = Server(kind, store_url, args.port, args.workers, env)
    try:
        asyncio.run(closed_loop(url, batch_body, args.batch, 2.0))  # warm-up of both workers
        batch = asyncio.run(closed_loop(url, batch_body, args.batch, args.seconds))
    finally:
        server.stop()
    return {"single_cold": cold, "single_warm": warm, "batch": batch}


def median_runs(runs: list[dict]) -> dict:
    """Per metric, the median over rounds (the machine is shared and noisy)."""
    out = {}
    for phase in runs[0]:
        out[phase] = {k: statistics.median(r[phase][k] for r in runs) if isinstance(runs[0][phase][k], float | int)
                      else runs[0][phase][k] for k in runs[0][phase]}
        out[phase]["errors"] = sum(r[phase]["errors"] for r in runs)
    out["rounds"] = runs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "serving")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=2000, help="single-instance requests per pass")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10.0, help="duration of the batched run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("--servers", default="file,redis,naive")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    args = p.parse_args()

    from redis_server import RedisServer

    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import open_store

    data, run = prepare(args.work)
    singles = [json.dumps({"instances": [i]}).encode() for i in instances(data / "test.txt", args.requests)]
    batch_body = json.dumps({"instances": instances(data / "test.txt", args.batch, offset=args.requests)}).encode()
    results = {}
    redis_dir = args.work / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(redis_dir).start() if "redis" in args.servers else None
    try:
        if redis is not None:
            t0 = time.perf_counter()
            publish_checkpoint(run, open_store(redis.url), version="bench")
            results["redis_publish_s"] = time.perf_counter() - t0
        rounds: dict[str, list[dict]] = {k: [] for k in args.servers.split(",")}
        for r in range(args.rounds):
            for kind in rounds:
                print(f"serving bench: round {r + 1}/{args.rounds}: {kind}", file=sys.stderr, flush=True)
                url = redis.url if kind == "redis" else f"file://{args.work / 'store'}"
                rounds[kind].append(run_server(kind, url, args, singles, batch_body, {"DLRM_CACHE_MB": "256"}))
        for kind, runs in rounds.items():
            results[kind] = median_runs(runs)
    finally:
        if redis is not None:
            redis.stop(save=False)
    if "naive" in results and "redis" in results:
        results["redis_warm_vs_naive_batch"] = (
            results["redis"]["batch"]["instances_per_s"] / results["naive"]["batch"]["instances_per_s"]
        )
    results["config"] = {"rate": args.rate, "requests": args.requests, "batch": args.batch, "rounds": args.rounds,
                         "workers": args.workers, "seconds": args.seconds, "cpus": os.cpu_count(),
                         "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (args.out / "serving.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"Serving on loopback, load generator on the same {c['cpus']} cores ({c['date']}; medians of "
        f"{c['rounds']} interleaved rounds): {c['requests']} single-instance requests at {c['rate']:.0f}/s per "
        f"pass on a fresh 1-worker server (cold, then warm), then {c['batch']}-instance requests for "
        f"{c['seconds']:.0f} s on 4 connections to {c['workers']} workers.",
        "",
        "| server | single p50 ms (cold / warm) | single p99 ms (cold / warm) | errors | batched instances/s | batched p50 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"file": "ours, file store (mmap)", "redis": "ours, Redis store + row cache",
             "naive": "naive: all tables in the API process"}
    for kind in ("file", "redis", "naive"):
        if kind not in r:
            continue
        x = r[kind]
        cold, warm, b = x["single_cold"], x["single_warm"], x["batch"]
        lines.append(
            f"| {names[kind]} | {cold['p50_ms']:.1f} / {warm['p50_ms']:.1f} | {cold['p99_ms']:.1f} / {warm['p99_ms']:.1f} | "
            f"{cold['errors'] + warm['errors'] + b['errors']} | {b['instances_per_s']:,.0f} | {b['p50_ms']:.1f} |"
        )
    if "redis_warm_vs_naive_batch" in r:
        lines += ["", f"Redis (warm cache) vs naive, batched throughput: {r['redis_warm_vs_naive_batch']:.2f}x. "
                  f"Publishing the model to Redis took {r.get('redis_publish_s', 0):.1f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
