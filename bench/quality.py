"""Test AUC and log loss on held-out data, in one run: our default config, a logistic-regression
baseline (same trainer, hashed features) and a plain PyTorch DLRM (26 nn.EmbeddingBag +
SparseAdam, same data through the same reader and hashing, one epoch), on

* the real Criteo sample (../shared/data/criteo-wideresdnn: 8,000 rows to train, 2,000 to test);
* 500k generated planted-teacher rows (100k test rows), beside the teacher's Bayes-optimal AUC;

and, with your own data's path (``--parts own``: the schema comes from ``dlrm data schema`` on
the training file, as a user would make it; ours against a hashed logistic regression on the
same columns, several seeds):

* a generated user-style CSV table (``dlrm data synth --format csv``: the label in the middle, an
  ignored id column, string and integer categoricals, a multi-hot column, numeric columns with
  gaps), 500k / 100k rows, beside its Bayes-optimal AUC;
* the real Avazu sample (../shared/data/avazu-wideresdnn: 8,999 rows to train, 1,000 to test);

and, for choosing hashed or dynamic ids (``--parts ids``): test AUC against table rows, both
modes, several seeds, on generated data where collisions cost AUC (a flatter Zipf law,
``--ids-zipf``, so that tens of thousands of ids per feature are each seen many times; tables
capped well below the vocabularies, ``--capacities``), beside the uncapped hashed table, and on
the real Criteo sample; with ``--ids-controls N`` beside hashed runs on N equivalent hashes
(rows permuted: the same collisions) pooled with it, and with ``--ids-stand-in`` the offline
stand-in (frequent ids own rows, known in advance), both from ``id_controls.py``.

Usage: python bench/quality.py [--parts criteo,own,ids] [--synth-rows 500000] [--seeds 3].
Writes bench/results/quality.{json,md} (the parts run, merged with the others' last results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from id_controls import equivalent_hash, stand_in  # noqa: E402
from quality_kit import PLAIN_LR, mean_of, run_ours, run_plain  # noqa: E402

from dense_trainer.config import Config, load_config  # noqa: E402
from dense_trainer.data.synth import synthesize  # noqa: E402
from dense_trainer.data.synth_table import synthesize_table  # noqa: E402
from dlrm_core.schema_inference import infer_schema  # noqa: E402


def criteo_part(args, default: Config, lr: Config) -> dict:
    synth = args.work / f"synth-{args.synth_rows}"
    if not (synth / "bayes.json").exists():
        print(f"generating {args.synth_rows:,} rows into {synth}", file=sys.stderr)
        synthesize(synth, args.synth_rows, args.synth_test_rows, seed=0)
    datasets = {
        "criteo-sample": (args.criteo / "train.txt", args.criteo / "test.txt", None),
        f"generated-{args.synth_rows // 1000}k": (
            synth / "train.txt",
            synth / "test.txt",
            json.loads((synth / "bayes.json").read_text()),
        ),
    }
    results = {}
    for name, (train, test, bayes) in datasets.items():
        if not train.exists():
            print(f"skipping {name}: {train} not found", file=sys.stderr)
            continue
        row = {}
        systems = [
            ("ours (default config)", lambda a=train, b=test: run_ours(default, a, b)),
            ("logistic regression (same trainer)", lambda a=train, b=test: run_ours(lr, a, b)),
            (
                "plain PyTorch DLRM (EmbeddingBag + SparseAdam)",
                lambda a=train, b=test: run_plain(default, a, b),
            ),
            (
                f"plain PyTorch DLRM, our init (+-{default.embedding.init_scale})",
                lambda a=train, b=test: run_plain(default, a, b, default.embedding.init_scale),
            ),
        ]
        for system, fn in systems:
            print(f"{name}: {system}", file=sys.stderr, flush=True)
            row[system] = fn()
        if bayes:
            row["Bayes-optimal (teacher)"] = {
                "test_auc": bayes["test_auc"],
                "test_logloss": bayes["test_logloss"],
            }
        results[name] = row
    return results


def own_part(args, quiet: list[dict]) -> dict:
    """Your own data's path: `dlrm data schema` on the training file, then ours vs hashed LR."""
    table = args.work / f"table-{args.synth_rows}"
    if not (table / "bayes.json").exists():
        print(f"generating a {args.synth_rows:,}-row CSV table into {table}", file=sys.stderr)
        synthesize_table(table, args.synth_rows, args.synth_test_rows, seed=0, format="csv")
    avazu = args.avazu
    datasets = {
        f"own CSV table-{args.synth_rows // 1000}k": (
            table / "train.csv",
            table / "test.csv",
            json.loads((table / "bayes.json").read_text()),
            [],
        ),
        "Avazu sample (real)": (avazu / "train.csv", avazu / "test.csv", None, ["id"]),
    }
    results = {}
    for name, (train, test, bayes, ignore) in datasets.items():
        if not train.exists():
            print(f"skipping {name}: {train} not found", file=sys.stderr)
            continue
        schema = infer_schema([train], "click", ignore=ignore)
        path = args.work / f"{name.split()[0]}-{name.split()[-1]}-schema.toml"
        path.write_text(schema.to_toml(f"dlrm data schema {train} --label click"))
        row = {}
        for system, extra in (
            ("ours (schema from `dlrm data schema`)", {}),
            ("hashed logistic regression, same columns", {"model": {"kind": "lr"}}),
        ):
            runs = []
            for seed in range(args.seeds):
                cfg = load_config(path, quiet + [extra, {"train": {"seed": seed}}])
                print(f"{name}: {system}, seed {seed}", file=sys.stderr, flush=True)
                runs.append(run_ours(cfg, train, test))
            row[system] = mean_of(runs)
        if bayes:
            row["Bayes-optimal (teacher)"] = {
                "test_auc": bayes["test_auc"],
                "test_logloss": bayes["test_logloss"],
            }
        results[name] = row
    return results


