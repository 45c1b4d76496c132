"""Tables ten times the row cache, Zipf traffic: file and Redis servers, cold and warm.

Model: the default DLRM's dense network (dim 16), trained briefly on generated data, published
with 26 tables of ``--rows`` rows each (default 1M: 26M rows, 1.66 GB of fp32 rows, ten times the
``--cache-mb`` 160 MB row cache); the rows are random (N(0, 0.05)): latency and hit rates do not
depend on their values. Publishing them is timed (rows/s) for both stores, and Redis's memory per
row is measured (``INFO memory``: used_memory after over before, over the rows).

Traffic: each categorical value drawn from a Zipf law (exponent ``--zipf``) over ``--rows``
distinct values per feature, so the hot rows fit in the cache and the tail does not. Per server
(one uvicorn worker, fresh): *cold*, single-instance requests at ``--rate``/s (open loop,
``bench/loadgen.c``) on a
new process (empty row cache; the file store's pages as the OS page cache holds them); then 3,000
more requests (8 at a time) to warm it; *warm*, the same rate again with new draws; then
256-instance requests,
4 connections, closed loop: instances/s. The server's row-cache hit rate (``/metrics``) is
reported per pass. Writes bench/results/big_tables.{json,md}.
"""

from __future__ import annotations

import argparse
import json
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

from serving_kit import LoadGen, Server, build_loadgen  # noqa: E402

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]


