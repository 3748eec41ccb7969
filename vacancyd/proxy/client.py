"""The forwarding leg: a pooled HTTP/1.1 client for one upstream, over asyncio protocols.

The proxy sends every forwarded request (borrowed work, pass-through routes) with it; the
WebSocket tunnels and the adapters' controllers keep aiohttp's client. Responses are parsed
by httptools (llhttp, the C parser Node.js uses). What it keeps from a general client:

* connection reuse: an idle kept-alive connection is reused, most recently used first, and
  closed after :data:`IDLE_TIMEOUT_S` seconds unused or when the server closes it;
* framing: ``Content-Length``, chunked and close-delimited bodies; no body for ``HEAD``,
  1xx, 204 and 304; interim 1xx replies are skipped; a chunked body's trailer fields are
  read and dropped (they never become reply headers);
* streaming with back-pressure: once :data:`READ_LIMIT_BYTES` are buffered and not yet
  consumed, the socket stops being read until the consumer catches up;
* cancellation: cancelling a caller that waits for a reply or reads a body, or
  :meth:`Response.close`, aborts the connection at once, which is what tells the upstream
  to stop; so does :meth:`Call.abort` (a reclaim's cut) for the request it was passed to,
  and whatever that request waits for (its connect, its reply's headers, a read of its
  body) raises :class:`Cut` at once, without the caller's task being cancelled;
* a connect deadline, and for borrowed jobs a silence limit: no byte from the upstream
  for that long (counted once the request has gone out, and not while the reply waits for
  a slow consumer) ends the exchange with :class:`UpstreamSilent`;
* classified failures: :class:`ConnectFailed` (nothing listens, the connect timed out),
  :class:`BadResponse` (no valid HTTP reply: garbage, oversized headers, the connection
  closed before a reply), :class:`BrokenBody` (the reply broke off after its headers).

A request that fails on a *reused* connection before any byte of a reply arrived is sent
once more on a fresh connection: the server closed that kept-alive connection as the
request went out (llama-server closes idle ones), and the request body is in memory, so it
can be replayed. A failure on a fresh connection, or after any reply byte, is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Coroutine, Iterable
from typing import Any, cast

import httptools
from multidict import CIMultiDict

from vacancyd.proxy.upstreamreply import (
    READ_LIMIT_BYTES,
    BadResponse,
    BrokenBody,
    ConnectFailed,
    Cut,
    ForwardError,
    Response,
    UpstreamSilent,
)

__all__ = [
    "READ_LIMIT_BYTES",
    "BadResponse",
    "BrokenBody",
    "Call",
    "ConnectFailed",
    "Cut",
    "ForwardError",
    "Response",
    "UpstreamClient",
    "UpstreamSilent",
]


#: Request bodies up to this size go out in one write with their head (bytes); larger ones
#: are written as a view, so sending them makes no joined copy.
_JOINED_WRITE_BYTES = 64 * 1024
#: An idle pooled connection is closed after this many seconds unused.
IDLE_TIMEOUT_S = 15.0
#: The most header bytes (names and values) and header lines a reply may carry.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 256
#: A request body larger than this is handed to the socket in slices of SEND_SLICE_BYTES,
#: each after the last has drained, so a large upload never copies tens of MiB on the loop.
LARGE_BODY_BYTES = 1024 * 1024
SEND_SLICE_BYTES = 256 * 1024
#: Methods whose replies never carry a body, whatever their headers say.
_NO_BODY_METHODS = frozenset({"HEAD"})


class _ClosedBeforeReply(BadResponse):
    """The connection ended before any byte of a reply arrived (a retry may be allowed)."""


class _Connection(asyncio.Protocol):
    """One TCP connection to the upstream, carrying one exchange at a time."""

    def __init__(self, pool: UpstreamClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        #: An exchange on this connection has completed before (it came from the pool).
        self.reused = False
        self.keep_alive = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self._head_waiter: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._no_body = False
        self._received = 0
        self._status = b""
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._header_bytes = 0
        #: Between a reply's status line and the end of its header section (fields parsed
        #: after it are a chunked body's trailer section, which is not copied).
        self._in_headers = False
        self._reading_paused = False
        self._complete = False
        #: Resolved once the socket is closed.
        self._loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self._sender: asyncio.Task[None] | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._silence_s: float | None = None
        self._silence_timer: asyncio.TimerHandle | None = None
        self._last_byte_at = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.pool.opened(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._head_waiter is None and self._response is None:
            self.abort()  # bytes nobody asked for on an idle connection: not reusable
            return
        self._received += len(data)
        if self._silence_timer is not None:
            self._last_byte_at = self._loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("the upstream switched protocols on a plain request"))
        except httptools.HttpParserCallbackError as exc:
            # httptools wraps what a callback raised; ours name the limit that was crossed
            cause = exc.__context__
            self._fail(
                cause
                if isinstance(cause, ForwardError)
                else BadResponse(f"invalid HTTP response: {exc}")
            )
        except httptools.HttpParserError as exc:
            # An error raised in a callback (oversized headers) reaches here wrapped.
            own = exc.__context__ if isinstance(exc.__context__, ForwardError) else None
            self._fail(own or BadResponse(f"invalid HTTP response: {exc}"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def eof_received(self) -> bool:
        self.closed = True  # never pooled again; a close-delimited body ends on the close
        return False  # close the transport: HTTP/1.1 has no half-closed replies

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.resume_writing()  # a body sender waiting to drain sees the close and stops
        self.pool.forget(self, lost=True)
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            why = f": {exc}" if exc is not None else ""
            error: BadResponse = (
                _ClosedBeforeReply(f"the upstream closed the connection before replying{why}")
                if self._received == 0
                else BadResponse(f"the upstream closed the connection mid-reply{why}")
            )
            waiter.set_exception(error)
        response = self._response
        if response is not None and not self._complete:
            if self._close_delimited():
                self._complete = True
                response._finish()
            else:
                why = f" ({exc})" if exc is not None else ""
                response._finish(BrokenBody(f"the upstream's reply broke off{why}"))

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            self.keep_alive = False  # a second reply nobody asked for: do not reuse
        self._status = b""
        self._headers = CIMultiDict()
        self._header_bytes = 0
        self._in_headers = True

    def on_status(self, status: bytes) -> None:
        self._status += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_headers:
            return  # a trailer field: not part of the reply's headers, and not forwarded
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES or len(self._headers) >= MAX_HEADERS:
            raise BadResponse(
                f"the upstream's reply headers exceed {MAX_HEADERS} lines or "
                f"{MAX_HEADER_BYTES} bytes"
            )
        self._headers.add(
            name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        )

    def on_headers_complete(self) -> None:
        self._in_headers = False
        code = self.parser.get_status_code()
        if 100 <= code < 200:
            return  # an interim reply (100 Continue, 103 Early Hints): the final one follows
        waiter = self._head_waiter
        if waiter is None or waiter.done():
            return
        response = Response(
            self, code, self._status.decode("utf-8", "surrogateescape"), self._headers
        )
        self._response = response
        self._head_waiter = None
        self.keep_alive = self.parser.should_keep_alive()
        waiter.set_result(response)
        if self._no_body or code in (204, 304):
            # llhttp cannot be told that a HEAD reply has no body: end it here and never
            # reuse the connection (its parser would wait for the announced body).
            self._complete = True
            self._stop_silence()
            if self._no_body:
                self.keep_alive = False
            response._finish()

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is None or self._complete:
            return
        response._feed(body)
        if response.buffered >= READ_LIMIT_BYTES and not self._reading_paused:
            self._reading_paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200 or self._response is None:
            return
        if not self._complete:
            self._complete = True
            self._stop_silence()
            self._response._finish()

    # -- used by the pool and the response ---------------------------------------------

    def _close_delimited(self) -> bool:
        """The reply's body ends when the connection does (no length, not chunked)."""
        response = self._response
        if response is None:
            return False
        headers = response.headers
        return (
            "Content-Length" not in headers
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
        )

    def start(
        self, head: bytes, body: bytes | None, no_body: bool, silence_s: float | None
    ) -> asyncio.Future[Response]:
        """Send a request; the future resolves with the reply once its headers are in."""
        if self.transport is None or self.transport.is_closing():
            raise _ClosedBeforeReply("the pooled connection was already closed")
        self._cancel_idle_timer()
        self._received = 0
        self._response = None
        self._complete = False
        self._no_body = no_body
        waiter: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._head_waiter = waiter
        if not body:
            self.transport.write(head)
        elif len(body) <= _JOINED_WRITE_BYTES:
            self.transport.writelines((head, body))  # one send for head and body
        elif len(body) <= LARGE_BODY_BYTES:
            # Python 3.11's writelines joins its pieces and the transport copies what the
            # socket did not take yet; a view is buffered once, without the joined copy
            # (docs/benchmarks.md, upload storm).
            self.transport.write(head)
            self.transport.write(memoryview(body))
        else:
            # Larger still: slices, each after the last drained, so at most one slice is
            # ever copied into the transport's buffer and a server that stops reading holds
            # the rest back.
            self.transport.write(head)
            self._sender = self._loop.create_task(self._send_body(body))
        self._silence_s = silence_s
        if silence_s is not None:
            self._last_byte_at = self._loop.time()
            self._silence_timer = self._loop.call_at(
                self._last_byte_at + silence_s, self._check_silence
            )
        return waiter

    async def _send_body(self, body: bytes) -> None:
        """Hand a large body to the socket slice by slice, waiting for each to drain (a
        server that stops reading holds the rest back, not the loop); stops when the
        connection closes, whose loss reports the failure."""
        view = memoryview(body)
        for offset in range(0, len(view), SEND_SLICE_BYTES):
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            transport.write(view[offset : offset + SEND_SLICE_BYTES])
            if self._write_paused:
                self._drained = self._loop.create_future()
                await self._drained
                self._drained = None

    def _sending(self) -> bool:
        """The request is still going out (body slices left, or bytes in the socket's
        write buffer)."""
        if self._sender is not None and not self._sender.done():
            return True
        transport = self.transport
        return transport is not None and transport.get_write_buffer_size() > 0

    def _check_silence(self) -> None:
        """The silence timer fired. A byte that arrived since (``data_received`` notes
        when) moves the deadline to the limit after it; a request body still going out or a
        reply waiting for its consumer starts the count again; otherwise the upstream has
        been silent for the whole limit."""
        self._silence_timer = None
        limit = self._silence_s
        if limit is None or self._complete or self.closed:
            return
        loop = self._loop
        now = loop.time()
        if self._reading_paused or self._sending():
            self._last_byte_at = now  # waiting on the borrower or the send: not silence
        due = self._last_byte_at + limit
        if due > now + 0.001:
            self._silence_timer = loop.call_at(due, self._check_silence)
            return
        self._fail(UpstreamSilent(f"the upstream sent nothing for {limit:g} s"))

    def _stop_silence(self) -> None:
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None

    def resume(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def finished(self) -> None:
        """The reply was read to its end: pool the connection if it stays alive."""
        self._response = None
        if self.closed or not self.keep_alive or not self._complete or self._sending():
            self.abort()  # a reply before the whole request went out: not reusable
            return
        self.reused = True
        self.resume()
        self.pool.put_idle(self)

    def idle_for(self, timeout_s: float) -> None:
        self._idle_timer = asyncio.get_running_loop().call_later(timeout_s, self.abort)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _fail(self, error: ForwardError) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        elif self._response is not None and not self._complete:
            silent = isinstance(error, UpstreamSilent)
            self._response._finish(error if silent else BrokenBody(str(error)))
        self.abort()

    def abort(self) -> None:
        self._cancel_idle_timer()
        self._stop_silence()
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
        self.closed = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.abort()


class Call:
    """One forwarded request that its owner may end at any moment (a reclaim's cut).

    Pass it to :meth:`UpstreamClient.request`; :meth:`abort` then makes whatever that
    request waits for raise :class:`Cut` at once: a connect (it runs in a task of its own,
    which the abort cancels: a connect is a coroutine of the event loop's, with no
    connection to close yet), the reply's headers, a read of the reply's body. The
    connection is aborted, which is what tells the upstream to stop. A request started after
    the abort raises :class:`Cut` without sending anything.
    """

    __slots__ = ("_conn", "_connecting", "_response", "aborted")

    def __init__(self) -> None:
        self.aborted = False
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[tuple[asyncio.BaseTransport, _Connection]] | None = None
        self._response: Response | None = None

    def abort(self) -> None:
        """End the request now (idempotent; never raises, never blocks)."""
        if self.aborted:
            return
        self.aborted = True
        error = Cut("the exchange was cut")
        if self._response is not None:
            self._response.abort(error)
        elif self._conn is not None:
            self._conn._fail(error)  # the wait for the reply's headers raises it
        if self._connecting is not None:
            self._connecting.cancel()


def _cut() -> Cut:
    return Cut("the exchange was cut")


class UpstreamClient:
    """Pooled connections to one upstream (``host``, ``port``), plain HTTP/1.1.

    ``connect_timeout_s``: the deadline for opening a connection (seconds). One per upstream
    listener; :meth:`close` aborts every connection it holds.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        #: Every connection whose socket is still open (closed on shutdown).
        self._open: set[_Connection] = set()
        self._closed = False

    async def request(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]],
        body: bytes | None,
        *,
        silence_s: float | None = None,
        call: Call | None = None,
    ) -> Response:
        """Send ``method target`` (origin form: path and query, as sent by the borrower)
        with ``headers`` (``Host`` included; ``Content-Length`` is set here) and ``body``
        (None: no body). Returns once the reply's headers are in. ``silence_s``: the most
        seconds the upstream may send nothing (None: no limit). ``call``: lets its owner end
        the request at any moment (:meth:`Call.abort`).

        Raises :class:`ConnectFailed`, :class:`BadResponse`, :class:`UpstreamSilent`,
        :class:`Cut` (``call`` was aborted) or ValueError (a header value that would break
        the request's framing). A request that
        fails on a reused connection before any reply byte is sent again once on a fresh
        connection.
        """
        head = _request_head(method, target, headers, body)
        no_body = method in _NO_BODY_METHODS
        if call is not None and call.aborted:
            raise _cut()
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, head, body, no_body, silence_s, call)
            except _ClosedBeforeReply:
                pass  # the server closed the kept-alive connection as we sent: once more
        conn = await self._connect(call)
        try:
            return await self._exchange(conn, head, body, no_body, silence_s, call)
        except _ClosedBeforeReply as exc:
            raise BadResponse(str(exc)) from None

    async def _exchange(
        self,
        conn: _Connection,
        head: bytes,
        body: bytes | None,
        no_body: bool,
        silence_s: float | None,
        call: Call | None = None,
    ) -> Response:
        self._busy.add(conn)
        if call is not None:
            if call.aborted:
                conn.abort()
                raise _cut()
            call._conn = conn
        try:
            response = await conn.start(head, body, no_body, silence_s)
        except BaseException:
            conn.abort()
            raise
        if call is not None:
            if call.aborted:  # cut as the reply's headers arrived
                response.close()
                raise _cut()
            call._response = response
        return response

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.abort()
        return None

    async def _connect(self, call: Call | None = None) -> _Connection:
        if self._closed:
            raise ConnectFailed("the proxy is shutting down")
        if call is not None and call.aborted:
            raise _cut()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                opening = loop.create_connection(lambda: _Connection(self), self.host, self.port)
                if call is None:
                    _, protocol = await opening
                else:
                    _, protocol = await _interruptible(opening, call)
        except TimeoutError:
            raise ConnectFailed(
                f"no connection to {self.host}:{self.port} within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return protocol

    def put_idle(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed:
            conn.abort()
            return
        conn.idle_for(self.idle_timeout_s)
        self._idle.append(conn)

    def opened(self, conn: _Connection) -> None:
        self._open.add(conn)

    def forget(self, conn: _Connection, *, lost: bool = False) -> None:
        self._busy.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)
        if lost:
            self._open.discard(conn)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Abort every connection and wait (at most ``timeout_s`` seconds) until their
        sockets are closed; later requests fail with :class:`ConnectFailed`."""
        self._closed = True
        conns = [*self._idle, *self._busy, *self._open]
        self._idle.clear()
        self._busy.clear()
        for conn in conns:
            conn.abort()
        lost = [conn.lost for conn in conns if not conn.lost.done()]
        if lost:
            await asyncio.wait(lost, timeout=timeout_s)


async def _interruptible(
    opening: Coroutine[Any, Any, tuple[asyncio.BaseTransport, _Connection]], call: Call
) -> tuple[asyncio.BaseTransport, _Connection]:
    """Run the connect ``opening`` in a task of its own, which :meth:`Call.abort` cancels;
    raises :class:`Cut` when it did (the caller's own cancellation passes as it is)."""
    task = asyncio.get_running_loop().create_task(opening)
    call._connecting = task
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if call.aborted and task.cancelled() and (current is None or not current.cancelling()):
            raise _cut() from None
        raise
    finally:
        call._connecting = None


def _request_head(
    method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes | None
) -> bytes:
    """The request line and header section, ``Content-Length`` included, as bytes."""
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name or ":" in name:
            raise ValueError(f"header {name!r} would break the request's framing")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    elif method in ("POST", "PUT", "PATCH"):
        lines.append("Content-Length: 0")
    lines.append("\r\n")
    text = "\r\n".join(lines)
    if "\n" in target or "\r" in target or " " in target:
        raise ValueError("the request target would break the request line")
    return text.encode("utf-8", "surrogateescape")
