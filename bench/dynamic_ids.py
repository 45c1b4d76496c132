"""Dynamic ids: their throughput cost against hashed ids while ids churn, and their bounded memory.

1. Training throughput with churning ids: 26 tables x ROWS rows (default 20k), dim 64, batch
   2048, the train_throughput.py model, ids Zipf(1.05) over VOCAB values per table (default 1M:
   the tables hold a few percent of the vocabulary). Hashed (id % rows) against dynamic (``evict``
   lru / lfu, the config's admission and shared rows) on the very same raw ids. A warm-up fills
   the tables (the table's "full at start" column says whether it did); every timed step then
   admits new ids and evicts old ones (every batch is a fresh draw, none repeats). The maps run
   their C kernel (``idmap/native.py``; DLRM_IDMAP_KERNEL=torch for their torch version).
   Measured in
     (a) one process (``Trainer.train_step`` on the in-process fbgemm shard, each step
         prefetching the next as ``Trainer.fit`` does), the systems interleaved over rounds,
         medians quoted; twice: the dense step on every core (the lookup remaps its own ids,
         ``idmap/ahead.py``: a remap thread would only preempt the step), and on one core fewer
         (a core spare: dynamic tables remap the next batch meanwhile, as beside a GPU);
     (b) E2,T2: 2 embedding servers + 2 trainers as local processes over Gloo (as
         distributed_throughput.py launches them, --pipeline exact), one launch per system and
         round, interleaved, medians quoted; whole tables, and every table split by rows over
         both servers (a dynamic table's ids routed by hash; cost against hashed split alike).
   Reported: samples/s, cost vs hashed, ids admitted and evicted per timed step (all tables),
   whether the tables were full when timing began.
2. Bounded memory: a stream of 10M distinct ids (one table of 100k rows, 200k ids a step, a tenth
   of them seen twice) through ``DynamicIdMap``: rows used after every step (never above the
   capacity) and the process's RSS over the stream.

Usage: python bench/dynamic_ids.py [--rows 20000] [--vocab 1000000] [--steps 15] [--rounds 2]
       [--dist-rounds 2] [--skip memory,single,spare,dist] [--tag NAME]
Writes bench/results/dynamic_ids{_TAG}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

T, DIM, BATCH, NUM_DENSE = 26, 64, 2048, 13
SYSTEMS = {
    "hashed": {},
    "dynamic, lru": {"ids": "dynamic", "evict": "lru"},
    "dynamic, lfu": {"ids": "dynamic", "evict": "lfu"},
}
"""Name -> the [embedding] settings of that system (hashed: none)."""
DIST_SYSTEMS = {
    **{name: (ids, "auto") for name, ids in SYSTEMS.items()},
    "hashed, split by rows": ({}, "row_wise"),
    "dynamic, lru, split by rows": (SYSTEMS["dynamic, lru"], "row_wise"),
}
"""E2,T2: name -> (its [embedding] settings, placement): whole tables, or every table split by
rows over the two servers (a dynamic table's ids then routed by hash: ``idmap/pieces.py``)."""


def make_batches(vocab: int, rows: int, n: int, seed: int = 0):
    """n batches with raw 64-bit ids [T, B], and the same batches with hashed rows (id % rows)."""
    from dlrm_core.batch import Batch, SparseFeatures

    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, vocab + 1) ** 1.05
    cdf = np.cumsum(w) / w.sum()
    raw, hashed = [], []
    for _ in range(n):
        ranks = np.minimum(np.searchsorted(cdf, rng.random((T, BATCH))), vocab - 1)
        ids = ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # raw 64-bit ids, spread
        dense = torch.from_numpy(
            np.log1p(rng.lognormal(0, 1, (BATCH, NUM_DENSE))).astype(np.float32)
        )
        labels = torch.from_numpy((rng.random(BATCH) < 0.25).astype(np.float32))
        raw.append(
            Batch(dense, SparseFeatures.one_hot(torch.from_numpy(ids.view(np.int64))), labels)
        )
        rows_of = (ids % np.uint64(rows)).astype(np.int64)  # as the featuriser hashes
        hashed.append(Batch(dense, SparseFeatures.one_hot(torch.from_numpy(rows_of)), labels))
    return raw, hashed


