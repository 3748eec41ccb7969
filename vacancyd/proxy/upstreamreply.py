"""One upstream reply as the forwarding client hands it to the proxy, and the ways an
exchange with an upstream fails (:mod:`vacancyd.proxy.client` is the client itself)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

#: Unconsumed response bytes after which the socket stops being read (back-pressure).
READ_LIMIT_BYTES = 2**16


class ReplyConnection(Protocol):
    """What a :class:`Response` asks of the connection it arrived on."""

    def resume(self) -> None:
        """Read the socket again (the consumer caught up)."""

    def finished(self) -> None:
        """The reply was read to its end: back to the pool, or closed."""

    def abort(self) -> None:
        """Abort the connection now."""


class ForwardError(Exception):
    """The upstream exchange failed; the subclass says at which stage."""


class ConnectFailed(ForwardError):
    """No connection to the upstream: refused, unreachable, or past the connect deadline."""


class BadResponse(ForwardError):
    """The upstream did not send a valid HTTP reply (garbage, oversized headers, an
    unexpected protocol switch, or the connection closed before the reply's headers)."""


class BrokenBody(ForwardError):
    """The upstream's reply broke off after its headers (reset, closed early, bad framing)."""


class UpstreamSilent(ForwardError):
    """The upstream sent nothing for the exchange's silence limit (before its reply or
    between two pieces of it); the connection is aborted."""


class Cut(ForwardError):
    """The request's owner ended the exchange (:meth:`Call.abort`, a reclaim's cut); the
    connection is aborted."""


class Response:
    """One reply: ``status`` (int), ``reason`` (str), ``headers`` (case-insensitive, as
    sent). The body is read with :meth:`iter_chunks` or, when it arrived with the headers,
    :meth:`complete_body`; then :meth:`release` (connection back to the pool when the body
    was read to its end) or :meth:`close` (connection aborted)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_waiter",
        "buffered",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, conn: ReplyConnection, status: int, reason: str, headers: CIMultiDict[str]):
        self._conn: ReplyConnection | None = conn
        self.status = status
        self.reason = reason
        self.headers = CIMultiDictProxy(headers)
        self._chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, error: ForwardError) -> None:
        """End the reply now with ``error``: bytes not yet read are dropped, a read waiting
        or to come raises ``error``, and the connection is aborted."""
        self._chunks.clear()
        self.buffered = 0
        self._done = False
        self._error = error
        self._wake()
        self.close()

    # -- read by the proxy -------------------------------------------------------------

    @property
    def at_eof(self) -> bool:
        """True once the whole body arrived and was consumed."""
        return self._done and not self._chunks

    def complete_body(self) -> bytes | None:
        """The whole body when it has all arrived (and none was consumed), else None."""
        if not self._done:
            return None
        chunks, self._chunks = self._chunks, collections.deque()
        self.buffered = 0
        return b"".join(chunks)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; raises :class:`BrokenBody` if it breaks off."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self.buffered -= len(chunk)
                conn = self._conn
                if conn is not None and self.buffered < READ_LIMIT_BYTES:
                    conn.resume()
                yield chunk
                continue
            if self._done:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def release(self) -> None:
        """Done with the reply: the connection goes back to the pool if the body was read
        to its end and the server keeps it alive; otherwise it is aborted."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.at_eof:
            conn.finished()
        else:
            conn.abort()

    def close(self) -> None:
        """Abort the connection now (the upstream sees its client go away)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
