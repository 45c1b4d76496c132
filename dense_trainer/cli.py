"""``dlrm train`` and ``dlrm data synth``."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from dense_trainer.config import Config, load_config, prepare_config
from dlrm_core.config import add_config_flags, flag_overrides, parse_override
from dlrm_core.env import fill_from_env
from dlrm_core.errors import ConfigError
from dlrm_core.formats import InputReader, check_files

log = logging.getLogger(__name__)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a DLRM on your data (Criteo layout by default)",
        description="Train a DLRM and write metrics.json, curves.png and checkpoints to --out. "
        "Precedence: flags > --set > --config file > defaults. Every config field is a flag "
        "(--section.field, with short aliases for the common ones).",
    )
    add_run_arguments(p)
    p.set_defaults(func=run_train, parser=p)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dlrm train`` and ``dlrm worker``: files, resume, and every config field."""
    p.add_argument(
        "--train",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="training files, read in order (required)",
    )
    p.add_argument(
        "--test", nargs="+", type=Path, metavar="FILE", help="held-out test files (required)"
    )
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (required)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --out"
    )
    add_config_arguments(p)
    p.epilog = (
        "Every option may also come from the environment as DLRM_<OPTION>, e.g. DLRM_TRAIN, "
        "DLRM_EMBEDDING_SERVERS, DLRM_TRAIN_EPOCHS."
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config, --set and one flag per config field."""
    p.add_argument("--config", type=Path, metavar="TOML", help="config file (see configs/)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set optim.lr=0.002 (repeatable)",
    )
    add_config_flags(p, Config)


def config_from_args(args: argparse.Namespace, required: tuple[str, ...] = ()) -> Config:
    """The run's config: defaults < --config file < --set < flags (and their DLRM_* variables)."""
    fill_from_env(args.parser, args, list(required))
    overrides = [parse_override(s) for s in args.set] + flag_overrides(args, Config)
    return load_config(args.config, overrides)


def run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, ("out",))
    if cfg.stream.url:
        return run_train_stream(cfg, args)
    for dest in ("train", "test"):
        if not getattr(args, dest, None):
            raise ConfigError(
                f"--{dest} (or DLRM_{dest.upper()}) is required (or --stream URL: online)"
            )
    if cfg.dist.towers and not cfg.dist.embedding_servers:
        raise ConfigError(
            "--towers needs --embedding-servers: the tower modules run on them (one server per "
            "tower at least)"
        )
    distributed = cfg.dist.embedding_servers or cfg.dist.trainers > 1
    if distributed and not cfg.dist.embedding_servers:
        raise ConfigError("--trainers > 1 needs --embedding-servers (the tables live on them)")
    if distributed:
        from dense_trainer.rank_context import rank_context

        rank_context(start=True)  # the ranks' fork server imports torch while this process checks
    # Cheap checks before torch loads and the tables are allocated: files open, the schema's
    # columns are there (bad flags, configs and files are refused in a fraction of a second).
    check_files(args.train, "training")
    check_files(args.test, "test")
    valid = [Path(f) for f in cfg.train.valid_files]
    if valid:
        check_files(valid, "validation")
    cfg = prepare_config(cfg, args.train)
    InputReader(cfg.feature_spec(), [*args.train, *valid, *args.test]).check()
    from dense_trainer.report import format_metrics
    from dense_trainer.run_setup import prepare_out_dir
    from dense_trainer.train import Trainer

    prepare_out_dir(args.out)
    if distributed:
        from dense_trainer.distributed import launch_local
        from dense_trainer.job_plan import make_plan

        plan = make_plan(cfg, args.train)  # refuse a model that cannot fit before starting anything
        metrics = launch_local(cfg, args.train, args.test, args.out, args.resume, plan)
    else:
        metrics = Trainer(cfg, args.out).fit(args.train, args.test, resume=args.resume)
    print(format_metrics(metrics))
    return 0


def run_train_stream(cfg: Config, args: argparse.Namespace) -> int:
    """``dlrm train --stream URL``: online training, one process (the tables in it)."""
    if args.train or args.test:
        raise ConfigError("--stream trains from the stream: --train / --test are for files")
    if cfg.dist.trainers > 1:
        raise ConfigError("--stream takes one trainer for now (--trainers 1)")
    from dense_trainer.online import stream_config, train_stream

    if cfg.dist.embedding_servers:  # the tables on embedding servers, this process's ranks
        from dense_trainer.distributed import launch_local
        from dense_trainer.rank_context import rank_context
        from dense_trainer.run_setup import prepare_out_dir

        rank_context(start=True)
        prepare_out_dir(args.out)
        m = launch_local(stream_config(cfg), [], [], args.out, args.resume)
    else:
        m = train_stream(cfg, args.out, args.resume)
    fresh = m["freshness_s"]
    print(
        f"trained on {m['rows']:,} rows from {m['stream']} in {m['steps']:,} steps "
        f"({m['rows_per_s'] or 0:,.0f} rows/s); progressive AUC {m['progressive_auc']:.4f}, "
        f"log loss {m['progressive_logloss']:.4f}; trained {fresh['p50'] or 0:.2f}s after the "
        f"event (p50), {fresh['p99'] or 0:.2f}s (p99); dead letters "
        f"{sum(m['dead_letters'].values()):,}; metrics in {args.out / 'metrics.json'}"
    )
    return 0


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="one rank of a disaggregated job (launched by torchrun)",
        description="One rank of a disaggregated training job, for torchrun or any launcher that "
        "sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Takes the same flags as `dlrm train` "
        "on every rank; ranks below --trainers train, the others are embedding servers.",
    )
    add_run_arguments(p)
    p.set_defaults(func=run_worker_cli, parser=p)


