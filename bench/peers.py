"""What users try first on their own table: scikit-learn's logistic regression, LightGBM and
CatBoost, on the data sets of ``bench/defaults.py``, beside our default DLRM and logistic
regression from its last results (issue 35, item 6).

Each peer sees what ours sees: the same training rows, the same validation rows (the rows our
trainer holds out: ``dense_trainer/data/split.py``, 5%), the same test rows, the columns of the
schema ``dlrm data schema`` wrote (categoricals, multi-hot cells, numbers with gaps), and is
tuned on the validation rows only, as its users would:

* ``sklearn lr``: one-hot categoricals (each value of a multi-hot cell its own column; values seen
  once share the unknown column), numbers log1p'd or standardized as the schema says with a
  missing flag; L2 strength ``C`` chosen on validation log loss from ``C_GRID``;
* ``lightgbm``: categoricals as pandas categories (a multi-hot cell as one category), numbers
  as they are; early stopping on validation log loss (50 rounds), learning rate 0.05;
* ``catboost``: categoricals as its ``cat_features`` (ordered target statistics), early stopping
  on validation with ``use_best_model``, learning rate 0.08, depth 6.

Runs in the bench environment (``make bench-env``: bench/requirements-peers.txt); needs no torch.
Usage: python bench/peers.py [--rows 100000] [--work /tmp/dlrm-defaults] (after
bench/defaults.py with the same --rows and --work). Writes bench/results/peers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.csv as pcsv

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from dense_trainer.data.split import RowSplit  # noqa: E402 (numpy only)

SHARED = REPO.parent / "shared" / "data"
C_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
# = dlrm_core.schema.CRITEO_COLUMNS, copied: this script runs without the project installed
CRITEO = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
THREADS = 2


def schema_of(path: Path | None) -> tuple[str, list[dict]]:
    """(label column, features) of a ``dlrm data schema`` file; None: the Criteo layout."""
    if path is None:
        dense = [{"kind": "dense", "name": f"I{i}", "transform": "log1p"} for i in range(1, 14)]
        cats = [{"kind": "categorical", "name": f"C{i}"} for i in range(1, 27)]
        return "label", dense + cats
    doc = tomllib.loads(path.read_text())
    return doc["label"], doc["features"]


def read(path: Path, columns: list[str] | None = None) -> pd.DataFrame:
    """A training or test file as strings and numbers (the Criteo layout: TSV, no header). A
    file whose first line is not the training file's header (``columns``) is data in its layout,
    as our reader takes it."""
    if path.suffix == ".txt":
        opts = pcsv.ReadOptions(column_names=CRITEO)
        parse = pcsv.ParseOptions(delimiter="\t")
        table = pcsv.read_csv(path, read_options=opts, parse_options=parse)
    else:
        with open(path) as f:
            first = f.readline().rstrip("\r\n").split(",")
        headerless = columns is not None and first != columns
        opts = pcsv.ReadOptions(column_names=columns if headerless else None)
        table = pcsv.read_csv(path, read_options=opts)
    return table.to_pandas()


def split_rows(n: int) -> np.ndarray:
    """bool [n]: the rows our trainer holds out for validation (file 0, data rows 1..n)."""
    return RowSplit(0.05, "validation").keep(0, np.arange(1, n + 1, dtype=np.int64))


def numbers(df: pd.DataFrame, feats: list[dict], stats: dict) -> np.ndarray:
    """Dense features as the schema transforms them, plus a missing flag each: float [n, 2I]."""
    cols = []
    for f in feats:
        x = pd.to_numeric(df[f.get("column", f["name"])], errors="coerce").to_numpy(float)
        missing = np.isnan(x)
        if f.get("transform") == "log1p":
            x = np.log1p(np.maximum(np.nan_to_num(x), 0.0))
        else:
            mu, sd = stats.setdefault(f["name"], (np.nanmean(x), np.nanstd(x) or 1.0))
            x = (np.nan_to_num(x, nan=mu) - mu) / sd
        cols += [x, missing.astype(float)]
    return np.stack(cols, 1) if cols else np.zeros((len(df), 0))


def tokens(df: pd.DataFrame, f: dict) -> list[list[str]]:
    """Each row's values of a categorical feature (a multi-hot cell split; a gap: none)."""
    col = df[f.get("column", f["name"])].astype("string").fillna("")
    sep = f.get("separator")
    return [[v for v in s.split(sep) if v] if sep else ([s] if s else []) for s in col]


