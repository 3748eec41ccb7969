"""The proxy's forwarding client against raw HTTP/1.1 servers: framing, interim replies,
reuse, oversized headers, back-pressure and the silence limit (vacancyd/proxy/client.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from vacancyd.proxy import client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handle: Handler) -> AsyncIterator[client.UpstreamClient]:
    """A server running ``handle`` per connection, and a client pointed at it; on exit the
    client is closed and every connection's handler has finished and closed its socket."""
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handle(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = client.UpstreamClient("127.0.0.1", port, connect_timeout_s=5)
    try:
        yield upstream
    finally:
        await upstream.close()
        server.close()
        await server.wait_closed()
        if handlers:
            await asyncio.wait(handlers, timeout=5)


async def read_request(reader: asyncio.StreamReader) -> str:
    head = await reader.readuntil(b"\r\n\r\n")
    line = head.split(b"\r\n", 1)[0].decode()
    for field in head.split(b"\r\n")[1:]:
        if field.lower().startswith(b"content-length:"):
            await reader.readexactly(int(field.split(b":", 1)[1]))
    return line


async def body_of(response: client.Response) -> bytes:
    data = b""
    async for chunk in response.iter_chunks():
        data += chunk
    response.release()
    return data


HOST = [("Host", "127.0.0.1")]


async def test_chunked_replies_are_reassembled_and_the_connection_reused() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                await read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
                )
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async with raw_server(handle) as upstream:
        for _ in range(3):
            response = await upstream.request("POST", "/v1/x", HOST, b"{}")
            assert response.status == 200 and await body_of(response) == b"hello world"
    assert connections == 1


async def test_head_replies_have_no_body_and_their_connection_is_not_reused() -> None:
    lines: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                lines.append(await read_request(reader))
                if lines[-1].startswith("HEAD"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async with raw_server(handle) as upstream:
        head = await upstream.request("HEAD", "/v1/models", HOST, None)
        assert head.status == 200 and head.headers["Content-Length"] == "1234"
        assert await body_of(head) == b""
        empty = await upstream.request("DELETE", "/v1/x", HOST, None)
        assert empty.status == 204 and await body_of(empty) == b""
        again = await upstream.request("DELETE", "/v1/x", HOST, None)
        assert again.status == 204 and await body_of(again) == b""
    assert lines == ["HEAD /v1/models HTTP/1.1", "DELETE /v1/x HTTP/1.1", "DELETE /v1/x HTTP/1.1"]


async def test_interim_replies_are_skipped() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
        )
        await writer.drain()
        writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("POST", "/v1/x", HOST, b"{}")
        assert response.status == 201 and response.reason == "Created"
        assert "Link" not in response.headers
        assert await body_of(response) == b"ok"


async def test_a_close_delimited_body_ends_with_the_connection() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("GET", "/v1/models", HOST, None)
        assert await body_of(response) == b"all of it"


async def test_a_body_cut_short_is_a_broken_body() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("GET", "/v1/models", HOST, None)
        with pytest.raises(client.BrokenBody):
            await body_of(response)
        response.close()


async def test_oversized_reply_headers_are_a_bad_response() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n\r\n")
        await writer.drain()
        writer.close()

    async with raw_server(handle) as upstream:
        with pytest.raises(client.BadResponse, match="exceed"):
            await upstream.request("GET", "/v1/models", HOST, None)


async def test_nothing_listening_is_connect_failed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    upstream = client.UpstreamClient("127.0.0.1", port, connect_timeout_s=5)
    with pytest.raises(client.ConnectFailed):
        await upstream.request("GET", "/", HOST, None)
    await upstream.close()


async def test_a_slow_consumer_stops_the_upstream_being_read() -> None:
    sent = 0
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        total = 64 * 1024 * 1024
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        block = b"x" * 65536
        try:
            while sent < total:
                writer.write(block)
                await writer.drain()
                sent += len(block)
        except ConnectionError:
            pass
        finally:
            done.set()
            writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("GET", "/big", HOST, None)
        await asyncio.sleep(0.5)  # the consumer reads nothing for a while
        # only what the socket buffers hold got through: far less than the body
        assert response.buffered <= client.READ_LIMIT_BYTES + 65536 * 4
        assert sent < 32 * 1024 * 1024
        chunks = response.iter_chunks()
        assert await anext(chunks)
        response.close()  # the consumer gives up: the upstream sees its client go
        await asyncio.wait_for(done.wait(), 10)
    assert sent < 64 * 1024 * 1024


