"""The scaling model's components, measured on this machine (``bench/scaling.py --measure``).

One thread each unless said; medians of 9 runs, so measure on a quiet machine: the dense step
(1 and 2 threads, and beside a twin process), a server's fused lookup, update and correction, the
trainer's routing and assembly, and Gloo point-to-point messages over loopback.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402

F, D = tt.T, tt.DIM


@dataclass
class Costs:
    dense_s: float
    """Seconds per sample of the dense step (forward, backward, Adam), one thread."""
    dense_speedup_2: float
    """Speed-up of the dense step on two threads."""
    dense_pair_s: float
    """Seconds per sample of the one-thread dense step while another process runs it on the other
    core, their gradients all-reduced between them as DDP does (two trainers on this machine)."""
    lookup_s: float
    """Seconds per sample of a server's fused lookup of all 26 tables, one thread."""
    update_s: float
    """Seconds per sample of a server's fused row-wise Adagrad update (fbgemm's backward), one
    thread."""
    correct_s: float
    """Seconds per sample of a corrected lookup's extra work (changed bags, re-lookup, messages)."""
    client_s: float
    """Seconds per sample of the trainer's routing, packing, assembly and gradient split."""
    latency_s: float
    """One-way latency of a small point-to-point message (Gloo, loopback)."""
    message_cpu_s: float
    """Seconds a rank spends per small message posted in a burst (posting, completing)."""
    loopback_bytes_per_s: float
    """Bytes per second of one loopback Gloo stream."""
    transfer_cpu_s_per_byte: float
    """CPU seconds each side (sender, receiver) spends per byte sent over Gloo (copies, system
    calls, Gloo's threads): what the exchange costs the cores it shares with the compute."""
    cast_s_per_element: float = 0.0
    """CPU seconds to cast one element fp32 -> bf16 plus one bf16 -> fp32 (a halved exchange: each
    side casts what it sends down and what it receives back up), one thread."""
    step_overhead_s: float = 0.0
    """Seconds per step a CPU trainer spends beyond the components (the training loop's own
    work: loss, zero_grad, the step's bookkeeping): the one fitted term, the measured one-process
    step minus the components' sum; GPU trainers' rate is assumed to include it."""


def _typical_time(fn, reps: int = 9) -> float:
    """The median of ``reps`` runs (after one warm-up); measure on a quiet machine."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dense_step(b: int, all_reduce: bool = False):
    """The trainer's dense step on a batch of ``b`` (the bench workload's model and optimizer);
    ``all_reduce``: the gradients summed over the process group in one flat message before the
    optimizer step, as DDP's one bucket (the dense model's 2 MB of gradients fit in its 25 MB)."""
    import distributed_throughput as dt

    from dense_trainer.model import build_dense_model
    from embedding_server.kernels.optimizers import DenseOptimizerConfig, build_dense_optimizer

    cfg = dt.bench_config(0, 1)
    ((dense_np, _, y_np),) = tt.make_batches(dt.ROWS, "uniform", 1)
    dense, y = torch.from_numpy(dense_np[:b]), torch.from_numpy(y_np[:b])
    model = build_dense_model(cfg.model, tt.NUM_DENSE, [D] * F, D)
    opt = build_dense_optimizer(DenseOptimizerConfig(lr=tt.DENSE_LR), model.parameters())
    emb = torch.randn(b, F * D, requires_grad=True)

    params = list(model.parameters())

    def step() -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, emb), y)
        opt.zero_grad()
        loss.backward()
        if all_reduce:
            flat = torch.cat([p.grad.view(-1) for p in params])  # [sum of parameter sizes]
            torch.distributed.all_reduce(flat)
            at = 0
            for p in params:
                p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
                at += p.numel()
        opt.step()

    return step


def _dense_twin(rank: int, port: int, b: int, out: str) -> None:
    """One of two processes running the one-thread dense step at the same moments."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    step = _dense_step(b, all_reduce=True)
    step()
    times = []
    for _ in range(9):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    dist.destroy_process_group()


def _dense_pair_s(b: int) -> float:
    """Seconds per sample of the one-thread dense step while a second process runs it beside it
    (two trainers sharing this machine's two cores: caches and memory bandwidth shared)."""
    import torch.multiprocessing as mp

    from dense_trainer.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "pair.json"
    mp.start_processes(
        _dense_twin, args=(free_port(), b, str(out)), nprocs=2, start_method="spawn", join=True
    )
    return json.loads(out.read_text()) / b


