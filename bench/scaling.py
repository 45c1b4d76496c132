"""A scaling model of disaggregated training: samples/s for H hosts x (T trainers, E embedding
servers), predicted from measured component costs, checked against every configuration the
other benches measured on this machine, and extrapolated to a data-centre layout.

Components, measured here (``--measure``; one thread each unless said):

    dense       the trainer's dense forward + backward + Adam, per sample (1 and 2 threads)
    sparse      an embedding server's fused lookup + row-wise Adagrad update, per sample
    client      the trainer's routing of ids and assembly of pooled vectors, per sample
    link        point-to-point message cost over loopback (Gloo): per message and per byte

The model of one step of global batch B (bytes per sample from the analytical minimum):

    trainer work   W_t = B/T * (dense / speedup(threads) + client)
    server work    W_s = B/E * sparse
    transfers      X_in = B/T * pooled bytes / link, X_out = B/T * (ids + grads) / link
                   (a link per host: the bytes of every rank on it; plus per-message costs)
    lockstep       step = W_t + W_s + X_in + X_out
    exact          step = W_t + W_s + max(X_in, X_out) + min(X_in, X_out) / chunks
    semi-sync      step = max(W_t, W_s + X_in / chunks, max(X_in, X_out))
    shared cores   step >= (work of every rank on a host) / its cores (the 2-core machine)

Usage: python bench/scaling.py [--measure] [--gpu-dense-samples-per-s 5e6]. Reads
bench/results/{distributed_throughput,pipeline}.json, writes bench/results/scaling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402

F, D = tt.T, tt.DIM
BYTES = {"ids": 4 * F, "pooled": 4 * F * D, "grads": 4 * F * D}


@dataclass
class Costs:
    dense_s: float
    """Seconds per sample of the dense step, one thread."""
    dense_speedup_2: float
    """Speed-up of the dense step on two threads."""
    sparse_s: float
    """Seconds per sample of a server's lookup + update, one thread."""
    client_s: float
    """Seconds per sample of the trainer's routing and assembly."""
    message_s: float
    """Seconds per point-to-point message (latency and overhead)."""
    loopback_bytes_per_s: float
    """Bytes per second of one loopback Gloo stream."""
    transfer_cpu_s_per_byte: float = 0.0
    """CPU seconds each side (sender, receiver) spends per byte sent over Gloo (copies, system
    calls, Gloo's threads): what the exchange costs the cores it shares with the compute."""


def _median_time(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure() -> Costs:
    """Measure the components on this machine (a few seconds each)."""
    import distributed_throughput as dt

    from dense_trainer.model import build_dense_model
    from dlrm_core.batch import SparseFeatures
    from dlrm_core.schema import criteo_spec
    from embedding_server.local_table import LocalTable
    from embedding_server.optimizers import (
        DenseOptimizerConfig,
        SparseOptimizerConfig,
        build_dense_optimizer,
    )
    from embedding_server.shard import EmbeddingShard

    b = dt.GLOBAL_BATCH
    cfg = dt.bench_config(0, 1)
    (dense_np, ids_np, y_np), = tt.make_batches(dt.ROWS, "uniform", 1)
    dense, ids, y = torch.from_numpy(dense_np), torch.from_numpy(ids_np), torch.from_numpy(y_np)
    model = build_dense_model(cfg.model, tt.NUM_DENSE, [D] * F, D)
    opt = build_dense_optimizer(DenseOptimizerConfig(lr=tt.DENSE_LR), model.parameters())
    emb = torch.randn(b, F * D, requires_grad=True)

    def dense_step() -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, emb), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    torch.set_num_threads(1)
    one = _median_time(dense_step)
    torch.set_num_threads(2)
    two = _median_time(dense_step)
    torch.set_num_threads(1)
    spec = criteo_spec([dt.ROWS] * F, [D] * F)
    shard = EmbeddingShard([LocalTable(t, i) for i, t in enumerate(spec.tables)], SparseOptimizerConfig(lr=tt.SPARSE_LR))
    sparse = SparseFeatures.one_hot(ids)

    def sparse_step() -> None:
        shard(sparse).backward(torch.ones(b, F * D))

    sp = _median_time(sparse_step)
    client = _median_time(lambda: _client_work(sparse, spec))
    message_s, bw, cpu_per_byte = _loopback()
    return Costs(one / b, one / two, sp / b, client / b, message_s, bw, cpu_per_byte)


def _client_work(sparse, spec) -> None:
    """What a trainer does per step around the exchange: route ids to 2 servers, pack, assemble."""
    from embedding_server.planner import plan_sharding
    from embedding_server.sharding import SCHEMES
    from embedding_server.wire import pack_ids

    plan = plan_sharding(spec, 2, "rowwise_adagrad", "table_wise")
    parts = []
    for f in range(len(spec.tables)):
        values, offsets = sparse.feature_values(f)
        pieces = plan.pieces_of(spec.tables[f].name)
        parts += SCHEMES[pieces[0].kind].route(values, offsets[1:] - offsets[:-1], pieces, spec.tables[f])
    pack_ids(parts, torch.int32)
    torch.cat([torch.randn(sparse.batch_size, D) for _ in range(len(spec.tables))], dim=1)