def criteo_folds(args) -> list[tuple[Path, Path]]:
    """The Criteo sample's splits: ``--ids-folds`` 1, its own (8,000 / 2,000 rows); K > 1, K folds
    of its 10,000 rows (a fixed shuffle; fold k tests, the rest train, in file order)."""
    train, test = args.criteo / "train.txt", args.criteo / "test.txt"
    if args.ids_folds <= 1 or not train.exists():
        return [(train, test)]
    lines = train.read_bytes().splitlines(keepends=True) + test.read_bytes().splitlines(
        keepends=True
    )
    # [rows] each row's fold
    fold = np.random.default_rng(0).permutation(len(lines)) % args.ids_folds
    out = []
    for k in range(args.ids_folds):
        d = args.work / f"criteo-fold{k}of{args.ids_folds}"
        d.mkdir(parents=True, exist_ok=True)
        for name, keep in (("train.txt", fold != k), ("test.txt", fold == k)):
            (d / name).write_bytes(
                b"".join(line for line, take in zip(lines, keep, strict=True) if take)
            )
        out.append((d / "train.txt", d / "test.txt"))
    return out


def paired(runs: list[dict], base: list[dict], seeds: int) -> dict:
    """Mean and standard error of ``runs`` minus ``base`` test AUC, run by run (same split, same
    seed; split-major, ``seeds`` per split). The standard error is two-way clustered by seed and
    by split (Cameron, Gelbach & Miller: V_seed + V_split - V_run, at least the larger of the
    first two): a seed's initial weights and a split's id -> row mapping each move all of their
    runs together, so run-by-run scatter alone understates the uncertainty (seed 4 of the Criteo
    folds sits 0.015 below hashed in all five)."""
    d = np.array([r["test_auc"] - b["test_auc"] for r, b in zip(runs, base, strict=True)])
    if len(d) < 2:
        return {"vs_hashed": float(d.mean()), "vs_hashed_se": None}
    grid = d.reshape(-1, seeds)  # [splits, seeds]
    v_run = d.var(ddof=1) / d.size
    v_seed = grid.mean(0).var(ddof=1) / grid.shape[1] if grid.shape[1] > 1 else v_run
    v_split = grid.mean(1).var(ddof=1) / grid.shape[0] if grid.shape[0] > 1 else v_run
    return {
        "vs_hashed": float(d.mean()),
        "vs_hashed_se": float(np.sqrt(max(v_seed + v_split - v_run, v_seed, v_split))),
    }


