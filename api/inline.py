"""Requests on a remote store scored on the event loop while they need no network.

``api/fastpath.py`` scores a lone small request on the loop itself. On a remote store (Redis)
that is safe only when the request needs no round trip: every row it reads is in the row cache
and its version is loaded. The fast path runs such a request with ``remote_on_loop`` set; the
serving code checks, before any side effect of scoring (batcher, metrics, cache), whether the
request would reach the store, and if so raises :class:`Offload`; the fast path then scores it
again in a pool thread, from its body, as any other request.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_REMOTE_ON_LOOP = contextvars.ContextVar("dlrm_remote_on_loop", default=False)


class Offload(Exception):  # noqa: N818 - a signal, not an error
    """This request needs the remote store (a network round trip): score it in a pool thread."""


@contextmanager
def remote_on_loop() -> Iterator[None]:
    """Mark the calls inside as a remote-store request running on the event loop."""
    token = _REMOTE_ON_LOOP.set(True)
    try:
        yield
    finally:
        _REMOTE_ON_LOOP.reset(token)


def on_loop() -> bool:
    """Whether this call is a remote-store request running on the event loop."""
    return _REMOTE_ON_LOOP.get()


def need_store() -> None:
    """Called where the request is about to reach the remote store.

    Raises:
        Offload: the request runs on the event loop (``remote_on_loop``).
    """
    if _REMOTE_ON_LOOP.get():
        raise Offload
