"""The proxy's connections to its upstream: kept-alive connections are reused, and a request
sent on one that the upstream closed as it went out is sent once more on a fresh one, never
when the connection was fresh or the upstream had started to reply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import running_daemon

REPLY = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
    }
).encode()


@dataclass
class KeepAliveUpstream:
    """A raw HTTP/1.1 server that answers every request with a chat completion on a kept-alive
    connection, as llama-server does, and drops a connection that sat idle: a request that
    arrives on a connection idle for ``idle_close_s`` seconds or more is met by closing it
    unanswered (the server's keep-alive timer fired as the request went out).

    ``mode``: ``"close"`` as above; ``"partial"``: the idle connection gets the first bytes
    of a status line before the close; ``"never"``: every connection is closed unanswered.
    """

    idle_close_s: float = 0.3
    mode: str = "close"
    connections: int = 0
    #: (connection number, request line, body) for each request the server read.
    requests: list[tuple[int, str, bytes]] = field(default_factory=list)
    dropped: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        self.connections += 1
        number = self.connections
        served_at: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                length = 0
                for f in fields:
                    name, _, value = f.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append((number, line, body))
                idle = served_at is not None and loop.time() - served_at >= self.idle_close_s
                if self.mode == "never" or idle:
                    self.dropped += 1
                    if self.mode == "partial":
                        writer.write(b"HTTP/1.1 2")
                        await writer.drain()
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(REPLY)}\r\n\r\n".encode()
                    + REPLY
                )
                await writer.drain()
                served_at = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()
            await server.wait_closed()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(http: aiohttp.ClientSession, url: str, n: int) -> tuple[int, dict[str, object]]:
    body = {**CHAT, "messages": [{"role": "user", "content": f"request {n}"}]}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def test_kept_alive_connections_are_reused() -> None:
    fake = KeepAliveUpstream(idle_close_s=60)
    async with fake.serving() as target, running_daemon(daemon_toml(upstream("up", target))) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            for n in range(5):
                assert (await post(http, d.proxy_url("up"), n))[0] == 200
    assert fake.connections == 1 and len(fake.requests) == 5 and fake.dropped == 0


async def test_a_request_on_a_kept_alive_connection_just_closed_is_sent_again() -> None:
    fake = KeepAliveUpstream(idle_close_s=0.3)
    async with fake.serving() as target, running_daemon(daemon_toml(upstream("up", target))) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            assert (await post(http, d.proxy_url("up"), 1))[0] == 200
            await asyncio.sleep(0.5)  # the upstream now drops that connection when used
            status, reply = await post(http, d.proxy_url("up"), 2)
    assert status == 200 and reply["object"] == "chat.completion"
    assert fake.dropped == 1 and fake.connections == 2
    (c1, _, first), (c2, _, dropped), (c3, line, replayed) = fake.requests
    assert (c1, c2, c3) == (1, 1, 2)
    assert line == "POST /v1/chat/completions HTTP/1.1"
    assert replayed == dropped and b"request 2" in replayed and b"request 1" in first
    assert not d.state.ledger.jobs()


async def test_a_fresh_connection_closed_before_a_reply_is_not_sent_again() -> None:
    fake = KeepAliveUpstream(mode="never")
    async with fake.serving() as target, running_daemon(daemon_toml(upstream("up", target))) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            status, reply = await post(http, d.proxy_url("up"), 1)
    assert status == 502
    error = reply["error"]
    assert isinstance(error, dict) and error["code"] == "upstream_protocol_error"
    assert len(fake.requests) == 1 and fake.connections == 1


async def test_a_reused_connection_that_began_a_reply_is_not_sent_again() -> None:
    fake = KeepAliveUpstream(idle_close_s=0.3, mode="partial")
    async with fake.serving() as target, running_daemon(daemon_toml(upstream("up", target))) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            assert (await post(http, d.proxy_url("up"), 1))[0] == 200
            await asyncio.sleep(0.5)
            status, reply = await post(http, d.proxy_url("up"), 2)
    assert status == 502
    error = reply["error"]
    assert isinstance(error, dict) and error["code"] == "upstream_protocol_error"
    assert len(fake.requests) == 2 and fake.connections == 1 and fake.dropped == 1
