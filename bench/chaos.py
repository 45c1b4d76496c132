"""Chaos: kill or stop a random role at a random moment; every run must end in bounded time naming
the role, resume to completion and reach the uninterrupted run's quality.

    python bench/chaos.py                          30 runs (seed 0), about 30 minutes on 2 cores
    python bench/chaos.py --runs 10 --first 10 --append     runs 10..19, merged into the results

Each run draws a role and a fault:

    trainer / master trainer / embedding server   SIGKILL or SIGSTOP at a random step of an E=2, T=2
                                                  `dlrm train` (deltas every second): the job must
                                                  end within dist.timeout_s + 15 s naming the rank;
                                                  then `--resume` must complete within 0.003 AUC of
                                                  the uninterrupted run; updates lost = steps redone
    host link                                     (root only) the four ranks as bare `dlrm worker`
                                                  processes in four network namespaces; one host's
                                                  link is cut (no TCP reset): every rank must give
                                                  up
                                                  within dist.timeout_s + 30 s, the survivors naming
                                                  the lost one; then the job resumes (local
                                                  launcher)
    API worker                                    SIGKILL or SIGSTOP one of `dlrm serve --workers 2`
                                                  under load: the worker must be gone (uvicorn's
                                                  supervisor names it: `Child process [pid] died`)
                                                  within 15 s; service resumes by itself; served AUC
    Redis                                         SIGKILL or SIGSTOP the serving store (append-only
                                                  file) while the API serves v1 and v2 is published:
                                                  requests and the publish fail in bounded time
                                                  naming the store; Redis restarts (or continues);
                                                  v2 is published; served AUC

After every training run the checkpoints are checked: ``latest`` names a complete checkpoint whose
whole chain verifies (every file's digest). Every served answer is checked against the
predictions of the version it names: a version never mixes another's rows or weights.
Results: bench/results/chaos.json (every run) and chaos.md (the table). The kit (setting,
processes, API under load, checkpoint checks) is ``chaos_kit.py``; one function per fault,
``chaos_faults.py``; this file draws the runs, runs them and writes the results.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_faults import api_worker_run, link_run, redis_run, training_run  # noqa: E402
from chaos_kit import AUC_TOLERANCE as AUC_TOLERANCE  # noqa: E402 - tests/test_chaos.py reads it here
from chaos_kit import RANK_OF, REPO, ROLES, Setting  # noqa: E402


def draw(seed: int, n: int) -> list[tuple[str, str]]:
    """The (role, fault) of runs 0..n-1, the same for every slice of one seed: every block of 30
    runs gives each role 5 runs (SIGKILL and SIGSTOP 3/2 or 2/3), in a random order."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        block = []
        for role in ROLES:
            faults = (
                ["link cut"] * 5
                if role == "host link"
                else ["SIGKILL", "SIGSTOP"] * 2 + [rng.choice(["SIGKILL", "SIGSTOP"])]
            )
            block += [(role, f) for f in faults]
        rng.shuffle(block)
        out += block
    return out[:n]


def run_one(setting: Setting, index: int, role: str, fault: str, seed: int) -> dict:
    rng = random.Random(seed * 1000 + index)
    out = setting.work / f"run-{index}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    try:
        if role in RANK_OF:
            result = training_run(setting, role, fault, rng, out)
        elif role == "host link":
            result = link_run(setting, rng, out)
        elif role == "API worker":
            result = api_worker_run(setting, fault, rng)
        else:
            result = redis_run(setting, fault, rng, setting.work / f"redis-{index}")
    except Exception as exc:  # a harness failure is a failed run, not a crash of the suite
        result = {
            "bounded": False,
            "resumed": False,
            "harness_error": f"{type(exc).__name__}: {exc}",
        }
    shutil.rmtree(out, ignore_errors=True)
    return {
        "run": index,
        "role": role,
        "fault": fault,
        "seconds": round(time.time() - t0, 1),
        **result,
    }


def summarize(runs: list[dict]) -> dict:
    done = [r for r in runs if "skipped" not in r]
    aucs = [r["auc_diff"] for r in done if r.get("auc_diff") is not None]
    lost = [r["updates_lost_steps"] for r in done if r.get("updates_lost_steps") is not None]
    return {
        "runs": len(done),
        "skipped": len(runs) - len(done),
        "bounded_exits": sum(1 for r in done if r.get("bounded") and r.get("named")),
        "max_exit_s": max((r.get("exit_s", 0) for r in done), default=0),
        "resumes_completed": sum(1 for r in done if r.get("resumed")),
        "worst_auc_diff": max(aucs, default=None),
        "max_updates_lost_steps": max(lost, default=None),
        "mean_updates_lost_steps": sum(lost) / len(lost) if lost else None,
        "version_mixes": sum(r.get("version_mixes", 0) for r in done),
        "version_regressions": sum(r.get("version_regressions", 0) for r in done),
        "checkpoint_problems": sum(1 for r in done if r.get("checkpoint_problem")),
    }


