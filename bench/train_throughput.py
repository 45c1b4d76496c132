"""Training throughput and memory, side by side in one run: ours vs TorchRec vs plain PyTorch.

Workload (Kaggle-shaped): 26 tables x ROWS rows, dim 64, batch 2048, bottom MLP 13-512-256-64,
dot interaction, top MLP 512-256-1, row-wise Adagrad on the tables and Adam on the dense
parameters, one process on the CPU, ids uniform or Zipf-distributed. Each system runs in its own
process (so that peak RSS is its own), on the same pre-built batches, and the systems are
interleaved over several rounds; we quote medians and ratios.

    (a) ours:     dense_trainer.Trainer.train_step on the in-process fbgemm shard
    (b) torchrec: DLRM under DistributedModelParallel, world size 1 (Gloo), fused row-wise
                  Adagrad (TorchRec from `make bench-env`, installed with --no-deps)
    (c) plain:    26 nn.EmbeddingBag(sparse=True) + SparseAdam (bench/plain_dlrm.py)

Also measured: parse throughput of the Criteo reader (rows/s) beside training samples/s from a
file, and the embedding lookup+update bandwidth against this machine's memory copy bandwidth.

Usage: python bench/train_throughput.py [--rows 100000] [--rounds 2] [--steps 30]
Writes bench/results/train_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

T, DIM, BATCH, NUM_DENSE = 26, 64, 2048, 13
BOTTOM, TOP = [512, 256], [512, 256]
SPARSE_LR, DENSE_LR = 0.05, 1e-3


def make_batches(rows: int, dist: str, n: int, seed: int = 0):
    """n batches: dense [B, 13], ids [T, B], labels [B] (numpy, shared by every system)."""
    rng = np.random.default_rng(seed)
    perm = [rng.permutation(rows) for _ in range(T)]
    if dist == "zipf":
        w = 1.0 / np.arange(1, rows + 1) ** 1.05
        cdf = np.cumsum(w) / w.sum()
    out = []
    for _ in range(n):
        dense = rng.lognormal(0, 1, (BATCH, NUM_DENSE)).astype(np.float32)
        if dist == "zipf":
            ranks = np.minimum(np.searchsorted(cdf, rng.random((T, BATCH))), rows - 1)
            ids = np.stack([perm[t][ranks[t]] for t in range(T)])
        else:
            ids = rng.integers(0, rows, (T, BATCH))
        labels = (rng.random(BATCH) < 0.25).astype(np.float32)
        out.append((np.log1p(dense), ids.astype(np.int64), labels))
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_steps(step, batches, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        step(b)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


# -- workers: each runs in its own process ---------------------------------------------------------


def worker_ours(args) -> dict:
    from dense_trainer.config import load_config
    from dense_trainer.train import Trainer
    from dlrm_core.batch import Batch, SparseFeatures

    cfg = load_config(
        None,
        [
            {
                "embedding": {
                    "dim": DIM,
                    "hash_size": args.rows,
                    "optimizer": {"kind": "rowwise_adagrad", "lr": SPARSE_LR},
                },
                "model": {
                    "dense_arch_layer_sizes": BOTTOM,
                    "over_arch_layer_sizes": TOP,
                    "interaction": "dot",
                },
                "optim": {"kind": "adam", "lr": DENSE_LR},
                "train": {"batch_size": BATCH, "progress": False},
            }
        ],
    )
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()))
    raw = make_batches(args.rows, args.dist, args.batches)
    batches = [
        Batch(torch.from_numpy(d), SparseFeatures.one_hot(torch.from_numpy(i)), torch.from_numpy(y))
        for d, i, y in raw
    ]
    times = time_steps(trainer.train_step, batches, args.warmup, args.steps)
    result = {"step_s": times, "kernel": trainer.client.kernel}

    # Embedding lookup + fused update alone, and the bytes it moves.
    shard = trainer.client.shard
    emb_times, moved = [], []
    for i in range(args.warmup + args.steps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        out = shard(b.sparse)  # [B, T*D]
        out.backward(torch.ones_like(out))
        if i >= args.warmup:
            emb_times.append(time.perf_counter() - t0)
            unique = sum(
                int(torch.unique(b.sparse.values.view(T, -1)[t]).numel()) for t in range(T)
            )
            lookups = BATCH * T * DIM * 4  # rows gathered (fwd) and gradients read (bwd)
            # fwd: read rows + write pooled; bwd: read grads, read+write each unique row and its
            # row-wise accumulator.
            moved.append(2 * lookups + lookups + unique * (DIM * 4 * 2 + 8))
    result["embedding_s"] = emb_times
    result["embedding_bytes"] = moved
    return result


def worker_torchrec(args) -> dict:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    keys = [f"t{i}" for i in range(T)]
    tables = [
        EmbeddingBagConfig(name=k, embedding_dim=DIM, num_embeddings=args.rows, feature_names=[k])
        for k in keys
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*BOTTOM, DIM],
        over_arch_layer_sizes=[*TOP, 1],
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": SPARSE_LR})
    constraints = {
        k: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for k in keys
    }
    topology = Topology(world_size=1, compute_device="cpu")
    sharders = get_default_sharders()
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).plan(
        model, sharders
    )
    dmp = DistributedModelParallel(
        module=model, device=torch.device("cpu"), plan=plan, sharders=sharders
    )
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.Adam(p, lr=DENSE_LR),
    )
    batches = []
    for d, ids, y in make_batches(args.rows, args.dist, args.batches):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(ids.reshape(-1)),
            lengths=torch.ones(T * BATCH, dtype=torch.int32),
        )
        batches.append((torch.from_numpy(d), kjt, torch.from_numpy(y)))

    def step(b):
        dense, kjt, labels = b
        logits = dmp(dense, kjt).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()

    times = time_steps(step, batches, args.warmup, args.steps)
    import torchrec

    kernels = sorted({p.compute_kernel for m in plan.plan.values() for p in m.values()})
    dist.destroy_process_group()
    return {"step_s": times, "torchrec_version": torchrec.__version__, "kernels": kernels}


def worker_plain(args) -> dict:
    from plain_dlrm import PlainDLRM

    model = PlainDLRM([args.rows] * T, DIM, BOTTOM, TOP)
    opts = model.optimizers(SPARSE_LR, DENSE_LR)
    offsets = torch.arange(T * BATCH + 1)
    batches = [
        (torch.from_numpy(d), torch.from_numpy(i.reshape(-1)), torch.from_numpy(y))
        for d, i, y in make_batches(args.rows, args.dist, args.batches)
    ]

    def step(b):
        dense, values, labels = b
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, values, offsets), labels
        )
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()

    return {"step_s": time_steps(step, batches, args.warmup, args.steps)}


def worker_parse(args) -> dict:
    """Reader throughput alone, and our training from a file vs from memory."""
    from dense_trainer.config import load_config
    from dense_trainer.data.loader import BatchLoader
    from dense_trainer.data.synth import synthesize
    from dense_trainer.train import Trainer

    tmp = Path(tempfile.mkdtemp())
    synthesize(tmp, train_rows=args.parse_rows, test_rows=2048, seed=0)
    cfg = load_config(
        None,
        [
            {
                "embedding": {"dim": DIM, "hash_size": args.rows, "optimizer": {"lr": SPARSE_LR}},
                "model": {"dense_arch_layer_sizes": BOTTOM, "over_arch_layer_sizes": TOP},
                "optim": {"lr": DENSE_LR},
                "train": {"batch_size": BATCH, "progress": False, "checkpoint_every_steps": 0},
            }
        ],
    )
    spec = cfg.feature_spec()
    out = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        loader = BatchLoader([tmp / "train.txt"], spec, BATCH, num_workers=workers)
        rows = sum(b.batch_size for b in loader)
        out[f"loader_rows_per_s_{workers}w"] = rows / (time.perf_counter() - t0)
        out["parse_rows_per_s_1thread"] = loader.stats.parse_rows_per_s
    metrics = Trainer(cfg, tmp / "run").fit([tmp / "train.txt"], [tmp / "test.txt"])
    out["train_from_file_samples_per_s"] = metrics["train_samples_per_s"]
    out["train_from_file_data_wait_share"] = metrics["data_wait_share"]
    out["file_bytes_per_row"] = (tmp / "train.txt").stat().st_size / args.parse_rows
    return out


def worker_memcpy(args) -> dict:
    n = 128 << 20  # 512 MB of fp32
    src, dst = torch.randn(n), torch.empty(n)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return {"copy_GBps": 2 * n * 4 / statistics.median(times) / 1e9}  # read + write


WORKERS = {
    "ours": worker_ours,
    "torchrec": worker_torchrec,
    "plain": worker_plain,
    "parse": worker_parse,
    "memcpy": worker_memcpy,
}


def run_worker(name: str, args, dist: str = "uniform") -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--dist",
        dist,
        "--rows",
        str(args.rows),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batches",
        str(args.batches),
        "--parse-rows",
        str(args.parse_rows),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {name}/{dist} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=100_000, help="rows per table (default 100k)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=8, help="distinct pre-built batches")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every system")
    p.add_argument(
        "--parse-rows", type=int, default=300_000, help="rows of the file for the parse test"
    )
    p.add_argument("--systems", default="ours,torchrec,plain")
    p.add_argument("--dists", default="uniform,zipf")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dist", default="uniform", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        result = WORKERS[args.worker](args)
        result["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return

    systems, dists = args.systems.split(","), args.dists.split(",")
    runs: dict[str, dict[str, list[dict]]] = {d: {s: [] for s in systems} for d in dists}
    for r in range(args.rounds):
        for d in dists:
            for s in systems:
                print(f"round {r + 1}/{args.rounds}: {s} ({d})", file=sys.stderr, flush=True)
                runs[d][s].append(run_worker(s, args, d))
    print("parse + memcpy", file=sys.stderr, flush=True)
    parse = run_worker("parse", args)
    memcpy = run_worker("memcpy", args)

    table = {}
    for d in dists:
        table[d] = {}
        for s in systems:
            step = statistics.median([t for run in runs[d][s] for t in run["step_s"]])
            table[d][s] = {
                "median_step_ms": step * 1e3,
                "samples_per_s": BATCH / step,
                "peak_rss_mb": statistics.median(run["peak_rss_mb"] for run in runs[d][s]),
            }
        if "ours" in systems:
            ours = table[d]["ours"]
            for s in systems:
                if s != "ours":
                    ours[f"speedup_vs_{s}"] = ours["samples_per_s"] / table[d][s]["samples_per_s"]
                    ours[f"rss_ratio_vs_{s}"] = ours["peak_rss_mb"] / table[d][s]["peak_rss_mb"]
            emb_s = [t for run in runs[d]["ours"] for t in run["embedding_s"]]
            emb_b = [b for run in runs[d]["ours"] for b in run["embedding_bytes"]]
            gbps = statistics.median(b / t for b, t in zip(emb_b, emb_s, strict=True)) / 1e9
            ours["embedding_ms"] = statistics.median(emb_s) * 1e3
            ours["embedding_GBps"] = gbps
            ours["embedding_share_of_copy_bw"] = gbps / memcpy["copy_GBps"]
    result = {
        "workload": {
            "tables": T,
            "rows": args.rows,
            "dim": DIM,
            "batch": BATCH,
            "bottom": BOTTOM,
            "top": TOP,
            "sparse_optimizer": "rowwise_adagrad",
            "dense_optimizer": "adam",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "results": table,
        "parse": parse,
        "memcpy": memcpy,
        "torchrec": runs[dists[0]].get("torchrec", [{}])[0].get("torchrec_version"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    (args.out / "train_throughput.md").write_text(md)
    print(md)


def render_markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        f"Training throughput, {w['tables']} tables x {w['rows']:,} rows, dim {w['dim']}, batch "
        f"{w['batch']}, "
        f"1 process on {r['machine']['cpus']} CPU cores ({r['date']}; median of {r['rounds']} x "
        f"{r['timed_steps_per_run']} steps per system)",
        "",
        "| ids | system | samples/s | step ms | peak RSS MB | ours: speed ratio | ours: RSS ratio "
        "|",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for d, systems in r["results"].items():
        ours = systems.get("ours", {})
        for s, v in systems.items():
            ratio = f"{ours.get(f'speedup_vs_{s}', 1.0):.2f}x" if s != "ours" else "-"
            rss = f"{ours.get(f'rss_ratio_vs_{s}', 1.0):.2f}x" if s != "ours" else "-"
            name = {
                "ours": "ours (fbgemm TBE, fused row-wise Adagrad)",
                "torchrec": f"TorchRec {r.get('torchrec') or ''} DMP, world size 1",
                "plain": "plain PyTorch (EmbeddingBag + SparseAdam)",
            }.get(s, s)
            lines.append(
                f"| {d} | {name} | {v['samples_per_s']:,.0f} | {v['median_step_ms']:.1f} | "
                f"{v['peak_rss_mb']:,.0f} | {ratio} | {rss} |"
            )
    p, m = r["parse"], r["memcpy"]
    lines += [
        "",
        "| data path | rows/s |",
        "|---|---:|",
        "| Criteo parse, per worker thread (rows / parse seconds) | "
        f"{p['parse_rows_per_s_1thread']:,.0f} |",
        f"| loader, 1 worker | {p['loader_rows_per_s_1w']:,.0f} |",
        f"| loader, 2 workers | {p['loader_rows_per_s_2w']:,.0f} |",
        f"| training from the file (ours, samples/s) | {p['train_from_file_samples_per_s']:,.0f} |",
        f"| of which waiting for the loader | {100 * p['train_from_file_data_wait_share']:.1f}% |",
    ]
    lines += ["", "| embedding lookup + fused update (ours) | value |", "|---|---:|"]
    for d, systems in r["results"].items():
        if "ours" in systems:
            o = systems["ours"]
            lines.append(f"| {d}: time per step | {o['embedding_ms']:.2f} ms |")
            lines.append(
                f"| {d}: bandwidth | {o['embedding_GBps']:.1f} GB/s "
                f"({100 * o['embedding_share_of_copy_bw']:.0f}% of copy bandwidth) |"
            )
    lines.append(f"| memory copy bandwidth (read + write) | {m['copy_GBps']:.1f} GB/s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
