"""Secrets: read from files (``*_FILE``, Docker / Kubernetes secrets), never printed.

A store URL may carry a password (``redis://user:pw@host/0``); every message, log line, metric
label and response shows it through :func:`redact_url` (``redis://user:***@host/0``), and
:func:`scrub` removes known secret strings from text that came from elsewhere (a library's
exception message).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from dlrm_core.errors import ConfigError

MASK = "***"
SECRET_QUERY_KEYS = ("password", "passwd", "pass", "secret", "token", "key")
"""Query parameters whose values are masked (``ssl_keyfile`` is a path, not a secret: kept)."""


def redact_url(url: str) -> str:
    """``url`` with its password (and secret-looking query values) replaced by ``***``.

    >>> redact_url("redis://api:s3cret@10.0.0.5:6379/0?prefix=m")
    'redis://api:***@10.0.0.5:6379/0?prefix=m'
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # unparseable: show nothing of it
    netloc = parts.netloc
    if "@" in netloc:
        auth, _, host = netloc.rpartition("@")
        user, colon, _ = auth.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        pairs = [(k, MASK if k.lower() in SECRET_QUERY_KEYS or k.lower().endswith("password") else v)
                 for k, v in pairs]
        query = urlencode(pairs, safe="/*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_password(url: str) -> str | None:
    """The password a URL carries, if any (to scrub it from foreign messages)."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def scrub(text: str, secrets: list[str | None]) -> str:
    """``text`` with every occurrence of each (non-empty) secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def read_secret_file(path: str | Path, what: str) -> str:
    """The secret held by ``path``: its first line, stripped (a trailing newline is common).

    Raises:
        ConfigError: the file is missing, unreadable or empty (the message names the file,
            never its content).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ConfigError(f"{what} {path}: the file is empty")
    return secret


def read_secret_lines(path: str | Path, what: str) -> list[str]:
    """Every non-empty, non-comment line of ``path`` (several keys, for rotation)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"{what} {path}: no key in the file")
    return keys
