"""uvicorn's HTTP protocol (httptools) with the client timeouts and header cap it lacks.

uvicorn times out an idle kept-alive connection (``timeout_keep_alive``) but nothing else: a
connection that never sends a byte, or sends its headers a byte every few seconds (slowloris),
or stalls in its body, holds its socket (and a request's state) for as long as the client likes,
and httptools takes headers of any size. Per connection, here:

    - a request's line and headers must arrive within ``header_timeout_s`` of its first byte (or
      of the connection, for the first request): else 408 and the connection is closed;
    - its body must keep coming: at most ``body_idle_s`` between two of its chunks, else the
      connection is closed (the app sees ``http.disconnect``);
    - its line and headers together are at most ``max_header_bytes``: else 431, closed;
    - a plain ``GET`` of a health probe (``api/probes.py``) is answered from the parser callback
      that completes its headers: no ASGI task, no routing, no thread, so probes never queue
      behind scoring requests.

The limits come from the environment (``DLRM_HEADER_TIMEOUT_S``, ``DLRM_BODY_IDLE_S``,
``DLRM_MAX_HEADER_BYTES``, as ``api/settings.py`` documents them), read per connection, since
uvicorn builds the protocol from its own config; ``dlrm serve`` passes this class as ``http``.
"""

from __future__ import annotations

import asyncio
import os

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api import probes

DEFAULTS = {"DLRM_HEADER_TIMEOUT_S": 10.0, "DLRM_BODY_IDLE_S": 30.0, "DLRM_MAX_HEADER_BYTES": 65536}


def _limit(name: str) -> float:
    try:
        return float(os.environ.get(name) or DEFAULTS[name])
    except ValueError:
        return DEFAULTS[name]


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing a request already answered (431)."""


def _answer(status: int, reason: str) -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f'content-length: {len(reason) + 13}\r\n\r\n{{"error": "{reason}"}}'
    ).encode()


class GuardedHttpTools(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a header deadline, a body idle timeout and a header cap."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = _limit("DLRM_HEADER_TIMEOUT_S")
        self.body_idle_s = _limit("DLRM_BODY_IDLE_S")
        self.max_header_bytes = int(_limit("DLRM_MAX_HEADER_BYTES"))
        self._timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._in_body = False
        self._probe = False  # the request being parsed was answered as a probe

    def _arm(self, delay: float, on_fire) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, on_fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self, answer: bytes | None) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    def _headers_late(self) -> None:
        self._close(_answer(408, "Request Timeout"))

    def _body_stalled(self) -> None:
        if self.flow is not None and self.flow.read_paused:  # we stopped reading, not the client
            self._arm(self.body_idle_s, self._body_stalled)
            return
        self._close(None)  # the app is reading the body: it sees a disconnect

    # -- the connection and the parser's callbacks -------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.header_timeout_s, self._headers_late)  # until the first request's headers

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_body and self._timer is not None:
            self._arm(self.body_idle_s, self._body_stalled)
        self._unset_keepalive_if_required()
        try:  # uvicorn's own data_received, but for a request this class already answered
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Rejected):
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes, self._in_body = 0, False
        if self._timer is None:  # a kept-alive connection's next request: its own deadline
            self._arm(self.header_timeout_s, self._headers_late)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.max_header_bytes:
            self._close(_answer(431, "Request Header Fields Too Large"))
            raise _Rejected

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._answer_probe():
            return
        self._in_body = True
        self._arm(self.body_idle_s, self._body_stalled)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_body = False
        if self._probe:
            self._probe = False
            self._after_probe()
            return
        super().on_message_complete()

    def _answer_probe(self) -> bool:
        """Answer a probe now, if this request is one and nothing is in flight before it."""
        answers = probes.installed()
        if (
            answers is None
            or self.parser.get_method() != b"GET"
            or (self.cycle and not self.cycle.response_complete)
        ):
            return False
        answer = answers.answer(httptools.parse_url(self.url).path.decode("latin-1"))
        if answer is None:
            return False
        status, body = answer
        self._keep = self.parser.should_keep_alive()
        head = [
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Service Unavailable'}",
            "content-type: application/json",
            f"content-length: {len(body)}",
        ]
        head += ["retry-after: 2"] if status != 200 else []
        head += [] if self._keep else ["connection: close"]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self._probe = True
        return True

    def _after_probe(self) -> None:
        """What uvicorn does once a response is complete: close, or wait for the next request."""
        self.server_state.total_requests += 1
        if not self._keep:
            self._close(None)
            return
        if not self.transport.is_closing():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
