"""Test AUC and log loss on held-out data, in one run: our default config, a logistic-regression
baseline (same trainer, hashed features) and a plain PyTorch DLRM (26 nn.EmbeddingBag +
SparseAdam, same data through the same reader and hashing, one epoch), on

* the real Criteo sample (../shared/data/criteo-wideresdnn: 8,000 rows to train, 2,000 to test);
* 500k generated planted-teacher rows (100k test rows), beside the teacher's Bayes-optimal AUC.

Usage: python bench/quality.py [--synth-rows 500000]. Writes bench/results/quality.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from plain_dlrm import PlainDLRM  # noqa: E402

from dense_trainer.config import Config, load_config  # noqa: E402
from dense_trainer.data.loader import BatchLoader  # noqa: E402
from dense_trainer.data.synth import synthesize  # noqa: E402
from dense_trainer.metrics import log_loss_from_logits, roc_auc  # noqa: E402
from dense_trainer.train import Trainer  # noqa: E402

PLAIN_LR = 1e-3  # SparseAdam's and Adam's default


def run_ours(cfg: Config, train: Path, test: Path) -> dict:
    m = Trainer(cfg, Path(tempfile.mkdtemp())).fit([train], [test])
    return {k: m[k] for k in ("test_auc", "test_logloss", "train_samples_per_s", "samples_seen")}


def run_plain(cfg: Config, train: Path, test: Path, init_scale: float | None = None) -> dict:
    """The plain PyTorch DLRM with the default config's shape and batch size, fed by our reader.

    Its tables start as the DLRM reference initialises them (uniform +-sqrt(1/rows)) unless
    ``init_scale`` is given.
    """
    torch.manual_seed(cfg.train.seed)
    spec = cfg.feature_spec()
    model = PlainDLRM([t.rows for t in spec.tables], cfg.embedding.dim,
                      cfg.model.dense_arch_layer_sizes, cfg.model.over_arch_layer_sizes,
                      init_scale=init_scale)
    opts = model.optimizers(PLAIN_LR, PLAIN_LR)
    seen, t0 = 0, time.perf_counter()
    for batch in BatchLoader([train], spec, cfg.train.batch_size):
        logits = model(batch.dense, batch.sparse.values, batch.sparse.offsets)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        seen += batch.batch_size
    elapsed = time.perf_counter() - t0
    z, y = [], []
    with torch.no_grad():
        for batch in BatchLoader([test], spec, cfg.train.eval_batch_size):
            z.append(model(batch.dense, batch.sparse.values, batch.sparse.offsets).numpy())
            y.append(batch.labels.numpy())
    z, y = np.concatenate(z), np.concatenate(y)
    return {"test_auc": roc_auc(z, y), "test_logloss": log_loss_from_logits(z, y),
            "train_samples_per_s": seen / elapsed, "samples_seen": seen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synth-rows", type=int, default=500_000)
    p.add_argument("--synth-test-rows", type=int, default=100_000)
    p.add_argument("--criteo", type=Path, default=REPO.parent / "shared" / "data" / "criteo-wideresdnn")
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()

    quiet = [{"train": {"progress": False, "checkpoint_every_steps": 0}}]
    default = load_config(None, quiet)
    lr = load_config(None, quiet + [{"model": {"kind": "lr"}}])
    synth = args.work / f"synth-{args.synth_rows}"
    if not (synth / "bayes.json").exists():
        print(f"generating {args.synth_rows:,} rows into {synth}", file=sys.stderr)
        synthesize(synth, args.synth_rows, args.synth_test_rows, seed=0)
    datasets = {
        "criteo-sample": (args.criteo / "train.txt", args.criteo / "test.txt", None),
        f"generated-{args.synth_rows // 1000}k": (
            synth / "train.txt", synth / "test.txt", json.loads((synth / "bayes.json").read_text())),
    }
    results = {}
    for name, (train, test, bayes) in datasets.items():
        if not train.exists():
            print(f"skipping {name}: {train} not found", file=sys.stderr)
            continue
        row = {}
        systems = [
            ("ours (default config)", lambda: run_ours(default, train, test)),  # noqa: B023
            ("logistic regression (same trainer)", lambda: run_ours(lr, train, test)),  # noqa: B023
            ("plain PyTorch DLRM (EmbeddingBag + SparseAdam)", lambda: run_plain(default, train, test)),  # noqa: B023
            (f"plain PyTorch DLRM, our init (+-{default.embedding.init_scale})",
             lambda: run_plain(default, train, test, default.embedding.init_scale)),  # noqa: B023
        ]
        for system, fn in systems:
            print(f"{name}: {system}", file=sys.stderr, flush=True)
            row[system] = fn()
        if bayes:
            row["Bayes-optimal (teacher)"] = {"test_auc": bayes["test_auc"], "test_logloss": bayes["test_logloss"]}
        results[name] = row
    out = {"results": results, "date": time.strftime("%Y-%m-%d %H:%M"), "plain_lr": PLAIN_LR,
           "default_config": default.model_dump(mode="json")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(out, indent=2) + "\n")
    md = render(out)
    (args.out / "quality.md").write_text(md)
    print(md)


def render(out: dict) -> str:
    lines = [f"Held-out quality, one epoch each ({out['date']})", "",
             "| data | model | test AUC | test log loss | train samples/s |", "|---|---|---:|---:|---:|"]
    for data, rows in out["results"].items():
        for system, r in rows.items():
            sps = f"{r['train_samples_per_s']:,.0f}" if "train_samples_per_s" in r else "-"
            lines.append(f"| {data} | {system} | {r['test_auc']:.4f} | {r['test_logloss']:.4f} | {sps} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
