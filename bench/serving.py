"""Serving cost, capacity and batching on loopback, side by side in one run.

Servers (started one at a time, 1 uvicorn worker each; the load generator shares the cores):
    file   `dlrm serve --store file://...`   rows memory-mapped (page cache)
    redis  `dlrm serve --store redis://...`  rows fetched with pipelined HMGETs, hot-row cache
    naive  the same app whose service holds every table in memory as nn.EmbeddingBag modules
           (the "load the whole model into the API" baseline)

Phases (``--phases``), each server fresh:
    cpu         server CPU time per single-instance request: sequential requests on one
                connection from the C load generator (one in flight) cycling through 500
                bodies, a 3 s pass over them to warm up (rows cached: the warm regime), then
                --cpu-seconds (4) of them: the server process's user + system time
                (/proc/PID/stat, every thread) over the second pass, per request. (Until
                2026-12-03 a Python httpx client sent them: on the same 2 cores its own work
                between requests left the server's caches cold, which read more server CPU
                per request, and noisier, than this client on the same server; phase
                cpu-httpx, not run by default, measures that way beside it.)
    sweep       capacity: open loop of single-instance requests at rising rates (latency from
                each scheduled send time: no coordinated omission); the highest rate whose p99
                is <= --p99-ms (15) and without errors is the server's capacity. A cold pass
                first (600 rows never seen, at 200/s) is reported apart; the sweep reuses them.
    concurrent  64 clients in a closed loop of single-instance requests, dynamic batching on
                (the default) and off (DLRM_BATCHING=false): instances/s and p50/p99.

The sweep and the 64 clients are driven by bench/loadgen.c (compiled here with gcc: one thread,
epoll, keep-alive connections), so that the load generator costs the 2 shared cores little
(a Python asyncio + httpx client delivered only ~80 requests/s in all).
    batch       closed loop, 4 connections, 256-instance requests: instances/s.

Model: the default DLRM (dim 16, MLPs 512-256-64 / 512-256) with 26 tables x 100k rows, trained
one epoch on 200k generated rows. ``--row-dtype fp32,int8`` publishes the same checkpoint once per
row dtype (``dlrm publish --row-dtype``: file store ``store`` for fp32, ``store-DTYPE`` for the
others; Redis under the key prefix ``dlrm`` / ``dlrm-DTYPE``) and runs every phase of the file and
Redis servers against each (rows "..., int8"); the naive server reads fp32 tables only.
Writes bench/results/serving.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

CPU_BODIES = 500
"""Distinct single-instance bodies of the cpu phase (the first of the test rows)."""

from serving_kit import (  # noqa: E402
    LoadGen,
    Server,
    build_loadgen,
    closed_loop,
    instances,
    prepare,
    process_cpu_s,
    redis_url,
    server_key,
    store_dir,
)


def cpu_per_request(server: Server, gen: LoadGen, bodies: Path, seconds: float) -> dict:
    """Sequential requests on one connection (the C load generator, one request in flight, cycling
    through ``bodies`` from the first each run): the server's CPU time over them, per request,
    after a warm-up pass over every body (``bodies``: few enough that 3 s sends each once even at
    a cold store's rate, so that the timed pass reads only rows seen before)."""
    gen.run(bodies, 3.0, conns=1)
    cpu0 = process_cpu_s(server.proc.pid)
    result = gen.run(bodies, seconds, conns=1)
    cpu1 = process_cpu_s(server.proc.pid)
    return {
        "requests": result["requests"],
        "cpu_ms": 1e3 * (cpu1 - cpu0) / max(1, result["requests"]),
        "wall_ms": 1e3 * result["elapsed_s"] / max(1, result["requests"]),
        "errors": result["errors"],
    }


def cpu_per_request_httpx(server: Server, url: str, bodies: list[bytes]) -> dict:
    """The cpu phase as it was measured until 2026-12-03: sequential requests from a Python httpx
    client on one connection, sent once to warm up, then again (``cpu-httpx``)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as client:
        for body in bodies:
            client.post(url, content=body, headers=headers)
        cpu0 = process_cpu_s(server.proc.pid)
        errors = sum(
            client.post(url, content=body, headers=headers).status_code != 200 for body in bodies
        )
        cpu1 = process_cpu_s(server.proc.pid)
    return {"requests": len(bodies), "cpu_ms": 1e3 * (cpu1 - cpu0) / len(bodies), "errors": errors}


def sweep(
    gen: LoadGen, url: str, bodies: list[bytes], rates: list[float], seconds: float, p99_ms: float
) -> dict:
    """Open loop at each rate (rising) until p99 exceeds ``p99_ms``, over rows the cold pass (at
    200 requests/s, the first sight of each row) has seen."""
    pool = gen.bodies("pool", bodies[:600])
    cold = gen.run(pool, 3.0, rate=200.0)
    passes, capacity = [], 0.0
    for rate in rates:
        result = gen.run(pool, seconds, rate=rate)
        result["loadavg_1min"] = round(os.getloadavg()[0], 2)
        passes.append(result)
        if result["p99_ms"] > p99_ms or result["errors"]:
            break
        capacity = rate
    drain(url, bodies[0])
    return {"cold": cold, "passes": passes, "capacity_rps": capacity}


def drain(url: str, body: bytes) -> None:
    """Wait until the server has worked off what an overloaded pass left queued (requests the
    client gave up on are still scored): one request answered within 50 ms."""
    with httpx.Client(timeout=120) as client:
        for _ in range(100):
            t0 = time.perf_counter()
            client.post(url, content=body, headers={"content-type": "application/json"})
            if time.perf_counter() - t0 < 0.05:
                return


def concurrent_clients(gen: LoadGen, bodies: Path, clients: int, seconds: float) -> dict:
    """``clients`` connections, each sending the next single-instance request when answered."""
    result = gen.run(bodies, seconds, conns=clients)
    result["clients"] = clients
    result["loadavg_1min"] = round(os.getloadavg()[0], 2)
    return result


def batch_sizes(metrics_url: str, before: dict | None = None) -> dict:
    """Model calls and requests scored so far, from the server's batching histogram; ``before``:
    an earlier reading, subtracted (the calls of the phases in between only)."""
    calls = requests = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("dlrm_model_batch_requests_count"):
            calls = float(line.split()[-1])
        elif line.startswith("dlrm_model_batch_requests_sum"):
            requests = float(line.split()[-1])
    if before is not None:
        calls, requests = calls - before["model_calls"], requests - before["requests"]
    return {
        "model_calls": calls,
        "requests": requests,
        "mean_requests_per_call": requests / calls if calls else None,
    }


def run_server(kind, store_url, args, singles, batch_body, env, loadgen: Path) -> dict:
    """Every phase of one server kind, each on a fresh 1-worker server (2 for ``batch``)."""
    url = f"http://127.0.0.1:{args.port}/v1/models/dlrm:predict"
    gen = LoadGen(loadgen, args.port, "/v1/models/dlrm:predict", args.work)
    all_singles = gen.bodies("singles", singles)
    cpu_singles = gen.bodies("cpu-singles", singles[:CPU_BODIES])
    out = {}
    phases = args.phases.split(",")
    if {"cpu", "cpu-httpx", "sweep", "concurrent"} & set(phases):
        server = Server(kind, store_url, args.port, 1, env)
        try:
            if "sweep" in phases:
                out["sweep"] = sweep(gen, url, singles, args.rates, args.sweep_seconds, args.p99_ms)
            if "cpu" in phases:
                out["cpu"] = cpu_per_request(server, gen, cpu_singles, args.cpu_seconds)
            if "cpu-httpx" in phases:
                out["cpu_httpx"] = cpu_per_request_httpx(server, url, singles[:1000])
            if "concurrent" in phases:
                metrics = f"http://127.0.0.1:{args.port}/metrics"
                # (the sweep's and cpu phase's lone requests: calls of one)
                before = batch_sizes(metrics)
                out["batching_on"] = concurrent_clients(gen, all_singles, 64, args.seconds)
                out["batching_on_batches"] = batch_sizes(metrics, before)
        finally:
            server.stop()
    if "concurrent" in phases:
        server = Server(kind, store_url, args.port, 1, {**env, "DLRM_BATCHING": "false"})
        try:
            concurrent_clients(gen, all_singles, 64, 1.0)  # warm-up
            out["batching_off"] = concurrent_clients(gen, all_singles, 64, args.seconds)
        finally:
            server.stop()
    if "batch" in phases:
        server = Server(kind, store_url, args.port, args.workers, env)
        try:
            asyncio.run(closed_loop(url, batch_body, args.batch, 2.0))  # warm-up of both workers
            out["batch"] = asyncio.run(closed_loop(url, batch_body, args.batch, args.seconds))
        finally:
            server.stop()
    return out


def median_runs(runs: list[dict]) -> dict:
    """Per server, the medians over rounds of the headline numbers (the machine is shared and
    noisy); every round is kept under ``rounds``."""

    def med(get):
        values = [get(r) for r in runs]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict = {"rounds": runs}
    first = runs[0]
    if "cpu" in first:
        out["cpu_ms"] = med(lambda r: r["cpu"]["cpu_ms"])
        out["cpu_ms_range"] = [
            min(r["cpu"]["cpu_ms"] for r in runs),
            max(r["cpu"]["cpu_ms"] for r in runs),
        ]
    if "cpu_httpx" in first:
        out["cpu_httpx_ms"] = med(lambda r: r["cpu_httpx"]["cpu_ms"])
    if "sweep" in first:
        out["capacity_rps"] = med(lambda r: r["sweep"]["capacity_rps"])
        out["cold_p50_ms"] = med(lambda r: r["sweep"]["cold"]["p50_ms"])
        out["cold_p99_ms"] = med(lambda r: r["sweep"]["cold"]["p99_ms"])
    for key in ("batching_on", "batching_off", "batch"):
        if key in first:
            out[key] = {
                k: med(lambda r, key=key, k=k: r[key][k])
                for k in first[key]
                if k in ("instances_per_s", "p50_ms", "p99_ms")
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "serving")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--rates",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[
            200,
            400,
            600,
            800,
            1000,
            1200,
            1500,
            1750,
            2000,
            2250,
            2500,
            2750,
            3000,
            3500,
            4000,
            5000,
        ],
        help="request rates of the capacity sweep, rising",
    )
    p.add_argument("--sweep-seconds", type=float, default=3.0, help="length of each sweep pass")
    p.add_argument(
        "--p99-ms", type=float, default=15.0, help="a rate is held when p99 is at most this"
    )
    p.add_argument(
        "--cpu-seconds", type=float, default=4.0, help="length of the cpu phase's timed pass"
    )
    p.add_argument("--phases", default="cpu,sweep,concurrent,batch")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=6.0, help="duration of each closed-loop run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("--servers", default="file,redis,naive")
    p.add_argument(
        "--row-dtype",
        type=lambda t: t.split(","),
        default=["fp32"],
        help="row dtypes published and served by the file and Redis servers, e.g. fp32,int8",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    args = p.parse_args()

    from redis_server import RedisServer

    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import open_store

    bad = sorted(set(args.row_dtype) - {"fp32", "fp16", "int8", "int4"})
    if bad:
        p.error(f"--row-dtype: unknown {', '.join(bad)} (use fp32, fp16, int8, int4)")
    kinds = args.servers.split(",")
    # (kind, row dtype) per server; the naive server reads the fp32 tables only
    servers = [(kind, d) for d in args.row_dtype for kind in kinds if kind != "naive"]
    servers += [("naive", "fp32")] if "naive" in kinds else []
    data, run = prepare(args.work, sorted({d for _, d in servers}))
    loadgen = build_loadgen(args.work)
    load_before = os.getloadavg()
    singles = [json.dumps({"instances": [i]}).encode() for i in instances(data / "test.txt", 4000)]
    batch_body = json.dumps(
        {"instances": instances(data / "test.txt", args.batch, offset=4000)}
    ).encode()
    results = {}
    redis_dir = args.work / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(redis_dir).start() if "redis" in args.servers else None
    try:
        for row_dtype in args.row_dtype if redis is not None else []:
            t0 = time.perf_counter()
            publish_checkpoint(
                run,
                open_store(redis_url(redis.url, row_dtype)),
                version="bench",
                row_dtype=row_dtype,
            )
            results[f"{server_key('redis', row_dtype)}_publish_s"] = time.perf_counter() - t0
        rounds: dict[str, list[dict]] = {server_key(*s): [] for s in servers}
        for r in range(args.rounds):
            for kind, row_dtype in servers:
                key = server_key(kind, row_dtype)
                print(
                    f"serving bench: round {r + 1}/{args.rounds}: {key}",
                    file=sys.stderr,
                    flush=True,
                )
                url = (
                    redis_url(redis.url, row_dtype)
                    if kind == "redis"
                    else f"file://{store_dir(args.work, row_dtype)}"
                )
                rounds[key].append(
                    run_server(
                        kind, url, args, singles, batch_body, {"DLRM_CACHE_MB": "256"}, loadgen
                    )
                )
        for key, runs in rounds.items():
            results[key] = median_runs(runs)
    finally:
        if redis is not None:
            redis.stop(save=False)
    results["config"] = {
        "rates": args.rates,
        "sweep_seconds": args.sweep_seconds,
        "p99_ms": args.p99_ms,
        "cpu_seconds": args.cpu_seconds,
        "batch": args.batch,
        "rounds": args.rounds,
        "phases": args.phases,
        "workers": args.workers,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "row_dtypes": args.row_dtype,
        "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (args.out / "serving.md").write_text(md)
    print(md)


def _f(value, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def _range(span: list[float] | None) -> str:
    return f" ({span[0]:.2f}-{span[1]:.2f})" if span else ""


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"Serving on loopback, load generator on the same {c['cpus']} cores ({c['date']}; medians "
        "of "
        f"{c['rounds']} interleaved rounds; one uvicorn worker). CPU: server CPU time over "
        f"{c['cpu_seconds']:.0f} s of "
        "sequential single-instance requests (one connection, the C load generator), median and "
        "range over the rounds. Capacity: highest of "
        f"{[int(r) if float(r).is_integer() else r for r in c['rates']]} requests/s held "
        "with p99 <= "
        f"{c['p99_ms']:.0f} ms ({c['sweep_seconds']:.0f} s per rate, single-instance requests, "
        "open loop). "
        f"64 clients: closed loop of single-instance requests for {c['seconds']:.0f} s. Machine "
        "load "
        f"(1-minute load average, before / after; other tenants included): {c['loadavg_1min']}.",
        "",
        "| server | CPU ms / request (range) | capacity req/s (p99 <= 15 ms) | cold p50 / p99 ms "
        "| 64 clients, batching on: inst/s (p50 / p99 ms) | batching off: inst/s (p50 / "
        "p99 ms) | on / off |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = {
        "file": "ours, file store (mmap)",
        "redis": "ours, Redis store + row cache",
        "naive": "naive: all tables in the API process",
    }
    for d in c.get("row_dtypes", ["fp32"]):
        if d != "fp32":
            names |= {
                f"file-{d}": f"ours, file store, {d}",
                f"redis-{d}": f"ours, Redis store, {d}",
            }
    for kind in names:
        if kind not in r:
            continue
        x = r[kind]
        on, off = x.get("batching_on") or {}, x.get("batching_off") or {}
        gain = on["instances_per_s"] / off["instances_per_s"] if on and off else None
        lines.append(
            f"| {names[kind]} | {_f(x.get('cpu_ms'), '.2f')}{_range(x.get('cpu_ms_range'))} | "
            f"{_f(x.get('capacity_rps'))} | "
            f"{_f(x.get('cold_p50_ms'), '.1f')} / {_f(x.get('cold_p99_ms'), '.1f')} | "
            f"{_f(on.get('instances_per_s'))} ({_f(on.get('p50_ms'), '.1f')} / "
            f"{_f(on.get('p99_ms'), '.1f')}) | "
            f"{_f(off.get('instances_per_s'))} ({_f(off.get('p50_ms'), '.1f')} / "
            f"{_f(off.get('p99_ms'), '.1f')}) | "
            f"{_f(gain, '.2f')}x |"
        )
    if any("cpu_httpx_ms" in r.get(k, {}) for k in names):
        lines += [
            "",
            "Server CPU ms per request with the requests sent by a Python httpx client instead "
            "(phase "
            "cpu-httpx, the same servers): "
            + "; ".join(
                f"{k} {r[k]['cpu_httpx_ms']:.2f} (C client {_f(r[k].get('cpu_ms'), '.2f')})"
                for k in names
                if "cpu_httpx_ms" in r.get(k, {})
            ),
        ]
    if any("batch" in r.get(k, {}) for k in names):
        lines += [
            "",
            f"{c['batch']}-instance requests, 4 connections, {c['workers']} workers: "
            + "; ".join(
                f"{k} {_f(r[k]['batch']['instances_per_s'])} instances/s"
                for k in names
                if "batch" in r.get(k, {})
            ),
        ]
    per_call = {
        k: r[k]["rounds"][0].get("batching_on_batches", {}).get("mean_requests_per_call")
        for k in names
        if k in r and r[k].get("rounds")
    }
    if any(v is not None for v in per_call.values()):
        lines += [
            "",
            "Requests per model call with batching on, 64 clients (from "
            "`dlrm_model_batch_requests` "
            "over that phase, first round): "
            + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in per_call.items()),
        ]
    publish = [
        f"{k[: -len('_publish_s')]} {v:.1f} s" for k, v in r.items() if k.endswith("_publish_s")
    ]
    if publish:
        lines += ["", f"Publishing the model to Redis took: {', '.join(publish)}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