def bench_config(rows: int, ids: dict, servers: int = 0, trainers: int = 1):
    from dense_trainer.config import load_config

    return load_config(
        None,
        [
            {
                "embedding": {
                    "dim": DIM,
                    "hash_size": rows,
                    "optimizer": {"kind": "rowwise_adagrad", "lr": 0.05},
                    **ids,
                },
                "model": {
                    "dense_arch_layer_sizes": [512, 256],
                    "over_arch_layer_sizes": [512, 256],
                },
                "train": {"batch_size": BATCH, "progress": False},
                "dist": {"embedding_servers": servers, "trainers": trainers},
            }
        ],
    )


def totals(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """Sums over the tables of rows_used, admitted, evicted (empty: no dynamic table)."""
    if not stats:
        return {}
    return {k: sum(s[k] for s in stats.values()) for k in ("rows_used", "admitted", "evicted")}


def churn(before: dict[str, int], after: dict[str, int], steps: int, capacity: int | None) -> dict:
    """Ids admitted / evicted per timed step, and whether the tables were full when timing began."""
    if not before:
        return {"admitted_per_step": None, "evicted_per_step": None, "full_at_start": None}
    return {
        "admitted_per_step": (after["admitted"] - before["admitted"]) / steps,
        "evicted_per_step": (after["evicted"] - before["evicted"]) / steps,
        "full_at_start": before["rows_used"] >= capacity,
    }


def single(args, threads: int) -> dict:
    """(a) One process, the systems interleaved over rounds on the same fresh batches; the dense
    step on ``threads`` threads (every core, or one core left to the maps' remap ahead)."""
    from dense_trainer.train import Trainer

    torch.set_num_threads(threads)

    raw, hashed = make_batches(args.vocab, args.rows, args.warmup + args.rounds * args.steps)
    trainers = {
        name: Trainer(bench_config(args.rows, ids), Path(tempfile.mkdtemp()))
        for name, ids in SYSTEMS.items()
    }
    data = {name: hashed if not ids else raw for name, ids in SYSTEMS.items()}

    def run(name: str, start: int, end: int, times: list[float] | None = None) -> None:
        """Steps start..end-1, each prefetching the next as ``Trainer.fit`` does (dynamic tables
        remap it meanwhile where a core is spare, ``idmap/ahead.py``; hashed: nothing to do), but
        the last."""
        trainer, batches = trainers[name], data[name]
        for i in range(start, end):
            t0 = time.perf_counter()
            trainer.train_step(batches[i], prefetch=batches[i + 1].sparse if i + 1 < end else None)
            if times is not None:
                times.append(time.perf_counter() - t0)

    for name in trainers:  # warm-up: fill the tables
        run(name, 0, args.warmup)
    before = {name: totals(t.client.id_stats()) for name, t in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for r in range(args.rounds):
        for name in trainers:
            run(name, args.warmup + r * args.steps, args.warmup + (r + 1) * args.steps, times[name])
    out = {}
    for name, trainer in trainers.items():
        step = statistics.median(times[name])
        after = totals(trainer.client.id_stats())
        out[name] = {
            "samples_per_s": BATCH / step,
            "step_ms": 1e3 * step,
            **churn(before[name], after, args.rounds * args.steps, capacity(args)),
        }
    return with_cost(out)


def capacity(args) -> int:
    """Rows of all the tables (ids + shared rows): what rows_used reaches when they are full."""
    return T * args.rows


def with_cost(out: dict) -> dict:
    """Each system's cost against hashed ids placed the same way."""
    for name, row in out.items():
        base = out["hashed, split by rows" if name.endswith("split by rows") else "hashed"][
            "samples_per_s"
        ]
        row["cost_vs_hashed"] = 1 - row["samples_per_s"] / base
    return out


def snapshot_after(shard, clock: int, store: dict) -> None:
    """Record the shard's id stats once its maps have made ``clock`` training lookups (the end of
    the warm-up, seen from a server)."""
    remap = shard.id_maps.remap

    def recording(sparse, train):
        out = remap(sparse, train)
        if train and int(shard.id_maps.counters[0, 0]) == clock:  # COUNTERS[0]: clock
            store.update(shard.id_stats())
        return out

    shard.id_maps.remap = recording


def dist_rank(rank: int, name: str, args, port: int, out: str) -> None:
    """One rank of E2,T2: ranks 0-1 trainers, 2-3 embedding servers."""
    from dense_trainer.distributed import rank_threads
    from dense_trainer.train import Trainer
    from embedding_server.client.distributed import DistributedEmbeddingClient
    from embedding_server.planner import plan_sharding, wire_id_bound
    from embedding_server.runtime.cluster import Roles, join
    from embedding_server.runtime.server import EmbeddingServer
    from embedding_server.runtime.transport import open_transport
    from embedding_server.wire import ids_dtype

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4")
    roles = Roles(2, 2)
    cluster = join(roles, 120, rank)
    torch.set_num_threads(rank_threads(roles, rank))
    ids, placement = DIST_SYSTEMS[name]
    cfg = bench_config(args.rows, ids, 2, 2)
    spec = cfg.feature_spec()
    plan = plan_sharding(spec, 2, "rowwise_adagrad", placement)
    cluster.transport = open_transport(cluster, ids_dtype(wire_id_bound(plan, spec)))
    total = args.warmup + args.steps
    if cluster.is_trainer:
        client = DistributedEmbeddingClient(cluster, plan, spec, 0.5, "fp32", corrected=True)
        trainer = Trainer(cfg, Path(tempfile.mkdtemp()), client=client, cluster=cluster)
        raw, hashed = make_batches(args.vocab, args.rows, total)
        data = [b.share(rank, 2) for b in (raw if ids else hashed)]
        times = []
        for i in range(total):
            ahead = data[i + 1].sparse if i + 1 < total else None
            t0 = time.perf_counter()
            trainer.train_step(data[i], BATCH, ahead)
            times.append(time.perf_counter() - t0)
        client.close()
        stats = [None] * 4 if rank == 0 else None
        dist.gather_object({"step_s": times[args.warmup :]}, stats, dst=0)
    else:
        server = EmbeddingServer(
            cluster, plan, spec, cfg.embedding, cfg.dist, cfg.live, 0, Path(tempfile.mkdtemp())
        )
        warm: dict = {}
        for shard in server.shards:
            if shard.id_maps:
                snapshot_after(shard, args.warmup, warm)
        server.serve()
        ends = server.shard.id_stats() if server.shard is not None else {}
        dist.gather_object({"warm": warm, "end": ends}, None, dst=0)
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    dist.barrier()
    cluster.heartbeat.close()  # not inside a store call when the process ends
    dist.destroy_process_group()


def distributed(args) -> dict:
    """(b) E2,T2, one launch per system and round, the systems interleaved; medians of the
    rounds' median steps."""
    from dense_trainer.distributed import free_port
    from embedding_server.idmap.remap import merge_piece_stats

    runs: dict[str, list[dict]] = {name: [] for name in DIST_SYSTEMS}
    for r in range(args.dist_rounds):
        for name in DIST_SYSTEMS:
            print(f"E2,T2 round {r + 1}/{args.dist_rounds}: {name}", file=sys.stderr, flush=True)
            path = Path(tempfile.mkdtemp()) / "result.json"
            mp.start_processes(
                dist_rank,
                args=(name, args, free_port(), str(path)),
                nprocs=4,
                start_method="spawn",
                join=True,
            )
            ranks = json.loads(path.read_text())
            warm, end = (merge_piece_stats([r[key] for r in ranks[2:]]) for key in ("warm", "end"))
            runs[name].append(
                {
                    "step": statistics.median(ranks[0]["step_s"]),
                    **churn(totals(warm), totals(end), args.steps, capacity(args)),
                }
            )
    out = {}
    for name, rs in runs.items():
        step = statistics.median(x["step"] for x in rs)
        out[name] = {
            "samples_per_s": BATCH / step,
            "step_ms": 1e3 * step,
            "round_step_ms": [1e3 * x["step"] for x in rs],
            **{k: v for k, v in rs[-1].items() if k != "step"},
        }
    return with_cost(out)


def memory(args) -> dict:
    from dlrm_core.schema import DynamicIds
    from embedding_server.idmap.dynamic import DynamicIdMap

    m = DynamicIdMap(100_000, DynamicIds(admit_after=2))
    rss, used = [], []
    batch = 200_000
    t0 = time.perf_counter()
    for start in range(0, args.stream_ids, batch):
        ids = torch.arange(start, start + batch, dtype=torch.int64) * 2654435761
        m.lookup(torch.cat([ids, ids[: batch // 10]]), train=True)
        used.append(m.stats()["rows_used"])
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {
        "distinct_ids": args.stream_ids,
        "capacity": 100_000,
        "max_rows_used": max(used),
        "peak_rss_mb_after_first_quarter": rss[len(rss) // 4],
        "peak_rss_mb_at_end": rss[-1],
        "seconds": time.perf_counter() - t0,
        **m.stats(),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows", type=int, default=20_000, help="rows per table (dynamic: its capacity)"
    )
    p.add_argument("--vocab", type=int, default=1_000_000, help="distinct ids per table")
    p.add_argument("--steps", type=int, default=15, help="timed steps per round")
    p.add_argument(
        "--warmup", type=int, default=60, help="steps that fill the tables before timing"
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of the one-process systems")
    p.add_argument("--dist-rounds", type=int, default=2, help="launches of each E2,T2 system")
    p.add_argument("--stream-ids", type=int, default=10_000_000)
    p.add_argument(
        "--skip", default="", help="comma-separated parts not to run: memory, single, spare, dist"
    )
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--tag", default="", help="suffix of the result files (e.g. dist, for a run of one part)"
    )
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": args.rows,
        "vocab": args.vocab,
        "steps": args.steps,
        "warmup": args.warmup,
        "kernel": kernel_in_use(),
        "rounds": args.rounds,
        "dist_rounds": args.dist_rounds,
        "loadavg_start": os.getloadavg()[0],
        "cores": os.cpu_count(),
    }
    if "memory" not in skip:
        result["memory"] = memory(args)
    cores = os.cpu_count() or 1
    if "single" not in skip:
        result["single"] = single(args, cores)
    if "spare" not in skip and cores > 1:
        result["single, a core spare"] = single(args, cores - 1)
    if "dist" not in skip:
        result["E2,T2"] = distributed(args)
    result["loadavg_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "dynamic_ids" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / f"{name}.md").write_text(md)
    print(md)


def kernel_in_use() -> str:
    """Which id-map kernel this run's maps use (``idmap/native.py``)."""
    from embedding_server.idmap import native

    return "C (idmap/idhash.c)" if native.library() is not None else "torch"


def render(r: dict) -> str:
    lines = [
        f"Dynamic ids ({r['date']}; 1-min load average {r['loadavg_start']:.2f} at the start, "
        f"{r['loadavg_end']:.2f} at the end): 26 tables x {r['rows']:,} rows, dim {DIM}, batch "
        f"{BATCH}, "
        f"Zipf(1.05) ids over {r['vocab']:,} values per table; {r['warmup']} warm-up steps, then "
        "every step "
        f"admits and evicts; the id maps' kernel: {r.get('kernel', 'torch')}",
        "",
    ]
    cores = r.get("cores", 2)
    for part, label in (
        (
            "single",
            f"one process, the dense step on all {cores} cores, medians of {r['rounds']} "
            f"rounds x {r['steps']} steps",
        ),
        (
            "single, a core spare",
            f"one process, the dense step on {cores - 1} thread(s): a core "
            f"spare for the remap ahead, as beside a GPU dense step",
        ),
        (
            "E2,T2",
            f"2 servers + 2 trainers, --pipeline exact, medians of {r['dist_rounds']} "
            f"launches x {r['steps']} steps",
        ),
    ):
        if part not in r:
            continue
        lines += [
            f"{part} ({label}):",
            "",
            "| ids | samples/s | step ms | cost vs hashed | admitted / step | evicted / step | "
            "full at start |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for name, t in r[part].items():
            adm = "-" if t["admitted_per_step"] is None else f"{t['admitted_per_step']:,.0f}"
            ev = "-" if t["evicted_per_step"] is None else f"{t['evicted_per_step']:,.0f}"
            full = "-" if t["full_at_start"] is None else ("yes" if t["full_at_start"] else "no")
            lines.append(
                f"| {name} | {t['samples_per_s']:,.0f} | {t['step_ms']:.1f} | "
                f"{100 * t['cost_vs_hashed']:.1f}% "
                f"| {adm} | {ev} | {full} |"
            )
        lines.append("")
    if "memory" in r:
        m = r["memory"]
        lines += [
            f"Bounded memory: {m['distinct_ids']:,} distinct ids into a {m['capacity']:,}-row "
            "table: "
            f"at most {m['max_rows_used']:,} rows used, {m['admitted']:,} admitted, "
            f"{m['evicted']:,} evicted; "
            f"peak RSS {m['peak_rss_mb_after_first_quarter']:,.0f} MB after a quarter of the "
            "stream, "
            f"{m['peak_rss_mb_at_end']:,.0f} MB at its end ({m['seconds']:.1f}s)."
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
