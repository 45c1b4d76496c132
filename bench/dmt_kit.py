"""What the DMT bench's parts share: the CLI they drive, the model and tower flags, the tower
plan, and how much of the planted teacher's interaction a plan keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
CRITEO = REPO.parent / "shared" / "data" / "criteo-wideresdnn"


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def model_flags(args) -> list[str]:
    return [
        "--embedding-dim",
        str(args.dim),
        "--batch-size",
        str(args.batch),
        "--no-progress",
        "--set",
        f"embedding.hash_size={args.hash_size}",
        "--set",
        "dist.timeout_s=120",
    ]


def tower_flags(args, plan: Path) -> list[str]:
    flags = ["--towers", str(plan)]
    if args.tower_dim:
        flags += ["--tower-dim", str(args.tower_dim)]
    if args.compress:
        flags += ["--tower-compress", str(args.compress)]
    return flags


def make_plan(args, train: Path, out: Path, extra: list[str]) -> dict:
    r = sh(
        [
            *DLRM,
            "plan-towers",
            "-k",
            "2",
            "--train",
            str(train),
            "--out",
            str(out),
            "--warmup-rows",
            str(args.warmup_rows),
            *extra,
        ],
        cwd=REPO,
    )
    return {"table": r.stdout.strip(), "plan": json.loads(out.read_text())}


def planted_kept(plan: dict, data_seed: int, random_plans: int = 200) -> dict:
    """Share of the generator's planted pair weights |w_fg| inside towers: the partitioner's
    plan against random balanced partitions of the same sizes (the ground truth the warm-up
    never sees)."""
    import numpy as np

    from dense_trainer.data.synth import make_teacher

    teacher = make_teacher(data_seed)
    weight = np.abs(teacher.pair_w)
    tower = {
        f"C{i + 1}": t
        for t, tw in enumerate(plan["towers"])
        for i in [int(f[1:]) - 1 for f in tw["features"]]
    }

    def same(assign):
        return float(
            weight[[assign[a] == assign[b] for a, b in teacher.pairs]].sum() / weight.sum()
        )

    ours = same([tower[f"C{i + 1}"] for i in range(26)])
    rng = np.random.default_rng(0)
    sizes = [len(t["features"]) for t in plan["towers"]]
    base = np.repeat(np.arange(len(sizes)), sizes)
    rand = [same(rng.permutation(base).tolist()) for _ in range(random_plans)]
    return {
        "partitioner": ours,
        "random_mean": float(np.mean(rand)),
        "random_p95": float(np.quantile(rand, 0.95)),
    }