def run_worker_cli(args: argparse.Namespace) -> int:
    from dense_trainer.distributed import run_worker

    cfg = prepare_config(config_from_args(args, ("train", "test", "out")), args.train)
    if not cfg.dist.embedding_servers:
        raise ConfigError("dlrm worker needs --embedding-servers")
    rank = int(os.environ.get("RANK", "-1"))
    if rank < 0:
        raise ConfigError(
            "dlrm worker: RANK is not set (launch it with torchrun, or set RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT)"
        )
    metrics = run_worker(rank, cfg, args.train, args.test, args.out, args.resume)
    if metrics is not None:
        from dense_trainer.report import format_metrics

        print(format_metrics(metrics))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print the sharding plan of the tables over embedding servers",
        description="Plan the tables over --embedding-servers E servers (each holding "
        "--server-memory) "
        "and print bytes and expected lookups per server; a model that cannot fit is refused, "
        "naming the table and the shortfall.",
    )
    p.add_argument(
        "--sample", type=Path, metavar="FILE", help="data file to measure pooling factors on"
    )
    add_config_arguments(p)
    p.set_defaults(func=run_plan, parser=p)


def run_plan(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.dist.embedding_servers < 1:
        raise ConfigError("dlrm plan needs --embedding-servers E (at least 1)")
    if args.sample is not None:
        check_files([args.sample], "sample")
        cfg = prepare_config(cfg, [args.sample])
    from dense_trainer.job_plan import make_plan, pooling_factors  # torch: after the checks
    from embedding_server.planner import describe_plan, table_factors

    factors = pooling_factors(cfg, [args.sample]) if args.sample else None  # read the sample once
    plan = make_plan(cfg, factors=factors)
    spec = cfg.feature_spec()
    print(
        describe_plan(
            plan,
            spec,
            cfg.embedding.optimizer.kind,
            cfg.train.batch_size,
            table_factors(spec, factors),
        )
    )
    return 0


def add_plan_towers_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan-towers",
        help="group the features into towers (DMT) and write a plan for `dlrm train --towers`",
        description="Group the sparse features into K towers: strongly interacting features share "
        "a "
        "tower (strength from a short warm-up of the flat model on --train), towers balanced by "
        "table memory and lookups. Prints the towers, their balance and the share of interaction "
        "kept inside towers; writes --out. --method random / contiguous make ablation baselines; "
        "a hand-written plan file is accepted by `dlrm train --towers` as it is.",
    )
    p.add_argument("--towers", "-k", type=int, required=True, metavar="K", help="number of towers")
    p.add_argument(
        "--out", type=Path, required=True, metavar="PLAN", help="plan file to write (JSON)"
    )
    p.add_argument(
        "--train",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="data for the warm-up (needed by --method interaction)",
    )
    p.add_argument(
        "--method", choices=["interaction", "random", "contiguous"], default="interaction"
    )
    p.add_argument(
        "--compress",
        type=int,
        metavar="C",
        help="outputs c_t of every tower module (default: no compression)",
    )
    p.add_argument(
        "--warmup-rows",
        type=int,
        default=200_000,
        metavar="N",
        help="rows of the warm-up (default 200000)",
    )
    p.add_argument(
        "--slack", type=float, default=0.15, help="allowed cost above the mean tower (default 0.15)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_config_arguments(p)
    p.set_defaults(func=run_plan_towers, parser=p)


def run_plan_towers(args: argparse.Namespace) -> int:
    import numpy as np

    from dense_trainer.tower_planning import feature_costs, interaction_strength
    from embedding_server.towers import partition, report

    cfg = config_from_args(args)
    if args.train:
        check_files(args.train, "training")
        cfg = prepare_config(cfg, args.train)
    spec = cfg.feature_spec()
    names = spec.sparse_names
    # Features sharing a table must share a tower: they are partitioned as one unit.
    units = [
        [f for f, t in enumerate(spec.feature_tables) if t == table]
        for table in dict.fromkeys(spec.feature_tables)
    ]
    if not 1 <= args.towers <= len(units):
        raise ConfigError(
            f"--towers {args.towers}: must be between 1 and the {len(units)} features "
            "(features sharing a table count once)"
        )
    if args.compress is not None and args.compress < 1:
        raise ConfigError("--compress must be at least 1")
    factors = None
    strength = None
    if args.train:
        from dense_trainer.job_plan import pooling_factors

        factors = pooling_factors(cfg, args.train)
        strength = interaction_strength(cfg, args.train, args.warmup_rows)
    elif args.method == "interaction":
        raise ConfigError(
            "--method interaction needs --train (the warm-up measures the interactions)"
        )
    costs = feature_costs(cfg, factors)
    unit_costs = np.array([costs[u].sum() for u in units])
    if args.method == "interaction":
        unit_strength = np.array(
            [
                [strength[np.ix_(a, b)].sum() if i != j else 0.0 for j, b in enumerate(units)]
                for i, a in enumerate(units)
            ]
        )
        unit_groups = partition.interaction_towers(
            unit_strength, unit_costs, args.towers, args.slack, args.seed
        )
    elif args.method == "random":
        unit_groups = partition.random_towers(unit_costs, args.towers, args.seed)
    else:
        unit_groups = partition.contiguous_towers([str(u) for u in range(len(units))], args.towers)
    groups = [sorted(f for u in group for f in units[u]) for group in unit_groups]
    plan = report.make_plan(names, groups, args.method, args.compress, strength)
    plan.save(args.out)
    print(report.describe_towers(plan, spec, costs, strength))
    print(
        f"\nwrote {args.out}; train with: dlrm train --towers {args.out} --embedding-servers "
        f"{args.towers} ..."
    )
    return 0
