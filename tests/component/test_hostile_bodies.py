"""Hostile bodies against a real daemon: no body may freeze the event loop, slow uploads
hold only what they sent, and pass-through routes never carry a GET/HEAD body, an encoded
body or an oversized one to the upstream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.errors import error_fields

TOKEN = "borrow-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT_MIB = 16


def config(target: str, *, adapter: str = "openai", **limits: Any) -> str:
    """A token-guarded lender whose bodies may be up to LIMIT_MIB; ``limits`` are more (or
    other) keys of ``[server.limits]``; a model ``big`` is too large to ever be admitted."""
    return daemon_toml(
        upstream(
            "up",
            target,
            adapter=adapter,
            models={"default_mib": 1, "footprint_mib": {"big": 100000000}},
        ),
        server={"trust_loopback": None},
        tokens=(token("cluster", TOKEN, "borrow"),),
        limits={
            "max_request_body_mib": LIMIT_MIB,
            "max_buffered_body_mib": 4 * LIMIT_MIB,
            "body_read_timeout_s": 60,
            "body_idle_timeout_s": 10,
            **limits,
        },
        collectors={"poll_s": 0.2},
    )


@asynccontextmanager
async def lender(adapter: str = "openai", **limits: Any) -> AsyncIterator[RunningDaemon]:
    app, _seen = openai_like_app()
    async with serve_app(app) as url:
        async with running_daemon(config(url, adapter=adapter, **limits)) as d:
            await d.wait_ready()
            yield d


async def max_loop_lag(work: Callable[[], Awaitable[None]]) -> float:
    """Run ``work`` while a heartbeat measures the event loop's own lag (seconds).

    A heartbeat that wakes late was held either by code running on the loop or by the
    operating system giving the CPU to other processes (this machine is shared). Only the
    first is the daemon's doing, so each late wake-up counts the CPU time the whole process
    (every thread) spent in that gap, never more than the gap itself: a parser that holds
    the loop burns that time, a descheduled process does not.
    """
    worst = 0.0
    done = False

    async def heartbeat() -> None:
        nonlocal worst
        while not done:
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(0.005)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            worst = max(worst, min(wall, cpu) - 0.005)

    beat = asyncio.get_running_loop().create_task(heartbeat())
    await asyncio.sleep(0.05)
    try:
        await work()
    finally:
        done = True
        await beat
    return worst


def many_field_multipart(size: int) -> tuple[bytes, str]:
    """A multipart body of about ``size`` bytes of small fields, with the model field last."""
    boundary = "b0undary7f3a"
    part = (f'--{boundary}\r\nContent-Disposition: form-data; name="f"\r\n\r\nvalue\r\n').encode()
    tail = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nbig\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    body = part * ((size - len(tail)) // len(part)) + tail
    return body, f"multipart/form-data; boundary={boundary}"


def many_token_json(size: int) -> bytes:
    head, tail = b'{"messages": [', b'{"n": 1}], "model": "big"}'
    item = b'{"role": "user", "content": "x", "n": [1, 2]},'
    return head + item * ((size - len(head) - len(tail)) // len(item)) + tail


@pytest.mark.parametrize("kind", ["multipart", "json"])
async def test_a_body_at_the_limit_never_stalls_the_loop(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = LIMIT_MIB * 1024 * 1024 - 4096
    if kind == "multipart":
        body, ctype = many_field_multipart(size)
        path = "/v1/audio/transcriptions"
    else:
        body, ctype = many_token_json(size), "application/json"
        path = "/v1/chat/completions"
    monkeypatch.setattr("vacancyd.runtime.loops.TARGET_WATCH_S", 3600.0)
    async with lender() as d:
        # the daemon reads the machine's socket table at start (then every 15 s) to see how
        # the upstream listens: tens of ms of CPU on a busy machine, none of it the body's
        # doing, so the measurement starts once that first read is done, with no second one
        # due before it ends
        await d.wait_until(lambda: "up" in d.state.target_exposure, 30)
        answers: list[tuple[int, str]] = []
        host, port = d.daemon.bound["up"].rsplit(":", 1)

        async def send() -> None:
            # a hand-written client, so the test's own side never copies the body at once
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {ctype}\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            view = memoryview(body)
            for offset in range(0, len(body), 64 * 1024):
                writer.write(view[offset : offset + 64 * 1024])
                await writer.drain()
            reply = await reader.read()
            writer.close()
            status = int(reply.split(b" ", 2)[1])
            code = error_fields(json.loads(reply.split(b"\r\n\r\n", 1)[1]))["code"]
            answers.append((status, code))

        lag = await max_loop_lag(send)
    # the model (the last field) was read: the footprint of "big" cannot fit
    assert answers == [(503, "insufficient_capacity")]
    assert lag < 0.05, f"the event loop stalled for {lag * 1000:.0f} ms"


async def test_tricklers_hold_only_what_they_sent() -> None:
    app, _seen = openai_like_app()
    async with serve_app(app) as url:
        toml = config(url, max_buffered_body_mib=2, max_request_body_mib=1)
        async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
            await d.wait_ready()
            url_work = d.proxy_url("up") + "/v1/chat/completions"
            stop = asyncio.Event()

            async def trickle() -> AsyncIterator[bytes]:
                yield b'{"model": "m", "pad": "'
                while not stop.is_set():
                    yield b"x"
                    await asyncio.sleep(0.1)
                yield b'"}'

            tricklers = [
                asyncio.create_task(http.post(url_work, data=trickle(), headers=AUTH))
                for _ in range(6)
            ]
            await asyncio.sleep(0.5)
            statuses = []
            for _ in range(10):
                async with http.post(url_work, json={"model": "m"}, headers=AUTH) as r:
                    statuses.append(r.status)
            stop.set()
            for t in tricklers:
                (await t).release()
    # six uploads that promised up to 1 MiB each under a 2 MiB budget starve nobody
    assert statuses == [200] * 10


class NaiveUpstream:
    """An HTTP/1.1 server that reads request heads only and never a body (some servers
    ignore a GET body), answering each head on the same kept-alive connection. A body it
    was sent is read as the next request, so whatever it saw shows what was forwarded."""

    def __init__(self) -> None:
        self.request_lines: list[str] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                self.request_lines.append(line)
                body = json.dumps({"object": "list", "data": [{"id": line}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            self.server.close()
            await self.server.wait_closed()


async def test_pass_through_bodies_never_reach_a_naive_upstream() -> None:
    naive = NaiveUpstream()
    smuggled = b"GET /v1/models/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    async with naive.serving() as target:
        toml = config(target, max_passthrough_body_kib=4)
        async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
            await d.wait_ready()
            base = d.proxy_url("up")
            async with http.get(base + "/v1/models", headers=AUTH) as r:
                assert r.status == 200
            # a GET body on a pass-through route is refused, not forwarded
            async with http.request("GET", base + "/health", data=smuggled, headers=AUTH) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "body_not_allowed"
            for _ in range(3):
                async with http.get(base + "/v1/models", headers=AUTH) as r:
                    assert r.status == 200
                    assert (await r.json())["data"][0]["id"] == "GET /v1/models HTTP/1.1"
    assert "GET /v1/models/smuggled HTTP/1.1" not in naive.request_lines
    assert not any("health" in line for line in naive.request_lines)


async def test_pass_through_bodies_are_small_and_never_decompressed() -> None:
    zstd = pytest.importorskip("backports.zstd")
    app, seen = openai_like_app()
    async with serve_app(app) as target:
        toml = config(target, adapter="ollama", max_passthrough_body_kib=4)
        async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
            await d.wait_ready()
            show = d.proxy_url("up") + "/api/show"
            bomb = zstd.compress(b"{" + b" " * (64 * 1024 * 1024) + b"}")
            assert len(bomb) < 64 * 1024
            async with http.post(
                show, data=bomb, headers={**AUTH, "Content-Encoding": "zstd"}
            ) as r:
                assert r.status == 415
                assert (await r.json())["code"] == "encoded_body_not_allowed"  # Ollama's shape
            async with http.post(show, data=b"x" * 5000, headers=AUTH) as r:
                assert r.status == 413

            async def chunked() -> AsyncIterator[bytes]:
                for _ in range(10):
                    yield b"y" * 1000

            async with http.post(show, data=chunked(), headers=AUTH) as r:
                assert r.status == 413
    assert not any(s["path"] == "/api/show" for s in seen)
