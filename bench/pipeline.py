"""Pipelined steps, measured where they matter, in one run (medians of --rounds, interleaved):

* ``hosts`` (root, ``ip netns`` and ``tc``): the disaggregated layout across two hosts, a trainer
  host and a parameter host (two network namespaces on a bridge, each host's egress limited with
  ``tc tbf`` to --rate, default 1gbit); one trainer and one embedding server (``dlrm worker``
  ranks under a topology file), dim 64: lockstep (``--pipeline off``) vs pipelined (``exact``,
  with corrected early lookups and without) vs ``semi-sync`` samples/s, from the job's own
  metrics.json.
* ``quality``: test AUC of ``exact`` vs ``semi-sync`` on --quality-rows generated rows (one
  server, one trainer, the default model; several seeds), beside the Bayes-optimal AUC.

* ``link`` (part of ``hosts``, or alone to add it to the last hosts results): the shaped link as
  the job sees it, Gloo messages of one step's size one way and both ways at once
  (``bench/link_probe.py``), read by the scaling model.

Usage: python bench/pipeline.py [--parts hosts,quality|link] [--rows 150000] [--quality-rows
500000].
Writes bench/results/pipeline.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from tests import netns  # noqa: E402

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
MODES = {
    "lockstep": ["--pipeline", "off"],
    "pipelined": ["--pipeline", "exact"],
    "pipelined, uncorrected": ["--pipeline", "exact", "--set", "dist.corrected_lookups=false"],
    "semi-sync": ["--pipeline", "semi-sync"],
}
"""Each mode's flags (``pipelined, uncorrected``: exact too, the next lookup waits for the update
instead of being corrected afterwards)."""


def synth(rows: int, test_rows: int, out: Path) -> Path:
    if not (out / "bayes.json").exists():
        subprocess.run(
            [
                *DLRM,
                "data",
                "synth",
                "--train-rows",
                str(rows),
                "--test-rows",
                str(test_rows),
                "--seed",
                "0",
                "--out",
                str(out),
            ],
            check=True,
            capture_output=True,
        )
    return out


def model_flags(args) -> list[str]:
    return [
        "--embedding-dim",
        "64",
        "--hash-size",
        "100000",
        "--batch-size",
        str(args.batch_size),
        "--no-progress",
        "--set",
        "train.checkpoint_every_steps=0",
        "--set",
        "train.eval_every_steps=0",
        "--set",
        "model.dense_arch_layer_sizes=[512, 256]",
        "--set",
        "model.over_arch_layer_sizes=[512, 256]",
    ]


def run_on_hosts(
    hosts: netns.Hosts, flags: list[str], out: Path, port: int, topology: Path
) -> dict:
    """Rank 0 (the trainer) on host 0, rank 1 (the embedding server) on host 1."""
    argv = [
        *DLRM,
        "worker",
        *flags,
        "--out",
        str(out),
        "--embedding-servers",
        "1",
        "--trainers",
        "1",
        "--topology",
        str(topology),
    ]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": hosts.addrs[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": hosts.ifname,
            "LOCAL_TRAINERS": "1",
        }
        procs.append(
            subprocess.Popen(
                hosts.command(rank, argv),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    failed = [
        f"rank {r}:\n{text[-2000:]}"
        for r, (p, text) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode
    ]
    if failed:
        raise SystemExit("ranks failed:\n" + "\n".join(failed))
    m = json.loads((out / "metrics.json").read_text())
    moved = m["alltoall_bytes_per_sample"]
    return {
        "samples_per_s": m["train_samples_per_s"],
        "test_auc": m["test_auc"],
        "communication_ms_per_step": m["communication_ms_per_step"],
        "cross_host_bytes_per_sample": m["cross_host_bytes_per_sample"],
        "trainer_to_server_bytes_per_sample": moved["trainers_to_servers"],
        "server_to_trainer_bytes_per_sample": moved["servers_to_trainers"] + moved["corrections"],
        "correction_bytes_per_sample": moved["corrections"],
    }


def shape_links(hosts: netns.Hosts, rate: str) -> None:
    for ns in hosts.names:  # each host's egress: the data-centre link
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                hosts.ifname,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
            check=True,
        )


def probe_link(
    hosts: netns.Hosts, port: int, work: Path, message_bytes: int, reps: int = 5
) -> dict:
    """The shaped link as the job sees it: Gloo messages of one step's pooled vectors, one way
    and both ways at once (bench/link_probe.py), and the one-way latency of a tiny message."""
    out = work / "link.json"
    argv = [sys.executable, str(HERE / "link_probe.py"), str(message_bytes), str(reps), str(out)]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "MASTER_ADDR": hosts.addrs[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": hosts.ifname,
        }
        procs.append(
            subprocess.Popen(
                hosts.command(rank, argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("link probe failed:\n" + "\n".join(o[-2000:] for o in outputs))
    return json.loads(out.read_text())


def probe_bytes(args) -> int:
    """One step's pooled vectors of the hosts runs (26 features x dim 64, fp32)."""
    return args.batch_size * 26 * 64 * 4


def link_part(args, work: Path, hosts: dict) -> dict:
    """Only the link probe, on a fresh pair of shaped namespace hosts, into the last hosts
    results."""
    with netns.Hosts(2, net=79) as pair:
        shape_links(pair, hosts.get("rate", args.rate))
        return {**hosts, "link": probe_link(pair, 29890, work, probe_bytes(args))}


