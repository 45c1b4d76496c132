"""DMT, flat vs towers, same data, in one run: bytes across hosts, throughput on an emulated
two-level topology, and test AUC.

Topology part (root, ``ip netns`` and ``tc``): two network namespaces are two hosts on a bridge;
each host runs one trainer and one embedding server (``--hosts 2``: 2 trainers, 2 servers).
Each host's egress is rate-limited with ``tc tbf`` (``--rate``, default 1gbit), so cross-host
traffic pays the data-centre link while traffic between ranks of a host stays on its loopback.
Runs, every one a real ``dlrm worker`` per rank:

    flat           tables balanced over both servers; every trainer fetches half its pooled
                   embeddings from the other host (and sends their gradients back)
    flat+hier      the same through the hierarchical all-to-all
    towers         K = 2 towers from ``dlrm plan-towers`` (interaction strength of a warm-up),
                   tower t on host t's server, its module compressing F_t x D to c_t x D'
    towers+hier    the same through the hierarchical all-to-all

Reported per run: samples/s (the trainers' training loop), cross-host bytes per sample (the
exchange's count, and the hosts' interface counters, which include TCP/IP overhead, the
rendezvous and evaluation), test AUC. Where namespaces cannot be made the part is skipped and
says why.

Quality part (loopback, E = 2, T = 1): flat vs towers test AUC on generated planted-teacher
data (Bayes-optimal AUC beside it) and on the real Criteo sample (8k/2k rows).

Writes bench/results/dmt.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(HERE))

from dmt_kit import CRITEO, DLRM, make_plan, model_flags, planted_kept, sh, tower_flags  # noqa: E402
from dmt_topology import topology_part  # noqa: E402

# -- quality -------------------------------------------------------------------------------------


def train_local(flags: list[str], out: Path) -> dict:
    sh(
        [*DLRM, "train", *flags, "--out", str(out), "--embedding-servers", "2", "--trainers", "1"],
        cwd=REPO,
    )
    m = json.loads((out / "metrics.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {
        "test_auc": m["test_auc"],
        "test_logloss": m["test_logloss"],
        "servers_to_trainers_bytes_per_sample": m["alltoall_bytes_per_sample"][
            "servers_to_trainers"
        ],
    }


def compare(args, flags: list[str], plan: Path, work: Path, tag: str) -> dict:
    """Flat and towers over ``args.seeds`` seeds (initialisation and data order): AUC per seed,
    mean, and the mean difference."""
    runs: dict = {"flat": [], "towers": []}
    for seed in range(args.seeds):
        seeded = [*flags, "--set", f"train.seed={seed}"]
        runs["flat"].append(train_local(seeded, work / f"{tag}-flat-{seed}"))
        runs["towers"].append(
            train_local([*seeded, *tower_flags(args, plan)], work / f"{tag}-towers-{seed}")
        )
        print(
            f"  {tag} seed {seed}: flat {runs['flat'][-1]['test_auc']:.4f}, "
            f"towers {runs['towers'][-1]['test_auc']:.4f}",
            flush=True,
        )
    out = {
        name: {
            "test_auc": [r["test_auc"] for r in rs],
            "test_logloss": [r["test_logloss"] for r in rs],
            "mean_auc": statistics.mean(r["test_auc"] for r in rs),
            "servers_to_trainers_bytes_per_sample": rs[0]["servers_to_trainers_bytes_per_sample"],
        }
        for name, rs in runs.items()
    }
    out["auc_towers_minus_flat"] = out["towers"]["mean_auc"] - out["flat"]["mean_auc"]
    return out


def quality_part(args, data: Path, plan: Path, work: Path) -> dict:
    out: dict = {"batch": args.quality_batch}
    base = [
        *model_flags(args),
        "--batch-size",
        str(args.quality_batch),
        "--train",
        str(data / "train.txt"),
        "--test",
        str(data / "test.txt"),
    ]
    synth = compare(args, base, plan, work, "generated")
    synth["bayes_auc"] = json.loads((data / "bayes.json").read_text())["test_auc"]
    synth["rows"] = [args.quality_rows, args.test_rows * 5]
    out["generated"] = synth
    if (CRITEO / "train.txt").exists():
        crit = [
            *model_flags(args),
            "--batch-size",
            "128",
            "--train",
            str(CRITEO / "train.txt"),
            "--test",
            str(CRITEO / "test.txt"),
        ]
        cplan = work / "criteo-towers.json"
        out["criteo_plan"] = make_plan(
            args,
            CRITEO / "train.txt",
            cplan,
            [
                "--set",
                f"embedding.dim={args.dim}",
                "--set",
                f"embedding.hash_size={args.hash_size}",
            ],
        )["table"]
        out["criteo_sample"] = compare(args, crit, cplan, work, "criteo")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rate",
        default="1gbit,100mbit",
        help="cross-host link rates (tc syntax, comma-separated: one set of runs per rate)",
    )
    ap.add_argument("--rows", type=int, default=200_000, help="training rows of the topology runs")
    ap.add_argument(
        "--quality-rows", type=int, default=500_000, help="training rows of the quality runs"
    )
    ap.add_argument("--test-rows", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048, help="global batch of the topology runs")
    ap.add_argument("--hash-size", type=int, default=100_000)
    ap.add_argument("--tower-dim", type=int, default=14, help="D' of the tower outputs")
    ap.add_argument("--compress", type=int, default=0, help="c_t (0: no merging of features)")
    ap.add_argument("--warmup-rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each quality comparison")
    ap.add_argument(
        "--quality-batch",
        type=int,
        default=512,
        help="batch of the quality runs (the default config's)",
    )
    ap.add_argument("--parts", default="topology,quality")
    args = ap.parse_args()
    results: dict = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="dlrm-bench-dmt-") as tmp:
        work = Path(tmp)
        data = work / "data"
        sh(
            [
                *DLRM,
                "data",
                "synth",
                "--train-rows",
                str(args.rows),
                "--test-rows",
                str(args.test_rows),
                "--seed",
                "5",
                "--out",
                str(data),
            ]
        )
        plan = work / "towers.json"
        planned = make_plan(
            args,
            data / "train.txt",
            plan,
            [
                "--set",
                f"embedding.dim={args.dim}",
                "--set",
                f"embedding.hash_size={args.hash_size}",
            ],
        )
        results["plan"] = planned["plan"]
        results["planted_interaction_kept"] = planted_kept(planned["plan"], data_seed=5)
        print(planned["table"], flush=True)
        print(
            "planted interaction kept inside towers:",
            results["planted_interaction_kept"],
            flush=True,
        )
        if "topology" in args.parts:
            print(f"topology: 2 hosts, cross-host links at {args.rate}", flush=True)
            results["topology"] = topology_part(args, data, plan, work)
            results["topology_args"] = vars(args)
        if "quality" in args.parts:
            qdata = work / "qdata"
            sh(
                [
                    *DLRM,
                    "data",
                    "synth",
                    "--train-rows",
                    str(args.quality_rows),
                    "--test-rows",
                    str(args.test_rows * 5),
                    "--seed",
                    "3",
                    "--out",
                    str(qdata),
                ]
            )
            qplan = work / "qtowers.json"
            qplanned = make_plan(
                args,
                qdata / "train.txt",
                qplan,
                [
                    "--set",
                    f"embedding.dim={args.dim}",
                    "--set",
                    f"embedding.hash_size={args.hash_size}",
                ],
            )
            results["quality_plan_planted_interaction_kept"] = planted_kept(
                qplanned["plan"], data_seed=3
            )
            print(f"quality (loopback, E=2, T=1, batch {args.quality_batch}):", flush=True)
            results[f"quality_batch{args.quality_batch}"] = quality_part(args, qdata, qplan, work)
    (HERE / "results").mkdir(exist_ok=True)
    previous = HERE / "results" / "dmt.json"
    if previous.exists():  # parts not run this time keep their last results
        kept = {
            k: v
            for k, v in json.loads(previous.read_text()).items()
            if k not in results and k != "args"
        }
        results = {**kept, **results}
    (HERE / "results" / "dmt.json").write_text(json.dumps(results, indent=2) + "\n")
    (HERE / "results" / "dmt.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        f"# DMT: flat vs towers ({r['date']}, {r['cpus']} CPUs)",
        "",
        f"D = {a['dim']}, towers K = 2 from `dlrm plan-towers`, tower outputs c_t x D' with "
        f"c_t = {a['compress'] or 'F_t'} and D' = {a['tower_dim'] or a['dim']}.",
        "",
    ]
    t = r.get("topology")
    a = r.get("topology_args", a)
    if t and "skipped" not in t:
        lines += [
            "## Two hosts (network namespaces), rate-limited cross-host links (tc tbf)",
            "",
            f"{a['rows']:,} generated rows, global batch {a['batch']}, 2 trainers + 2 servers, one "
            "of each per "
            f"host; medians of {a['rounds']} round(s).",
            "",
            "| link | run | samples/s | cross-host B/sample (exchange) | wire B/sample "
            "(interfaces) | messages/step | test AUC |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for rate, res in t.items():
            for name in ("flat", "flat+hier", "towers", "towers+hier"):
                x = res[name]
                lines.append(
                    f"| {rate} | {name} | {x['samples_per_s']:,.0f} | "
                    f"{x['cross_host_bytes_per_sample']:,.0f} | "
                    f"{x['wire_bytes_per_sample']:,.0f} | {x['cross_host_messages_per_step']:.0f} "
                    f"| {x['test_auc']:.4f} |"
                )
        lines.append("")
        for rate, res in t.items():
            q = res["ratios"]
            lines.append(
                f"* {rate}: towers vs flat **{q['cross_host_bytes_flat_over_towers']:.2f}x fewer "
                "cross-host "
                f"bytes** ({q['wire_bytes_flat_over_towers']:.2f}x on the wire, which also carries "
                "the "
                f"trainers' DDP all-reduce), **{q['samples_per_s_towers_over_flat']:.2f}x "
                "samples/s** "
                f"({q['samples_per_s_towers_hier_over_flat']:.2f}x with the hierarchical "
                "all-to-all; "
                f"flat+hier {q['samples_per_s_flat_hier_over_flat']:.2f}x flat)"
            )
        lines.append("")
    elif t:
        lines += [f"Topology part skipped: {t['skipped']}", ""]
    kept = [
        r[k]
        for k in ("planted_interaction_kept", "quality_plan_planted_interaction_kept")
        if k in r
    ]
    if kept:
        lines += [
            "Share of the generator's planted interaction weight kept inside towers (ground truth "
            "the "
            "warm-up never sees): "
            + "; ".join(
                f"partitioner {k['partitioner']:.0%} vs random balanced partitions "
                f"{k['random_mean']:.0%} "
                f"(95th percentile {k['random_p95']:.0%})"
                for k in kept
            )
            + ".",
            "",
        ]
    for key in sorted(k for k in r if k.startswith("quality_batch")):
        q = r[key]

        def row(label: str, c: dict, ref: str) -> str:
            fmt = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
            return (
                f"| {label} | {c['flat']['mean_auc']:.4f} ({fmt(c['flat']['test_auc'])}) | "
                f"{c['towers']['mean_auc']:.4f} ({fmt(c['towers']['test_auc'])}) | "
                f"{c['auc_towers_minus_flat']:+.4f} | {ref} |"
            )

        g = q["generated"]
        lines += [
            f"## Test AUC, batch {q['batch']} (loopback, 2 servers, 1 trainer, one epoch; mean of "
            f"{len(g['flat']['test_auc'])} seeds, each in brackets)",
            "",
            "| data | flat | towers | towers - flat | reference |",
            "|---|---|---|---:|---|",
            row(
                f"generated {g['rows'][0]:,} / {g['rows'][1]:,} rows",
                g,
                f"Bayes-optimal {g['bayes_auc']:.4f}",
            ),
        ]
        if "criteo_sample" in q:
            lines.append(row("real Criteo sample 8k / 2k rows", q["criteo_sample"], "batch 128"))
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
