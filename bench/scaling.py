"""A scaling model of disaggregated training: samples/s for H hosts x (T trainers, E embedding
servers), predicted from measured component costs, checked against every configuration the
other benches measured on this machine, and extrapolated to a data-centre layout.

Components, measured here (``--measure``; one thread each unless said; medians of 9 runs, so
measure on a quiet machine):

    dense       the trainer's dense forward + backward + Adam, per sample (1 and 2 threads; and
                one thread beside a twin process, gradients all-reduced between them as DDP does)
    lookup      an embedding server's fused lookup of the 26 tables, per sample
    update      its fused row-wise Adagrad update (fbgemm's backward), per sample
    correct     a corrected lookup's extra work (``exact``: changed bags, re-lookup, messages)
    client      the trainer's routing and packing of ids, assembly and gradient split, per sample
    link        point-to-point messages over loopback (Gloo): latency, CPU per message, bytes
                per second, and CPU per byte on each side
    cast        a bf16 exchange's casts, fp32 -> bf16 and back, per element (each side casts
                what it sends down and what it receives up)

The model of one step of global batch B over T trainers and E servers (bytes per sample at the
analytical minimum; x_in / x_out: the busiest host link's pooled / gradient bytes over its
rate, plus a latency):

    trainer work   W_t = B/T * (dense / speedup(threads) + client + cast) + messages * CPU per
    message
    server work    lookup, update, correct: B/E per server (per server thread)
    lockstep       W_t + lookup + update + x_in + x_out
    exact          max(W_t + overlap(x_out, update + correct) + latency, lookup + x_in)
    semi-sync      max(W_t, lookup + update + x_in / chunks, x_in, x_out)
    shared cores   step >= the CPU time of every rank on the machine / its cores, a 2-thread
                   dense step holding 2 cores, every byte exchanged costing its sender and its
                   receiver (the 2-core machine, its network namespaces included)

overlap(a, b) = max(a, b) + min(a, b) / chunks (a chunk's update starts when its gradients are in).

Usage: python bench/scaling.py [--measure] [--gpu-dense-samples-per-s 5e6]. Reads
bench/results/{distributed_throughput,pipeline}.json, writes bench/results/scaling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402
from scaling_measure import Costs, measure  # noqa: E402

F, D = tt.T, tt.DIM
BYTES = {"ids": 4 * F, "pooled": 4 * F * D, "grads": 4 * F * D}


# -- the model -------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where the ranks run."""

    trainers: int
    servers: int
    trainer_hosts: int = 1
    server_hosts: int = 1
    shared: bool = True
    """Trainers and servers on the same cores (the 2-core machine, its namespaces included)."""
    cores: int = 2
    """Cores of the shared machine."""
    trainer_threads: int = 2
    server_threads: int = 1
    """Cores a server's fused kernels use (fbgemm's CPU kernels: assumed to scale linearly)."""
    link_bytes_per_s: float = 1e12
    """Each host's link (its egress and its ingress, full duplex)."""
    chunks: int = 1
    dense_samples_per_s: float | None = None
    """A trainer's dense rate when it is not this machine's CPU (a GPU)."""
    exchange_bytes: float = 4.0
    """Bytes per pooled / gradient element on the wire (2 with bf16)."""
    both_ways_bytes_per_s: float | None = None
    """Each direction's rate while the other direction is busy too (measured on the namespace
    hosts' shaped links: about half the one-way rate); None: ``link_bytes_per_s`` (full duplex)."""
    latency_s: float | None = None
    """One-way latency of a small message on this link; None: the loopback's, measured."""
    correction_bytes: float = 0.0
    """Bytes per sample of corrected bags (``exact``), on top of the pooled vectors: a property of
    the data (how many bags the previous step's update changed), measured in the run."""


def _both_ways(a: float, b: float, lay: Layout) -> float:
    """Seconds to move ``a`` bytes one way and ``b`` the other at the same time: each at most at
    the one-way rate, both together at most at twice the both-ways rate."""
    both = lay.both_ways_bytes_per_s or lay.link_bytes_per_s
    return max(a / lay.link_bytes_per_s, b / lay.link_bytes_per_s, (a + b) / (2 * both))


def _overlapped(a: float, b: float, chunks: int) -> float:
    """Two stages a then b over ``chunks`` pieces, each piece's b after its a: the longer plus a
    chunk of the shorter."""
    return max(a, b) + min(a, b) / chunks


