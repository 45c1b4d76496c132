"""Health probes under load: ``/healthz`` and ``/readyz`` latency while N clients score.

One `dlrm serve` (1 worker, file store, the serving bench's model: ``bench/serving.py``
``prepare``), N connections in a closed loop of scoring requests (the C load generator), and
beside them a probe every ``--every-ms`` on a fresh connection each (as a kubelet probes):
the probes' p50 / p99 / max, the scoring throughput, and the share of probes over 50 ms.
Loads: single instances, and a mix where every 8th body holds 256 instances (large bodies
hold the GIL longest).

Usage: python bench/probes.py [--conns 200] [--seconds 20]
Writes bench/results/probes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_kit import REPO, LoadGen, Server, build_loadgen, instances, prepare  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from dense_trainer.distributed import free_port  # noqa: E402


def probe_once(port: int, path: str, timeout: float = 10.0) -> float:
    """Seconds from connect to the whole answer of one GET on a fresh connection."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        while s.recv(65536):
            pass
    return time.perf_counter() - t0


def probing(port: int, paths: list[str], every_s: float, stop: threading.Event, out: dict) -> None:
    k = 0
    while not stop.is_set():
        path = paths[k % len(paths)]
        try:
            out.setdefault(path, []).append(probe_once(port, path))
        except OSError:
            out.setdefault(path + " errors", []).append(1)
        k += 1
        stop.wait(every_s)


def summary(lat: list[float]) -> dict:
    ms = sorted(v * 1e3 for v in lat)
    if not ms:
        return {"probes": 0}
    return {
        "probes": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max_ms": ms[-1],
        "over_50ms": sum(v > 50 for v in ms) / len(ms),
    }


def run_load(args, gen: LoadGen, bodies: Path, port: int) -> dict:
    stop, got = threading.Event(), {}
    thread = threading.Thread(
        target=probing, args=(port, ["/healthz", "/readyz"], args.every_ms / 1e3, stop, got)
    )
    time.sleep(1.0)
    thread.start()
    result = gen.run(bodies, args.seconds, conns=args.conns)
    stop.set()
    thread.join()
    return {
        "scoring": {k: result[k] for k in ("requests", "errors", "elapsed_s") if k in result}
        | {
            "requests_per_s": result["requests"] / result["elapsed_s"],
            "p99_ms": result.get("p99_ms"),
        },
        **{path: summary(got.get(path, [])) for path in ("/healthz", "/readyz")},
        "probe_errors": len(got.get("/healthz errors", [])) + len(got.get("/readyz errors", [])),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conns", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--every-ms", type=float, default=100.0)
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "serving")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data, _ = prepare(args.work)
    loadgen = build_loadgen(args.work)
    rows = instances(data / "test.txt", 2048)
    singles = [json.dumps({"instances": [r]}).encode() for r in rows[:500]]
    big = json.dumps({"instances": rows[:256]}).encode()
    mixed = [big if i % 8 == 0 else b for i, b in enumerate(singles[:64])]
    port = free_port()
    server = Server("file", f"file://{args.work / 'store'}", port, 1, {})
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "conns": args.conns,
        "seconds": args.seconds,
        "every_ms": args.every_ms,
    }
    try:
        gen = LoadGen(loadgen, port, "/v1/models/dlrm:predict", args.work)
        for name, bodies in (
            ("single instances", singles),
            ("1 in 8 bodies of 256 instances", mixed),
        ):
            print(f"probes: {args.conns} clients, {name}", file=sys.stderr, flush=True)
            results[name] = run_load(args, gen, gen.bodies(name.split()[0], bodies), port)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probes.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "probes.md").write_text(render(results))
    print(render(results))


def render(r: dict) -> str:
    lines = [
        f"Health probes under load ({r['date']}; `python bench/probes.py --conns {r['conns']} "
        "--seconds "
        f"{r['seconds']:g}`): one worker, {r['conns']} clients in a closed loop, a probe every "
        f"{r['every_ms']:g} ms on a fresh connection",
        "",
        "| load | scoring req/s | probe | probes | p50 ms | p99 ms | max ms | over 50 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in r.items():
        if not isinstance(v, dict) or "scoring" not in v:
            continue
        for path in ("/healthz", "/readyz"):
            s = v[path]
            if not s.get("probes"):
                lines.append(
                    f"| {name} | {v['scoring']['requests_per_s']:,.0f} | {path} | 0 | - | - | - | "
                    "- |"
                )
                continue
            lines.append(
                f"| {name} | {v['scoring']['requests_per_s']:,.0f} | {path} | {s['probes']} | "
                f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} | {s['over_50ms']:.0%} "
                "|"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
