"""The forwarding client against a raw HTTP/1.1 server that sends unusual but parseable
replies: what the reply's header section says is what the proxy sees, and a reply the
client refuses is refused with an error that says why."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from vacancyd.proxy import client


@asynccontextmanager
async def raw_server(reply: bytes) -> AsyncIterator[int]:
    """Answer every request (read up to the end of its header section) with ``reply``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            await reader.read()  # keep the connection until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def fetch(port: int) -> tuple[client.Response, bytes]:
    upstream = client.UpstreamClient("127.0.0.1", port, connect_timeout_s=2)
    try:
        response = await upstream.request("GET", "/", [("Host", "x")], None)
        body = b"".join([chunk async for chunk in response.iter_chunks()])
        response.release()
        return response, body
    finally:
        await upstream.close()


async def test_trailer_fields_do_not_become_reply_headers() -> None:
    # A chunked reply's trailer section comes after the body: its fields are not part of
    # the header section the proxy copies to the borrower (RFC 9110 §6.5), so an upstream
    # cannot set a header such as Content-Type or X-Anything after the fact through it.
    reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Checksum\r\n\r\n2\r\n{}\r\n0\r\n"
        b"X-Checksum: abc\r\nContent-Type: text/html\r\n\r\n"
    )
    async with raw_server(reply) as port:
        response, body = await fetch(port)
    assert body == b"{}"
    assert "X-Checksum" not in response.headers
    assert response.headers.getall("Content-Type") == ["application/json"]


async def test_oversized_reply_headers_are_refused_with_the_limit_named() -> None:
    reply = (
        b"HTTP/1.1 200 OK\r\nX-Big: "
        + b"a" * (client.MAX_HEADER_BYTES + 1)
        + b"\r\nContent-Length: 2\r\n\r\nok"
    )
    async with raw_server(reply) as port:
        with pytest.raises(client.BadResponse, match=f"{client.MAX_HEADER_BYTES} bytes"):
            await fetch(port)


async def test_too_many_reply_header_lines_are_refused_with_the_limit_named() -> None:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(client.MAX_HEADERS + 1))
    reply = b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 2\r\n\r\nok"
    async with raw_server(reply) as port:
        with pytest.raises(client.BadResponse, match=f"{client.MAX_HEADERS} lines"):
            await fetch(port)
