"""What the proxy's fast paths must not change: replies sent in one write keep their exact
status, headers and body; HEAD and bodiless replies pass as sent; Expect keeps aiohttp's
semantics off the router; upstream cookies are never kept for the next borrower; every
reply names vacancyd as its Server; and
back-to-back borrowed requests are admitted on uvloop, whose loop clock is coarse."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from tests.support.daemon import (
    RunningDaemon,
    openai_like_app,
    running_daemon,
    serve_app,
    single_upstream_toml,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def lender_toml(target: str) -> str:
    return single_upstream_toml(api=0, proxy=0, target=target)


async def raw_exchange(d: RunningDaemon, request: bytes) -> bytes:
    """Send ``request`` bytes to the proxy listener; everything it answers until it closes."""
    host, port = d.daemon.bound["up"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


@pytest.fixture
def shaped_upstream() -> web.Application:
    """An OpenAI-like upstream with replies of every framing the proxy must pass intact."""
    app, _ = openai_like_app()

    async def created(_: web.Request) -> web.Response:
        return web.Response(
            status=201,
            body=b'{"id": "x",  "spaced":  true}',
            content_type="application/json",
            headers={"X-Upstream": "kept", "Cache-Control": "no-store"},
        )

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"part one, ")
        await resp.write(b"part two")
        await resp.write_eof()
        return resp

    async def empty(_: web.Request) -> web.Response:
        return web.Response(status=204, headers={"X-Upstream": "no body"})

    app.router.add_get("/v1/models/created", created)
    app.router.add_get("/v1/models/chunked", chunked)
    app.router.add_get("/v1/models/empty", empty)
    return app


async def test_complete_replies_keep_status_headers_and_body(
    shaped_upstream: web.Application,
) -> None:
    # The openai adapter passes /v1/models/{id} reads through.
    async with serve_app(shaped_upstream) as base, running_daemon(lender_toml(base)) as d:
        await d.wait_ready()
        proxy = d.proxy_url("up")
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy + "/v1/models/created") as r:
                assert r.status == 201
                assert await r.read() == b'{"id": "x",  "spaced":  true}'
                assert r.headers["X-Upstream"] == "kept"
                assert r.headers["Cache-Control"] == "no-store"
                assert r.headers["Content-Type"] == "application/json"
                assert r.headers["Content-Length"] == "29"
                assert r.headers["Server"] == "vacancyd"
            async with http.get(proxy + "/v1/models/chunked") as r:
                assert r.status == 200
                assert await r.read() == b"part one, part two"
            async with http.get(proxy + "/v1/models/empty") as r:
                assert r.status == 204
                assert r.headers["X-Upstream"] == "no body"
                assert await r.read() == b""
            async with http.post(proxy + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["message"]["content"] == "hi"


async def test_head_keeps_the_upstream_content_length(shaped_upstream: web.Application) -> None:
    async with serve_app(shaped_upstream) as base, running_daemon(lender_toml(base)) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/v1/models") as r:
                length = len(await r.read())
        data = await raw_exchange(
            d, b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert f"Content-Length: {length}".encode() in head
        assert body == b""


async def test_unknown_expectation_is_417_and_http10_expect_is_ignored() -> None:
    app, seen = openai_like_app()
    async with serve_app(app) as base, running_daemon(lender_toml(base)) as d:
        await d.wait_ready()
        data = await raw_exchange(
            d,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nConnection: close\r\n\r\n",
        )
        assert data.startswith(b"HTTP/1.1 417"), data[:80]
        assert b"\r\nServer: vacancyd\r\n" in data
        assert not seen
        data = await raw_exchange(
            d, b"GET /v1/models HTTP/1.0\r\nHost: x\r\nExpect: teapot\r\n\r\n"
        )
        assert data.startswith(b"HTTP/1.0 200") or data.startswith(b"HTTP/1.1 200"), data[:80]
        assert [s["path"] for s in seen] == ["/v1/models"]


async def test_upstream_cookies_are_not_replayed_to_the_next_borrower() -> None:
    """The proxy's own client keeps no cookie the upstream sets, so another borrower's
    request carries none (``localhost`` is a name an ordinary cookie jar would store
    cookies for; the header hygiene also keeps Set-Cookie from borrowers)."""
    cookies_seen: list[str | None] = []

    async def login(request: web.Request) -> web.Response:
        cookies_seen.append(request.headers.get("Cookie"))
        resp = web.json_response({"object": "list", "data": []})
        resp.set_cookie("session", "borrower-a-secret")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", login)
    async with serve_app(app) as base:
        target = base.replace("127.0.0.1", "localhost")
        async with running_daemon(lender_toml(target)) as d:
            await d.wait_ready()
            url = d.proxy_url("up") + "/v1/models"
            async with aiohttp.ClientSession() as borrower_a, borrower_a.get(url) as r:
                assert r.status == 200
            async with aiohttp.ClientSession() as borrower_b, borrower_b.get(url) as r:
                assert r.status == 200
    assert cookies_seen == [None, None]


def test_back_to_back_borrowed_requests_are_admitted_on_uvloop() -> None:
    """Each request is released just before the next arrives, so each admission needs a
    capacity sample taken after that release. uvloop's loop clock only moves once per loop
    iteration, in whole milliseconds: stamping with it made the release and its sample tie,
    and every back-to-back request was refused ``resource_busy``."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> list[int]:
        app, _ = openai_like_app()
        statuses = []
        async with serve_app(app) as base, running_daemon(lender_toml(base)) as d:
            await d.wait_ready()
            url = d.proxy_url("up") + "/v1/chat/completions"
            async with aiohttp.ClientSession() as http:
                for _ in range(40):
                    async with http.post(url, json=CHAT) as r:
                        await r.read()
                        statuses.append(r.status)
        return statuses

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == [200] * 40