def sklearn_lr_unregularized(data: dict, feats: list[dict]) -> dict:
    """The same model with almost no L2 (C = 1e4): what its regularization is worth."""
    return sklearn_lr(data, feats, grid=(1e4,))


def sklearn_lr(data: dict, feats: list[dict], grid: tuple[float, ...] = C_GRID) -> dict:
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss
    from sklearn.preprocessing import MultiLabelBinarizer

    dense = [f for f in feats if f["kind"] == "dense"]
    stats: dict = {}
    mats = {k: [sparse.csr_matrix(numbers(d, dense, stats))] for k, d in data.items()}
    for f in (f for f in feats if f["kind"] == "categorical"):
        rows = {k: tokens(d, f) for k, d in data.items()}
        counts = pd.Series([v for r in rows["train"] for v in r]).value_counts()
        vocab = sorted(counts.index[counts >= 2])
        known = set(vocab)
        enc = MultiLabelBinarizer(classes=[*vocab, "<rare>"], sparse_output=True)
        enc.fit([])
        for k, r in rows.items():
            mats[k].append(enc.transform([[v if v in known else "<rare>" for v in x] for x in r]))
    x = {k: sparse.hstack(m).tocsr() for k, m in mats.items()}
    best = None
    for c in grid:
        model = LogisticRegression(C=c, max_iter=400, solver="lbfgs")
        model.fit(x["train"], data["train"]["y"])
        loss = log_loss(data["valid"]["y"], model.predict_proba(x["valid"])[:, 1])
        if best is None or loss < best[0]:
            best = (loss, c, model)
    loss, c, model = best
    return {"p": model.predict_proba(x["test"])[:, 1], "valid_logloss": loss, "chosen": f"C={c}"}


def _frame(df: pd.DataFrame, feats: list[dict], cats: dict) -> pd.DataFrame:
    out = {}
    for f in feats:
        col = df[f.get("column", f["name"])]
        if f["kind"] == "dense":
            out[f["name"]] = pd.to_numeric(col, errors="coerce")
        else:
            values = col.astype("string")
            kinds = cats.setdefault(f["name"], pd.Index(values.dropna().unique()))
            out[f["name"]] = pd.Categorical(values, categories=kinds)
    return pd.DataFrame(out)


def lightgbm(data: dict, feats: list[dict]) -> dict:
    import lightgbm as lgb
    from sklearn.metrics import log_loss

    cats: dict = {}
    x = {k: _frame(d, feats, cats) for k, d in data.items()}
    model = lgb.LGBMClassifier(
        n_estimators=3000, learning_rate=0.05, num_threads=THREADS, verbose=-1
    )
    model.fit(
        x["train"],
        data["train"]["y"],
        eval_set=[(x["valid"], data["valid"]["y"])],
        callbacks=[lgb.early_stopping(50, verbose=False)],
    )
    p_valid = model.predict_proba(x["valid"])[:, 1]
    return {
        "p": model.predict_proba(x["test"])[:, 1],
        "valid_logloss": log_loss(data["valid"]["y"], p_valid),
        "chosen": f"{model.best_iteration_} trees",
    }


def catboost(data: dict, feats: list[dict]) -> dict:
    from catboost import CatBoostClassifier
    from sklearn.metrics import log_loss

    def frame(df):
        return pd.DataFrame(
            {
                f["name"]: pd.to_numeric(df[f.get("column", f["name"])], errors="coerce")
                if f["kind"] == "dense"
                else df[f.get("column", f["name"])].astype("string").fillna("").astype(str)
                for f in feats
            }
        )

    x = {k: frame(d) for k, d in data.items()}
    cat = [f["name"] for f in feats if f["kind"] == "categorical"]
    model = CatBoostClassifier(
        iterations=3000,
        learning_rate=0.08,
        depth=6,
        thread_count=THREADS,
        od_type="Iter",
        od_wait=50,
        use_best_model=True,
        verbose=False,
        allow_writing_files=False,
    )
    valid = (x["valid"], data["valid"]["y"])
    model.fit(x["train"], data["train"]["y"], cat_features=cat, eval_set=valid)
    p_valid = model.predict_proba(x["valid"])[:, 1]
    return {
        "p": model.predict_proba(x["test"])[:, 1],
        "valid_logloss": log_loss(data["valid"]["y"], p_valid),
        "chosen": f"{model.get_best_iteration() + 1} trees",
    }


