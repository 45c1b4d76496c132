"""The run's report: ``metrics.json``, ``curves.png`` and the table ``dlrm train`` prints.

``metrics.json`` holds the test AUC and log loss (exact, over the whole test set, scored once on
the model the run keeps), the validation figures of that model and where it was found, the
Bayes-optimal scores when the test file came from ``dlrm data synth``, throughput, the share of
time spent waiting for data, parse throughput, peak RSS, the evaluation history and the config;
distributed runs add all-to-all bytes per sample against the analytical minimum and the step's
time breakdown.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dense_trainer.checkpointing import TrainState
from dense_trainer.plots import plot_curves
from embedding_server.idmap.remap import merge_piece_stats


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_metrics(
    trainer, final: dict, train_files, test_files, finished: bool, cluster_stats: dict | None = None
) -> dict[str, Any]:
    """``metrics.json`` and ``curves.png`` (master only) of ``trainer`` (``train.Trainer``, which
    calls this); returns the metrics."""
    s = trainer.state
    bayes = bayes_beside(test_files)
    metrics: dict[str, Any] = {
        "test_auc": final.get("test_auc"),
        "test_logloss": final.get("test_logloss"),
        "test_rows": final.get("test_rows"),
        **validation_metrics(trainer),
        "train_samples_per_s": s.samples_seen / s.train_seconds if s.train_seconds else math.nan,
        "samples_seen": s.samples_seen,
        "steps": s.step,
        "epochs": trainer.cfg.train.epochs,
        "completed": finished,
        "train_seconds": s.train_seconds,
        "data_wait_share": s.data_wait_seconds / s.train_seconds if s.train_seconds else None,
        "parse_rows_per_s": s.parse_rows / s.parse_seconds if s.parse_seconds else None,
        "malformed_lines": s.bad_lines.get("count", 0),
        "embedding_kernel": trainer.client.kernel,
        "device": str(trainer.device),
        "peak_rss_mb": peak_rss_mb(),
        "bayes_auc": bayes.get("test_auc") if bayes else None,
        "bayes_logloss": bayes.get("test_logloss") if bayes else None,
        "train_files": [str(f) for f in train_files],
        "test_files": [str(f) for f in test_files],
        "history": s.history,
        "config": trainer.cfg.model_dump(mode="json"),
        "trainers": trainer.trainers,
        "embedding_servers": trainer.cluster.roles.num_servers if trainer.cluster else 0,
        "step_time_breakdown_ms": {
            k.removesuffix("_s"): 1e3 * v / max(s.step, 1) for k, v in trainer.timings.items()
        },
    }
    if trainer.is_master:  # what the run's checkpoints wrote, and the fault it resumed from
        done = trainer.checkpoints.finalizer.completed
        metrics["checkpoints"] = {
            "written": len(done),
            "skipped": trainer.checkpoints.skipped,
            "longest_s": max((c["seconds"] for c in done), default=None),
            "last": done[-1] if done else None,
        }
        metrics["resumed_after_fault"] = trainer.resumed
    if cfg_losses := trainer.step_losses:
        metrics["step_losses"] = cfg_losses
    trainers = [r for r in (cluster_stats or {}).get("ranks", []) if "rows_parsed" in r]
    metrics["rows_parsed_by_trainer"] = (
        [r["rows_parsed"] for r in trainers] if trainers else [s.parse_rows]
    )
    if cluster_stats is not None:
        metrics.update(
            cluster_metrics(
                cluster_stats, sum(trainer.client.output_dims()), len(trainer.spec.tables), s
            )
        )
    servers = [r.get("ids", {}) for r in (cluster_stats or {}).get("ranks", []) if "server" in r]
    metrics.update(id_metrics(merge_piece_stats([trainer.client.id_stats(), *servers])))
    if trainer.live is not None:
        metrics["live_updates"] = trainer.live.stats(
            [r["live"] for r in (cluster_stats or {}).get("ranks", []) if "live" in r]
        )
    if not trainer.is_master:
        return metrics
    (trainer.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    score = (
        f"test AUC {final['test_auc']:.4f}"
        if final
        else f"validation AUC {metrics.get('valid_auc') or math.nan:.4f}"
    )
    title = f"{trainer.cfg.model.kind}/{trainer.cfg.model.interaction}: {score}"
    plot_curves(s.history, trainer.out_dir / "curves.png", title, metrics["bayes_auc"])
    return metrics


def id_metrics(stats: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Dynamic tables' id maps (table -> counts): rows in use (admitted ids plus the default row),
    ids admitted and evicted so far, training lookups that read the default row. Empty with no
    dynamic table."""
    if not stats:
        return {}
    pick = lambda key: {name: s[key] for name, s in sorted(stats.items())}  # noqa: E731
    return {
        "embedding_rows_used": pick("rows_used"),
        "embedding_ids_admitted": pick("admitted"),
        "embedding_ids_evicted": pick("evicted"),
        "embedding_default_row_lookups": pick("default_lookups"),
    }


