"""``dlrm train`` and ``dlrm data synth``."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from dense_trainer.config import load_config, parse_override
from embedding_server.cli import fill_from_env
from embedding_server.errors import ConfigError

log = logging.getLogger(__name__)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a DLRM on Criteo-layout files",
        description="Train a DLRM on Criteo-layout files (plain or .gz) and write metrics.json, "
        "curves.png and checkpoints to --out. Precedence: flags > --config file > defaults.",
    )
    p.add_argument("--train", nargs="+", type=Path, metavar="FILE", help="training files, read in order (required)")
    p.add_argument("--test", nargs="+", type=Path, metavar="FILE", help="held-out test files (required)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (required)")
    p.add_argument("--config", type=Path, metavar="TOML", help="config file (see configs/)")
    p.add_argument("--epochs", type=int, help="train.epochs")
    p.add_argument("--batch-size", type=int, help="train.batch_size")
    p.add_argument("--embedding-dim", type=int, help="embedding.dim")
    p.add_argument("--hash-size", type=int, help="embedding.hash_size (rows per table, cap)")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--live-store", metavar="URL", help="push changed rows to this serving store while training (live.store)")
    g = p.add_argument_group("disaggregated training (dist.*)")
    g.add_argument("--embedding-servers", type=int, metavar="E", help="embedding-server ranks (0: tables in this process)")
    g.add_argument("--trainers", type=int, metavar="T", help="trainer ranks (data parallel)")
    g.add_argument("--sharding", choices=["auto", "table_wise", "row_wise", "column_wise"], help="table placement")
    g.add_argument("--server-memory", metavar="SIZE", help="memory per embedding server, e.g. 8GB")
    g.add_argument("--exchange-dtype", choices=["fp32", "fp16", "bf16"], help="pooled embeddings/gradients on the wire")
    g.add_argument("--hosts", type=int, metavar="H", help="emulated hosts (0: one per machine)")
    g.add_argument("--topology", metavar="FILE", help='topology file, JSON {"hosts": [[ranks], ...]}')
    g.add_argument("--hierarchical", action="store_true", help="hierarchical (two-level) all-to-all")
    g.add_argument("--towers", metavar="PLAN", help="tower plan file from `dlrm plan-towers` (DMT)")
    g.add_argument("--tower-compress", type=int, metavar="C", help="outputs of every tower module (0: as planned)")
    g.add_argument("--tower-dim", type=int, metavar="D", help="dim of the tower outputs (0: the embedding dim)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set optim.lr=0.002 (repeatable)",
    )
    p.epilog = "Every option may also come from the environment as DLRM_<OPTION>, e.g. DLRM_TRAIN, DLRM_EMBEDDING_SERVERS."
    p.set_defaults(func=run_train, parser=p)


def config_from_args(args: argparse.Namespace):
    fill_from_env(args.parser, args, ["train", "test", "out"])
    overrides = [parse_override(s) for s in args.set]
    flags = {
        ("train", "epochs"): args.epochs,
        ("train", "batch_size"): args.batch_size,
        ("embedding", "dim"): args.embedding_dim,
        ("embedding", "hash_size"): args.hash_size,
        ("data", "strict"): True if args.strict else None,
        ("train", "progress"): False if args.no_progress else None,
        ("live", "store"): args.live_store,
        ("dist", "embedding_servers"): getattr(args, "embedding_servers", None),
        ("dist", "trainers"): getattr(args, "trainers", None),
        ("dist", "sharding"): getattr(args, "sharding", None),
        ("dist", "server_memory"): getattr(args, "server_memory", None),
        ("dist", "exchange_dtype"): getattr(args, "exchange_dtype", None),
        ("dist", "hosts"): getattr(args, "hosts", None),
        ("dist", "topology"): getattr(args, "topology", None),
        ("dist", "hierarchical"): True if getattr(args, "hierarchical", False) else None,
        ("dist", "towers"): getattr(args, "towers", None),
        ("dist", "tower_compress"): getattr(args, "tower_compress", None),
        ("dist", "tower_dim"): getattr(args, "tower_dim", None),
    }
    for (section, key), value in flags.items():
        if value is not None:
            overrides.append({section: {key: value}})
    return load_config(args.config, overrides)


def run_train(args: argparse.Namespace) -> int:
    from dense_trainer.data.criteo import check_files
    from dense_trainer.train import Trainer, prepare_out_dir  # deferred: `dlrm --help` stays fast

    cfg = config_from_args(args)
    if cfg.dist.towers and not cfg.dist.embedding_servers:
        raise ConfigError("--towers needs --embedding-servers: the tower modules run on them (one server per tower at least)")
    # Cheap checks before the tables are allocated.
    check_files(args.train, "training")
    check_files(args.test, "test")
    prepare_out_dir(args.out)
    if cfg.dist.embedding_servers or cfg.dist.trainers > 1:
        from dense_trainer.distributed import launch_local, make_plan

        if not cfg.dist.embedding_servers:
            raise ConfigError("--trainers > 1 needs --embedding-servers (the tables live on them)")
        plan = make_plan(cfg, args.train)  # refuse a model that cannot fit before starting anything
        metrics = launch_local(cfg, args.train, args.test, args.out, args.resume, plan)
    else:
        metrics = Trainer(cfg, args.out).fit(args.train, args.test, resume=args.resume)
    print(format_metrics(metrics))
    return 0


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="one rank of a disaggregated job (launched by torchrun)",
        description="One rank of a disaggregated training job, for torchrun or any launcher that "
        "sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Takes the same flags as `dlrm train` "
        "on every rank; ranks below --trainers train, the others are embedding servers.",
    )
    for action in sub.choices["train"]._actions:  # the same flags as `dlrm train`
        if action.dest != "help":
            p._add_action(action)
    p.set_defaults(func=run_worker_cli, parser=p)


def run_worker_cli(args: argparse.Namespace) -> int:
    from dense_trainer.distributed import run_worker

    cfg = config_from_args(args)
    if not cfg.dist.embedding_servers:
        raise ConfigError("dlrm worker needs --embedding-servers")
    rank = int(os.environ.get("RANK", "-1"))
    if rank < 0:
        raise ConfigError("dlrm worker: RANK is not set (launch it with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    metrics = run_worker(rank, cfg, args.train, args.test, args.out, args.resume)
    if metrics is not None:
        print(format_metrics(metrics))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the sharding plan of the tables over embedding servers")
    p.add_argument("--config", type=Path, metavar="TOML")
    p.add_argument("--embedding-servers", type=int, required=True, metavar="E")
    p.add_argument("--server-memory", metavar="SIZE", help="e.g. 8GB")
    p.add_argument("--sharding", choices=["auto", "table_wise", "row_wise", "column_wise"], default=None)
    p.add_argument("--sample", type=Path, metavar="FILE", help="data file to measure pooling factors on")
    p.add_argument("--hash-size", type=int)
    p.add_argument("--embedding-dim", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from dense_trainer.distributed import make_plan
    from embedding_server.planner import describe_plan

    overrides = [parse_override(s) for s in args.set]
    for (section, key), value in {("dist", "embedding_servers"): args.embedding_servers,
                                  ("dist", "server_memory"): args.server_memory, ("dist", "sharding"): args.sharding,
                                  ("embedding", "hash_size"): args.hash_size, ("embedding", "dim"): args.embedding_dim,
                                  ("train", "batch_size"): args.batch_size}.items():
        if value is not None:
            overrides.append({section: {key: value}})
    cfg = load_config(args.config, overrides)
    if args.sample is not None:
        from dense_trainer.data.criteo import check_files

        check_files([args.sample], "sample")
    from dense_trainer.distributed import pooling_factors

    factors = pooling_factors(cfg, [args.sample]) if args.sample else None  # read the sample once
    plan = make_plan(cfg, factors=factors)
    print(describe_plan(plan, cfg.feature_spec(), cfg.embedding.optimizer.kind, cfg.train.batch_size, factors))
    return 0


def add_plan_towers_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan-towers",
        help="group the features into towers (DMT) and write a plan for `dlrm train --towers`",
        description="Group the sparse features into K towers: strongly interacting features share a "
        "tower (strength from a short warm-up of the flat model on --train), towers balanced by "
        "table memory and lookups. Prints the towers, their balance and the share of interaction "
        "kept inside towers; writes --out. --method random / contiguous make ablation baselines; "
        "a hand-written plan file is accepted by `dlrm train --towers` as it is.",
    )
    p.add_argument("--towers", "-k", type=int, required=True, metavar="K", help="number of towers")
    p.add_argument("--out", type=Path, required=True, metavar="PLAN", help="plan file to write (JSON)")
    p.add_argument("--train", nargs="+", type=Path, metavar="FILE", help="data for the warm-up (needed by --method interaction)")
    p.add_argument("--method", choices=["interaction", "random", "contiguous"], default="interaction")
    p.add_argument("--compress", type=int, metavar="C", help="outputs c_t of every tower module (default: no compression)")
    p.add_argument("--warmup-rows", type=int, default=200_000, metavar="N", help="rows of the warm-up (default 200000)")
    p.add_argument("--slack", type=float, default=0.15, help="allowed cost above the mean tower (default 0.15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=Path, metavar="TOML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.set_defaults(func=run_plan_towers)


def run_plan_towers(args: argparse.Namespace) -> int:
    from dense_trainer.tower_planning import feature_costs, interaction_strength
    from embedding_server import towers

    cfg = load_config(args.config, [parse_override(s) for s in args.set])
    spec = cfg.feature_spec()
    names = [t.name for t in spec.tables]
    if not 1 <= args.towers <= len(names):
        raise ConfigError(f"--towers {args.towers}: must be between 1 and the {len(names)} features")
    if args.compress is not None and args.compress < 1:
        raise ConfigError("--compress must be at least 1")
    factors = None
    strength = None
    if args.train:
        from dense_trainer.data.criteo import check_files
        from dense_trainer.distributed import pooling_factors

        check_files(args.train, "training")
        factors = pooling_factors(cfg, args.train)
        strength = interaction_strength(cfg, args.train, args.warmup_rows)
    elif args.method == "interaction":
        raise ConfigError("--method interaction needs --train (the warm-up measures the interactions)")
    costs = feature_costs(cfg, factors)
    if args.method == "interaction":
        groups = towers.interaction_towers(strength, costs, args.towers, args.slack, args.seed)
    elif args.method == "random":
        groups = towers.random_towers(costs, args.towers, args.seed)
    else:
        groups = towers.contiguous_towers(names, args.towers)
    plan = towers.make_plan(names, groups, args.method, args.compress, strength)
    plan.save(args.out)
    print(towers.describe_towers(plan, spec, costs, strength))
    print(f"\nwrote {args.out}; train with: dlrm train --towers {args.out} --embedding-servers {args.towers} ...")
    return 0


def format_metrics(m: dict) -> str:
    rows = [
        ("test AUC", f"{m['test_auc']:.4f}"),
        ("test log loss", f"{m['test_logloss']:.4f}"),
    ]
    if m.get("bayes_auc") is not None:
        rows += [("Bayes-optimal AUC", f"{m['bayes_auc']:.4f}"), ("Bayes-optimal log loss", f"{m['bayes_logloss']:.4f}")]
    rows += [
        ("train samples/s", f"{m['train_samples_per_s']:,.0f}"),
        ("parse rows/s (1 thread)", f"{m['parse_rows_per_s']:,.0f}" if m.get("parse_rows_per_s") else "-"),
        ("time waiting for data", f"{100 * m['data_wait_share']:.1f}%" if m.get("data_wait_share") is not None else "-"),
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


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="data utilities")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    s = dsub.add_parser(
        "synth",
        help="generate Criteo-layout data from a planted teacher model",
        description="Write DIR/train.txt, DIR/test.txt and DIR/bayes.json (the Bayes-optimal AUC "
        "and log loss of the test split).",
    )
    s.add_argument("--train-rows", type=int, required=True, metavar="N")
    s.add_argument("--test-rows", type=int, required=True, metavar="M")
    s.add_argument("--out", type=Path, required=True, metavar="DIR")
    s.add_argument("--seed", type=int, default=0, metavar="S")
    s.add_argument("--ctr", type=float, default=0.25, help="target click rate (default 0.25)")
    s.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the id laws (default 1.1)")
    s.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from dense_trainer.data.synth import synthesize

    if args.train_rows < 1 or args.test_rows < 1:
        raise ConfigError("--train-rows and --test-rows must be at least 1")
    if not 0 < args.ctr < 1:
        raise ConfigError("--ctr must be between 0 and 1")
    try:
        bayes = synthesize(args.out, args.train_rows, args.test_rows, args.seed, args.ctr, args.zipf)
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(json.dumps(bayes, indent=2))
    return 0
