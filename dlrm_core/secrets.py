"""Secrets: read from files (``*_FILE``, Docker / Kubernetes secrets), never printed.

A store URL may carry a password (``redis://user:pw@host/0``); every message, log line, metric
label and response shows it through :func:`redact_url` (``redis://user:***@host/0``), and
:func:`scrub` removes known secret strings from text that came from elsewhere (a library's
exception message).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from dlrm_core.errors import ConfigError

MASK = "***"
SECRET_QUERY_KEYS = ("password", "passwd", "pass", "secret", "token", "key")
"""Query parameters whose values are masked (``ssl_keyfile`` is a path, not a secret: kept)."""


def split_userinfo(url: str) -> tuple[str, str | None, str]:
    """``(scheme://, userinfo or None, rest)`` of ``url``, taking the userinfo up to the *last*
    ``@`` of the URL: a password holding ``/``, ``?``, ``#`` or ``@`` (not percent-encoded) then
    stays inside the userinfo instead of leaking into the host, path or fragment.

    >>> split_userinfo("redis://default:pa/ss@127.0.0.1:6379/0")
    ('redis://', 'default:pa/ss', '127.0.0.1:6379/0')
    """
    head, sep, tail = url.partition("://")
    if not sep:
        return "", None, url
    userinfo, at, rest = tail.rpartition("@")
    return head + sep, (userinfo if at else None), (rest if at else tail)


def ambiguous_userinfo(url: str) -> bool:
    """Whether ``url``'s userinfo holds a character that URL parsers read as the end of it
    (``/ ? # @``): the URL then means something else to every library than to its writer."""
    _, userinfo, _ = split_userinfo(url)
    return userinfo is not None and any(c in userinfo for c in "/?#@")


def redact_url(url: str) -> str:
    """``url`` with its password (and secret-looking query values) replaced by ``***``.

    A userinfo that parsers would misread (a password with ``/``, ``?``, ``#`` or ``@``) is
    masked whole, user included: no piece of it is ever shown.

    >>> redact_url("redis://api:s3cret@10.0.0.5:6379/0?prefix=m")
    'redis://api:***@10.0.0.5:6379/0?prefix=m'
    >>> redact_url("redis://default:pa/ss@127.0.0.1:6379/0")
    'redis://***@127.0.0.1:6379/0'
    """
    scheme, userinfo, rest = split_userinfo(url)
    if userinfo is not None and ambiguous_userinfo(url):
        return f"{scheme}{MASK}@{_redact_query(rest)}"
    try:
        parts = urlsplit(url)
    except ValueError:
        # unparseable: show nothing of it but the scheme and what follows the userinfo
        return (
            f"{scheme}{MASK}@{rest}"
            if userinfo is not None
            else (f"{scheme}{MASK}" if scheme else MASK)
        )
    netloc = parts.netloc
    if "@" in netloc:
        auth, _, host = netloc.rpartition("@")
        user, colon, _ = auth.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{user}@{host}"
    return urlunsplit(parts._replace(netloc=netloc, query=_redact_query(parts.query)))


def _redact_query(text: str) -> str:
    """A query string (or ``host/path?query``) with secret-looking values masked."""
    before, q, query = text.rpartition("?") if "?" in text else ("", "", text)
    if not query or "=" not in query:
        return text
    pairs = parse_qsl(query, keep_blank_values=True)
    pairs = [
        (k, MASK if k.lower() in SECRET_QUERY_KEYS or k.lower().endswith("password") else v)
        for k, v in pairs
    ]
    return before + q + urlencode(pairs, safe="/*")


def url_password(url: str) -> str | None:
    """The password a URL carries, if any (to scrub it from foreign messages); for a userinfo
    that parsers would misread, everything after the user's ``:``."""
    _, userinfo, _ = split_userinfo(url)
    if userinfo is None:
        return None
    _, colon, password = userinfo.partition(":")
    return password if colon and password else None


def scrub(text: str, secrets: list[str | None]) -> str:
    """``text`` with every occurrence of each (non-empty) secret replaced by ``***``, as written
    and percent-decoded (a library may echo either)."""
    for secret in secrets:
        if secret:
            for form in sorted({secret, unquote(secret)}, key=len, reverse=True):
                text = text.replace(form, MASK)
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
