"""``dlrm stream``: event streams for online training (``dlrm stream replay``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dlrm_core.secrets import redact_url


def add_stream_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stream", help="event streams for online training")
    ssub = p.add_subparsers(dest="stream_command", required=True, metavar="COMMAND")
    r = ssub.add_parser(
        "replay",
        help="publish a file's rows into the impression and click streams at a rate",
        description="Each row becomes an impression entry (its columns, an impression_id); a "
        "row labelled 1 also becomes a click entry CLICK_DELAY seconds later. Any input format "
        "the trainer reads (Criteo TSV, CSV / TSV with a header, Parquet).",
    )
    r.add_argument("files", type=Path, nargs="+", metavar="FILE")
    r.add_argument(
        "--url", default="redis://127.0.0.1:6379/0", help="the Redis holding the streams"
    )
    r.add_argument("--rate", type=float, default=1000.0, help="rows per second (default 1000)")
    r.add_argument("--click-delay", type=float, default=2.0, metavar="S", help="seconds (2)")
    r.add_argument("--label", default="label", help="the label column (default label)")
    r.add_argument("--impressions", default="impressions", help="impression stream name")
    r.add_argument("--clicks", default="clicks", help="click stream name")
    r.add_argument("--max-rows", type=int, default=0, metavar="N", help="stop after N rows")
    r.add_argument("--run", default="r", help="prefix of the impression ids (default r)")
    r.add_argument(
        "--backfill",
        action="store_true",
        help="write every row at once, as a log of the past (entry times as --rate would space "
        "them, the last one now): a backlog for benchmarks and tests",
    )
    r.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    from dense_trainer.data.stream.replay import replay

    stats = replay(
        args.files,
        args.url,
        args.impressions,
        args.clicks,
        args.label,
        args.rate,
        args.click_delay,
        args.max_rows,
        args.run,
        backfill=args.backfill,
    )
    print(
        f"replayed {stats.impressions:,} impressions and {stats.clicks:,} clicks into "
        f"{redact_url(args.url)} ({args.impressions}, {args.clicks}) in {stats.seconds:.1f}s"
    )
    return 0
