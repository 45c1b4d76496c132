"""Dynamic ids: their throughput cost against hashed ids, and their bounded memory.

1. Training throughput, one process (``Trainer.train_step`` on the in-process fbgemm shard):
   26 tables x ROWS rows, dim 64, batch 2048, the train_throughput.py workload, ids Zipf(1.05)
   over a vocabulary of VOCAB_FACTOR x ROWS per table; hashed (id % rows) against dynamic
   (``evict`` lru / lfu) on the very same raw ids, interleaved over rounds, medians quoted.
2. Bounded memory: a stream of 10M distinct ids (one table of 100k rows, 200k ids a step, a tenth
   of them seen twice) through ``DynamicIdMap``: rows used after every step (never above the
   capacity) and the process's RSS over the stream.

Usage: python bench/dynamic_ids.py [--rows 100000] [--steps 20] [--rounds 2]
Writes bench/results/dynamic_ids.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

T, DIM, BATCH, NUM_DENSE = 26, 64, 2048, 13


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
        dense = torch.from_numpy(np.log1p(rng.lognormal(0, 1, (BATCH, NUM_DENSE))).astype(np.float32))
        labels = torch.from_numpy((rng.random(BATCH) < 0.25).astype(np.float32))
        raw.append(Batch(dense, SparseFeatures.one_hot(torch.from_numpy(ids.view(np.int64))), labels))
        rows_of = (ids % np.uint64(rows)).astype(np.int64)  # as the featuriser hashes
        hashed.append(Batch(dense, SparseFeatures.one_hot(torch.from_numpy(rows_of)), labels))
    return raw, hashed


def trainer_for(rows: int, ids: dict):
    from dense_trainer.config import load_config
    from dense_trainer.train import Trainer

    cfg = load_config(None, [{
        "embedding": {"dim": DIM, "hash_size": rows, "optimizer": {"kind": "rowwise_adagrad", "lr": 0.05}, **ids},
        "model": {"dense_arch_layer_sizes": [512, 256], "over_arch_layer_sizes": [512, 256]},
        "train": {"batch_size": BATCH, "progress": False},
    }])
    return Trainer(cfg, Path(tempfile.mkdtemp()))


def throughput(args) -> dict:
    batches, hashed = make_batches(args.rows * args.vocab_factor, args.rows, args.batches)
    systems = {"hashed": ({}, hashed), "dynamic, lru": ({"ids": "dynamic", "evict": "lru"}, batches),
               "dynamic, lfu": ({"ids": "dynamic", "evict": "lfu"}, batches)}
    trainers = {name: trainer_for(args.rows, ids) for name, (ids, _) in systems.items()}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for name, (_, data) in systems.items():  # warm-up: fill the tables
        for i in range(args.warmup):
            trainers[name].train_step(data[i % len(data)])
    for _ in range(args.rounds):
        for name, (_, data) in systems.items():
            for i in range(args.steps):
                t0 = time.perf_counter()
                trainers[name].train_step(data[i % len(data)])
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name in systems:
        step = statistics.median(times[name])
        stats = trainers[name].client.id_stats()
        out[name] = {"samples_per_s": BATCH / step, "step_ms": 1e3 * step,
                     "rows_used_C1": stats.get("C1", {}).get("rows_used"),
                     "evicted_C1": stats.get("C1", {}).get("evicted")}
    base = out["hashed"]["samples_per_s"]
    for name in systems:
        out[name]["cost_vs_hashed"] = 1 - out[name]["samples_per_s"] / base
    return out


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
    return {"distinct_ids": args.stream_ids, "capacity": 100_000, "max_rows_used": max(used),
            "peak_rss_mb_after_first_quarter": rss[len(rss) // 4], "peak_rss_mb_at_end": rss[-1],
            "seconds": time.perf_counter() - t0, **m.stats()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--vocab-factor", type=int, default=10, help="vocabulary per table, in table rows")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stream-ids", type=int, default=10_000_000)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    torch.manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "rows": args.rows, "vocab_factor": args.vocab_factor,
              "memory": memory(args), "throughput": throughput(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamic_ids.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / "dynamic_ids.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    lines = [f"Dynamic ids ({r['date']}): one process, 26 tables x {r['rows']:,} rows, dim {DIM}, batch {BATCH}, "
             f"Zipf(1.05) ids over {r['vocab_factor']}x the rows per table", "",
             "| ids | samples/s | step ms | cost vs hashed | C1 rows used | C1 evicted |", "|---|---:|---:|---:|---:|---:|"]
    for name, t in r["throughput"].items():
        lines.append(f"| {name} | {t['samples_per_s']:,.0f} | {t['step_ms']:.1f} | {100 * t['cost_vs_hashed']:.1f}% | "
                     f"{t['rows_used_C1'] or '-'} | {t['evicted_C1'] if t['evicted_C1'] is not None else '-'} |")
    m = r["memory"]
    lines += ["", f"Bounded memory: {m['distinct_ids']:,} distinct ids into a {m['capacity']:,}-row table: "
              f"at most {m['max_rows_used']:,} rows used, {m['admitted']:,} admitted, {m['evicted']:,} evicted; "
              f"peak RSS {m['peak_rss_mb_after_first_quarter']:,.0f} MB after a quarter of the stream, "
              f"{m['peak_rss_mb_at_end']:,.0f} MB at its end ({m['seconds']:.1f}s)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