def markdown(runs: list[dict], meta: dict) -> str:
    def row(name: str, rs: list[dict]) -> str:
        s = summarize(rs)
        auc = f"{s['worst_auc_diff']:.4f}" if s["worst_auc_diff"] is not None else "-"
        lost = (
            f"{s['max_updates_lost_steps']} max, {s['mean_updates_lost_steps']:.1f} mean"
            if s["max_updates_lost_steps"] is not None
            else "-"
        )
        return (
            f"| {name} | {s['runs']} | {s['bounded_exits']}/{s['runs']} | {s['max_exit_s']:.1f} | "
            f"{s['resumes_completed']}/{s['runs']} | {auc} | {lost} | {s['version_mixes']} | "
            f"{s['version_regressions']} | {s['checkpoint_problems']} |"
        )

    lines = [
        f"# Chaos runs (`bench/chaos.py`, seed {meta['seed']})",
        "",
        f"{meta['note']}",
        "",
        "| role | runs | bounded exits naming the role | max time to exit (s) | resumes completed "
        "| "
        "worst AUC difference | updates lost (steps) | version mixes | version regressions | "
        "corrupt or incomplete checkpoints |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        row("**all**", runs),
    ]
    for role in ROLES:
        rs = [r for r in runs if r["role"] == role]
        if rs:
            lines.append(row(role, rs))
    lines += [
        "",
        "| run | role | fault | at | exit (s) | bounded, named | resumed | AUC diff | lost steps "
        "| message |",
        "|---:|---|---|---:|---:|---|---|---:|---:|---|",
    ]
    for r in sorted(runs, key=lambda r: r["run"]):
        at = r.get("at_step", r.get("at_request", ""))
        auc = f"{r['auc_diff']:.4f}" if r.get("auc_diff") is not None else "-"
        msg = (
            r.get("message")
            or r.get("skipped")
            or r.get("harness_error")
            or r.get("resume_error")
            or ""
        )
        msg = str(msg).replace("|", "/")[:140]
        lines.append(
            f"| {r['run']} | {r['role']} | {r['fault']} | {at} | {r.get('exit_s', '-')} | "
            f"{'yes' if r.get('bounded') and r.get('named') else 'NO'} | "
            f"{'yes' if r.get('resumed') else 'NO'} | "
            f"{auc} | {r.get('updates_lost_steps', '-')} | {msg} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument(
        "--first", type=int, default=0, help="index of the first run (slices of one seed)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout-s", type=float, default=20.0, help="dist.timeout_s of the training runs"
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "chaos")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    p.add_argument(
        "--append", action="store_true", help="merge with the runs already in chaos.json"
    )
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    setting = Setting(args.work, args.timeout_s)
    plan = draw(args.seed, args.first + args.runs)
    path = args.results / "chaos.json"
    previous = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
    runs = {r["run"]: r for r in previous}
    for index in range(args.first, args.first + args.runs):
        role, fault = plan[index]
        result = run_one(setting, index, role, fault, args.seed)
        runs[index] = result
        print(json.dumps(result), flush=True)
    ordered = [runs[i] for i in sorted(runs)]
    meta = {
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "note": (
            f"E=2, T=2 `dlrm train` on {setting.rows:,} generated rows (tiny config, batch "
            f"{setting.batch}, "
            f"{setting.steps} steps), "
            "deltas every second, full checkpoints every 100 steps, dist.timeout_s = "
            f"{args.timeout_s:g}; "
            f"uninterrupted test AUC {setting.ref_auc:.4f}; the uninterrupted run trains "
            f"{setting.steps_per_s:.0f} steps/s, so one delta interval holds about that many steps "
            "(updates lost are counted in steps redone on resume). Version regressions: a v2 "
            "answer "
            "followed by a v1 answer while the two workers switch (each answer is its own "
            "version's). "
            f"2 CPU cores shared with other jobs."
        ),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"meta": meta, "summary": summarize(ordered), "runs": ordered}, indent=1) + "\n"
    )
    (args.results / "chaos.md").write_text(markdown(ordered, meta))
    print(json.dumps(summarize(ordered), indent=1))


if __name__ == "__main__":
    main()
