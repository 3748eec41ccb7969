"""The idle keep-alive timer against requests still arriving, with real sockets: an idle
kept-alive connection closes after ``keepalive_timeout_s``, but a request whose headers or
body are still coming in is never cut by it (the header deadline and the body timeouts
govern it), on the first request of a connection and on later ones alike; and a later
request's headers still have a deadline of their own."""

from __future__ import annotations

import asyncio
import json

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app

#: The idle timer is short and the header deadline long, so any cut by the wrong timer shows.
LIMITS = {"keepalive_timeout_s": 0.4, "header_read_timeout_s": 3, "body_idle_timeout_s": 5}


def target(d: RunningDaemon) -> tuple[str, int]:
    host, port = d.daemon.bound["up"].rsplit(":", 1)
    return host, int(port)


async def trickle(writer: asyncio.StreamWriter, data: bytes, *, step: int, pause_s: float) -> None:
    for i in range(0, len(data), step):
        writer.write(data[i : i + step])
        await writer.drain()
        await asyncio.sleep(pause_s)


async def reply(reader: asyncio.StreamReader) -> bytes:
    """One response (Content-Length framed): its head."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return head


def get(path: str = "/v1/models") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def post(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )


async def test_the_idle_timer_never_cuts_a_request_still_arriving() -> None:
    app, _seen = openai_like_app()
    async with serve_app(app) as url:
        async with running_daemon(daemon_toml(upstream("up", url), limits=LIMITS)) as d:
            await d.wait_ready()
            addr = target(d)
            loop = asyncio.get_running_loop()

            # idle: closed by the keep-alive timer, well before the header deadline
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(get())
            assert (await reply(reader)).startswith(b"HTTP/1.1 200")
            began = loop.time()
            assert await asyncio.wait_for(reader.read(), 3) == b""
            assert loop.time() - began < 2
            writer.close()

            # the first request's headers trickle for ~1.5 s (past the 0.4 s idle timer)
            reader, writer = await asyncio.open_connection(*addr)
            await trickle(writer, get(), step=4, pause_s=0.15)
            assert (await reply(reader)).startswith(b"HTTP/1.1 200")
            # a later request on the same connection, its headers trickling as slowly
            await asyncio.sleep(0.1)
            await trickle(writer, get(), step=4, pause_s=0.15)
            assert (await reply(reader)).startswith(b"HTTP/1.1 200")
            # and a later request whose body trickles past the idle timer
            body = json.dumps({"model": "m", "messages": []}).encode()
            await asyncio.sleep(0.1)
            writer.write(post(body))
            await trickle(writer, body, step=6, pause_s=0.15)
            assert (await reply(reader)).startswith(b"HTTP/1.1 200")
            writer.close()


async def test_a_later_request_still_has_a_header_deadline() -> None:
    app, _seen = openai_like_app()
    async with serve_app(app) as url:
        async with running_daemon(daemon_toml(upstream("up", url), limits=LIMITS)) as d:
            await d.wait_ready()
            reader, writer = await asyncio.open_connection(*target(d))
            writer.write(get())
            assert (await reply(reader)).startswith(b"HTTP/1.1 200")
            # the next request's headers never complete: cut at the 3 s header deadline,
            # however often a byte arrives
            loop = asyncio.get_running_loop()
            began = loop.time()

            async def forever() -> None:
                while True:
                    writer.write(b"X")
                    await writer.drain()
                    await asyncio.sleep(0.2)

            writer.write(b"GET /v1/models HTTP/1.1\r\nX-Slow: ")
            dripping = loop.create_task(forever())
            try:
                assert await asyncio.wait_for(reader.read(), 8) == b""
            finally:
                dripping.cancel()
                await asyncio.gather(dripping, return_exceptions=True)
            assert 2.5 < loop.time() - began < 6
            writer.close()


async def test_replies_that_keep_the_connection_say_for_how_long() -> None:
    """``Keep-Alive: timeout=N`` (the idle timeout, whole seconds) on every reply that keeps
    its connection, on a proxy listener (forwarded, refused) and on the API listener; none
    on a reply that closes it."""
    app, _ = openai_like_app()
    async with serve_app(app) as t:
        toml = daemon_toml(upstream("up", t), limits={"keepalive_timeout_s": 30.5})
        async with running_daemon(toml) as d:
            await d.wait_ready()
            host, port = target(d)
            api_host, api_port = d.daemon.bound["api"].rsplit(":", 1)
            body = json.dumps({"model": "m", "messages": []}).encode()
            d.state.set_lending(False)  # the chat request is refused (a prepared reply)
            heads = []
            for where, data in (
                ((host, port), get()),  # forwarded to the upstream
                ((host, port), post(body) + body),  # refused by the gate
                ((api_host, int(api_port)), get("/healthz")),  # the API listener
            ):
                reader, writer = await asyncio.open_connection(*where)
                writer.write(data)
                heads.append(await reply(reader))
                writer.write(data.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
                heads.append(await reply(reader))
                writer.close()
    kept, closed = heads[0::2], heads[1::2]
    assert [h.split(b"\r\n", 1)[0] for h in kept] == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 503 Service Unavailable",
        b"HTTP/1.1 200 OK",
    ]
    assert all(b"\r\nKeep-Alive: timeout=30\r\n" in h for h in kept), kept
    assert not any(b"Keep-Alive" in h for h in closed), closed
    assert all(b"\r\nConnection: close\r\n" in h for h in closed), closed
