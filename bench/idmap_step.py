"""The id-map step alone: ``ShardIdMaps.remap`` of one training lookup, in dynamic_ids.py's
churning regime (26 tables x ROWS rows, dim 64, batch 2048, Zipf(1.05) ids over VOCAB values per
table, the tables full), on one thread.

An in-process shard (rowwise Adagrad, the kernel the trainer uses) per policy; a warm-up of
remaps fills the tables, then every timed step remaps a fresh batch (admits, evicts, resets rows).
No forward or backward runs: this is the map's own cost, the part of dynamic_ids.py's step that
hashed ids do not pay. Each policy runs on the maps' C kernel and on their torch version
(``--kernels``, ``idmap/native.py``), each with its own shard on the same batches; medians over
rounds of them all interleaved.

Usage: python bench/idmap_step.py [--rows 20000] [--vocab 1000000] [--steps 15] [--warmup 60]
       [--rounds 3] [--policies lru,lfu] [--kernels native,torch] [--tag NAME]
Writes bench/results/idmap_step{_TAG}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from dynamic_ids import BATCH, bench_config, make_batches  # noqa: E402


def shard_for(rows: int, policy: str):
    """The in-process shard of dynamic_ids.py's one-process system ``dynamic, <policy>``."""
    from embedding_server.client.local import InProcessEmbeddingClient

    cfg = bench_config(rows, {"ids": "dynamic", "evict": policy})
    spec = cfg.feature_spec()
    return InProcessEmbeddingClient(
        spec.tables,
        cfg.embedding.optimizer,
        cfg.embedding.device,
        cfg.train.seed,
        cfg.embedding.init_scale or None,
        spec.feature_tables,
    ).shard


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=15, help="timed steps per round and policy")
    p.add_argument(
        "--warmup", type=int, default=60, help="remaps before timing (60 fill the tables)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default="lru,lfu")
    p.add_argument(
        "--kernels", default="native,torch", help="the maps' kernels (DLRM_IDMAP_KERNEL values)"
    )
    p.add_argument("--tag", default="", help="suffix of the result files (e.g. before / after)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    torch.set_num_threads(1)
    systems = [(pol, k) for pol in args.policies.split(",") for k in args.kernels.split(",")]
    raw, _ = make_batches(args.vocab, args.rows, args.warmup + args.rounds * args.steps)
    shards = {f"{pol}, {k}": (k, shard_for(args.rows, pol)) for pol, k in systems}
    load0 = os.getloadavg()[0]
    for kernel, shard in shards.values():
        use_kernel(kernel)
        for b in raw[: args.warmup]:
            shard.id_maps.remap(b.sparse, train=True)
    full = {
        name: sum(s["rows_used"] for s in shard.id_maps.stats().values()) >= 26 * args.rows
        for name, (_, shard) in shards.items()
    }
    times: dict[str, list[float]] = {name: [] for name in shards}
    # thread CPU time: less hit by a loaded machine
    cpu: dict[str, list[float]] = {name: [] for name in shards}
    for r in range(args.rounds):
        for pol, (kernel, shard) in shards.items():
            use_kernel(kernel)
            for b in raw[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]:
                t0, c0 = time.perf_counter(), time.thread_time()
                shard.id_maps.remap(b.sparse, train=True)
                times[pol].append(time.perf_counter() - t0)
                cpu[pol].append(time.thread_time() - c0)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": args.rows,
        "vocab": args.vocab,
        "batch": BATCH,
        "steps": args.steps,
        "rounds": args.rounds,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg()[0],
        "threads": 1,
        "policies": {
            pol: {
                "step_ms_median": 1e3 * statistics.median(t),
                "step_ms_min": 1e3 * min(t),
                "cpu_ms_median": 1e3 * statistics.median(cpu[pol]),
                "full_at_start": full[pol],
                **{k: v for k, v in _totals(shards[pol][1]).items()},
            }
            for pol, t in times.items()
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "idmap_step" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / f"{name}.md").write_text(md)
    print(md)


def use_kernel(kernel: str) -> None:
    """The maps' kernel from now on (``idmap/native.py``: its choice is read on first use)."""
    from embedding_server.idmap import native

    os.environ[native.ENV] = kernel
    native.library.cache_clear()
    if kernel == "native" and native.library() is None:
        raise SystemExit("the id maps' C kernel does not build here")


def _totals(shard) -> dict[str, int]:
    stats = shard.id_maps.stats()
    return {k: sum(s[k] for s in stats.values()) for k in ("admitted", "evicted")}


def render(r: dict) -> str:
    lines = [
        f"Id-map step alone ({r['date']}; 1-min load average {r['loadavg_start']:.2f} at the "
        "start, "
        f"{r['loadavg_end']:.2f} at the end; one thread): 26 tables x {r['rows']:,} rows, batch "
        f"{r['batch']}, "
        f"Zipf(1.05) over {r['vocab']:,} values per table; {r['rounds']} rounds x {r['steps']} "
        "steps",
        "",
        "| policy, kernel | median ms / step | min ms / step | median CPU ms / step | admitted "
        "(total) | evicted (total) | full at start |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for pol, t in r["policies"].items():
        lines.append(
            f"| {pol} | {t['step_ms_median']:.1f} | {t['step_ms_min']:.1f} | "
            f"{t['cpu_ms_median']:.1f} | {t['admitted']:,} "
            f"| {t['evicted']:,} | {'yes' if t['full_at_start'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