def ids_part(args, quiet: list[dict]) -> dict:
    """Hashed vs dynamic ids at equal rows: the AUC-vs-rows curve (mean over ``--seeds`` seeds,
    and on the Criteo sample over ``--ids-folds`` splits), dynamic's paired difference beside."""
    data = args.work / f"ids-{args.ids_rows}-zipf{args.ids_zipf}"
    if "generated" in args.ids_data and not (data / "bayes.json").exists():
        print(
            f"generating {args.ids_rows:,} rows (zipf {args.ids_zipf}) into {data}", file=sys.stderr
        )
        synthesize(data, args.ids_rows, args.synth_test_rows, seed=0, zipf=args.ids_zipf)
    dynamic = {"ids": "dynamic", "admit_after": args.admit_after, "evict": args.evict}
    if args.shared_rows is not None:
        dynamic["shared_rows"] = args.shared_rows
    folds = f", {args.ids_folds} folds" if args.ids_folds > 1 else ""
    sets = {
        f"generated-{args.ids_rows // 1000}k, zipf {args.ids_zipf}": [
            (data / "train.txt", data / "test.txt")
        ]
    }
    if "criteo" in args.ids_data:
        sets[f"criteo-sample{folds}"] = criteo_folds(args)
    results = {}
    for name, splits in sets.items():
        if not splits[0][0].exists() or not any(
            name.startswith(s) for s in args.ids_data.split(",")
        ):
            continue
        row = {}
        for rows in [int(c) for c in args.capacities.split(",")] + [args.unlimited]:
            modes = ("hashed", "dynamic") if rows != args.unlimited else ("hashed",)
            by_mode = {}
            for mode in modes:
                extra = {"embedding": {"hash_size": rows, **(dynamic if mode == "dynamic" else {})}}
                runs = by_mode[mode] = runs_on(
                    args, quiet, extra, splits, f"{name}: {mode}, {rows} rows"
                )
                label = f"{mode}, {rows:,} rows per table" + (
                    " (uncapped)" if rows == args.unlimited else ""
                )
                row[label] = {**mean_of(runs), "rows": rows, "mode": mode}
                if mode == "dynamic":
                    row[label].update(paired(runs, by_mode["hashed"], args.seeds))
                    if args.ids_controls or args.ids_stand_in:
                        controls = control_rows(args, quiet, name, splits, rows, by_mode)
                        row[label].update(controls.pop("dynamic", {}))
                        row.update(controls)
        results[f"ids: {name}"] = row
    return results


def runs_on(
    args, quiet: list[dict], extra: dict, splits: list[tuple[Path, Path]], what: str
) -> list[dict]:
    """``--seeds`` runs of the config ``extra`` on each split, split-major (the order ``paired``
    pairs by)."""
    runs = []
    for split, (train, test) in enumerate(splits):
        for seed in range(args.seeds):
            print(f"{what}, split {split}, seed {seed}", file=sys.stderr, flush=True)
            runs.append(
                run_ours(load_config(None, quiet + [extra, {"train": {"seed": seed}}]), train, test)
            )
    return runs


def control_rows(
    args,
    quiet: list[dict],
    name: str,
    splits: list[tuple[Path, Path]],
    rows: int,
    by_mode: dict[str, list[dict]],
) -> dict:
    """``id_controls``' rows at ``rows`` rows per table: ``--ids-controls`` hashed runs on
    equivalent hashes (each paired with the original), their pool with it (dynamic's difference
    from the pool under "dynamic"), and with ``--ids-stand-in`` the offline stand-in."""
    hashed = {"embedding": {"hash_size": rows}}
    out, pool = {}, [by_mode["hashed"]]
    for c in range(args.ids_controls):
        copies = [
            equivalent_hash(
                tr,
                te,
                args.work / "ids-controls" / f"{tr.parent.name}-{rows}-perm{c + 1}",
                rows,
                seed=c + 1,
            )
            for tr, te in splits
        ]
        runs = runs_on(
            args, quiet, hashed, copies, f"{name}: hashed, {rows} rows, equivalent hash {c + 1}"
        )
        out[f"hashed, {rows:,} rows, rows permuted (control {c + 1})"] = {
            **mean_of(runs),
            **paired(runs, pool[0], args.seeds),
        }
        pool.append(runs)
    pooled = [
        {
            k: float(np.mean([runs[i][k] for runs in pool]))
            for k in ("test_auc", "test_logloss", "train_samples_per_s", "samples_seen")
        }
        for i in range(len(pool[0]))
    ]
    if len(pool) > 1:
        out[f"hashed, {rows:,} rows, pooled over {len(pool)} equivalent hashes"] = mean_of(pooled)
        out["dynamic"] = pooled_diff(by_mode["dynamic"], pooled, args.seeds)
    if args.ids_stand_in:
        shared = max(1, int(rows * load_config(None).embedding.shared_rows))
        copies = [
            stand_in(
                tr,
                te,
                args.work / "ids-controls" / f"{tr.parent.name}-{rows}-stand-in",
                rows,
                shared,
            )
            for tr, te in splits
        ]
        runs = runs_on(args, quiet, hashed, copies, f"{name}: offline stand-in, {rows} rows")
        out[f"offline stand-in, {rows:,} rows"] = {
            **mean_of(runs),
            **paired(runs, pool[0], args.seeds),
            **(pooled_diff(runs, pooled, args.seeds) if len(pool) > 1 else {}),
        }
    return out