def cluster_metrics(stats: dict, width: int, num_tables: int, state: TrainState) -> dict[str, Any]:
    """All-to-all traffic per sample against the analytical minimum, and the step's breakdown."""
    ranks = stats["ranks"]
    trainer_stats = [r for r in ranks if "client" in r and r["client"]]
    servers = [r for r in ranks if "server" in r]
    samples = max(state.samples_seen, 1)
    out_bytes = sum(r["client"]["bytes_out"] for r in trainer_stats)
    in_bytes = sum(r["client"]["bytes_in"] for r in trainer_stats)
    # width: sum D_t, or C * D'
    minimum = {"ids": 4 * num_tables, "pooled": 4 * width, "gradients": 4 * width}
    steps = max(state.step, 1)
    comm_ms = 1e3 * sum(r["client"]["comm_s"] for r in trainer_stats) / len(trainer_stats) / steps
    cross = sum(r.get("exchange", {}).get("cross_host_bytes", 0) for r in trainer_stats)
    cross += sum(r.get("cross_host_bytes", 0) for r in servers)
    messages = sum(r.get("exchange", {}).get("cross_host_messages", 0) for r in trainer_stats)
    messages += sum(r.get("cross_host_messages", 0) for r in servers)
    return {
        "cross_host_bytes_per_sample": cross / samples,
        "cross_host_messages_per_step": messages / steps,
        "alltoall_bytes_per_sample": {
            "trainers_to_servers": out_bytes / samples,
            "servers_to_trainers": in_bytes / samples,
            "corrections": sum(r["client"].get("correction_bytes", 0) for r in trainer_stats)
            / samples,
            "analytical_minimum": minimum,
            "note": "trainers_to_servers counts ids, bag lengths, headers and gradients (training "
            "and evaluation lookups); the minimum is one int32 id per feature and the "
            "fp32 pooled vectors and their gradients; corrections (exact pipelining: "
            "bags the previous update changed, looked up again) come on top of "
            "servers_to_trainers",
        },
        "server_time_ms_per_step": {
            "lookup": 1e3 * max(r["lookup_s"] for r in servers) / steps if servers else 0.0,
            "update": 1e3 * max(r["update_s"] for r in servers) / steps if servers else 0.0,
            "tower_module": 1e3 * max(r.get("tower_s", 0.0) for r in servers) / steps
            if servers
            else 0.0,
            "correct": 1e3 * max(r.get("correct_s", 0.0) for r in servers) / steps
            if servers
            else 0.0,
        },
        "corrected_bag_share": (
            sum(r.get("corrected_bags", 0.0) for r in servers)
            / max(sum(r.get("bags", 0.0) for r in servers), 1.0)
        ),
        "communication_ms_per_step": comm_ms,
    }


def bayes_beside(test_files: list[Path]) -> dict | None:
    """The generator's ``bayes.json`` next to a single generated test file, if there is one."""
    if len(test_files) != 1:
        return None
    path = Path(test_files[0]).parent / "bayes.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def validation_metrics(trainer) -> dict[str, Any]:
    """The validation figures of the model kept, and where in the run it was found."""
    s, held = trainer.state, trainer.validation
    if held is None:
        return {"validation": None}
    evals = [h for h in s.history if "valid_logloss" in h]
    kept = (
        s.best if trainer.cfg.train.keep_best and s.best is not None else evals[-1] if evals else {}
    )
    return {
        "valid_auc": kept.get("valid_auc"),
        "valid_logloss": kept.get("valid_logloss"),
        "valid_rows": kept.get("valid_rows"),
        "validation": {
            "files": [str(f) for f in held.files],
            "share": held.split.fraction if held.split is not None else None,
            "evaluations": len(evals),
            "kept_step": kept.get("step"),
            "kept_samples": kept.get("samples"),
            "best_step": s.best["step"] if s.best else None,
            "stopped_early_at_step": s.stopped_early,
        },
    }


