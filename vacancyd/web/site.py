"""A TCP site that admits connections within budgets (listener protections, both the API
and the proxy listeners).

Every listener (the API and each proxy) counts its connections itself, at accept time, so
the cap holds exactly even when the kernel hands over a burst at once. A connection starts
*unauthenticated*; the first request on it that passes authentication (a bearer token, or
loopback trust) moves it out of that state (:func:`mark_authenticated`). Unauthenticated
connections have budgets of their own, so anonymous clients cannot fill a listener:

* at most ``max_unauthenticated_connections`` at once on the listener, and, once half of
  those are in use, at most ``max_unauthenticated_per_peer`` from one address (so a client
  that opens a burst of connections on an idle listener is not refused, while a flood from
  one address can hold at most half the pool);
* an address that holds its share does not lock out the next client from the same address
  (every local client is 127.0.0.1): a new connection from it takes the place of that
  address's oldest connection that is not in the middle of a request, which is answered 503
  (or, between requests, just closed). Only when every one of them is busy is the newcomer
  refused. So a slow-header flood never starves a request that arrives whole, such as the
  owner's admin call or a ``/healthz`` probe sharing the flooder's address;
* each is closed ``unauthenticated_timeout_s`` after it opened (gracefully: a response in
  progress finishes first), so a slow-header connection holds its place briefly;
* a connection must complete its first request's headers within ``header_read_timeout_s``,
  and each later request's within as long from its first byte.

``keepalive_timeout_s`` is a separate, idle-only timer: it closes a kept-alive connection on
which nothing at all arrives between requests. Once a request's first byte arrives it no
longer applies (the header deadline does, then the body's own timeouts), so a request whose
bytes are still coming in is never cut by it.

A connection refused by a budget gets a short JSON 503 and is closed (after the client has
had a moment to read it: a refused connection is half-closed and drained briefly, so the
client's request arriving just after the answer does not turn into a reset). On the API listener a
refused connection's request head is still read (briefly, and only for a bounded number at
once) so ``GET /healthz`` and ``GET /readyz`` are answered even while the listener is full.

Requests that aiohttp cannot parse (a malformed request line, a bad header) are answered
with the same JSON error envelope as everything else, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body

log = logging.getLogger(__name__)

#: Answers a health probe while the listener is full: path -> (status, JSON body), or None
#: when the path is not a probe.
Probe = Callable[[str], tuple[int, dict[str, Any]] | None]

#: Refused connections whose request head is read for a probe, at most, at once.
MAX_PROBE_READERS = 64
#: How long a refused connection may take to send a probe's request head (seconds).
PROBE_READ_TIMEOUT_S = 1.0
#: The largest probe request head read (bytes).
PROBE_HEAD_BYTES = 4096
#: Refused connections kept open after their answer, at most, at once: each is half-closed
#: and what the client still sends is read and dropped, for up to LINGER_S seconds (more
#: are closed at once).
MAX_LINGERING = 256
#: How long a refused connection's answer waits for the client to read it and close (s).
LINGER_S = 2.0
SERVER_HEADER = "vacancyd"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """One listener's connection budgets. Counts are connections, times seconds."""

    max_connections: int
    max_unauthenticated: int
    max_unauthenticated_per_peer: int
    unauthenticated_timeout_s: float
    header_read_timeout_s: float


def _response(status: int, reason: str, body: dict[str, Any], retry_after: bool) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Server: {SERVER_HEADER}\r\n"
        + ("Retry-After: 2\r\n" if retry_after else "")
        + f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


_FULL = {
    why: _response(
        503,
        "Service Unavailable",
        error_body(
            f"No vacancy: {text}", ErrorType.NO_VACANCY, ErrorCode.CONNECTION_LIMIT, limit=why
        ),
        True,
    )
    for why, text in {
        "connections": "too many open connections to this listener",
        "unauthenticated": "too many unauthenticated connections to this listener",
        "peer": "too many unauthenticated connections from your address",
    }.items()
}


