"""Bearer-key authentication of every route but the health probes, checked before the body is
read (a pure-ASGI middleware, outside routing: an unauthenticated client costs no parsing).

Keys come from ``DLRM_API_KEY`` (one, or several separated by commas) and/or
``DLRM_API_KEY_FILE`` (one per line, ``#`` comments). Several keys may be valid at once, so a
key is rotated without downtime: add the new key, move the clients, remove the old one. The
file is re-read when it changes (checked at most once a second), so a Kubernetes or Docker
secret update takes effect without a restart; a file that turns unreadable or empty keeps the
keys it held (logged), never locking everyone out. Keys are compared as SHA-256 digests with
``hmac.compare_digest``, against every key: the time taken says nothing about any key.
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

from api.errors import error_body
from dlrm_core.errors import ConfigError
from dlrm_core.secrets import read_secret_lines

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
"""Liveness and readiness probes: answered without a key (kubelets and load balancers)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The valid bearer keys.

    Args:
        keys: keys given directly (``DLRM_API_KEY``).
        key_file: file of keys, one per line (``DLRM_API_KEY_FILE``), re-read when it changes.
        recheck_s: how often the file's modification time is looked at.

    Raises:
        ConfigError: the key file cannot be read or holds no key (at start).
    """

    def __init__(self, keys: list[str], key_file: Path | None = None, recheck_s: float = 1.0) -> None:
        self._fixed = [_digest(k) for k in keys if k]
        self.key_file = key_file
        self.recheck_s = recheck_s
        self._from_file: list[bytes] = []
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if key_file is not None:
            self._from_file = [_digest(k) for k in read_secret_lines(key_file, "API key file")]
            self._stamp = self._file_stamp()

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self.key_file is not None

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
                self._from_file = [_digest(k) for k in read_secret_lines(self.key_file, "API key file")]
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
    the health probes; the body is never read."""

    def __init__(self, app, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers", []))
        if token is not None and self.keys.check(token):
            return await self.app(scope, receive, send)
        message = "missing bearer API key" if token is None else "wrong bearer API key"
        body = error_body(scope["path"], message, "Authorization")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
