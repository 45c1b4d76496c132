"""The ``dlrm`` command: one entry point, one subcommand per job.

Errors meant for the user (bad flags, config typos, missing or malformed files, corrupt
checkpoints) end the command with one line on stderr and a non-zero exit status; set
``DLRM_DEBUG=1`` to see the traceback as well.
"""

from __future__ import annotations

import argparse
import os
import sys

from dlrm_core.errors import DlrmError
from dlrm_core.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    from api.cli import add_serve_parser
    from dense_trainer.cli import (
        add_plan_parser,
        add_plan_towers_parser,
        add_train_parser,
        add_worker_parser,
    )
    from dense_trainer.data.cli import add_data_parser
    from dense_trainer.data.stream.cli import add_stream_parser
    from dense_trainer.tune import add_tune_parser
    from embedding_server.cli import add_publish_parser, add_store_parser

    parser = argparse.ArgumentParser(
        prog="dlrm", description="Disaggregated DLRM training and serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(sub)
    add_tune_parser(sub)
    add_worker_parser(sub)
    add_plan_parser(sub)
    add_plan_towers_parser(sub)
    add_data_parser(sub)
    add_stream_parser(sub)
    add_publish_parser(sub)
    add_store_parser(sub)
    add_serve_parser(sub)
    return parser


def exit_status(code: int) -> int:
    """The status of a failed command (ending the process at once while a checkpoint writer is
    busy: see ``embedding_server.checkpoint.writer.exit_status``)."""
    if "embedding_server.checkpoint.writer" not in sys.modules:
        return code
    from embedding_server.checkpoint.writer import exit_status as writer_exit_status

    return writer_exit_status(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except DlrmError as exc:
        if os.environ.get("DLRM_DEBUG"):
            raise
        print(f"dlrm {args.command}: error: {exc}", file=sys.stderr)
        return exit_status(2)
    except BrokenPipeError:  # e.g. `dlrm ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as exc:
        print(f"dlrm {args.command}: {exc or 'interrupted'}", file=sys.stderr)
        return exit_status(130)


if __name__ == "__main__":
    sys.exit(main())