class _Refused(asyncio.Protocol):
    """A connection over a budget: 503 at once, or, where a probe answers, after its head."""

    def __init__(self, guard: ConnectionGuard, why: str, read_probe: bool) -> None:
        self._guard, self._why, self._read_probe = guard, why, read_probe
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._answered = False
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = _stream(transport)
        if not self._read_probe:
            self._answer(_FULL[self._why])
            return
        self._guard.probe_readers += 1
        self._timer = asyncio.get_running_loop().call_later(
            PROBE_READ_TIMEOUT_S, self._answer, _FULL[self._why]
        )

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return  # the rest of the request: dropped (see _answer)
        self._buf += data
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > PROBE_HEAD_BYTES:
                self._answer(_FULL[self._why])
            return
        parts = self._buf[:end].split(b" ")
        answer = None
        probe = self._guard.probe
        if probe is not None and len(parts) == 3 and parts[0] in (b"GET", b"HEAD"):
            answer = probe(parts[1].decode("latin-1").split("?", 1)[0])
        if answer is None:
            self._answer(_FULL[self._why])
            return
        status, body = answer
        self._answer(
            _response(status, "OK" if status == 200 else "Service Unavailable", body, False)
        )

    def _answer(self, data: bytes) -> None:
        """Send ``data`` and end the connection without destroying it: closing a socket
        whose client is still sending (its request arrives just after the refusal) makes
        the kernel reset the connection, and the reset can discard the answer before the
        client reads it. So the answer is followed by a FIN, and what the client still
        sends is read and dropped until it closes or :data:`LINGER_S` passes."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._answered:
            return
        self._answered = True
        transport.write(data)
        guard = self._guard
        if guard.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        guard.lingering += 1
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def eof_received(self) -> bool | None:
        return None  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._guard.probe_readers -= 1
        if self._linger is not None:
            self._linger.cancel()
            self._guard.lingering -= 1
        self._transport = None


class _Guarded(asyncio.Protocol):
    """aiohttp's request handler behind the connection budgets (a delegating protocol)."""

    def __init__(self, guard: ConnectionGuard, inner: RequestHandler) -> None:
        self.guard = guard
        self.inner = inner
        self.authenticated = False
        self.counted = False
        self._peer: str | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._headers_done = False
        self._first_bytes = False
        #: The header deadline of a later request on this kept-alive connection.
        self._next_head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        self._peer = peer
        guard.unauthenticated += 1
        guard.per_peer[peer] += 1
        guard.waiting.setdefault(peer, {})[self] = None
        loop = asyncio.get_running_loop()
        limits = guard.limits
        self._timers = [
            loop.call_later(limits.unauthenticated_timeout_s, self._unauthenticated_expired),
            loop.call_later(limits.header_read_timeout_s, self._header_deadline),
        ]
        self.inner.connection_made(transport)

    def mark_authenticated(self) -> None:
        if self.authenticated:
            return
        self.authenticated = True
        self._leave_unauthenticated()
        if self._timers:
            self._timers[0].cancel()

    def _leave_unauthenticated(self) -> None:
        guard = self.guard
        guard.unauthenticated -= 1
        peer = self._peer or ""
        guard.per_peer[peer] -= 1
        if guard.per_peer[peer] <= 0:
            del guard.per_peer[peer]
        waiting = guard.waiting.get(peer)
        if waiting is not None:
            waiting.pop(self, None)
            if not waiting:
                del guard.waiting[peer]

    @property
    def displaceable(self) -> bool:
        """Unauthenticated and between requests: aiohttp's handler is waiting for the next
        request's head (none parsed, none being handled or answered, not upgraded). A
        connection accepted so recently that its handler has not started yet is not."""
        inner = self.inner
        return (
            not self.authenticated
            and getattr(inner, "_waiter", None) is not None
            and not getattr(inner, "_messages", True)
            and not self.upgraded
        )

    def displace(self, why: str) -> None:
        """Give this connection's place to a newcomer from its address: counted out of
        every budget now (so the counts stay exact), answered ``503`` if no request on it
        has completed yet (its first request's head is still arriving), else just closed."""
        self._count_out()
        transport = self.inner.transport
        if transport is not None and not transport.is_closing():
            if getattr(self.inner, "_request_count", 1) == 0:
                transport.write(_FULL[why])
        self.inner.force_close()

    def _count_out(self) -> None:
        if self.counted:
            self.guard.open -= 1
            self.guard.connections.discard(self)
            self.counted = False
        if self._peer is not None and not self.authenticated:
            self._leave_unauthenticated()
        self.authenticated = True  # counted out once

    def _unauthenticated_expired(self) -> None:
        if not self.authenticated:
            self.inner.close()  # after the response in progress, if any

    def _header_deadline(self) -> None:
        if not self._headers_done and getattr(self.inner, "_request_count", 1) == 0:
            self.inner.force_close()

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (None once closed). Not checked with isinstance:
        uvloop's transports are not subclasses of asyncio's, and one filtered out here
        could never be reset, so a cut stream would wait out the close timeout instead."""
        return self.inner.transport

    @property
    def busy(self) -> bool:
        """A request is being handled on this connection (aiohttp's own flag)."""
        return bool(getattr(self.inner, "_request_in_progress", False))

    @property
    def upgraded(self) -> bool:
        """The connection was upgraded (a WebSocket tunnel)."""
        return bool(getattr(self.inner, "_upgraded", False))

    def _between_requests(self) -> bool:
        """Idle: no request being handled, none parsed and waiting, none half-received."""
        inner = self.inner
        return (
            not getattr(inner, "_request_in_progress", True)
            and not getattr(inner, "_messages", True)
            and self._next_head_timer is None
        )

    def _next_head_deadline(self, count: int) -> None:
        self._next_head_timer = None
        if getattr(self.inner, "_request_count", count) == count:
            self.inner.force_close()  # headers still incomplete after header_read_timeout_s

    def data_received(self, data: bytes) -> None:
        inner = self.inner
        if self._headers_done and self._between_requests():
            # The next request on a kept-alive connection has begun to arrive: from here the
            # header deadline governs it, not the idle timer (which would cut a request whose
            # bytes are still coming in); aiohttp re-arms its idle timer after the reply.
            handle = getattr(inner, "_keepalive_handle", None)
            if handle is not None:
                handle.cancel()
                inner._keepalive_handle = None
            count = getattr(inner, "_request_count", 0)
            self._next_head_timer = asyncio.get_running_loop().call_later(
                self.guard.limits.header_read_timeout_s, self._next_head_deadline, count
            )
        elif not self._headers_done and not self._first_bytes:
            # The first request's bytes: its header deadline (from the connection's start)
            # governs it, not aiohttp's idle timer.
            self._first_bytes = True
            handle = getattr(inner, "_keepalive_handle", None)
            if handle is not None:
                handle.cancel()
                inner._keepalive_handle = None
        before = getattr(inner, "_request_count", 0)
        inner.data_received(data)
        count = getattr(inner, "_request_count", 1)
        if not self._headers_done and count > 0:
            self._headers_done = True
            self._timers[1].cancel()
        if self._next_head_timer is not None and count > before:
            self._next_head_timer.cancel()
            self._next_head_timer = None

    def eof_received(self) -> bool | None:
        self.inner.eof_received()
        return None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in self._timers:
            timer.cancel()
        if self._next_head_timer is not None:
            self._next_head_timer.cancel()
            self._next_head_timer = None
        self._count_out()
        self.inner.connection_lost(exc)


class JsonErrorHandler(RequestHandler):
    """aiohttp's request handler, answering unparseable requests with the JSON envelope."""

    def __init__(
        self, *args: Any, on_malformed: Callable[[], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_malformed = on_malformed

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        if self.on_malformed is not None:
            self.on_malformed()
        log.info("malformed request from %s: %s", request.remote, message or exc)
        text = message or (str(exc) if exc else "bad request")
        resp = web.json_response(
            error_body(
                f"the request could not be parsed: {text}",
                ErrorType.INVALID_REQUEST,
                ErrorCode.BAD_REQUEST,
            ),
            status=status,
            headers={"Server": SERVER_HEADER},
        )
        resp.force_close()
        return resp


class ConnectionGuard:
    """The counts behind one listener's budgets (event-loop confined)."""

    def __init__(
        self,
        limits: ConnectionLimits,
        *,
        probe: Probe | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_malformed: Callable[[], None] | None = None,
    ) -> None:
        self.limits = limits
        self.probe = probe
        self.on_refused = on_refused
        self.on_malformed = on_malformed
        self.open = 0
        self.unauthenticated = 0
        self.per_peer: Counter[str] = Counter()
        #: Each address's unauthenticated connections, oldest first.
        self.waiting: dict[str, dict[_Guarded, None]] = {}
        self.probe_readers = 0
        #: Refused connections answered and waiting for their client to close.
        self.lingering = 0
        #: The admitted connections now open.
        self.connections: set[_Guarded] = set()

    def displace_for(self, peer: str, why: str) -> bool:
        """Make room for a new connection from ``peer`` that a budget (``why``:
        ``unauthenticated`` or ``peer``) would refuse: when ``peer`` already holds its
        share (``max_unauthenticated_per_peer``), its oldest displaceable connection gives
        its place up. Returns whether one did; never touches another address's."""
        if self.per_peer[peer] < self.limits.max_unauthenticated_per_peer:
            return False
        for conn in self.waiting.get(peer, {}):
            if conn.displaceable:
                if self.on_refused is not None:
                    self.on_refused(why)
                conn.displace(why)
                return True
        return False

    def reset_busy(self) -> int:
        """Reset (TCP RST) every open connection that is in the middle of a request, so
        that a reply cut by the daemon's stop never looks complete; upgraded (WebSocket)
        connections and idle kept-alive ones are left to close normally. Returns how many
        were reset."""
        busy = [c for c in self.connections if c.busy and not c.upgraded]
        for conn in busy:
            reset_connection(conn.transport)
        return len(busy)

    def factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        # the keyword arguments the runner gave aiohttp's Server (timeouts, access log)
        kwargs = dict(getattr(server, "_kwargs", {}))
        loop = asyncio.get_running_loop()

        def make() -> asyncio.Protocol:
            limits = self.limits
            if self.open >= limits.max_connections:
                return self._refuse("connections")
            if self.unauthenticated >= limits.max_unauthenticated:
                return self._refuse("unauthenticated")
            inner = JsonErrorHandler(server, loop=loop, on_malformed=self.on_malformed, **kwargs)
            return _PeerChecked(self, inner)

        return make

    def _refuse(self, why: str) -> asyncio.Protocol:
        if self.on_refused is not None:
            self.on_refused(why)
        # a flooding address gets its 503 at once; others may still ask a probe
        read = why != "peer" and self.probe is not None and self.probe_readers < MAX_PROBE_READERS
        return _Refused(self, why, read_probe=read)


class _PeerChecked(_Guarded):
    """Admits the connection once it is established (and its peer known): the counts are
    exact because ``connection_made`` calls run one at a time on the loop, and a TLS
    connection whose handshake fails never reaches it, so it is never counted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        guard = self.guard
        limits = guard.limits
        why = None
        if guard.open >= limits.max_connections:
            why = "connections"
        elif guard.unauthenticated >= limits.max_unauthenticated:
            why = "unauthenticated"
        elif (
            guard.per_peer[peer] >= limits.max_unauthenticated_per_peer
            and guard.unauthenticated >= limits.max_unauthenticated // 2
        ):
            why = "peer"
        if why in ("unauthenticated", "peer") and guard.displace_for(peer, why):
            why = None
        if why is not None:
            refused = guard._refuse(why)
            transport.set_protocol(refused)
            refused.connection_made(transport)
            return
        guard.open += 1
        self.counted = True
        guard.connections.add(self)
        super().connection_made(transport)


def _stream(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """``transport`` as the stream transport it is. uvloop's TCP and TLS transports have
    every method of ``asyncio.Transport`` but are not subclasses of it (nor of
    ``asyncio.BaseTransport``), so an ``isinstance`` check would refuse them: the type is
    asserted for the checker only, never tested at run time."""
    return cast(asyncio.Transport, transport)


_LINGER_RESET = struct.pack("ii", 1, 0)


def reset_connection(transport: asyncio.Transport | None) -> None:
    """Close ``transport`` with a TCP reset (SO_LINGER 0), not a FIN.

    A cut stream must never look like a clean end: an HTTP/1.0 reply, or a 1.1 reply framed
    by the connection's close, ends exactly where a FIN says it does, so only a reset tells
    the client the reply is incomplete.
    """
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


def mark_authenticated(request: web.BaseRequest) -> None:
    """Record that ``request``'s connection authenticated (it leaves the unauthenticated
    budgets). A no-op for connections a :class:`GuardedTCPSite` did not accept."""
    transport = request.transport
    if transport is None:
        return
    protocol = transport.get_protocol()
    if isinstance(protocol, _Guarded) and not protocol.authenticated:
        protocol.mark_authenticated()


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections are admitted by a :class:`ConnectionGuard`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        ssl_context: Any = None,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            self.guard.factory(server),
            self._host,
            self._port,
            backlog=self._backlog,
            ssl=self._ssl_context,
            ssl_handshake_timeout=(
                self.guard.limits.header_read_timeout_s if self._ssl_context else None
            ),
        )
        self._bound_port = (
            self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
        )

    @property
    def listening(self) -> asyncio.AbstractServer | None:
        """The asyncio server accepting this site's connections (None before start)."""
        return self._server


class CappedTCPSite(GuardedTCPSite):
    """A guarded site with only a connection cap (kept for callers that need no more)."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int
    ) -> None:
        limits = ConnectionLimits(
            max_connections=max_connections,
            max_unauthenticated=max_connections,
            max_unauthenticated_per_peer=max_connections,
            unauthenticated_timeout_s=3600.0,
            header_read_timeout_s=3600.0,
        )
        super().__init__(runner, host, port, guard=ConnectionGuard(limits))