def hosts_part(args, work: Path) -> dict:
    why_not = netns.available()
    if why_not is None and shutil.which("tc") is None:
        why_not = "no tc(8)"
    if why_not is not None:
        return {"skipped": why_not}
    data = synth(args.rows, 20_000, work / f"synth-{args.rows}")
    base = [
        *model_flags(args),
        "--train",
        str(data / "train.txt"),
        "--test",
        str(data / "test.txt"),
    ]
    topology = work / "hosts.json"
    topology.write_text(json.dumps({"hosts": [[0], [1]]}))
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    with netns.Hosts(2, net=79) as hosts:
        shape_links(hosts, args.rate)
        link = probe_link(hosts, 29890, work, probe_bytes(args))
        port = 29900
        for r in range(args.rounds):
            for name, mode in MODES.items():
                port += 1
                out = work / f"hosts-{name.replace(', ', '-')}-{r}"
                res = run_on_hosts(hosts, [*base, *mode], out, port, topology)
                shutil.rmtree(out, ignore_errors=True)
                print(f"  round {r} {name}: {res['samples_per_s']:,.0f} samples/s", flush=True)
                runs[name].append(res)
    table = {
        name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()
    }
    lock = table["lockstep"]["samples_per_s"]
    for row in table.values():
        row["vs_lockstep"] = row["samples_per_s"] / lock
    return {"rate": args.rate, "rows": args.rows, "results": table, "per_round": runs, "link": link}


def quality_part(args, work: Path) -> dict:
    data = synth(args.quality_rows, 100_000, work / f"synth-{args.quality_rows}")
    bayes = json.loads((data / "bayes.json").read_text())
    runs: dict[str, list[float]] = {name: [] for name in ("pipelined", "semi-sync")}
    for seed in range(args.seeds):
        for name in runs:
            out = work / f"quality-{name}-{seed}"
            cmd = [
                *DLRM,
                "train",
                "--train",
                str(data / "train.txt"),
                "--test",
                str(data / "test.txt"),
                "--out",
                str(out),
                "--embedding-servers",
                "1",
                *MODES[name],
                "--no-progress",
                "--set",
                f"train.seed={seed}",
                "--set",
                "train.checkpoint_every_steps=0",
            ]
            subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
            auc = json.loads((out / "metrics.json").read_text())["test_auc"]
            shutil.rmtree(out, ignore_errors=True)
            print(f"  seed {seed} {name}: AUC {auc:.4f}", flush=True)
            runs[name].append(auc)
    mean = {name: statistics.fmean(v) for name, v in runs.items()}
    return {
        "rows": args.quality_rows,
        "seeds": runs,
        "mean_auc": mean,
        "bayes_auc": bayes["test_auc"],
        "semi_sync_minus_exact": mean["semi-sync"] - mean["pipelined"],
    }


def markdown(r: dict) -> str:
    lines = [f"Pipelined steps ({r['date']}, {r['cpus']} cores)", ""]
    h = r.get("hosts")
    if h and "skipped" not in h:
        lines += [
            f"Two hosts (network namespaces), a trainer host and a parameter host, {h['rate']} "
            "links "
            f"(tc tbf); 1 trainer + 1 embedding server, dim 64, {h['rows']:,} rows; medians of "
            f"{len(next(iter(h['per_round'].values())))} rounds:",
            "",
            "| mode | samples/s | vs lockstep | communication ms/step |",
            "|---|---:|---:|---:|",
        ]
        for name, row in h["results"].items():
            lines.append(
                f"| {name} | {row['samples_per_s']:,.0f} | {row['vs_lockstep']:.2f}x | "
                f"{row['communication_ms_per_step']:.1f} |"
            )
        lines.append("")
        if "link" in h:
            k = h["link"]
            lines += [
                f"The link as Gloo sees it ({k['message_bytes'] / 1e6:.1f} MB messages): one way "
                f"{k['one_way_bytes_per_s'] / 1e6:.1f} MB/s, both ways at once "
                f"{k['both_ways_bytes_per_s'] / 1e6:.1f} MB/s per direction, one-way latency "
                f"{1e3 * k['latency_s']:.2f} ms.",
                "",
            ]
    elif h:
        lines += [f"hosts part skipped: {h['skipped']}", ""]
    q = r.get("quality")
    if q:
        lines += [
            f"Test AUC, {q['rows']:,} generated rows, 1 server + 1 trainer, default model "
            f"(seeds: {', '.join(f'{a:.4f}' for a in q['seeds']['pipelined'])} exact; "
            f"{', '.join(f'{a:.4f}' for a in q['seeds']['semi-sync'])} semi-sync):",
            "",
            "| mode | mean test AUC |",
            "|---|---:|",
        ]
        for name, auc in q["mean_auc"].items():
            lines.append(f"| {name} | {auc:.4f} |")
        lines += [
            f"| Bayes-optimal | {q['bayes_auc']:.4f} |",
            "",
            f"semi-sync - exact: {q['semi_sync_minus_exact']:+.4f}",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parts", default="hosts,quality")
    p.add_argument("--rows", type=int, default=150_000)
    p.add_argument("--quality-rows", type=int, default=500_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "pipeline")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    previous = (
        json.loads((args.out / "pipeline.json").read_text())
        if (args.out / "pipeline.json").exists()
        else {}
    )
    result = {**previous, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    if "hosts" in parts:
        result["hosts"] = hosts_part(args, args.work)
    elif "link" in parts and "results" in result.get("hosts", {}):
        result["hosts"] = link_part(args, args.work, result["hosts"])
    if "quality" in parts:
        result["quality"] = quality_part(args, args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / "pipeline.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
