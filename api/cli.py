"""``dlrm serve``: the REST endpoint on uvicorn."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a published model over HTTP",
        description="Serve the current version of a serving store (FastAPI on uvicorn). Every "
        "option can also be set by its DLRM_* environment variable (see api/settings.py).",
    )
    p.add_argument("--store", help="file://DIR or redis://[:password@]host:port/db (DLRM_STORE)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="worker processes (each has its own row cache)")
    p.add_argument("--model-name", help="served model name (DLRM_MODEL_NAME, default dlrm)")
    p.add_argument("--cache-mb", type=float, help="hot-row cache per worker (DLRM_CACHE_MB, default 256)")
    p.add_argument("--max-instances", type=int, help="largest batch per request (DLRM_MAX_INSTANCES, default 4096)")
    p.add_argument("--api-key-file", type=Path, help="require this bearer key (DLRM_API_KEY_FILE or DLRM_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.settings import Settings
    from dlrm_core.errors import ConfigError

    env = {
        "DLRM_STORE": args.store,
        "DLRM_MODEL_NAME": args.model_name,
        "DLRM_CACHE_MB": args.cache_mb,
        "DLRM_MAX_INSTANCES": args.max_instances,
        "DLRM_API_KEY_FILE": args.api_key_file,
    }
    for key, value in env.items():
        if value is not None:
            os.environ[key] = str(value)  # workers read their settings from the environment
    try:
        settings = Settings()
        settings.resolved_api_key()
    except (OSError, IndexError) as exc:
        raise ConfigError(f"--api-key-file: cannot read a key ({exc})") from None
    except ValueError as exc:
        raise ConfigError(f"serving settings: {exc}") from None
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    uvicorn.run(
        "api.main:app", host=args.host, port=args.port, workers=args.workers,
        log_level=args.log_level, access_log=False,
    )
    return 0