def measure() -> Costs:
    """Measure the components on this machine (a few seconds each)."""
    import distributed_throughput as dt

    from dlrm_core.batch import SparseFeatures
    from dlrm_core.schema import criteo_spec
    from embedding_server.kernels.optimizers import SparseOptimizerConfig
    from embedding_server.local_table import LocalTable
    from embedding_server.shard import EmbeddingShard

    b = dt.GLOBAL_BATCH
    (_, ids_np, _), (_, ids2_np, _) = tt.make_batches(dt.ROWS, "uniform", 2)
    ids = torch.from_numpy(ids_np)
    dense_step = _dense_step(b)
    torch.set_num_threads(1)
    one = _typical_time(dense_step)
    torch.set_num_threads(2)
    two = _typical_time(dense_step)
    torch.set_num_threads(1)
    pair = _dense_pair_s(b // 2)
    spec = criteo_spec([dt.ROWS] * F, [D] * F)
    shard = EmbeddingShard(
        [LocalTable(t, i) for i, t in enumerate(spec.tables)],
        SparseOptimizerConfig(lr=tt.SPARSE_LR),
    )
    sparse = SparseFeatures.one_hot(ids)
    ones = torch.ones(b, F * D)
    lookup = _typical_time(lambda: shard(sparse))
    both = _typical_time(lambda: shard(sparse).backward(ones))
    correct = _typical_time(_correction_work(shard, ids, torch.from_numpy(ids2_np)))
    client = _typical_time(_client_work(sparse, spec))
    latency, message_cpu, bw, cpu_per_byte = _loopback()
    pooled = torch.randn(b, F * D)  # [B, F * D]
    down = _typical_time(lambda: pooled.to(torch.bfloat16))
    half = pooled.to(torch.bfloat16)
    up = _typical_time(lambda: half.to(torch.float32))
    return Costs(
        one / b,
        one / two,
        pair,
        lookup / b,
        max(both - lookup, 0.0) / b,
        correct / b,
        client / b,
        latency,
        message_cpu,
        bw,
        cpu_per_byte,
        (down + up) / pooled.numel(),
    )


def _correction_work(shard, ids: torch.Tensor, nxt: torch.Tensor):
    """A corrected lookup's extra work for batch ``nxt`` after batch ``ids`` (ids [F, B])."""
    from embedding_server.runtime.correction import Corrector

    class Discard:  # the messages' sending is the link's cost, counted there
        def send_floats(self, peers, tensors, tag):
            return type("Sent", (), {"wait": lambda self: None})()

    corrector = Corrector([shard], [[D] * F], [0], torch.float32, Discard(), {})
    as_ids = [[(row, torch.ones(row.numel(), dtype=torch.int64)) for row in ids.to(torch.int64)]]
    next_ids = [[(row, torch.ones(row.numel(), dtype=torch.int64)) for row in nxt.to(torch.int64)]]
    b = ids.shape[1]

    def work() -> None:
        corrector.send(0, False, as_ids, [b])  # marks batch i's rows
        corrector.send(0, True, next_ids, [b])  # batch i+1: its changed bags looked up again

    return lambda: (work(), None)[1]


def _client_work(sparse, spec):
    """What a trainer does per step around the exchange, one server: route and pack the ids,
    assemble the received pooled vectors, split the gradient."""
    from embedding_server.client.distributed import FlatStage
    from embedding_server.planner import plan_sharding
    from embedding_server.sharding import SCHEMES
    from embedding_server.wire import pack_ids

    plan = plan_sharding(spec, 1, "rowwise_adagrad", "table_wise")
    stage = FlatStage(plan, spec, 1)
    b = sparse.batch_size
    received = [torch.randn(n) for _, n in stage.messages(b)]
    grad = torch.randn(b, F * D)

    def work() -> None:
        parts = []
        for f in range(len(spec.tables)):
            values, offsets = sparse.feature_values(f)
            pieces = plan.pieces_of(spec.tables[f].name)
            parts += SCHEMES[pieces[0].kind].route(
                values, offsets[1:] - offsets[:-1], pieces, spec.tables[f]
            )
        pack_ids(parts, torch.int32)
        stage.assemble(received, b, [])
        stage.split_grad(grad, b, [])

    return work


def _pingpong(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for n in (1, 4 << 20):
        t = torch.zeros(n // 4 or 1)
        reps = 50 if n == 1 else 10
        dist.barrier()
        trips, c0 = [], time.process_time()
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            trips.append(time.perf_counter() - t0)
        results[n] = min(trips) / 2  # one way, the least disturbed round trip
        results[f"cpu{n}"] = (time.process_time() - c0) / (2 * reps)  # this rank's CPU per message
    # a burst of small messages posted back to back: what each costs its sender (posting,
    # completing), not a round trip's wait
    small = [torch.zeros(1) for _ in range(200)]
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0) for t in small]
    for w in works:
        w.wait()
    results["burst"] = (time.perf_counter() - t0) / len(small)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _loopback() -> tuple[float, float, float, float]:
    """(one-way latency of a small message, CPU seconds per small message, bytes per second, CPU
    seconds per byte on each side) over loopback."""
    import torch.multiprocessing as mp

    from dense_trainer.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "pp.json"
    mp.start_processes(
        _pingpong, args=(free_port(), str(out)), nprocs=2, start_method="spawn", join=True
    )
    r = json.loads(out.read_text())
    small, big = r["1"], r[str(4 << 20)]
    cpu = max(r[f"cpu{4 << 20}"] - r["cpu1"], 0.0) / (4 << 20)
    return small, r["burst"], (4 << 20) / max(big - small, 1e-9), cpu