def small_model(work: Path) -> Path:
    """A trained default DLRM (small tables): its dense weights and feature layout are used."""
    data, run = work / "data", work / "run"
    if not (data / "train.txt").exists():
        subprocess.run(
            [
                *DLRM,
                "data",
                "synth",
                "--train-rows",
                "20000",
                "--test-rows",
                "2000",
                "--seed",
                "5",
                "--out",
                data,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if not (run / "metrics.json").exists():
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
                "1000",
                "--no-progress",
                "--set",
                "train.checkpoint_every_steps=0",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return run


def publish_big(run: Path, store, rows: int, version: str, chunk: int = 1 << 16) -> float:
    """The small model's dense network with 26 random tables of ``rows`` rows -> rows/s."""
    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import open_store

    tmp = open_store(f"file://{run / 'small-store'}")
    if tmp.current_version() is None:
        publish_checkpoint(run, tmp, version="small")
    meta, dense = tmp.read_meta("small"), tmp.read_dense("small")
    spec = meta.spec.model_copy(
        update={"tables": [t.model_copy(update={"rows": rows}) for t in meta.spec.tables]}
    )
    meta = meta.model_copy(update={"version": version, "spec": spec, "default_rows": {}})
    rng = np.random.default_rng(0)
    block = rng.normal(0, 0.05, size=(chunk, spec.tables[0].dim)).astype(np.float32)
    print(f"big tables: publishing {26 * rows:,} rows to {store.url}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with store.begin(meta) as writer:
        for t in spec.tables:
            for start in range(0, rows, chunk):
                writer.write_rows(
                    t.name, start, np.roll(block, start % 97, axis=0)[: min(chunk, rows - start)]
                )
        writer.write_dense(dense)
        writer.commit()
    return 26 * rows / (time.perf_counter() - t0)


def zipf_instances(n: int, rows: int, a: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(a, size=(n, 26)), rows)  # [n, 26], 1 = the most popular value
    dense = rng.integers(0, 50, size=(n, 13))
    return [
        {"dense": d.tolist(), "sparse": [f"{f:x}{k:07x}" for f, k in enumerate(r.tolist())]}
        for d, r in zip(dense, ranks, strict=True)
    ]


def cache_counts(port: int) -> tuple[float, float]:
    hits = misses = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("dlrm_cache_hits_total"):
            hits = float(line.split()[-1])
        elif line.startswith("dlrm_cache_misses_total"):
            misses = float(line.split()[-1])
    return hits, misses


def timed_pass(gen: LoadGen, port: int, bodies: Path, seconds: float, rate: float) -> dict:
    """Open loop at ``rate`` (bench/loadgen.c), with the server's row-cache hit rate over it."""
    h0, m0 = cache_counts(port)
    out = gen.run(bodies, seconds, rate=rate)
    h1, m1 = cache_counts(port)
    out["cache_hit_rate"] = (h1 - h0) / max(1.0, (h1 - h0) + (m1 - m0))
    return out


def run_server(kind: str, url: str, args, pools: dict[str, Path], loadgen: Path) -> dict:
    print(f"big tables: {kind} server", file=sys.stderr, flush=True)
    server = Server(kind, url, args.port, 1, {"DLRM_CACHE_MB": str(args.cache_mb)})
    gen = LoadGen(loadgen, args.port, "/v1/models/dlrm:predict", args.work)
    try:
        out = {"cold": timed_pass(gen, args.port, pools["cold"], args.pass_seconds, args.rate)}
        # closed loop: as fast as the server answers
        gen.run(pools["warmup"], 3000 / args.rate, conns=8)
        out["warm"] = timed_pass(gen, args.port, pools["warm"], args.pass_seconds, args.rate)
        h0, m0 = cache_counts(args.port)
        batch = gen.run(pools["batch"], args.seconds, conns=4)
        h1, m1 = cache_counts(args.port)
        batch["instances_per_s"] *= 256  # requests/s of 256-instance requests
        batch["cache_hit_rate"] = (h1 - h0) / max(1.0, (h1 - h0) + (m1 - m0))
        out["batch"] = batch
    finally:
        server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "big_tables")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table (26 tables, dim 16)")
    p.add_argument("--cache-mb", type=float, default=160.0)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="single-instance requests/s of the cold and warm passes",
    )
    p.add_argument("--pass-seconds", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=6.0, help="closed-loop batched run")
    p.add_argument("--port", type=int, default=18775)
    p.add_argument("--servers", default="file,redis")
    args = p.parse_args()

    import redis
    from redis_server import RedisServer

    from embedding_server.stores import open_store

    run = small_model(args.work)
    n = int(args.rate * args.pass_seconds)
    args.work.mkdir(parents=True, exist_ok=True)
    loadgen = build_loadgen(args.work)
    pools = {}
    for name, k, seed in (("cold", n, 1), ("warmup", 3000, 2), ("warm", n, 3)):
        pools[name] = args.work / f"bodies-{name}.txt"  # one JSON body per line, sent in turn
        pools[name].write_bytes(
            b"\n".join(
                json.dumps({"instances": [i]}).encode()
                for i in zipf_instances(k, args.rows, args.zipf, seed)
            )
            + b"\n"
        )
    pools["batch"] = args.work / "bodies-batch.txt"
    pools["batch"].write_bytes(
        json.dumps({"instances": zipf_instances(256, args.rows, args.zipf, 4)}).encode() + b"\n"
    )
    results: dict = {}
    (args.work / "redis").mkdir(parents=True, exist_ok=True)
    server = RedisServer(args.work / "redis").start() if "redis" in args.servers else None
    try:
        if "file" in args.servers:
            root = args.work / f"store-{time.time_ns()}"
            results["file_publish_rows_per_s"] = publish_big(
                run, open_store(f"file://{root}"), args.rows, "big"
            )
            results["file"] = run_server("file", f"file://{root}", args, pools, loadgen)
            subprocess.run(["rm", "-rf", str(root)], check=False)
        if server is not None:
            admin = redis.Redis.from_url(server.url)
            before = admin.info("memory")["used_memory"]
            results["redis_publish_rows_per_s"] = publish_big(
                run, open_store(server.url), args.rows, "big"
            )
            results["redis_bytes_per_row"] = (admin.info("memory")["used_memory"] - before) / (
                26 * args.rows
            )
            results["redis"] = run_server("redis", server.url, args, pools, loadgen)
    finally:
        if server is not None:
            server.stop(save=False)
    results["config"] = {
        **{k: v for k, v in vars(args).items() if k not in ("work", "out")},
        "table_mb": 26 * args.rows * 64 / 2**20,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "big_tables.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (args.out / "big_tables.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"Big tables ({c['date']}): 26 x {c['rows']:,} rows of dim 16 ({c['table_mb']:,.0f} MB "
        "fp32), row cache "
        f"{c['cache_mb']:.0f} MB, Zipf({c['zipf']}) values; single-instance requests at "
        f"{c['rate']:.0f}/s for "
        f"{c['pass_seconds']:.0f} s (open loop), cold (fresh server) then warm (after 3,000 "
        "requests); batched: "
        f"256-instance requests, 4 connections, {c['seconds']:.0f} s. One uvicorn worker.",
        "",
        "| store | cold p50 / p99 ms | cold hit rate | warm p50 / p99 ms | warm hit rate | "
        "batched inst/s | batched hit rate | publish rows/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("file", "redis"):
        if kind not in r:
            continue
        x = r[kind]
        lines.append(
            f"| {kind} | {x['cold']['p50_ms']:.1f} / {x['cold']['p99_ms']:.1f} | "
            f"{x['cold']['cache_hit_rate']:.2f} | "
            f"{x['warm']['p50_ms']:.1f} / {x['warm']['p99_ms']:.1f} | "
            f"{x['warm']['cache_hit_rate']:.2f} | "
            f"{x['batch']['instances_per_s']:,.0f} | {x['batch']['cache_hit_rate']:.2f} | "
            f"{r[kind + '_publish_rows_per_s']:,.0f} |"
        )
    if "redis_bytes_per_row" in r:
        lines += [
            "",
            f"Redis memory per row (used_memory delta / rows): {r['redis_bytes_per_row']:.1f} B "
            f"for a {64} B payload ({r['redis_bytes_per_row'] / 64:.2f}x).",
        ]
    lines += [
        "",
        "The file store has no row cache (the OS page cache holds its pages): its hit rates read "
        "0.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
