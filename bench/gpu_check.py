"""GPU check: the dense side on CUDA with the tables on CPU, a few hundred steps, in one run.

    (1) one process: tables in host memory (fbgemm CPU TBE, or the PyTorch kernel where fbgemm
        is absent), dense network on the GPU
    (2) one CPU embedding server + one CUDA trainer over Gloo (the disaggregated layout)

Prints samples/s and the step-time breakdown of each. Without CUDA it runs on the CPU and says
so (that is how it is tested). Run through bench/gpu_check.sh.
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
    from embedding_server.tbe import FBGEMM_IMPORT_ERROR

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "python": sys.version.split()[0],
            "fbgemm": "available" if FBGEMM_IMPORT_ERROR is None else f"absent ({FBGEMM_IMPORT_ERROR}): PyTorch kernel"}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def timed(trainer, steps: int, warmup: int, share=None) -> list[float]:
    data = dt.batches(8)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(warmup + steps):
        b = data[i % len(data)]
        if share is not None:
            b = b.share(*share)
        sync()
        t0 = time.perf_counter()
        trainer.train_step(b, dt.GLOBAL_BATCH)
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
    return {"device": device, "kernel": kernel, "samples_per_s": dt.GLOBAL_BATCH / step, "median_step_ms": 1e3 * step,
            "breakdown_ms": {k.removesuffix("_s"): 1e3 * v / steps for k, v in timings.items()}}


def disaggregated_rank(rank: int, port: int, steps: int, warmup: int, out: str) -> None:
    import torch.distributed as dist

    from dense_trainer.distributed import rank_threads
    from dense_trainer.train import Trainer
    from embedding_server.cluster import Roles, join
    from embedding_server.dist_client import DistributedEmbeddingClient
    from embedding_server.planner import plan_sharding
    from embedding_server.server import EmbeddingServer
    from embedding_server.transport import open_transport
    from embedding_server.wire import ids_dtype

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    roles = Roles(1, 1)
    cluster = join(roles, 300, rank)
    torch.set_num_threads(rank_threads(roles, rank))
    cfg = dt.bench_config(1, 1)
    spec = cfg.feature_spec()
    plan = plan_sharding(spec, 1, "rowwise_adagrad", "auto")
    cluster.transport = open_transport(cluster, ids_dtype(dt.ROWS))
    if rank == 0:
        client = DistributedEmbeddingClient(cluster, plan, spec)
        trainer = Trainer(cfg, Path(tempfile.mkdtemp()), client=client, cluster=cluster)
        times = timed(trainer, steps, warmup)
        client.close()
        result = summary(times, trainer.timings, steps, str(trainer.device), client.kernel)
        result["communication_ms"] = 1e3 * client.stats["comm_s"] / (steps + warmup)
        Path(out).write_text(json.dumps(result))
    else:
        server = EmbeddingServer(cluster, plan, spec, cfg.embedding, cfg.dist, cfg.live, 0, Path(tempfile.mkdtemp()))
        server.serve()
        result = None
    dist.barrier()
    cluster.heartbeat.close()  # not inside a store call when the process ends
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rows", type=int, default=100_000)
    args = p.parse_args()
    dt.ROWS = args.rows
    info = describe()
    print("environment:", json.dumps(info), flush=True)
    if not info["cuda"]:
        print("no CUDA device: running the same check on the CPU", flush=True)
    t0 = time.time()
    one = single(args.steps, args.warmup)
    print("single process:", json.dumps(one), flush=True)
    from dense_trainer.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "r.json"
    mp.start_processes(disaggregated_rank, args=(free_port(), args.steps, args.warmup, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    two = json.loads(out.read_text())
    print("1 CPU embedding server + 1 trainer:", json.dumps(two), flush=True)
    print("\n| layout | device | samples/s | step ms | embedding fwd ms | dense fwd ms | backward ms | optimizer ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in [("single process", one), ("E1,T1", two)]:
        b = r["breakdown_ms"]
        print(f"| {name} | {r['device']} | {r['samples_per_s']:,.0f} | {r['median_step_ms']:.1f} | "
              f"{b['embedding_forward']:.1f} | {b['dense_forward']:.1f} | {b['backward']:.1f} | {b['optimizer']:.1f} |")
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