def step_seconds(c: Costs, lay: Layout, mode: str, batch: int) -> tuple[float, str]:
    """(seconds per step, the bottleneck) of one global batch. mode: lockstep | exact |
    exact-uncorrected | semi-sync."""
    if lay.servers == 0:
        return batch * (
            c.dense_s / c.dense_speedup_2 + c.lookup_s + c.update_s
        ) + c.step_overhead_s, "one process's CPU"
    bt = batch / lay.trainers
    speedup = c.dense_speedup_2 if lay.trainer_threads >= 2 else 1.0
    per_sample = (
        c.dense_pair_s
        if lay.shared and lay.trainers >= 2 and lay.trainer_threads == 1
        else c.dense_s / speedup
    )
    dense = bt / lay.dense_samples_per_s if lay.dense_samples_per_s else bt * per_sample
    messages = 2 * lay.servers * lay.chunks  # a trainer's messages per direction and step
    # per sample, each side (bf16)
    cast = F * D * c.cast_s_per_element if lay.exchange_bytes < 4 else 0.0
    w_t = (
        dense
        + bt * (c.client_s + cast)
        + messages * c.message_cpu_s
        + (0.0 if lay.dense_samples_per_s else c.step_overhead_s)
    )
    per_server = batch / lay.servers / lay.server_threads  # examples' lookups per server thread
    lookup = per_server * (c.lookup_s + cast / 2)  # the pooled vectors cast down
    update = per_server * (c.update_s + cast / 2)  # the gradients cast up
    correct = per_server * c.correct_s if mode == "exact" else 0.0
    pooled = F * D * lay.exchange_bytes  # bytes per sample, each direction (+ ids out)
    per_host = lay.trainers / lay.trainer_hosts
    link, latency = (
        lay.link_bytes_per_s,
        lay.latency_s if lay.latency_s is not None else c.latency_s,
    )
    busiest = max(per_host * bt, batch / lay.server_hosts)  # samples over the busiest host link
    b_in = busiest * (pooled + (lay.correction_bytes if mode == "exact" else 0.0))
    b_out = busiest * (pooled + BYTES["ids"])
    x_in, x_out = b_in / link + latency, b_out / link + latency
    wire = _both_ways(b_in, b_out, lay) + latency  # the directions overlapped: both busy at once
    if mode == "lockstep":
        step = w_t + lookup + update + x_in + x_out
    # lookup and pooled message of i+1 during step i; gradients -> update -> correction
    elif mode == "exact":
        step = max(
            w_t + _overlapped(x_out, update + correct, lay.chunks) + latency, lookup + x_in, wire
        )
    elif mode == "exact-uncorrected":  # the lookup waits for the update; both directions chunked
        step = max(w_t + _overlapped(x_out, update, lay.chunks) + lookup + x_in / lay.chunks, wire)
    else:  # semi-sync: lookup of i+1 does not wait for update i
        step = max(w_t + latency, lookup + update + x_in / lay.chunks, wire)
    parts = {
        "trainer compute": w_t,
        "server compute": lookup + update + correct,
        "link": x_in + x_out if mode == "lockstep" else wire,
    }
    if lay.shared:  # every rank on the same cores
        # each byte: its sender's and receiver's copy
        copies = batch * (2 * pooled + BYTES["ids"]) * 2 * c.transfer_cpu_s_per_byte
        busy = (
            lay.trainers * (lay.trainer_threads if not lay.dense_samples_per_s else 1)
            + lay.servers * lay.server_threads
        )
        if busy > lay.cores:
            # More busy threads than cores: a server's work beside the trainers' dense step stalls
            # their thread team, so compute does not overlap compute; only the wire time beyond the
            # copies' CPU (a slow link) overlaps. Loopback transfers are copies: CPU too.
            parts["shared CPU cores (oversubscribed)"] = (
                w_t + lookup + update + correct + copies / 2
            )
            step = max(step, parts["shared CPU cores (oversubscribed)"])
        # their CPU time adds up; a 2-thread dense step holds 2 cores, a GPU's none
        threads = lay.trainer_threads if not lay.dense_samples_per_s else 0
        cpu = (
            lay.trainers * (dense * threads + bt * (c.client_s + cast) + messages * c.message_cpu_s)
            + lay.servers * lay.server_threads * (lookup + update + correct)
            + copies
        )
        parts["shared CPU cores"] = cpu / lay.cores
        step = max(step, parts["shared CPU cores"])
    return step, max(parts, key=parts.get)