def format_metrics(m: dict) -> str:
    rows = []
    if m.get("test_auc") is not None:
        rows += [
            ("test AUC", f"{m['test_auc']:.4f}"),
            ("test log loss", f"{m['test_logloss']:.4f}"),
        ]
    if m.get("valid_auc") is not None:
        v = m["validation"]
        rows += [
            ("validation AUC (model kept)", f"{m['valid_auc']:.4f}"),
            ("validation log loss", f"{m['valid_logloss']:.4f}"),
            ("model kept: step", f"{v['kept_step']:,} of {m['steps']:,}"),
        ]
        if v["stopped_early_at_step"] is not None:
            rows.append(("stopped early at step", f"{v['stopped_early_at_step']:,}"))
    if m.get("bayes_auc") is not None:
        rows += [
            ("Bayes-optimal AUC", f"{m['bayes_auc']:.4f}"),
            ("Bayes-optimal log loss", f"{m['bayes_logloss']:.4f}"),
        ]
    rows += [
        ("train samples/s", f"{m['train_samples_per_s']:,.0f}"),
        (
            "parse rows/s (1 thread)",
            f"{m['parse_rows_per_s']:,.0f}" if m.get("parse_rows_per_s") else "-",
        ),
        (
            "time waiting for data",
            f"{100 * m['data_wait_share']:.1f}%" if m.get("data_wait_share") is not None else "-",
        ),
        ("samples seen", f"{m['samples_seen']:,}"),
        ("steps", f"{m['steps']:,}"),
        ("epochs", str(m["epochs"])),
        ("malformed lines skipped", str(m["malformed_lines"])),
        ("embedding kernel", m["embedding_kernel"]),
        ("peak RSS", f"{m['peak_rss_mb']:,.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["| metric" + " " * (width - 6) + " | value |", "|" + "-" * (width + 2) + "|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def id_progress(stats: dict[str, dict[str, int]]) -> dict[str, str]:
    """The progress bar's summary of the dynamic tables (none: nothing)."""
    if not stats:
        return {}
    total = lambda key: sum(s[key] for s in stats.values())  # noqa: E731
    return {
        "rows": f"{total('rows_used'):,}",
        "admitted": f"{total('admitted'):,}",
        "evicted": f"{total('evicted'):,}",
        "default": f"{total('default_lookups'):,}",
    }


class RunningLoss:
    """The progress bar and the running training loss in the history (every 20 steps)."""

    def __init__(self, trainer, initial: int) -> None:
        self.trainer = trainer
        self.loss_sum = torch.zeros((), device=trainer.device)
        self.steps = self.samples = 0
        self.bar = tqdm(
            desc="train",
            unit="samples",
            unit_scale=True,
            disable=not (trainer.cfg.train.progress and trainer.is_master),
            dynamic_ncols=True,
            mininterval=0.5,
            file=sys.stderr,
            initial=initial,
        )

    def add(self, loss: torch.Tensor, b: int, epoch: int) -> None:
        t = self.trainer
        if t.cfg.train.log_step_losses:
            t.step_losses.append(float(loss))
        self.loss_sum += loss * b
        self.steps += 1
        self.samples += b
        if self.steps % 20 == 0 or self.steps == 1:
            running = float(self.loss_sum) / self.samples
            self.bar.set_postfix(
                loss=f"{running:.4f}",
                epoch=epoch,
                **id_progress(t.client.id_stats()),
                refresh=False,
            )
            t.state.history.append({"samples": t.state.samples_seen, "train_loss": running})
            self.loss_sum.zero_()
            self.samples = 0
        self.bar.update(b)

    def close(self) -> None:
        self.bar.close()
