"""``dlrm data``: data utilities (``synth``: generated data from a planted teacher, plain or
drifting; ``schema``: a config's schema inferred from a sample of the user's files)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dense_trainer.config import load_config
from dlrm_core.errors import ConfigError


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="data utilities")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    s = dsub.add_parser(
        "synth",
        help="generate data from a planted teacher model (Criteo layout, or a CSV/TSV/Parquet "
        "table)",
        description="Write DIR/train.txt, DIR/test.txt and DIR/bayes.json (the Bayes-optimal AUC "
        "and log loss of the test split). With --format csv|tsv|parquet: a user-style table "
        "(string ids, the label in the middle, empty cells, a multi-hot column) in "
        "DIR/train.EXT, DIR/test.EXT, with DIR/schema.toml, the config that reads it.",
    )
    s.add_argument("--train-rows", type=int, required=True, metavar="N")
    s.add_argument("--test-rows", type=int, required=True, metavar="M")
    s.add_argument("--out", type=Path, required=True, metavar="DIR")
    s.add_argument("--seed", type=int, default=0, metavar="S")
    s.add_argument(
        "--format",
        choices=["criteo", "csv", "tsv", "parquet"],
        default="criteo",
        help="criteo (default): the Criteo TSV layout; csv, tsv, parquet: a generic table",
    )
    s.add_argument(
        "--ctr",
        type=float,
        default=None,
        help="target click rate (default 0.25 criteo, 0.2 tables)",
    )
    s.add_argument(
        "--zipf", type=float, default=1.1, help="Zipf exponent of the id laws (default 1.1)"
    )
    s.add_argument(
        "--drift",
        type=int,
        default=0,
        metavar="K",
        help="a drifting click log (Criteo layout): the training rows in K segments, "
        "DIR/segment-NNN.txt in time order, preferences moving and new ids arriving between "
        "them; DIR/drift.json holds each segment's Bayes-optimal AUC",
    )
    s.add_argument(
        "--drift-change",
        type=float,
        default=0.5,
        metavar="R",
        help="share of each value's preference variance drawn anew per segment (default 0.5)",
    )
    s.add_argument(
        "--drift-new-ids",
        type=float,
        default=0.2,
        metavar="R",
        help="share of each vocabulary replaced by new ids per segment (default 0.2)",
    )
    s.set_defaults(func=run_synth)
    c = dsub.add_parser(
        "schema",
        help="infer a config's schema ([[features]]) from a sample of your data",
        description="Read the first rows of FILE(s) (CSV, TSV, Criteo TSV or Parquet, plain or "
        "gzip), "
        "decide for every column whether it is ignored, dense or categorical (and why), print the "
        "decisions as a markdown table and write --out, a config that `dlrm train --config` takes "
        "as it is. --ignore, --categorical and --dense override the guesses.",
    )
    c.add_argument(
        "files",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="data files (the first ones are sampled)",
    )
    c.add_argument(
        "--label", required=True, metavar="COL", help="the 0/1 label column (a name, or a number)"
    )
    c.add_argument(
        "--ignore", nargs="+", default=[], metavar="COL", help="columns that are not features"
    )
    c.add_argument(
        "--categorical", nargs="+", default=[], metavar="COL", help="columns to make categorical"
    )
    c.add_argument("--dense", nargs="+", default=[], metavar="COL", help="columns to make dense")
    c.add_argument(
        "--sample-rows", type=int, default=100_000, metavar="N", help="rows read (default 100000)"
    )
    c.add_argument(
        "--format",
        choices=["auto", "csv", "tsv", "parquet", "criteo"],
        default="auto",
        help="input format (default auto: by extension and content)",
    )
    c.add_argument(
        "--max-rows",
        type=int,
        default=1_000_000,
        metavar="R",
        help="cap of a table's rows (default 1000000)",
    )
    c.add_argument(
        "--missing-flags",
        action="store_true",
        help="give each dense column with gaps a missing flag, an input of its own (helps a "
        "logistic regression; the default DLRM neither gains nor loses)",
    )
    c.add_argument(
        "--out", type=Path, required=True, metavar="CONFIG.toml", help="config file to write"
    )
    c.set_defaults(func=run_schema)


def run_synth(args: argparse.Namespace) -> int:
    from dense_trainer.data.synth import synthesize
    from dense_trainer.data.synth_table import synthesize_table

    if args.train_rows < 1 or args.test_rows < 1:
        raise ConfigError("--train-rows and --test-rows must be at least 1")
    table = args.format != "criteo"
    ctr = args.ctr if args.ctr is not None else 0.2 if table else 0.25
    if not 0 < ctr < 1:
        raise ConfigError("--ctr must be between 0 and 1")
    if args.drift:
        return _run_drift(args, table, ctr)
    try:
        if table:
            bayes = synthesize_table(
                args.out, args.train_rows, args.test_rows, args.seed, args.format, ctr, args.zipf
            )
        else:
            bayes = synthesize(args.out, args.train_rows, args.test_rows, args.seed, ctr, args.zipf)
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(json.dumps(bayes, indent=2))
    return 0


def _run_drift(args: argparse.Namespace, table: bool, ctr: float) -> int:
    from dense_trainer.data.drift import synthesize_drifting

    if table:
        raise ConfigError("--drift writes the Criteo layout (leave out --format)")
    if args.drift < 2 or args.train_rows < args.drift:
        raise ConfigError("--drift K: at least 2 segments, and --train-rows at least K")
    if not (0 <= args.drift_change <= 1 and 0 <= args.drift_new_ids <= 1):
        raise ConfigError("--drift-change and --drift-new-ids must be between 0 and 1")
    try:
        record = synthesize_drifting(
            args.out,
            args.train_rows,
            args.test_rows,
            args.drift,
            args.seed,
            ctr,
            args.zipf,
            args.drift_change,
            args.drift_new_ids,
        )
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(json.dumps(record, indent=2))
    return 0


def run_schema(args: argparse.Namespace) -> int:
    """Infer the schema, write --out (checked to load as `dlrm train` loads it), print the table."""
    import shlex

    from dlrm_core.schema_inference import infer_schema

    schema = infer_schema(
        args.files,
        args.label,
        args.ignore,
        args.categorical,
        args.dense,
        args.sample_rows,
        args.format,
        args.max_rows,
        args.missing_flags,
    )
    flags = [
        ("--ignore", args.ignore),
        ("--categorical", args.categorical),
        ("--dense", args.dense),
    ]
    command = shlex.join(
        [
            "dlrm",
            "data",
            "schema",
            *map(str, args.files),
            "--label",
            args.label,
            *[a for flag, cols in flags if cols for a in (flag, *cols)],
            *(["--sample-rows", str(args.sample_rows)] if args.sample_rows != 100_000 else []),
            *(["--format", args.format] if args.format != "auto" else []),
            *(["--max-rows", str(args.max_rows)] if args.max_rows != 1_000_000 else []),
            *(["--missing-flags"] if args.missing_flags else []),
            "--out",
            str(args.out),
        ]
    )
    try:
        args.out.write_text(schema.to_toml(command))
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: {exc.strerror or exc}") from None
    load_config(args.out).feature_spec()  # what `dlrm train --config` will do with it
    print(schema.markdown())
    print(
        f"\nwrote {args.out}; train with: dlrm train --config {args.out} --train "
        f"{shlex.join(map(str, args.files))} "
        "--test TEST_FILES --out DIR"
    )
    return 0
