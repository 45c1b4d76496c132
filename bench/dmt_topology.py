"""The DMT bench's topology part: two network namespaces as two hosts on a bridge, each
host's egress rate-limited with ``tc tbf``; flat and tower runs, every rank a real ``dlrm
worker`` (see ``bench/dmt.py``)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from dmt_kit import DLRM, REPO, model_flags, sh, tower_flags

sys.path.insert(0, str(REPO))

from tests import netns  # noqa: E402


def run_on_hosts(hosts: netns.Hosts, flags: list[str], out: Path, port: int) -> dict:
    """One job: ranks 0, 2 on host 0 and ranks 1, 3 on host 1 (``--hosts 2``)."""
    world, host_of = 4, [0, 1, 0, 1]
    argv = [
        *DLRM,
        "worker",
        *flags,
        "--out",
        str(out),
        "--embedding-servers",
        "2",
        "--trainers",
        "2",
        "--hosts",
        "2",
    ]
    before = [hosts.traffic(h) for h in range(2)]
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": hosts.addrs[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": hosts.ifname,
            "LOCAL_TRAINERS": "1",
        }
        procs.append(
            subprocess.Popen(
                hosts.command(host_of[rank], argv),
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
    after = [hosts.traffic(h) for h in range(2)]
    m = json.loads((out / "metrics.json").read_text())
    wire = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))  # bytes sent by both hosts
    return {
        "samples_per_s": m["train_samples_per_s"],
        "cross_host_bytes_per_sample": m["cross_host_bytes_per_sample"],
        "cross_host_messages_per_step": m["cross_host_messages_per_step"],
        "wire_bytes_per_sample": wire / m["samples_seen"],
        "test_auc": m["test_auc"],
        "communication_ms_per_step": m["communication_ms_per_step"],
        "server_time_ms_per_step": m["server_time_ms_per_step"],
    }


def topology_part(args, data: Path, plan: Path, work: Path) -> dict:
    why_not = netns.available()
    if why_not is None and subprocess.run(["which", "tc"], capture_output=True).returncode != 0:
        why_not = "no tc(8)"
    if why_not is not None:
        return {"skipped": why_not}
    base = [
        *model_flags(args),
        "--train",
        str(data / "train.txt"),
        "--test",
        str(data / "test.txt"),
    ]
    runs = {
        "flat": base,
        "flat+hier": [*base, "--hierarchical"],
        "towers": [*base, *tower_flags(args, plan)],
        "towers+hier": [*base, *tower_flags(args, plan), "--hierarchical"],
    }
    by_rate: dict = {}
    with netns.Hosts(2, net=78) as hosts:
        port = 29800
        for i, rate in enumerate(args.rate.split(",")):
            for ns in hosts.names:  # each host's egress: the data-centre link
                sh(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "replace" if i else "add",
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
                    ]
                )
            print(f"cross-host links at {rate}:", flush=True)
            results: dict = {name: [] for name in runs}
            # interleaved rounds: drifts of this shared machine hit all alike
            for r in range(args.rounds):
                for name, flags in runs.items():
                    port += 1
                    res = run_on_hosts(hosts, flags, work / f"{name}-{i}-{r}", port)
                    shutil.rmtree(work / f"{name}-{i}-{r}", ignore_errors=True)  # checkpoints: GBs
                    print(
                        f"  round {r} {name}: {res['samples_per_s']:,.0f} samples/s, "
                        f"{res['cross_host_bytes_per_sample']:,.0f} B/sample across hosts, AUC "
                        f"{res['test_auc']:.4f}",
                        flush=True,
                    )
                    results[name].append(res)
            by_rate[rate] = summarise(results)
    return by_rate


def summarise(results: dict) -> dict:
    out = {name: median_run(rs) for name, rs in results.items()}
    flat, towers = out["flat"], out["towers"]
    out["ratios"] = {
        "cross_host_bytes_flat_over_towers": flat["cross_host_bytes_per_sample"]
        / towers["cross_host_bytes_per_sample"],
        "wire_bytes_flat_over_towers": flat["wire_bytes_per_sample"]
        / towers["wire_bytes_per_sample"],
        "samples_per_s_towers_over_flat": towers["samples_per_s"] / flat["samples_per_s"],
        "samples_per_s_towers_hier_over_flat": out["towers+hier"]["samples_per_s"]
        / flat["samples_per_s"],
        "samples_per_s_flat_hier_over_flat": out["flat+hier"]["samples_per_s"]
        / flat["samples_per_s"],
        "auc_towers_minus_flat": towers["test_auc"] - flat["test_auc"],
    }
    return out


def median_run(runs: list[dict]) -> dict:
    """The median run's figures, with the median samples/s over every round."""
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    mid = dict(ordered[len(ordered) // 2])
    mid["samples_per_s_all"] = [r["samples_per_s"] for r in runs]
    mid["samples_per_s"] = statistics.median(mid["samples_per_s_all"])
    return mid