MODES = (("lockstep", "lockstep"), ("pipelined", "exact"), ("semi-sync", "semi-sync"))


def predictions(c: Costs, batch: int, measured: dict) -> list[dict]:
    """Every configuration measured here: predicted and measured samples/s."""
    rows = []
    loop = c.loopback_bytes_per_s
    configs = {"single": (Layout(1, 0), "lockstep")}
    for e, t in ((1, 1), (2, 2)):
        threads = max(1, 2 // t)
        for label, mode in MODES:
            configs[f"E{e},T{t} {label}"] = (
                Layout(t, e, trainer_threads=threads, link_bytes_per_s=loop),
                mode,
            )
    configs["E1,T1 exact uncorrected"] = (Layout(1, 1, link_bytes_per_s=loop), "exact-uncorrected")
    configs["E2,T2 pipelined bf16"] = (
        Layout(2, 2, trainer_threads=1, link_bytes_per_s=loop, exchange_bytes=2.0),
        "exact",
    )
    for name, (lay, mode) in configs.items():
        if name in measured:
            step, neck = step_seconds(c, lay, mode, batch)
            rows.append(
                {
                    "config": name,
                    "predicted": batch / step,
                    "measured": measured[name],
                    "bottleneck": neck,
                }
            )
    return rows


def measured_rates(results: Path) -> tuple[dict, dict | None]:
    measured = results / "distributed_throughput.json"
    if not measured.exists():
        raise SystemExit(
            f"scaling.py: {measured} not found: run bench/distributed_throughput.py first "
            "(the model is checked against it)"
        )
    dt = json.loads(measured.read_text())["results"]
    local = {name: r["samples_per_s"] for name, r in dt.items() if not name.startswith("torchrec")}
    hosts = None
    pipe = results / "pipeline.json"
    if pipe.exists():
        h = json.loads(pipe.read_text()).get("hosts")
        if h and "results" in h:
            hosts = h
    return local, hosts


def host_predictions(c: Costs, hosts: dict) -> list[dict]:
    """The two-namespace runs: trainer host and parameter host on this machine's 2 cores, --rate
    links, batch 2048, 4 chunks."""
    rate = hosts["rate"].lower()
    bits = float(rate.rstrip("gmbit").rstrip("bit")) * (1e9 if "g" in rate else 1e6)
    probe = hosts.get("link")  # the link as Gloo saw it; else the nominal rate, full duplex
    rows = []
    for label, mode in (*MODES, ("pipelined, uncorrected", "exact-uncorrected")):
        if label not in hosts["results"]:  # (runs before 2026-12-03 have no uncorrected row)
            continue
        run = hosts["results"][label]
        link = (
            {
                "link_bytes_per_s": probe["one_way_bytes_per_s"],
                "both_ways_bytes_per_s": probe["both_ways_bytes_per_s"],
                "latency_s": probe["latency_s"],
            }
            if probe
            else {"link_bytes_per_s": bits / 8}
        )
        lay = Layout(
            1,
            1,
            trainer_threads=2,
            chunks=4,
            correction_bytes=run.get("correction_bytes_per_sample", 0.0),
            **link,
        )
        step, neck = step_seconds(c, lay, mode, 2048)
        rows.append(
            {
                "config": f"2 hosts at {hosts['rate']}, {label}",
                "predicted": 2048 / step,
                "measured": hosts["results"][label]["samples_per_s"],
                "bottleneck": neck,
            }
        )
    return rows


def correction_share(hosts: dict | None) -> float:
    """Corrected bags' bytes per pooled byte in the two-host ``exact`` run (0 without one)."""
    if not hosts:
        return 0.0
    return hosts["results"]["pipelined"].get("correction_bytes_per_sample", 0.0) / (F * D * 4)


def datacentre(
    c: Costs, gpu_rate: float, param_cores: int, batch: int, corrections: float
) -> list[dict]:
    """8 trainer hosts x 8 GPUs (64 trainers) and 8 parameter hosts (one server each, on
    ``param_cores`` cores) on 100 Gbit/s (12.5 GB/s per host, each direction); ``exact`` also
    moves ``corrections`` x the pooled bytes of corrected bags (the share measured here)."""
    rows = []
    for mode in ("lockstep", "exact", "semi-sync"):
        lay = Layout(
            64,
            8,
            trainer_hosts=8,
            server_hosts=8,
            shared=False,
            server_threads=param_cores,
            link_bytes_per_s=12.5e9,
            chunks=4,
            dense_samples_per_s=gpu_rate,
            correction_bytes=corrections * F * D * 4,
        )
        step, neck = step_seconds(c, lay, mode, batch)
        rows.append({"mode": mode, "samples_per_s": batch / step, "bottleneck": neck})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--measure", action="store_true", help="measure the components (else reuse the last ones)"
    )
    p.add_argument(
        "--gpu-dense-samples-per-s",
        type=float,
        default=5e6,
        help="one GPU's dense step rate, an assumption until bench/gpu_check.sh measures it",
    )
    p.add_argument("--param-host-cores", type=int, default=64)
    p.add_argument("--dc-batch", type=int, default=65_536)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    local, hosts = measured_rates(args.out)  # before measuring: what the model is checked against
    previous = args.out / "scaling.json"
    if args.measure or not previous.exists():
        costs = measure()
    else:
        costs = Costs(**json.loads(previous.read_text())["costs"])
    if args.measure and "single" in local:  # the one fitted term: the loop's own work per step
        costs.step_overhead_s = 0.0
        costs.step_overhead_s = max(
            2048 / local["single"] - step_seconds(costs, Layout(1, 0), "lockstep", 2048)[0], 0.0
        )
    rows = predictions(costs, 2048, local) + (host_predictions(costs, hosts) if hosts else [])
    for r in rows:
        r["error"] = r["predicted"] / r["measured"] - 1
    share = correction_share(hosts)
    dc = datacentre(
        costs, args.gpu_dense_samples_per_s, args.param_host_cores, args.dc_batch, share
    )
    result = {
        "costs": asdict(costs),
        "checks": rows,
        "datacentre": dc,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "assumptions": {
            "gpu_dense_samples_per_s": args.gpu_dense_samples_per_s,
            "correction_share": share,
            "param_host_cores": args.param_host_cores,
            "dc_batch": args.dc_batch,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    (args.out / "scaling.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    c = r["costs"]
    us = {k: 1e6 * v for k, v in c.items() if k.endswith("_s")}
    lines = [
        f"Scaling model ({r['date']}). Measured components (µs per sample unless said): dense "
        f"{us['dense_s']:.1f} "
        f"(x{c['dense_speedup_2']:.2f} on 2 threads), server lookup {us['lookup_s']:.2f}, update "
        f"{us['update_s']:.2f}, "
        f"correction {us['correct_s']:.2f}, trainer routing and assembly {us['client_s']:.2f}; "
        "messages: "
        f"{us['latency_s']:.0f} µs one way, {us['message_cpu_s']:.0f} µs of CPU each, "
        f"{c['loopback_bytes_per_s'] / 1e9:.2f} GB/s over loopback, "
        f"{1e9 * c['transfer_cpu_s_per_byte']:.2f} ns of "
        f"CPU per byte on each side; fitted: {1e3 * c.get('step_overhead_s', 0.0):.1f} ms per CPU "
        "trainer step beyond them "
        "(the one-process step minus the components).",
        "",
        "| configuration | predicted samples/s | measured | error | bottleneck |",
        "|---|---:|---:|---:|---|",
    ]
    for row in r["checks"]:
        lines.append(
            f"| {row['config']} | {row['predicted']:,.0f} | {row['measured']:,.0f} | "
            f"{100 * row['error']:+.0f}% | "
            f"{row['bottleneck']} |"
        )
    a = r["assumptions"]
    lines += [
        "",
        f"8 trainer hosts x 8 GPUs, 8 parameter hosts x {a['param_host_cores']} cores, 100 Gbit/s "
        "links, "
        f"global batch {a['dc_batch']:,}; one GPU's dense step assumed at "
        f"{a['gpu_dense_samples_per_s']:,.0f} "
        "samples/s (an assumption, not measured here); `exact`'s corrected bags add "
        f"{a.get('correction_share', 0):.2f}x "
        "the pooled bytes (as measured across the two namespace hosts):",
        "",
        "| mode | samples/s | bottleneck |",
        "|---|---:|---|",
    ]
    for row in r["datacentre"]:
        lines.append(f"| {row['mode']} | {row['samples_per_s']:,.0f} | {row['bottleneck']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
