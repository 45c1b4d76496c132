"""``dlrm tune``: a hyper-parameter search on the validation rows (Optuna: TPE sampling, median
pruning of bad trials, a trial count and a wall-time budget).

Every trial is a ``dlrm train`` run of the user's config with the trial's settings, scored by the
validation log loss of the model it keeps (``best_model.py``); a trial whose validation log loss
falls behind the median of earlier trials at the same evaluation is stopped there (pruned). The
search never reads a test file: it takes none. It writes, into ``--out``:

    best.toml     the whole config of the best trial: ``dlrm train --config best.toml``
                  reproduces its validation figures
    trials.csv    one row per trial: its settings, validation AUC and log loss, state, seconds
    best.json     the best trial's settings and figures

The search space (:func:`suggest`): both learning rates and their per-epoch decay, the embedding
dim, the batch size, the interaction (dot or DCN-v2), the wide part, the MLP sizes, over-arch
dropout, embedding and dense weight decay, and the epochs.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import tomli_w

log = logging.getLogger(__name__)

MLPS = {
    "small": ([64, 32], [64, 32]),
    "medium": ([128, 64], [256, 128]),
    "default": ([512, 256, 64], [512, 256]),
}
"""Sizes of the bottom and top MLPs a trial may take."""


def suggest(trial) -> dict[str, Any]:
    """The trial's settings, as nested config overrides (and flat, for the trials table)."""
    mlp = trial.suggest_categorical("mlp", list(MLPS))
    decay = trial.suggest_categorical("embedding_decay_on", [False, True])
    return {
        "embedding": {
            "dim": trial.suggest_categorical("embedding_dim", [8, 16, 32]),
            "optimizer": {
                "lr": trial.suggest_float("embedding_lr", 0.01, 0.5, log=True),
                "weight_decay": trial.suggest_float("embedding_decay", 1e-5, 3e-3, log=True)
                if decay
                else 0.0,
            },
        },
        "optim": {
            "lr": trial.suggest_float("dense_lr", 3e-4, 1e-2, log=True),
            "weight_decay": trial.suggest_float("dense_decay", 1e-8, 1e-4, log=True),
        },
        "model": {
            "interaction": trial.suggest_categorical("interaction", ["dot", "dcn"]),
            "wide": trial.suggest_categorical("wide", [True, False]),
            "dense_arch_layer_sizes": MLPS[mlp][0],
            "over_arch_layer_sizes": MLPS[mlp][1],
            "dropout": trial.suggest_float("dropout", 0.0, 0.3),
        },
        "schedule": {
            "decay": "epoch",
            "epoch_gamma": trial.suggest_float("epoch_gamma", 0.3, 1.0),
        },
        "train": {
            "batch_size": trial.suggest_categorical("batch_size", [256, 512, 1024, 2048]),
            "epochs": trial.suggest_int("epochs", 1, 5),
        },
    }


def config_toml(cfg) -> str:
    """A config as TOML that ``load_config`` reads back to the same config."""
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))


