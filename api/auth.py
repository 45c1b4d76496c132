"""Bearer-key authentication of every route but the health probes, checked before the body is
read (a pure-ASGI middleware, outside routing: an unauthenticated client costs no parsing).

Keys come from ``DLRM_API_KEY`` (one, or several separated by commas) and/or
``DLRM_API_KEY_FILE`` (one per line, ``#`` comments). Several keys may be valid at once, so a
key is rotated without downtime: add the new key, move the clients, remove the old one. The
file is re-read when it changes (checked at most once a second), so a Kubernetes or Docker
secret update takes effect without a restart; a file that turns unreadable, empty or holds a
short key keeps the keys it held (logged), never locking everyone out. Keys are compared as
SHA-256 digests with ``hmac.compare_digest``, against every key: the time taken says nothing
about any key.

Authentication fails closed: a key source that yields no key (``DLRM_API_KEY=""``, or only
commas and spaces; an empty key file) is an error naming the source, as is a key shorter than
:data:`MIN_KEY_LENGTH`; serving without keys is either explicit (``no_auth``) or, in ``dlrm
serve``, confined to a loopback address (``api/cli.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path

from fastapi.responses import JSONResponse

from api import docs
from api.errors import error_body
from dlrm_core.errors import ConfigError
from dlrm_core.secrets import read_secret_lines

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
"""Liveness and readiness probes: answered without a key (kubelets and load balancers)."""
MIN_KEY_LENGTH = 16
"""Shortest key accepted (``secrets.token_urlsafe(32)`` makes 43 characters): a short key can be
guessed by anyone who may send requests."""
NEW_KEY_HINT = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def checked_keys(keys: list[str], source: str) -> list[str]:
    """``keys`` (from ``source``) when each is long enough.

    Raises:
        ConfigError: ``source`` yields no key, or one shorter than :data:`MIN_KEY_LENGTH`
            (named by its place and length, never by its value).
    """
    if not keys:
        raise ConfigError(
            f"{source} holds no key (empty, or only separators and spaces): give a key of at "
            f"least {MIN_KEY_LENGTH} characters ({NEW_KEY_HINT}), or --no-auth to serve "
            "without authentication"
        )
    for i, key in enumerate(keys, 1):
        if len(key) < MIN_KEY_LENGTH:
            raise ConfigError(
                f"{source}: key {i} of {len(keys)} has {len(key)} characters, at least "
                f"{MIN_KEY_LENGTH} are needed ({NEW_KEY_HINT})"
            )
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The valid bearer keys.

    Args:
        keys: keys given directly (``DLRM_API_KEY``); None: not given. Given but empty (``[]``)
            is an error, not "no authentication".
        key_file: file of keys, one per line (``DLRM_API_KEY_FILE``), re-read when it changes.
        recheck_s: how often the file's modification time is looked at.
        no_auth: serve without keys, explicitly (``--no-auth``); a source given anyway is
            an error unless it yields nothing.

    Raises:
        ConfigError: a source yields no key or a short one, the key file cannot be read, or
            ``no_auth`` comes with keys.
    """

    def __init__(
        self,
        keys: list[str] | None,
        key_file: Path | None = None,
        recheck_s: float = 1.0,
        no_auth: bool = False,
    ) -> None:
        self.no_auth = no_auth
        self.key_file = key_file
        if no_auth and (keys or key_file is not None):
            raise ConfigError(
                "--no-auth (DLRM_NO_AUTH) with API keys given (DLRM_API_KEY or --api-key-file): "
                "choose one"
            )
        fixed = checked_keys(keys, "DLRM_API_KEY") if keys is not None and not no_auth else []
        self._fixed = [_digest(k) for k in fixed]
        self.recheck_s = recheck_s
        self._from_file: list[bytes] = []
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if key_file is not None:
            self._from_file = self._read_file()
            self._stamp = self._file_stamp()

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self.key_file is not None

    def describe(self) -> str:
        """The authentication mode for the start-up line (counts and sources, never a key)."""
        if not self.enabled:
            return "OFF (--no-auth)" if self.no_auth else "OFF (no key configured; loopback only)"
        sources = [f"{len(self._fixed)} from DLRM_API_KEY"] if self._fixed else []
        if self.key_file is not None:
            sources.append(f"{len(self._from_file)} from {self.key_file}, re-read on change")
        return f"bearer keys ({'; '.join(sources)})"

    def _read_file(self) -> list[bytes]:
        what = f"API key file {self.key_file}"
        return [
            _digest(k) for k in checked_keys(read_secret_lines(self.key_file, "API key file"), what)
        ]

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.key_file)
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.key_file is None or now - self._checked < self.recheck_s:
            return
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp or stamp is None:
                return
            try:
                self._from_file = self._read_file()
                self._stamp = stamp
                log.info("API keys reloaded from %s (%d keys)", self.key_file, len(self._from_file))
            except ConfigError as exc:
                log.warning("keeping the previous API keys: %s", exc)

    def check(self, token: str) -> bool:
        """Whether ``token`` is one of the keys (constant time in the token's value)."""
        self._maybe_reload()
        given = _digest(token)
        ok = False
        for key in [*self._fixed, *self._from_file]:
            ok |= hmac.compare_digest(given, key)
        return ok


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class RequireKey:
    """401 (with ``WWW-Authenticate: Bearer``) for every request without a valid key, except
    the health probes and the documentation's static pages (``api/docs.py``: ``/openapi.json``
    itself needs a key); the body is never read."""

    def __init__(self, app, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or not self.keys.enabled
            or path in OPEN_PATHS
            or docs.is_open(path)
        ):
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers", []))
        if token is not None and self.keys.check(token):
            return await self.app(scope, receive, send)
        message = "missing bearer API key" if token is None else "wrong bearer API key"
        body = error_body(scope["path"], message, "Authorization")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
