"""Serving-store URLs: which kind of store a URL names, checked without opening it or importing
the stores (torch), so that ``dlrm serve`` and ``dlrm publish`` refuse a bad one at once.

Every message here shows the URL through :func:`~dlrm_core.secrets.redact_url`; no message of
a URL library (which may quote the password: ``Port could not be cast to integer value as
'pa'``) is ever passed on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from dlrm_core.errors import ConfigError
from dlrm_core.secrets import ambiguous_userinfo, redact_url, url_password

log = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis", "rediss", "unix")
_warned: set[str] = set()


def check_store_url(url: str) -> str:
    """The kind of store ``url`` names, ``file`` or ``redis``, checked without opening it (so
    that a command refuses a bad URL before it starts anything). A password written in the URL
    logs a warning (once per URL): it shows in ``ps`` and shell history.

    Raises:
        ConfigError: an unknown scheme, or a Redis URL whose user/password, host, port or
            database cannot be read unambiguously (the URL shown without its password).
    """
    try:
        scheme = urlsplit(url).scheme
    except ValueError:  # e.g. an unbalanced [ in the host or password
        scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("file", ""):
        return "file"
    if scheme not in REDIS_SCHEMES:
        raise ConfigError(
            f"store URL {redact_url(url)}: unknown scheme {scheme!r} "
            "(use file://DIR, redis://host:port/db or rediss://host:port/db)"
        )
    _check_redis_url(url, scheme)
    if url_password(url) and url not in _warned:
        _warned.add(url)
        log.warning(
            "store URL %s carries a password: it shows in `ps` and shell history; "
            "give it with --store-password-file (DLRM_STORE_PASSWORD_FILE) instead",
            redact_url(url),
        )
    return "redis"


def _check_redis_url(url: str, scheme: str) -> None:
    shown = redact_url(url)
    if ambiguous_userinfo(url):
        raise ConfigError(
            f"store URL {shown}: its user or password holds a character URLs reserve (/ ? # @), "
            "so it cannot be read unambiguously; percent-encode it (/ as %2F, ? as %3F, # as %23, "
            "@ as %40) or give the password with --store-password-file (DLRM_STORE_PASSWORD_FILE)"
        )
    try:
        parts = urlsplit(url)
    except ValueError:  # its message quotes the URL: not passed on
        raise ConfigError(
            f"store URL {shown}: cannot be read as a URL (an unbalanced [ or ]?); "
            "percent-encode the password or give it with --store-password-file"
        ) from None
    try:
        port = parts.port  # raises ValueError (quoting the port) when it is not a number
    except ValueError:
        raise ConfigError(
            f"store URL {shown}: the port is not a number from 1 to 65535 "
            "(redis://[user[:password]@]host:port/db)"
        ) from None
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(
                f"store URL {shown}: no socket path (unix:///path/to/redis.sock?db=0)"
            )
        _check_db(shown, parse_qs(parts.query).get("db", ["0"])[0])
        return
    if not parts.hostname:
        raise ConfigError(f"store URL {shown}: no host (redis://[user[:password]@]host:port/db)")
    if port is not None and port == 0:
        raise ConfigError(f"store URL {shown}: the port is not a number from 1 to 65535")
    db = parts.path.lstrip("/")
    if db:
        _check_db(shown, db)


def _check_db(shown: str, db: str) -> None:
    if not db.isdigit():
        raise ConfigError(
            f"store URL {shown}: the database {db[:16]!r} is not a number "
            "(redis://host:port/0; a prefix goes in ?prefix=NAME)"
        )


def file_store_dir(url: str) -> Path:
    """The directory a ``file://`` store URL (or bare path) names, as ``open_store`` reads it
    (``file:///abs/dir``, ``file://relative/dir`` or ``dir``)."""
    if not url.startswith("file:"):
        return Path(url)
    parts = urlsplit(url)
    return Path(parts.netloc + parts.path) if parts.netloc else Path(parts.path)
