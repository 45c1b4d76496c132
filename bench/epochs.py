"""Does training longer ever hurt? Test AUC and log loss of the default DLRM against the number
of epochs, with and without the validation split and early stopping (issue 35), beside our
logistic regression, on generated data none of the defaults were tuned on: user-style CSV tables
of three generator settings (seed, Zipf law of the users and ads, click rate) and the Criteo
layout.

Each run: ``dlrm train`` defaults (the schema from ``dlrm data schema`` for the CSV tables), the
``--set`` overrides of its row. Rows:

* ``lr``: ``model.kind = lr``, 3 epochs, early stopping as the default does;
* ``dlrm, no validation, E epochs``: the model as it was (every epoch trained, the last kept);
* ``dlrm default, 5 epochs``: validation share, patience, the best model kept;
* ``... + embedding decay X``: the same with ``embedding.optimizer.weight_decay = X``.

Usage: python bench/epochs.py [--rows 200000] [--seeds 2] [--decays 0.0002,0.001]
Writes bench/results/epochs.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from dense_trainer.config import load_config  # noqa: E402
from dense_trainer.data.synth import synthesize  # noqa: E402
from dense_trainer.data.synth_table import synthesize_table  # noqa: E402
from dense_trainer.train import Trainer  # noqa: E402
from dlrm_core.schema_inference import infer_schema  # noqa: E402

QUIET = {"train": {"progress": False, "checkpoint_every_steps": 0}}
TABLES = {  # generator settings: (seed, Zipf exponent, click rate)
    "csv-a (zipf 1.1, ctr 0.2)": (0, 1.1, 0.2),
    "csv-b (zipf 0.9, ctr 0.1)": (1, 0.9, 0.1),
    "csv-c (zipf 1.3, ctr 0.3)": (2, 1.3, 0.3),
}


def datasets(work: Path, rows: int) -> dict[str, tuple[Path, Path, Path | None, dict]]:
    """name -> (train, test, schema config or None for the Criteo layout, bayes)."""
    out = {}
    for name, (seed, zipf, ctr) in TABLES.items():
        d = work / f"table-{seed}-{rows}"
        if not (d / "bayes.json").exists():
            synthesize_table(d, rows, rows // 4, seed=seed, format="csv", ctr=ctr, zipf=zipf)
        schema = d / "inferred.toml"
        if not schema.exists():
            schema.write_text(infer_schema([d / "train.csv"], "click").to_toml("dlrm data schema"))
        bayes = json.loads((d / "bayes.json").read_text())
        out[name] = (d / "train.csv", d / "test.csv", schema, bayes)
    d = work / f"criteo-{rows}"
    if not (d / "bayes.json").exists():
        synthesize(d, train_rows=rows, test_rows=rows // 4, seed=3)
    out["criteo layout"] = (
        d / "train.txt",
        d / "test.txt",
        None,
        json.loads((d / "bayes.json").read_text()),
    )
    return out


def systems(decays: list[float]) -> dict[str, dict]:
    off = {"validation": 0.0}
    rows = {
        "lr (3 epochs, default stopping)": {"model": {"kind": "lr"}, "train": {"epochs": 3}},
        "dlrm, no validation, 1 epoch": {"train": {**off, "epochs": 1}},
        "dlrm, no validation, 3 epochs": {"train": {**off, "epochs": 3}},
        "dlrm default, 5 epochs": {"train": {"epochs": 5}},
    }
    for d in decays:
        rows[f"dlrm default, 5 epochs, embedding decay {d:g}"] = {
            "train": {"epochs": 5},
            "embedding": {"optimizer": {"weight_decay": d}},
        }
    return rows


def run(schema: Path | None, over: dict, seed: int, train: Path, test: Path) -> dict:
    seeded = [QUIET, over, {"train": {"seed": seed}}]
    cfg = load_config(schema, seeded) if schema else load_config(None, seeded)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-epochs-") as out:
        m = Trainer(cfg, Path(out)).fit([train], [test])
    v = m.get("validation") or {}
    return {
        "test_auc": m["test_auc"],
        "test_logloss": m["test_logloss"],
        "samples_seen": m["samples_seen"],
        "kept_step": v.get("kept_step"),
        "steps": m["steps"],
        "wall_s": time.perf_counter() - t0,
        "train_samples_per_s": m["train_samples_per_s"],
    }


def summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("test_auc", "test_logloss", "wall_s", "train_samples_per_s"):
        xs = np.array([r[key] for r in runs], dtype=float)
        out[key] = float(xs.mean())
        out[key + "_sd"] = float(xs.std(ddof=1)) if len(xs) > 1 else 0.0
    out["kept_step / steps"] = [f"{r['kept_step']}/{r['steps']}" for r in runs]
    return out


def render(results: dict, meta: dict) -> str:
    lines = [
        f"# Epochs and early stopping ({meta['date']}, {meta['rows']:,} train rows, "
        f"seeds {meta['seeds']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| data | system | test AUC | sd | test log loss | kept step / steps | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for data, row in results.items():
        for system, s in row.items():
            if system == "Bayes-optimal":
                lines.append(
                    f"| {data} | Bayes-optimal (teacher) | {s['test_auc']:.4f} | | "
                    f"{s['test_logloss']:.4f} | | |"
                )
                continue
            lines.append(
                f"| {data} | {system} | {s['test_auc']:.4f} | {s['test_auc_sd']:.4f} | "
                f"{s['test_logloss']:.4f} | {', '.join(s['kept_step / steps'])} | "
                f"{s['wall_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--decays", default="0.0002,0.001")
    p.add_argument("--data", default="", help="comma-separated subset of the data sets")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrm-epochs")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    decays = [float(x) for x in args.decays.split(",") if x]
    results = {}
    for name, (train, test, schema, bayes) in datasets(args.work, args.rows).items():
        if args.data and not any(part and part in name for part in args.data.split(",")):
            continue
        row = {}
        for system, over in systems(decays).items():
            runs = []
            for seed in range(args.seeds):
                print(f"{name}: {system}, seed {seed}", file=sys.stderr, flush=True)
                runs.append(run(schema, over, seed, train, test))
            row[system] = summary(runs)
            print(f"  -> AUC {row[system]['test_auc']:.4f}", file=sys.stderr, flush=True)
        row["Bayes-optimal"] = {
            "test_auc": bayes["test_auc"],
            "test_logloss": bayes["test_logloss"],
        }
        results[name] = row
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": args.rows,
        "seeds": args.seeds,
        "command": "python bench/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "epochs.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / "epochs.md").write_text(render(results, meta))
    print(render(results, meta))


if __name__ == "__main__":
    main()
