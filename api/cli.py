"""``dlrm serve``: the REST endpoint on uvicorn.

With several workers, Prometheus runs in multiprocess mode: a fresh directory (or
``PROMETHEUS_MULTIPROC_DIR`` when set, emptied first) holds every worker's metric files, so
``/metrics`` and readiness answer for all workers, whichever one a connection reaches.
"""

from __future__ import annotations

import argparse
import glob
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger("api")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a published model over HTTP",
        description="Serve the current version of a serving store (FastAPI on uvicorn): KServe V1 "
        "(/v1/models/NAME:predict) and the Open Inference Protocol (/v2/models/NAME/infer). Every "
        "option can also be set by its DLRM_* environment variable (see api/settings.py).",
    )
    p.add_argument(
        "--store", help="file://DIR, redis://[user@]host:port/db or rediss://... (DLRM_STORE)"
    )
    p.add_argument(
        "--store-password-file", type=Path, help="the store's password (DLRM_STORE_PASSWORD_FILE)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--workers", type=int, default=1, help="worker processes (each has its own row cache)"
    )
    p.add_argument("--model-name", help="served model name (DLRM_MODEL_NAME, default dlrm)")
    p.add_argument(
        "--cache-mb", type=float, help="hot-row cache per worker (DLRM_CACHE_MB, default 256)"
    )
    p.add_argument(
        "--max-instances",
        type=int,
        help="largest batch per request (DLRM_MAX_INSTANCES, default 4096)",
    )
    p.add_argument(
        "--max-ids-per-request",
        type=int,
        help="most categorical ids per request, else 413 (DLRM_MAX_IDS_PER_REQUEST, default "
        "262144)",
    )
    p.add_argument(
        "--batching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="coalesce concurrent requests into one model call (DLRM_BATCHING, default on)",
    )
    p.add_argument(
        "--batch-max-size",
        type=int,
        help="most examples per model call (DLRM_BATCH_MAX_SIZE, default 256)",
    )
    p.add_argument(
        "--batch-max-delay-us",
        type=int,
        help="longest wait for requests on their way (DLRM_BATCH_MAX_DELAY_US, default 1000)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="bearer keys, one per line, re-read on change (DLRM_API_KEY_FILE or DLRM_API_KEY)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        default=None,
        help="serve without keys, explicitly (DLRM_NO_AUTH); without keys and without it, "
        "only a loopback --host is allowed",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        help="a request's headers must arrive within this (DLRM_HEADER_TIMEOUT_S, default 10)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one log line per request (DLRM_ACCESS_LOG, default on: ~40 µs/request served)",
    )
    p.add_argument("--log-format", choices=["text", "json"], help="DLRM_LOG_FORMAT (default text)")
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=run_serve)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) binds to loopback only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except (OSError, ValueError):
            return False


def _metrics_dir(workers: int) -> tuple[str | None, bool]:
    """(multiprocess directory or None, whether this command made it)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        os.makedirs(given, exist_ok=True)
        for stale in glob.glob(os.path.join(given, "*.db")):  # a previous run's values would add up
            os.remove(stale)
        return given, False
    if workers == 1:
        return None, False
    return tempfile.mkdtemp(prefix="dlrm-metrics-"), True


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from api.settings import Settings
    from dlrm_core.errors import ConfigError
    from dlrm_core.logs import logging_config, setup_logging
    from dlrm_core.secrets import read_secret_file, redact_url
    from dlrm_core.store_url import check_store_url, file_store_dir

    env = {
        "DLRM_STORE": args.store,
        "DLRM_STORE_PASSWORD_FILE": args.store_password_file,
        "DLRM_MODEL_NAME": args.model_name,
        "DLRM_CACHE_MB": args.cache_mb,
        "DLRM_MAX_INSTANCES": args.max_instances,
        "DLRM_API_KEY_FILE": args.api_key_file,
        "DLRM_MAX_IDS_PER_REQUEST": args.max_ids_per_request,
        "DLRM_BATCHING": None if args.batching is None else str(args.batching).lower(),
        "DLRM_BATCH_MAX_SIZE": args.batch_max_size,
        "DLRM_BATCH_MAX_DELAY_US": args.batch_max_delay_us,
        "DLRM_ACCESS_LOG": None if args.access_log is None else str(args.access_log).lower(),
        "DLRM_LOG_FORMAT": args.log_format,
        "DLRM_NO_AUTH": None if args.no_auth is None else "true",
        "DLRM_HEADER_TIMEOUT_S": args.header_timeout_s,
    }
    for key, value in env.items():
        if value is not None:
            os.environ[key] = str(value)  # workers read their settings from the environment
    setup_logging(level=args.log_level, json_lines=os.environ.get("DLRM_LOG_FORMAT") == "json")
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    try:
        settings = Settings()
    except ValidationError as exc:  # name the variable, never echo its value (it may be a secret)
        first = exc.errors()[0]
        name = "DLRM_" + "_".join(str(p) for p in first["loc"]).upper()
        raise ConfigError(f"{name}: {first['msg']}") from None
    # a key source without a key, or a short key, stops here, in one line
    keys = settings.key_ring()
    if not keys.enabled and not settings.no_auth and not is_loopback(args.host):
        raise ConfigError(
            f"refusing to serve {args.host} without authentication: give keys (DLRM_API_KEY "
            "or --api-key-file), or --no-auth to serve unauthenticated on purpose"
        )
    kind = check_store_url(settings.store)  # and a bad store URL, before a worker fails on it
    if kind == "file" and not file_store_dir(settings.store).is_dir():
        raise ConfigError(
            f"store {redact_url(settings.store)}: no such directory "
            f"({file_store_dir(settings.store)}); publish a model there first "
            "(dlrm publish --checkpoint RUN --store URL) or correct the path"
        )
    if settings.store_password_file is not None:
        read_secret_file(settings.store_password_file, "store password file")
    started = (
        f"serving model {settings.model_name!r} from {redact_url(settings.store)} on "
        f"{args.host}:{args.port} ({args.workers} worker{'s' if args.workers > 1 else ''}); "
        f"auth: {keys.describe()}"
    )
    if keys.enabled:
        log.info(started)
    else:
        log.warning(started)
    if settings.api_key is not None and settings.no_auth:
        log.warning(
            "DLRM_API_KEY is set but holds no key; serving without authentication (--no-auth)"
        )
    directory, made = _metrics_dir(args.workers)
    if directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    os.environ["DLRM_WORKERS"] = str(args.workers)
    try:
        uvicorn.run(
            "api.main:app",
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            access_log=False,  # our own (DLRM_ACCESS_LOG) carries the request id and route
            log_config=logging_config(
                level=args.log_level, json_lines=settings.log_format == "json"
            ),
            # header deadline, body idle timeout, header cap
            http="api.http_protocol:GuardedHttpTools",
            timeout_keep_alive=settings.keep_alive_s,
            h11_max_incomplete_event_size=settings.max_header_bytes,
        )
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    return 0