def pooled_diff(runs: list[dict], pooled: list[dict], seeds: int) -> dict:
    """``paired`` against hashed pooled over equivalent hashes, as vs_pooled / vs_pooled_se."""
    p = paired(runs, pooled, seeds)
    return {"vs_pooled": p["vs_hashed"], "vs_pooled_se": p["vs_hashed_se"]}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parts", default="criteo,own", help="comma-separated: criteo, own")
    p.add_argument("--synth-rows", type=int, default=500_000)
    p.add_argument("--synth-test-rows", type=int, default=100_000)
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds of the own-data runs (mean reported)"
    )
    p.add_argument("--ids-rows", type=int, default=500_000, help="ids part: training rows")
    p.add_argument("--ids-zipf", type=float, default=0.8, help="ids part: Zipf exponent of the ids")
    p.add_argument("--capacities", default="500,2000,8000", help="ids part: rows per table")
    p.add_argument(
        "--unlimited",
        type=int,
        default=100_000,
        help="ids part: uncapped rows (the largest vocabulary)",
    )
    p.add_argument(
        "--admit-after", type=int, default=1, help="ids part: dynamic tables' admit_after"
    )
    p.add_argument("--evict", default="lfu", help="ids part: dynamic tables' eviction policy")
    p.add_argument(
        "--shared-rows",
        type=float,
        default=None,
        help="ids part: dynamic tables' shared_rows (default: the config's)",
    )
    p.add_argument(
        "--ids-data", default="generated,criteo", help="ids part: data sets (generated, criteo)"
    )
    p.add_argument(
        "--ids-folds",
        type=int,
        default=1,
        help="ids part: Criteo sample splits (1: its own; K: K-fold over its 10,000 rows)",
    )
    p.add_argument(
        "--ids-controls",
        type=int,
        default=0,
        help="ids part: hashed runs on this many equivalent hashes (rows permuted), pooled "
        "(id_controls.py)",
    )
    p.add_argument(
        "--ids-stand-in",
        action="store_true",
        help="ids part: the offline stand-in too (frequent ids own rows, id_controls.py)",
    )
    p.add_argument(
        "--criteo", type=Path, default=REPO.parent / "shared" / "data" / "criteo-wideresdnn"
    )
    p.add_argument(
        "--avazu", type=Path, default=REPO.parent / "shared" / "data" / "avazu-wideresdnn"
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    args.work.mkdir(parents=True, exist_ok=True)

    quiet = [{"train": {"progress": False, "checkpoint_every_steps": 0}}]
    default = load_config(None, quiet)
    lr = load_config(None, quiet + [{"model": {"kind": "lr"}}])
    previous = (
        json.loads((args.out / "quality.json").read_text())
        if (args.out / "quality.json").exists()
        else {}
    )
    results = dict(previous.get("results", {}))
    if "criteo" in parts:
        results.update(criteo_part(args, default, lr))
    if "own" in parts:
        results.update(own_part(args, quiet))
    if "ids" in parts:
        results.update(ids_part(args, quiet))
    out = {
        "results": results,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "plain_lr": PLAIN_LR,
        "default_config": default.model_dump(mode="json"),
        "parts_run": sorted(parts),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(out, indent=2) + "\n")
    md = render(out)
    (args.out / "quality.md").write_text(md)
    print(md)


def render(out: dict) -> str:
    lines = [
        f"Held-out quality, one epoch each ({out['date']})",
        "",
        "| data | model | test AUC | test log loss | train samples/s |",
        "|---|---|---:|---:|---:|",
    ]
    for data, rows in out["results"].items():
        for system, r in rows.items():
            sps = f"{r['train_samples_per_s']:,.0f}" if "train_samples_per_s" in r else "-"
            seeds = f" (seeds: {', '.join(map(str, r['seeds']))})" if "seeds" in r else ""
            if r.get("vs_hashed_se") is not None:
                seeds += (
                    f"; paired vs hashed {r['vs_hashed']:+.4f} (standard error "
                    f"{r['vs_hashed_se']:.4f})"
                )
            if r.get("vs_pooled_se") is not None:
                seeds += (
                    f"; vs hashed pooled {r['vs_pooled']:+.4f} (standard error "
                    f"{r['vs_pooled_se']:.4f})"
                )
            lines.append(
                f"| {data} | {system}{seeds} | {r['test_auc']:.4f} | {r['test_logloss']:.4f} | "
                f"{sps} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
