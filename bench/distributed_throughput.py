"""Disaggregated training throughput, in one run: one process vs embedding servers + trainers vs
TorchRec DistributedModelParallel with world size 2.

Workload: bench/train_throughput.py's (26 tables x 100k rows, dim 64, global batch 2048,
bottom 13-512-256-64, top 512-256-1, row-wise Adagrad + Adam), the same pre-built batches for
every system, all processes on this machine (2 cores: more ranks share the same cores, so this
measures overheads, not scale-out).

    single              one process, tables in-process (dense_trainer.Trainer.train_step)
    E1,T1 lockstep      1 embedding server + 1 trainer, point to point over loopback (Gloo),
                        --pipeline off: the trainer waits for lookups, the server for gradients
    E1,T1 pipelined     --pipeline exact: the next batch's ids travel and are looked up while the
                        trainer computes, before the previous update; the bags that update
                        changed are looked up again and sent as a correction (results identical
                        to lockstep)
    E1,T1 exact uncorr. --pipeline exact without corrections (dist.corrected_lookups = false): the
                        lookup waits for the previous update
    E1,T1 semi-sync     --pipeline semi-sync: lookups do not wait for the previous update
    E2,T2 ...           2 servers + 2 trainers (DDP between trainers), the same three modes
    E2,T2 bf16          pipelined, pooled embeddings and gradients sent as bf16
    torchrec ws2        TorchRec DMP, world size 2, table-wise fused row-wise Adagrad, 1024 per rank

Reports median samples/s, ratios, the all-to-all bytes per sample per direction against the
analytical minimum, and the communication share of the step. Writes
bench/results/distributed_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402

GLOBAL_BATCH = tt.BATCH


def bench_config(servers: int, trainers: int, exchange: str = "fp32", pipeline: str = "exact"):
    """pipeline: off | exact | semi-sync | exact-uncorrected."""
    from dense_trainer.config import load_config

    corrected = pipeline != "exact-uncorrected"
    pipeline = pipeline.removesuffix("-uncorrected")

    return load_config(
        None,
        [
            {
                "embedding": {
                    "dim": tt.DIM,
                    "hash_size": ROWS,
                    "optimizer": {"kind": "rowwise_adagrad", "lr": tt.SPARSE_LR},
                },
                "model": {"dense_arch_layer_sizes": tt.BOTTOM, "over_arch_layer_sizes": tt.TOP},
                "optim": {"kind": "adam", "lr": tt.DENSE_LR},
                "train": {"batch_size": GLOBAL_BATCH, "progress": False},
                "dist": {
                    "embedding_servers": servers,
                    "trainers": trainers,
                    "exchange_dtype": exchange,
                    "pipeline": pipeline,
                    "corrected_lookups": corrected,
                },
            }
        ],
    )


ROWS = 100_000


def batches(n: int):
    from dlrm_core.batch import Batch, SparseFeatures

    return [
        Batch(torch.from_numpy(d), SparseFeatures.one_hot(torch.from_numpy(i)), torch.from_numpy(y))
        for d, i, y in tt.make_batches(ROWS, "uniform", n)
    ]


def ours_rank(
    rank: int,
    servers: int,
    trainers: int,
    exchange: str,
    pipeline: str,
    port: int,
    steps: int,
    warmup: int,
    out: str,
):
    from dense_trainer.train import Trainer
    from embedding_server.client.distributed import DistributedEmbeddingClient
    from embedding_server.planner import plan_sharding
    from embedding_server.runtime.cluster import Roles, join
    from embedding_server.runtime.pipelining import pipelining
    from embedding_server.runtime.server import EmbeddingServer
    from embedding_server.runtime.transport import open_transport
    from embedding_server.wire import ids_dtype

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(servers + trainers)
    )
    roles = Roles(trainers, servers)
    cluster = join(roles, 120, rank)
    from dense_trainer.distributed import rank_threads

    torch.set_num_threads(rank_threads(roles, rank))
    cfg = bench_config(servers, trainers, exchange, pipeline)
    spec = cfg.feature_spec()
    plan = plan_sharding(spec, servers, "rowwise_adagrad", "auto")
    cluster.transport = open_transport(cluster, ids_dtype(ROWS))
    if cluster.is_trainer:
        client = DistributedEmbeddingClient(
            cluster,
            plan,
            spec,
            1.0 / trainers,
            exchange,
            corrected=pipelining(cfg.dist).expects_corrections(),
        )
        trainer = Trainer(cfg, Path(tempfile.mkdtemp()), client=client, cluster=cluster)
        data = [b.share(rank, trainers) for b in batches(8)]
        times = []
        total = warmup + steps
        # the traffic counters cover every step (a prefetch straddles the warm-up's end)
        all_times = []
        for i in range(total):
            b, nxt = data[i % len(data)], data[(i + 1) % len(data)]
            ahead = nxt.sparse if pipeline != "off" and i + 1 < total else None
            t0 = time.perf_counter()
            trainer.train_step(b, GLOBAL_BATCH, ahead)
            all_times.append(time.perf_counter() - t0)
        times = all_times[warmup:]
        client.close()
        dist.gather_object({"rank": rank}, [None] * roles.world_size if rank == 0 else None, dst=0)
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "step_s": times,
                        "all_step_s": all_times,
                        "client": client.stats,
                        "rss_mb": tt.peak_rss_mb(),
                    }
                )
            )
    else:
        server = EmbeddingServer(
            cluster, plan, spec, cfg.embedding, cfg.dist, cfg.live, 0, Path(tempfile.mkdtemp())
        )
        server.serve()
        dist.gather_object({"rank": rank}, None, dst=0)
    dist.barrier()
    cluster.heartbeat.close()  # not inside a store call when the process ends
    dist.destroy_process_group()


def run_ours(servers: int, trainers: int, exchange: str, args, pipeline: str = "exact") -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    from dense_trainer.distributed import free_port

    port = free_port()
    mp.start_processes(
        ours_rank,
        args=(servers, trainers, exchange, pipeline, port, args.steps, args.warmup, str(out)),
        nprocs=servers + trainers,
        start_method="spawn",
        join=True,
    )
    r = json.loads(out.read_text())
    step = statistics.median(r["step_s"])
    c = r["client"]
    samples = GLOBAL_BATCH / trainers * (args.steps + args.warmup)  # the master's share, every step
    return {
        "samples_per_s": GLOBAL_BATCH / step,
        "median_step_ms": step * 1e3,
        "bytes_per_sample_out": c["bytes_out"] / samples,
        "bytes_per_sample_in": (c["bytes_in"] + c["correction_bytes"]) / samples,
        "comm_share": c["comm_s"] / sum(r["all_step_s"]),
        "master_rss_mb": r["rss_mb"],
    }


def run_single(args) -> dict:
    from dense_trainer.train import Trainer

    trainer = Trainer(bench_config(0, 1), Path(tempfile.mkdtemp()))
    data = batches(8)
    times = tt.time_steps(trainer.train_step, data, args.warmup, args.steps)
    step = statistics.median(times)
    return {"samples_per_s": GLOBAL_BATCH / step, "median_step_ms": step * 1e3}


def torchrec_rank(rank: int, port: int, steps: int, warmup: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
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

    keys = [f"t{i}" for i in range(tt.T)]
    tables = [
        EmbeddingBagConfig(name=k, embedding_dim=tt.DIM, num_embeddings=ROWS, feature_names=[k])
        for k in keys
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=tt.NUM_DENSE,
        dense_arch_layer_sizes=[*tt.BOTTOM, tt.DIM],
        over_arch_layer_sizes=[*tt.TOP, 1],
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(
        RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": tt.SPARSE_LR}
    )
    constraints = {
        k: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for k in keys
    }
    sharders = get_default_sharders()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints
    ).collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        module=model, device=torch.device("cpu"), plan=plan, sharders=sharders
    )
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.Adam(p, lr=tt.DENSE_LR),
    )
    local = GLOBAL_BATCH // 2
    data = []
    for d, ids, y in tt.make_batches(ROWS, "uniform", 8):
        sl = slice(rank * local, (rank + 1) * local)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(ids[:, sl].reshape(-1)),
            lengths=torch.ones(tt.T * local, dtype=torch.int32),
        )
        data.append((torch.from_numpy(d[sl]), kjt, torch.from_numpy(y[sl])))

    def step(b):
        dense, kjt, labels = b
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dmp(dense, kjt).squeeze(1), labels
        )
        opt.zero_grad()
        loss.backward()
        opt.step()

    times = tt.time_steps(step, data, warmup, steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": times}))
    dist.destroy_process_group()


def run_torchrec(args) -> dict | None:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        print("torchrec not installed here (run through `make bench`): skipped", file=sys.stderr)
        return None
    out = Path(tempfile.mkdtemp()) / "result.json"
    from dense_trainer.distributed import free_port

    mp.start_processes(
        torchrec_rank,
        args=(free_port(), args.steps, args.warmup, str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    step = statistics.median(json.loads(out.read_text())["step_s"])
    return {"samples_per_s": GLOBAL_BATCH / step, "median_step_ms": step * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    systems = {"single": lambda: run_single(args)}
    for e, t in ((1, 1), (2, 2)):
        for label, mode in (
            ("lockstep", "off"),
            ("pipelined", "exact"),
            ("semi-sync", "semi-sync"),
        ):
            systems[f"E{e},T{t} {label}"] = lambda e=e, t=t, mode=mode: run_ours(
                e, t, "fp32", args, mode
            )
        if e == 1:
            systems["E1,T1 exact uncorrected"] = lambda: run_ours(
                1, 1, "fp32", args, "exact-uncorrected"
            )
    systems["E2,T2 pipelined bf16"] = lambda: run_ours(2, 2, "bf16", args, "exact")
    systems["torchrec ws2"] = lambda: run_torchrec(args)
    runs: dict[str, list[dict]] = {k: [] for k in systems}
    for r in range(args.rounds):
        for name, fn in systems.items():
            print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            res = fn()
            if res is not None:
                runs[name].append(res)
    table = {}
    for name, rs in runs.items():
        if rs:
            table[name] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
    single = table["single"]["samples_per_s"]
    for row in table.values():
        row["time_per_sample_vs_single"] = single / row["samples_per_s"]
    if "torchrec ws2" in table:
        tr = table["torchrec ws2"]["samples_per_s"]
        for name in table:
            if name.startswith("E2,T2"):
                table[name]["throughput_vs_torchrec_ws2"] = table[name]["samples_per_s"] / tr
    minimum = {"ids_out": 4 * tt.T, "pooled_in": 4 * tt.T * tt.DIM, "grads_out": 4 * tt.T * tt.DIM}
    result = {
        "workload": {"tables": tt.T, "rows": ROWS, "dim": tt.DIM, "global_batch": GLOBAL_BATCH},
        "results": table,
        "analytical_minimum_bytes_per_sample": minimum,
        "rounds": args.rounds,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / "distributed_throughput.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    m = r["analytical_minimum_bytes_per_sample"]
    lines = [
        f"Disaggregated training on one {r['cpus']}-core machine ({r['date']}; "
        f"{r['workload']['tables']} tables x "
        f"{r['workload']['rows']:,} rows, dim {r['workload']['dim']}, global batch "
        f"{r['workload']['global_batch']}; "
        f"medians of {r['rounds']} rounds x {r['steps']} steps)",
        "",
        "| system | samples/s | time/sample vs single | vs TorchRec ws2 | bytes/sample out (min) "
        "| bytes/sample in (min) | comm share |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in r["results"].items():
        out = (
            f"{row['bytes_per_sample_out']:,.0f} ({m['ids_out'] + m['grads_out']:,})"
            if "bytes_per_sample_out" in row
            else "-"
        )
        inn = (
            f"{row['bytes_per_sample_in']:,.0f} ({m['pooled_in']:,})"
            if "bytes_per_sample_in" in row
            else "-"
        )
        share = f"{100 * row['comm_share']:.0f}%" if "comm_share" in row else "-"
        vs = (
            f"{row['throughput_vs_torchrec_ws2']:.2f}x"
            if "throughput_vs_torchrec_ws2" in row
            else "-"
        )
        lines.append(
            f"| {name} | {row['samples_per_s']:,.0f} | {row['time_per_sample_vs_single']:.2f}x | "
            f"{vs} | {out} | {inn} | {share} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
