"""GPU check: the dense side on CUDA with the tables on CPU, a few hundred steps, in one run.

    (1) one process: tables in host memory (fbgemm CPU TBE, or the PyTorch kernel where fbgemm
        is absent), dense network on the GPU
    (2) E1,T1: one CPU embedding server + one CUDA trainer over Gloo (the disaggregated layout),
        lockstep (``--pipeline off``), ``exact`` and ``semi-sync``
    (3) E2,T1: two CPU embedding servers + one CUDA trainer, ``exact``

Prints samples/s and the step-time breakdown of each and writes gpu.{json,md} to --out. Without
CUDA it runs on the CPU and says so (that is how it is tested: tests/test_gpu_check.py). Run
through bench/gpu_check.sh.
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
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import distributed_throughput as dt  # noqa: E402


def describe() -> dict:
    from embedding_server.kernels.tbe import FBGEMM_IMPORT_ERROR

    info = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "python": sys.version.split()[0],
        "fbgemm": "available"
        if FBGEMM_IMPORT_ERROR is None
        else f"absent ({FBGEMM_IMPORT_ERROR}): PyTorch kernel",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def timed(trainer, steps: int, warmup: int, share=None, ahead: bool = False) -> list[float]:
    """Step times; ``ahead``: each step is given the next batch's ids (pipelined runs)."""
    data = dt.batches(8)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(warmup + steps):
        b = data[i % len(data)]
        if share is not None:
            b = b.share(*share)
        sync()
        nxt = data[(i + 1) % len(data)].sparse if ahead and i + 1 < warmup + steps else None
        t0 = time.perf_counter()
        trainer.train_step(b, dt.GLOBAL_BATCH, nxt)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if i == warmup - 1:
            trainer.timings = dict.fromkeys(trainer.timings, 0.0)
    return times


def single(steps: int, warmup: int) -> dict:
    from dense_trainer.train import Trainer

    trainer = Trainer(dt.bench_config(0, 1), Path(tempfile.mkdtemp()))
    times = timed(trainer, steps, warmup)
    return summary(times, trainer.timings, steps, str(trainer.device), trainer.client.kernel)


def summary(times, timings, steps, device, kernel) -> dict:
    step = statistics.median(times)
    return {
        "device": device,
        "kernel": kernel,
        "samples_per_s": dt.GLOBAL_BATCH / step,
        "median_step_ms": 1e3 * step,
        "breakdown_ms": {k.removesuffix("_s"): 1e3 * v / steps for k, v in timings.items()},
    }


def disaggregated_rank(
    rank: int, servers: int, pipeline: str, rows: int, port: int, steps: int, warmup: int, out: str
) -> None:
    """Rank 0: the trainer (CUDA when there is one); ranks 1..servers: CPU embedding servers."""
    import torch.distributed as dist

    from dense_trainer.distributed import rank_threads
    from dense_trainer.train import Trainer
    from embedding_server.client.distributed import DistributedEmbeddingClient
    from embedding_server.planner import plan_sharding
    from embedding_server.runtime.cluster import Roles, join
    from embedding_server.runtime.pipelining import pipelining
    from embedding_server.runtime.server import EmbeddingServer
    from embedding_server.runtime.transport import open_transport
    from embedding_server.wire import ids_dtype

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(1 + servers))
    dt.ROWS = rows  # a spawned process starts from the module's default
    roles = Roles(1, servers)
    cluster = join(roles, 300, rank)
    torch.set_num_threads(rank_threads(roles, rank))
    cfg = dt.bench_config(servers, 1, pipeline=pipeline)
    spec = cfg.feature_spec()
    plan = plan_sharding(spec, servers, "rowwise_adagrad", "auto")
    cluster.transport = open_transport(cluster, ids_dtype(dt.ROWS))
    if rank == 0:
        mode = pipelining(cfg.dist)
        client = DistributedEmbeddingClient(
            cluster, plan, spec, corrected=mode.expects_corrections()
        )
        trainer = Trainer(cfg, Path(tempfile.mkdtemp()), client=client, cluster=cluster)
        times = timed(trainer, steps, warmup, ahead=mode.prefetch)
        client.close()
        result = summary(times, trainer.timings, steps, str(trainer.device), client.kernel)
        result["communication_ms"] = 1e3 * client.stats["comm_s"] / (steps + warmup)
        Path(out).write_text(json.dumps(result))
    else:
        server = EmbeddingServer(
            cluster, plan, spec, cfg.embedding, cfg.dist, cfg.live, 0, Path(tempfile.mkdtemp())
        )
        server.serve()
    dist.barrier()
    cluster.heartbeat.close()  # not inside a store call when the process ends
    dist.destroy_process_group()


def disaggregated(servers: int, pipeline: str, steps: int, warmup: int) -> dict:
    from dense_trainer.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "r.json"
    mp.start_processes(
        disaggregated_rank,
        args=(servers, pipeline, dt.ROWS, free_port(), steps, warmup, str(out)),
        nprocs=1 + servers,
        start_method="spawn",
        join=True,
    )
    return json.loads(out.read_text())


LAYOUTS = [
    ("E1,T1 lockstep", 1, "off"),
    ("E1,T1 exact", 1, "exact"),
    ("E1,T1 semi-sync", 1, "semi-sync"),
    ("E2,T1 exact", 2, "exact"),
]
"""(name, CPU embedding servers, pipeline) of the disaggregated runs, beside the single process."""


def render(info: dict, rows: dict[str, dict], seconds: float) -> str:
    lines = [
        f"GPU check ({time.strftime('%Y-%m-%d %H:%M')}): {json.dumps(info)}; 26 tables x "
        f"{dt.ROWS:,} rows, "
        f"dim {dt.tt.DIM}, batch {dt.GLOBAL_BATCH}; servers on the CPU, the trainer on "
        f"{'CUDA' if info['cuda'] else 'the CPU (no CUDA device)'}; {seconds:.0f} s in all",
        "",
        "| layout | device | samples/s | vs single | step ms | embedding fwd ms | dense fwd ms | "
        "backward ms "
        "| optimizer ms | communication ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows["single process"]["samples_per_s"]
    for name, r in rows.items():
        b = r["breakdown_ms"]
        comm = f"{r['communication_ms']:.1f}" if "communication_ms" in r else "-"
        lines.append(
            f"| {name} | {r['device']} | {r['samples_per_s']:,.0f} | "
            f"{r['samples_per_s'] / base:.2f}x | "
            f"{r['median_step_ms']:.1f} | {b['embedding_forward']:.1f} | {b['dense_forward']:.1f} "
            "| "
            f"{b['backward']:.1f} | {b['optimizer']:.1f} | {comm} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument(
        "--out", type=Path, default=HERE / "results", help="where gpu.json and gpu.md go"
    )
    args = p.parse_args()
    dt.ROWS = args.rows
    info = describe()
    print("environment:", json.dumps(info), flush=True)
    if not info["cuda"]:
        print("no CUDA device: running the same check on the CPU", flush=True)
    t0 = time.time()
    rows = {"single process": single(args.steps, args.warmup)}
    print("single process:", json.dumps(rows["single process"]), flush=True)
    for name, servers, pipeline in LAYOUTS:
        rows[name] = disaggregated(servers, pipeline, args.steps, args.warmup)
        print(f"{name}:", json.dumps(rows[name]), flush=True)
    seconds = time.time() - t0
    md = render(info, rows, seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(
        json.dumps({"environment": info, "results": rows, "seconds": seconds}, indent=2) + "\n"
    )
    (args.out / "gpu.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