def _pingpong(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for n in (1, 4 << 20):
        t = torch.zeros(n // 4 or 1)
        reps = 50 if n == 1 else 10
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        results[n] = (time.perf_counter() - t0) / (2 * reps)
        results[f"cpu{n}"] = (time.process_time() - c0) / (2 * reps)  # this rank's CPU per message
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _loopback() -> tuple[float, float, float]:
    """(seconds per message, bytes per second, CPU seconds per byte on each side) over loopback."""
    import torch.multiprocessing as mp

    from dense_trainer.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "pp.json"
    mp.start_processes(_pingpong, args=(free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    r = json.loads(out.read_text())
    small, big = r["1"], r[str(4 << 20)]
    cpu = max(r[f"cpu{4 << 20}"] - r["cpu1"], 0.0) / (4 << 20)
    return small, (4 << 20) / max(big - small, 1e-9), cpu


# -- the model ------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where the ranks run."""

    trainers: int
    servers: int
    trainer_hosts: int = 1
    server_hosts: int = 1
    shared: bool = True
    """Trainers and servers on the same hosts (the 2-core machine)."""
    cores_per_host: int = 2
    trainer_threads: int = 2
    link_bytes_per_s: float = 1e12
    """Each host's link (its egress and its ingress, full duplex)."""
    chunks: int = 1
    dense_samples_per_s: float | None = None
    """A trainer's dense rate when it is not this machine's CPU (a GPU)."""


def step_seconds(c: Costs, lay: Layout, mode: str, batch: int) -> tuple[float, str]:
    """(seconds per step, the bottleneck) of one global batch."""
    if lay.servers == 0:
        work = batch * (c.dense_s / c.dense_speedup_2 + c.sparse_s)
        return work, "one process's CPU"
    bt, bs = batch / lay.trainers, batch / lay.servers
    dense = bt / lay.dense_samples_per_s if lay.dense_samples_per_s else bt * c.dense_s / (
        c.dense_speedup_2 if lay.trainer_threads >= 2 else 1.0)
    w_t = dense + bt * c.client_s
    w_s = bs * c.sparse_s
    link = lay.link_bytes_per_s
    per_trainer_host = lay.trainers / lay.trainer_hosts
    x_in = per_trainer_host * bt * BYTES["pooled"] / link + lay.servers * lay.chunks * c.message_s
    x_out = per_trainer_host * bt * (BYTES["ids"] + BYTES["grads"]) / link + lay.servers * lay.chunks * c.message_s
    parts = {"trainer compute": w_t, "server compute": w_s, "link": max(x_in, x_out)}
    if mode == "lockstep":
        step = w_t + w_s + x_in + x_out
    elif mode == "exact":
        step = w_t + w_s + max(x_in, x_out) + min(x_in, x_out) / lay.chunks
    else:
        step = max(w_t, w_s + x_in / lay.chunks, max(x_in, x_out))
    if lay.shared:  # every rank on the same cores: their CPU time adds up
        threads = lay.trainer_threads if not lay.dense_samples_per_s else 0
        dense_cpu = dense * threads if threads >= 2 else (dense if threads else 0.0)  # a 2-thread step holds 2 cores
        moved = batch * sum(BYTES.values()) * 2  # every byte is copied out by its sender and in by its receiver
        cpu = lay.trainers * (dense_cpu + bt * c.client_s) + lay.servers * w_s + moved * c.transfer_cpu_s_per_byte
        cpu /= lay.cores_per_host * lay.trainer_hosts
        parts["shared CPU cores"] = cpu
        step = max(step, cpu)
    return step, max(parts, key=parts.get)


def predictions(c: Costs, batch: int, measured: dict) -> list[dict]:
    """Every configuration measured here: predicted and measured samples/s."""
    rows = []
    loop = c.loopback_bytes_per_s
    configs = {"single": (Layout(1, 0), "lockstep")}
    for (e, t) in ((1, 1), (2, 2)):
        threads = max(1, 2 // t)
        for label, mode in (("lockstep", "lockstep"), ("pipelined", "exact"), ("semi-sync", "semi-sync")):
            configs[f"E{e},T{t} {label}"] = (Layout(t, e, trainer_threads=threads, link_bytes_per_s=loop), mode)
    for name, (lay, mode) in configs.items():
        if name in measured:
            step, neck = step_seconds(c, lay, mode, batch)
            rows.append({"config": name, "predicted": batch / step, "measured": measured[name], "bottleneck": neck})
    return rows


def measured_rates(results: Path) -> tuple[dict, dict | None]:
    dt = json.loads((results / "distributed_throughput.json").read_text())["results"]
    local = {name: r["samples_per_s"] for name, r in dt.items() if not name.startswith("torchrec")}
    hosts = None
    pipe = results / "pipeline.json"
    if pipe.exists():
        h = json.loads(pipe.read_text()).get("hosts")
        if h and "results" in h:
            hosts = h
    return local, hosts


def host_predictions(c: Costs, hosts: dict) -> list[dict]:
    """The two-namespace runs: trainer host and parameter host, --rate links, batch 2048."""
    rate = hosts["rate"].lower()
    bits = float(rate.rstrip("gmbit").rstrip("bit")) * (1e9 if "g" in rate else 1e6)
    rows = []
    for label, mode in (("lockstep", "lockstep"), ("pipelined", "exact"), ("semi-sync", "semi-sync")):
        lay = Layout(1, 1, trainer_threads=2, link_bytes_per_s=bits / 8, chunks=4)
        step, neck = step_seconds(c, lay, mode, 2048)
        rows.append({"config": f"2 hosts at {hosts['rate']}, {label}", "predicted": 2048 / step,
                     "measured": hosts["results"][label]["samples_per_s"], "bottleneck": neck})
    return rows


def datacentre(c: Costs, gpu_rate: float, param_cores: int, batch: int) -> list[dict]:
    """8 trainer hosts x 8 GPUs and 8 parameter hosts on 100 Gbit/s (12.5 GB/s per host)."""
    rows = []
    for mode in ("lockstep", "exact", "semi-sync"):
        lay = Layout(64, 8 * param_cores, trainer_hosts=8, server_hosts=8, shared=False,
                     link_bytes_per_s=12.5e9, chunks=4, dense_samples_per_s=gpu_rate)
        # servers: param_cores server ranks per parameter host, one core each; the link of a
        # parameter host carries 1/8 of every trainer's bytes.
        step, neck = step_seconds(c, lay, mode, batch)
        server_link = batch / 8 * (BYTES["ids"] + BYTES["grads"]) / 12.5e9
        if server_link > step:
            step, neck = server_link, "parameter hosts' links"
        rows.append({"mode": mode, "samples_per_s": batch / step, "bottleneck": neck})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", action="store_true", help="measure the components (else reuse the last ones)")
    p.add_argument("--gpu-dense-samples-per-s", type=float, default=5e6,
                   help="one GPU's dense step rate, an assumption until bench/gpu_check.sh measures it")
    p.add_argument("--param-host-cores", type=int, default=64)
    p.add_argument("--dc-batch", type=int, default=65_536)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    previous = args.out / "scaling.json"
    if args.measure or not previous.exists():
        costs = measure()
    else:
        costs = Costs(**json.loads(previous.read_text())["costs"])
    local, hosts = measured_rates(args.out)
    rows = predictions(costs, 2048, local) + (host_predictions(costs, hosts) if hosts else [])
    for r in rows:
        r["error"] = r["predicted"] / r["measured"] - 1
    dc = datacentre(costs, args.gpu_dense_samples_per_s, args.param_host_cores, args.dc_batch)
    result = {"costs": asdict(costs), "checks": rows, "datacentre": dc, "date": time.strftime("%Y-%m-%d %H:%M"),
              "assumptions": {"gpu_dense_samples_per_s": args.gpu_dense_samples_per_s,
                              "param_host_cores": args.param_host_cores, "dc_batch": args.dc_batch}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / "scaling.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    c = r["costs"]
    lines = [f"Scaling model ({r['date']}). Measured components: dense {1e6 * c['dense_s']:.1f} µs/sample "
             f"(x{c['dense_speedup_2']:.2f} on 2 threads), server lookup + update {1e6 * c['sparse_s']:.2f} µs/sample, "
             f"trainer routing and assembly {1e6 * c['client_s']:.2f} µs/sample, messages {1e6 * c['message_s']:.0f} µs "
             f"and {c['loopback_bytes_per_s'] / 1e9:.2f} GB/s over loopback, "
             f"{1e9 * c.get('transfer_cpu_s_per_byte', 0.0):.2f} ns of CPU per byte on each side.", "",
             "| configuration | predicted samples/s | measured | error | bottleneck |", "|---|---:|---:|---:|---|"]
    for row in r["checks"]:
        lines.append(f"| {row['config']} | {row['predicted']:,.0f} | {row['measured']:,.0f} | {100 * row['error']:+.0f}% | "
                     f"{row['bottleneck']} |")
    a = r["assumptions"]
    lines += ["", f"8 trainer hosts x 8 GPUs, 8 parameter hosts x {a['param_host_cores']} cores, 100 Gbit/s links, "
              f"global batch {a['dc_batch']:,}; one GPU's dense step assumed at {a['gpu_dense_samples_per_s']:,.0f} "
              "samples/s (an assumption, not measured here):", "", "| mode | samples/s | bottleneck |", "|---|---:|---|"]
    for row in r["datacentre"]:
        lines.append(f"| {row['mode']} | {row['samples_per_s']:,.0f} | {row['bottleneck']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