class Search:
    """One study over ``cfg`` (a ``Config``) trained on ``train`` files, written into ``out``."""

    def __init__(self, cfg, train: list[Path], out: Path, trials: int, timeout_s: float) -> None:
        if cfg.train.validation <= 0 and not cfg.train.valid_files:
            from dlrm_core.errors import ConfigError

            raise ConfigError("dlrm tune needs validation rows: train.validation > 0 or --valid")
        self.cfg, self.train, self.out = cfg, list(train), Path(out)
        self.trials, self.timeout_s = trials, timeout_s
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    def objective(self, trial) -> float:
        import optuna

        from dense_trainer.config import load_config
        from dense_trainer.train import Trainer

        base = self.cfg.model_dump(mode="json", exclude_none=True)
        cfg = load_config(None, [base, suggest(trial), {"train": {"progress": False}}])
        run = self.out / "trials" / f"{trial.number:03d}"
        trainer = Trainer(cfg, run)
        pruned = []

        def report(result: dict, step: int) -> bool:
            trial.report(result["valid_logloss"], len(pruned))
            pruned.append(trial.should_prune())
            return pruned[-1]  # stop this trial's training: its model so far is kept

        trainer.best.on_evaluation = report
        t0 = time.monotonic()
        try:
            m = trainer.fit(self.train, [])
        finally:
            shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a trial's tables: not kept
        (run / "config.toml").write_text(config_toml(cfg))
        row = {
            "trial": trial.number,
            **trial.params,
            "valid_auc": m["valid_auc"],
            "valid_logloss": m["valid_logloss"],
            "steps": m["steps"],
            "seconds": round(time.monotonic() - t0, 1),
            "state": "pruned" if any(pruned) else "complete",
        }
        self.rows.append(row)
        self._progress(row)
        if any(pruned):
            raise optuna.TrialPruned()
        return m["valid_logloss"]

    def _progress(self, row: dict) -> None:
        done = [r for r in self.rows if r["state"] == "complete"]
        best = min(done, key=lambda r: r["valid_logloss"]) if done else None
        tail = (
            f"best {best['valid_logloss']:.5f} (trial {best['trial']})" if best else "no best yet"
        )
        print(
            f"trial {row['trial'] + 1}/{self.trials}: valid AUC {row['valid_auc']:.4f}, "
            f"log loss {row['valid_logloss']:.5f}, {row['state']}, {row['seconds']:.0f}s; {tail}; "
            f"{time.monotonic() - self.t0:.0f}s elapsed",
            flush=True,
        )

    def run(self) -> dict:
        """Run the study; write best.toml, best.json and trials.csv; return the best row."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.out.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=self.cfg.train.seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
        )
        study.optimize(
            self.objective, n_trials=self.trials, timeout=self.timeout_s or None, catch=()
        )
        done = [r for r in self.rows if r["state"] == "complete"]
        if not done:
            from dlrm_core.errors import DlrmError

            raise DlrmError("dlrm tune: no trial completed (raise --trials or --timeout)")
        best = min(done, key=lambda r: r["valid_logloss"])
        chosen = self.out / "trials" / f"{best['trial']:03d}" / "config.toml"
        shutil.copyfile(chosen, self.out / "best.toml")
        (self.out / "best.json").write_text(json.dumps(best, indent=2) + "\n")
        with open(self.out / "trials.csv", "w", newline="") as f:
            keys = list(dict.fromkeys(k for r in self.rows for k in r))
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        return best


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    from dense_trainer.cli import add_config_arguments

    p = sub.add_parser(
        "tune",
        help="search hyper-parameters on the validation rows (never the test set)",
        description="Train --trials models of your config with other settings (learning rates "
        "and their per-epoch decay, embedding dim, batch size, interaction, the wide part, MLP "
        "sizes, dropout, weight decay, epochs), each scored "
        "on the validation rows, bad ones pruned early; write the best trial's whole config to "
        "OUT/best.toml (`dlrm train --config OUT/best.toml` reproduces it) and the trial table "
        "to OUT/trials.csv. It takes no test files.",
    )
    p.add_argument("--train", nargs="+", type=Path, metavar="FILE", help="training files")
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (required)")
    p.add_argument("--trials", type=int, default=20, help="trials at most (default 20)")
    p.add_argument(
        "--timeout", type=float, default=0.0, metavar="S", help="wall-time budget (0: none)"
    )
    add_config_arguments(p)
    p.set_defaults(func=run_tune, parser=p)


def run_tune(args: argparse.Namespace) -> int:
    from dense_trainer.cli import config_from_args
    from dlrm_core.errors import ConfigError
    from dlrm_core.formats import InputReader, check_files

    cfg = config_from_args(args, ("train", "out"))
    if args.trials < 1 or args.timeout < 0 or not math.isfinite(args.timeout):
        raise ConfigError("--trials must be >= 1 and --timeout >= 0")
    if cfg.dist.embedding_servers or cfg.dist.trainers > 1:
        raise ConfigError("dlrm tune trains each trial in one process (no --embedding-servers)")
    check_files(args.train, "training")
    InputReader(cfg.feature_spec(), list(args.train)).check()
    best = Search(cfg, args.train, args.out, args.trials, args.timeout).run()
    print(
        f"best: trial {best['trial']}, valid AUC {best['valid_auc']:.4f}, log loss "
        f"{best['valid_logloss']:.5f}; config: {args.out / 'best.toml'}"
    )
    return 0