async def test_silence_before_the_reply_ends_the_exchange() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # accepts the request and says nothing until the client goes
        writer.close()

    async with raw_server(handle) as upstream:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(client.UpstreamSilent):
            await upstream.request("POST", "/v1/x", HOST, b"{}", silence_s=0.3)
        assert 0.25 <= loop.time() - began < 2


async def test_silence_counts_from_the_last_byte_of_a_stream() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):  # a byte every 0.2 s: never silent for 0.5 s
            writer.write(b"1\r\na\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        await reader.read()  # then nothing until the client goes
        writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("POST", "/v1/x", HOST, b"{}", silence_s=0.5)
        received = b""
        with pytest.raises(client.UpstreamSilent):
            async for chunk in response.iter_chunks():
                received += chunk
        assert received == b"aaaa"
        response.close()


def test_a_header_value_that_would_break_the_framing_is_refused() -> None:
    with pytest.raises(ValueError, match="framing"):
        client._request_head("GET", "/", [("X-A", "v\r\nX-Injected: 1")], None)
    head = client._request_head("POST", "/v1/x?a=1", HOST, b"abc")
    assert head == b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\n"


async def test_a_large_body_is_sent_whole_in_slices() -> None:
    received = b""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(f.split(b":", 1)[1])
            for f in head.split(b"\r\n")
            if f.lower().startswith(b"content-length:")
        )
        while len(received) < length:
            received += await reader.read(65536)
            await asyncio.sleep(0)  # a server that reads at its own pace
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    body = bytes(range(256)) * (24 * 1024)  # 6 MiB, past LARGE_BODY_BYTES
    assert len(body) > client.LARGE_BODY_BYTES
    async with raw_server(handle) as upstream:
        response = await upstream.request("POST", "/v1/upload", HOST, body)
        assert response.status == 200 and await body_of(response) == b"ok"
    assert received == body


async def test_an_early_reply_to_a_large_upload_is_delivered() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # answers before reading the body
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig")
        await writer.drain()
        try:
            while await reader.read(65536):  # then drops the rest until the client goes
                pass
        except ConnectionError:
            pass
        writer.close()

    async with raw_server(handle) as upstream:
        response = await upstream.request("POST", "/v1/upload", HOST, b"x" * (32 * 1024 * 1024))
        assert response.status == 413
        assert await body_of(response) == b"big"


async def test_an_aborted_call_ends_the_wait_for_the_reply_at_once() -> None:
    """A cut (:meth:`client.Call.abort`) while the reply's headers are awaited raises Cut in
    the waiting caller at once, without cancelling its task, and closes the connection."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers; returns when the client closes
        closed.set()

    async with raw_server(handle) as upstream:
        call = client.Call()
        pending = asyncio.get_running_loop().create_task(
            upstream.request("GET", "/slow", HOST, None, call=call)
        )
        await asyncio.sleep(0.1)
        call.abort()
        with pytest.raises(client.Cut):
            await asyncio.wait_for(pending, 1)
        assert not pending.cancelled()
        await asyncio.wait_for(closed.wait(), 2)


async def test_an_aborted_call_ends_a_body_read_and_drops_what_was_buffered() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handle) as upstream:
        call = client.Call()
        response = await upstream.request("GET", "/stream", HOST, None, call=call)
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"first"

        async def next_chunk() -> bytes:
            return await anext(chunks)

        reading = asyncio.get_running_loop().create_task(next_chunk())
        await asyncio.sleep(0.05)
        call.abort()
        with pytest.raises(client.Cut):
            await asyncio.wait_for(reading, 1)
        response.release()


async def test_a_call_aborted_before_it_starts_sends_nothing() -> None:
    asked: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await read_request(reader))

    async with raw_server(handle) as upstream:
        call = client.Call()
        call.abort()
        call.abort()  # idempotent
        with pytest.raises(client.Cut):
            await upstream.request("GET", "/never", HOST, None, call=call)
        await asyncio.sleep(0.05)
        assert asked == []


async def test_an_aborted_call_ends_a_connect_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connect that hangs (a black-holed address) is stopped by the cut at once, well
    before the connect deadline, and the caller's task is not cancelled."""
    loop = asyncio.get_running_loop()

    async def hanging(*_args: object, **_kw: object) -> tuple[asyncio.BaseTransport, object]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    monkeypatch.setattr(loop, "create_connection", hanging)
    upstream = client.UpstreamClient("127.0.0.1", 9, connect_timeout_s=30)
    call = client.Call()
    pending = loop.create_task(upstream.request("GET", "/", HOST, None, call=call))
    await asyncio.sleep(0.05)
    started = loop.time()
    call.abort()
    with pytest.raises(client.Cut):
        await asyncio.wait_for(pending, 1)
    assert loop.time() - started < 1 and not pending.cancelled()
    await upstream.close()
