"""Which defaults? Model variants on tables none of them were tuned on, chosen by validation log
loss, with the test figures beside (issue 35).

Data: user-style CSV tables from ``dlrm data synth --format csv`` under six generator settings
(seed, Zipf exponent of users and ads from 0.8 to 1.2, click rate 5% to 30%), ``--rows`` train
and as many test rows, their schema from ``dlrm data schema`` as a user would make it; the
Criteo layout (generated); and the real Criteo and Avazu samples (../shared/data, when present).
Each run is ``dlrm train`` with the defaults and the ``--set`` overrides of its system, seeds
``--seeds``; the default's validation split (5%) picks its kept model, the test split is read
once at the end. Systems:

* ``lr``: our logistic regression (``model.kind = lr``), the baseline users try first;
* ``no first order``: the default without ``model.first_order`` (the default before it);
* ``default``: the current defaults;
* ``--variants``: more, by name (``VARIANTS``).

The summary: per system, the mean over data sets of validation log loss and test AUC, and on
how many data sets it beats ``lr`` (test AUC; validation log loss).

Usage: python bench/defaults.py [--rows 100000] [--seeds 1] [--variants dropout,epoch-decay]
Writes bench/results/defaults.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
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
TABLES = [(10, 0.8, 0.15), (11, 1.0, 0.2), (12, 0.9, 0.25), (13, 1.2, 0.1), (14, 1.0, 0.05)]
TABLES += [(15, 0.85, 0.3)]
"""Generator settings of the CSV tables: (seed, Zipf exponent, click rate)."""
SHARED = REPO.parent / "shared" / "data"
SYSTEMS = {
    "lr": {"model": {"kind": "lr"}},
    "no first order": {"model": {"first_order": False}},
    "default": {},
}
VARIANTS = {
    "no wide part": {"model": {"wide": False}},
    "dynamic": {"embedding": {"ids": "dynamic"}},
    "dropout": {"model": {"dropout": 0.2}},
    "epoch-decay": {"schedule": {"decay": "epoch", "epoch_gamma": 0.5}},
    "dim8": {"embedding": {"dim": 8}},
    "adagrad": {"embedding": {"optimizer": {"kind": "adagrad"}}},
    "dim32": {"embedding": {"dim": 32}},
    "embedding-lr-0.1": {"embedding": {"optimizer": {"lr": 0.1}}},
    "dense-lr-1e-3": {"optim": {"lr": 1e-3}},
}


def datasets(work: Path, rows: int) -> dict[str, tuple[Path, Path, Path | None, float | None]]:
    """name -> (train, test, schema config or None for the Criteo layout, Bayes AUC or None)."""
    out = {}
    for seed, zipf, ctr in TABLES:
        d = work / f"table-{seed}-{rows}"
        if not (d / "bayes.json").exists():
            synthesize_table(d, rows, rows, seed=seed, format="csv", ctr=ctr, zipf=zipf)
        schema = d / "inferred.toml"
        if not schema.exists():
            schema.write_text(infer_schema([d / "train.csv"], "click").to_toml("dlrm data schema"))
        bayes = json.loads((d / "bayes.json").read_text())["test_auc"]
        out[f"csv zipf {zipf} ctr {ctr}"] = (d / "train.csv", d / "test.csv", schema, bayes)
    d = work / f"criteo-{rows}"
    if not (d / "bayes.json").exists():
        synthesize(d, train_rows=rows, test_rows=rows, seed=3)
    bayes = json.loads((d / "bayes.json").read_text())["test_auc"]
    out["criteo layout"] = (d / "train.txt", d / "test.txt", None, bayes)
    criteo, avazu = SHARED / "criteo-wideresdnn", SHARED / "avazu-wideresdnn"
    if (criteo / "train.txt").exists():
        out["Criteo sample (real)"] = (criteo / "train.txt", criteo / "test.txt", None, None)
    if (avazu / "train.csv").exists():
        schema = work / "avazu-schema.toml"
        if not schema.exists():
            inferred = infer_schema([avazu / "train.csv"], "click", ignore=["id"])
            schema.write_text(inferred.to_toml("dlrm data schema"))
        out["Avazu sample (real)"] = (avazu / "train.csv", avazu / "test.csv", schema, None)
    return out


def write_manifest(work: Path, rows: int, sets: dict) -> None:
    """``work/datasets-ROWS.json``: name -> [train, test, schema or null], for bench/peers.py."""
    listing = {name: [str(a), str(b), str(c) if c else None] for name, (a, b, c, _) in sets.items()}
    (work / f"datasets-{rows}.json").write_text(json.dumps(listing, indent=2))


def run(schema: Path | None, over: dict, seed: int, train: Path, test: Path) -> dict:
    seeded = [QUIET, over, {"train": {"seed": seed}}]
    cfg = load_config(schema, seeded) if schema else load_config(None, seeded)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-defaults-") as out:
        m = Trainer(cfg, Path(out)).fit([train], [test])
    v = m.get("validation") or {}
    return {
        "valid_logloss": m["valid_logloss"],
        "test_auc": m["test_auc"],
        "test_logloss": m["test_logloss"],
        "kept": f"{v.get('kept_step')}/{m['steps']}",
        "wall_s": time.perf_counter() - t0,
    }


def mean(runs: list[dict]) -> dict:
    out = {k: float(np.mean([r[k] for r in runs])) for k in ("valid_logloss", "test_auc")}
    out["test_logloss"] = float(np.mean([r["test_logloss"] for r in runs]))
    out["kept"] = [r["kept"] for r in runs]
    return out


def render(results: dict, meta: dict) -> str:
    systems = list(dict.fromkeys(s for r in results.values() for s in r["systems"]))
    lines = [
        f"# Defaults on tables nobody tuned for ({meta['date']}, {meta['rows']:,} train rows per "
        f"generated table, seeds {meta['seeds']})",
        "",
        f"Command: `{meta['command']}`",
        *[f"Earlier (merged): `{m['command']}` ({m['date']})" for m in meta.get("earlier", [])],
        "",
        "Test AUC (validation log loss in brackets: what chose the default).",
        "",
        "| data | Bayes AUC | " + " | ".join(systems) + " |",
        "|---|---|" + "---|" * len(systems),
    ]
    for data, row in results.items():
        bayes = f"{row['bayes']:.4f}" if row["bayes"] else ""
        got = row["systems"]
        cells = [
            f"{got[s]['test_auc']:.4f} ({got[s]['valid_logloss']:.4f})" if s in got else "not run"
            for s in systems
        ]
        lines.append(f"| {data} | {bayes} | " + " | ".join(cells) + " |")
    lines += ["", "| system | mean test AUC | mean valid log loss | beats lr (test AUC / valid) |"]
    lines.append("|---|---|---|---|")
    for s in systems:
        rows = [r["systems"] for r in results.values() if s in r["systems"]]
        auc = np.mean([r[s]["test_auc"] for r in rows])
        ll = np.mean([r[s]["valid_logloss"] for r in rows])
        wins = sum(r[s]["test_auc"] > r["lr"]["test_auc"] for r in rows)
        valid_wins = sum(r[s]["valid_logloss"] < r["lr"]["valid_logloss"] for r in rows)
        lines.append(f"| {s} | {auc:.4f} | {ll:.4f} | {wins} / {valid_wins} of {len(rows)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--variants", default="", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrm-defaults")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated data set names: run these, merged into the last results",
    )
    args = p.parse_args()
    systems = {**SYSTEMS, **{v: VARIANTS[v] for v in args.variants.split(",") if v}}
    sets = datasets(args.work, args.rows)
    write_manifest(args.work, args.rows, sets)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": args.rows,
        "seeds": args.seeds,
        "command": "python bench/" + shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    results: dict = {}
    if args.only:
        only = args.only.split(",")
        unknown = sorted(set(only) - set(sets))
        if unknown:
            p.error(f"--only: no data set {unknown[0]!r} (there are: {', '.join(sets)})")
        last = args.out / "defaults.json"
        if not last.exists():
            p.error(f"--only merges into earlier results: {last} does not exist (run without it)")
        before = json.loads(last.read_text())
        if (before["meta"]["rows"], before["meta"]["seeds"]) != (args.rows, args.seeds):
            p.error("--only merges into results of the same --rows and --seeds")
        results = before["results"]
        earlier = before["meta"].pop("earlier", [])
        meta["earlier"] = [*earlier, before["meta"]]
        sets = {name: sets[name] for name in only}
    for name, (train, test, schema, bayes) in sets.items():
        row = {}
        for system, over in systems.items():
            runs = [run(schema, over, seed, train, test) for seed in range(args.seeds)]
            row[system] = mean(runs)
            print(
                f"{name}: {system}: test AUC {row[system]['test_auc']:.4f}, valid log loss "
                f"{row[system]['valid_logloss']:.4f}, kept {', '.join(row[system]['kept'])}",
                file=sys.stderr,
                flush=True,
            )
        results[name] = {"bayes": bayes, "systems": row}
        write(args.out, results, meta)  # after each data set: a long run keeps what it measured
    print(render(results, meta))


def write(out: Path, results: dict, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "results": results}
    (out / "defaults.json").write_text(json.dumps(record, indent=2))
    (out / "defaults.md").write_text(render(results, meta))


if __name__ == "__main__":
    main()
