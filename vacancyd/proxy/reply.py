"""Refusals written as bytes serialized ahead of time (docs/benchmarks.md, "refusals").

A refusal's status line, headers and JSON body repeat exactly from one request to the next,
so :class:`PreparedReply` keeps them serialized and writes them in one call; only ``Date``
(once a second) and the ``Connection`` header (from the request's HTTP version and
keep-alive) vary. What goes on the wire is byte for byte what aiohttp's ``web.Response``
writes for the same status, headers and body on a proxy listener, in the same order:
the given headers, ``Content-Length``, ``Date``, ``Server: vacancyd``, then ``Connection``
when aiohttp would send one, and the listener's ``Keep-Alive`` when the connection stays
open. aiohttp still drives the exchange (parsing, keep-alive, the access log): the reply
is a ``web.StreamResponse`` whose :meth:`~PreparedReply.prepare` sends everything and
marks it finished.

Only for replies that carry their body: a ``HEAD`` request gets a plain ``web.Response``
(see :func:`reply`), whose framing aiohttp knows how to strip.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import HttpVersion10, HttpVersion11, hdrs, web

from vacancyd.web.site import SERVER_HEADER


class _Clock:
    """The ``Date`` header line for the current second (wall clock, RFC 9110 IMF-fixdate)."""

    __slots__ = ("line", "second")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
        return self.line


_clock = _Clock()
_SERVER_LINE = f"Server: {SERVER_HEADER}\r\n".encode()
_KEEP_ALIVE_10 = b"Connection: keep-alive\r\n\r\n"
_CLOSE_11 = b"Connection: close\r\n\r\n"
_END = b"\r\n"


class PreparedReply(web.StreamResponse):
    """A reply serialized once (``status``, ``headers``, ``body``) and written whole.

    Build one per request with :meth:`Template.reply`; the template holds the bytes. Raises
    nothing itself; a write to a closed connection raises aiohttp's connection error as a
    plain response would.
    """

    __slots__ = ("_template",)

    def __init__(self, template: Template) -> None:
        super().__init__(status=template.status, reason=template.reason)
        self._template = template

    async def prepare(self, request: web.BaseRequest) -> None:
        """Write the whole reply (once; later calls do nothing), then wait while the
        connection's write buffer is over its limit, as aiohttp's own end of a reply does.

        ``Connection`` follows aiohttp's rule: ``keep-alive`` on an HTTP/1.0 reply that
        keeps the connection, ``close`` on an HTTP/1.1 reply that does not. A
        ``Keep-Alive`` header the hook set follows it, on a reply that keeps the connection.
        """
        if self._eof_sent:
            return
        keep_alive = self._keep_alive  # False after force_close()
        if keep_alive is None:
            keep_alive = request.keep_alive
        self._keep_alive = keep_alive
        # The listener's reply hook, as aiohttp runs it after choosing the headers: it names
        # the Server (written from the template) and may close the connection, saying so in
        # a Connection header of its own, which then replaces aiohttp's choice.
        await request._prepare_hook(self)
        connection = self.headers.get(hdrs.CONNECTION)
        version = request.version
        template = self._template
        if version == HttpVersion11:
            line, tail = template.status_line_11, (_END if keep_alive else _CLOSE_11)
        elif version == HttpVersion10:
            line, tail = template.status_line_10, (_KEEP_ALIVE_10 if keep_alive else _END)
        else:
            status = f"HTTP/{version[0]}.{version[1]} {template.status} {template.reason}\r\n"
            line, tail = status.encode(), _END
        if connection is not None:
            tail = f"{hdrs.CONNECTION}: {connection}\r\n\r\n".encode()
        advertised = self.headers.get(hdrs.KEEP_ALIVE)  # the hook's idle timeout, if any
        if advertised is not None and keep_alive:
            tail = tail[:-2] + f"{hdrs.KEEP_ALIVE}: {advertised}\r\n\r\n".encode()
        writer = request.writer
        await writer.write(
            b"".join((line, template.head, _clock.date_line(), _SERVER_LINE, tail, template.body))
        )
        await writer.drain()
        self._eof_sent = True
        # What aiohttp reports as a reply's length (the access log's bytes): head and body.
        self._body_length = writer.output_size

    async def write_eof(self, data: bytes = b"") -> None:
        """Nothing left to send: :meth:`prepare` wrote the whole reply."""
        self._eof_sent = True


class Template:
    """The serialized parts of one reply: status line (per HTTP version), the fixed header
    lines (``Content-Length`` included) and the body. Immutable once built."""

    __slots__ = (
        "body",
        "head",
        "headers",
        "reason",
        "status",
        "status_line_10",
        "status_line_11",
    )

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """Raises ValueError when a header name or value holds a line break."""
        if any("\r" in f or "\n" in f for item in headers.items() for f in item):
            raise ValueError(f"a reply header holds a line break: {dict(headers)!r}")
        self.status = status
        self.headers = dict(headers)
        self.reason = HTTPStatus(status).phrase
        self.body = body
        self.status_line_11 = f"HTTP/1.1 {status} {self.reason}\r\n".encode()
        self.status_line_10 = f"HTTP/1.0 {status} {self.reason}\r\n".encode()
        lines = [f"{name}: {value}\r\n" for name, value in headers.items()]
        lines.append(f"{hdrs.CONTENT_LENGTH}: {len(body)}\r\n")
        self.head = "".join(lines).encode()

    def reply(self, request: web.BaseRequest) -> web.StreamResponse:
        """The reply for ``request``: prepared bytes, or a plain response for ``HEAD``."""
        if request.method == hdrs.METH_HEAD:
            return web.Response(status=self.status, headers=self.headers, body=self.body)
        return PreparedReply(self)