PEERS = {
    "sklearn lr": sklearn_lr,
    "lightgbm": lightgbm,
    "catboost": catboost,
    "sklearn lr without L2": sklearn_lr_unregularized,
}


def load(train: Path, test: Path, label: str) -> dict:
    frame = read(train)
    held = split_rows(len(frame))
    test_frame = read(test, list(frame.columns))
    data = {"train": frame[~held].copy(), "valid": frame[held].copy(), "test": test_frame}
    for d in data.values():
        d["y"] = pd.to_numeric(d[label]).to_numpy(int)
    return data


def render(results: dict, meta: dict) -> str:
    systems = [s for s in ("ours: default", "ours: lr") if any(s in r for r in results.values())]
    systems += list(PEERS)
    lines = [
        f"# Our default beside the peers users try first ({meta['date']})",
        "",
        f"Command: `{meta['command']}` (ours: `{meta['ours']}`)",
        *[f"Earlier: `{m['command']}` ({m['date']})" for m in meta.get("earlier", [])],
        "",
        "Test AUC (validation log loss in brackets; what each was tuned or stopped on).",
        "",
        "| data | " + " | ".join(systems) + " |",
        "|---|" + "---|" * len(systems),
    ]
    for data, row in results.items():
        cells = [
            f"{row[s]['test_auc']:.4f} ({row[s]['valid_logloss']:.4f})" if s in row else ""
            for s in systems
        ]  # a peer not run on a data set: empty
        lines.append(f"| {data} | " + " | ".join(cells) + " |")
    lines += ["", "| system | mean test AUC | data sets where ours beats it (test AUC) |"]
    lines.append("|---|---|---|")
    for s in systems:
        rows = [r for r in results.values() if s in r]
        wins = sum(
            r["ours: default"]["test_auc"] > r[s]["test_auc"] for r in rows if "ours: default" in r
        )
        auc = np.mean([r[s]["test_auc"] for r in rows])
        lines.append(f"| {s} | {auc:.4f} | {wins} of {len(rows)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from sklearn.metrics import roc_auc_score

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrm-defaults")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated (results merge)")
    args = p.parse_args()
    made = args.out / "defaults.json"
    ours = json.loads(made.read_text()) if made.exists() else {"results": {}}
    ours.setdefault("meta", {"command": "(bench/defaults.py not run)", "date": ""})
    # the data sets bench/defaults.py trained on, as it wrote them
    sets = json.loads((args.work / f"datasets-{args.rows}.json").read_text())
    old = args.out / "peers.json"
    before = json.loads(old.read_text()) if old.exists() else {"results": {}, "meta": {}}
    results = before["results"]  # the peers not run now keep their figures
    for name, (train, test, schema) in sets.items():
        label, feats = schema_of(Path(schema) if schema else None)
        data = load(Path(train), Path(test), label)
        mine = ours["results"].get(name, {}).get("systems", {})
        row = {
            **results.get(name, {}),
            **{f"ours: {k}": mine[k] for k in ("default", "lr") if k in mine},
        }
        for peer in args.peers.split(","):
            t0 = time.perf_counter()
            out = PEERS[peer](data, feats)
            row[peer] = {
                "test_auc": float(roc_auc_score(data["test"]["y"], out["p"])),
                "valid_logloss": float(out["valid_logloss"]),
                "chosen": out["chosen"],
                "wall_s": time.perf_counter() - t0,
            }
            print(f"{name}: {peer}: {row[peer]}", file=sys.stderr, flush=True)
        results[name] = row
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/" + shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "ours": ours["meta"]["command"] + f" ({ours['meta']['date']})",
        "earlier": [
            *before["meta"].get("earlier", []),
            *([before["meta"]] if before["meta"] else []),
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "results": results}
    (args.out / "peers.json").write_text(json.dumps(record, indent=2))
    (args.out / "peers.md").write_text(render(results, meta))
    print(render(results, meta))


if __name__ == "__main__":
    main()
