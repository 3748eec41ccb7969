"""The refusal fast path keeps what a borrower and an operator see: a serialized reply goes on
the wire byte for byte as aiohttp's own ``web.Response`` would send it (every HTTP version
and keep-alive combination, a forced close, HEAD), and a refusal flood is still counted and
timed per request, and logged once per reason with the rest counted in a summary line."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.daemon import openai_like_app, running_daemon, serve_app, single_upstream_toml
from vacancyd.proxy.app import ProxyRequest
from vacancyd.proxy.reply import PreparedReply, Template
from vacancyd.runtime.daemon import reply_headers
from vacancyd.web import access

HEADERS = {
    "Retry-After": "300",
    "x-should-retry": "false",
    "Content-Type": "application/json; charset=utf-8",
}
BODY = b'{"error": {"message": "No vacancy: test", "code": "lending_disabled"}}'
DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")


@asynccontextmanager
async def low_level_server(
    handler: Callable[[web.BaseRequest], Any], drain: bool = False
) -> AsyncIterator[tuple[str, int]]:
    """An aiohttp low-level server on loopback whose requests are proxy requests with the
    daemon's own reply hook (``Keep-Alive: timeout=75`` while serving; every reply closing
    its connection when ``drain``)."""
    loop = asyncio.get_running_loop()
    hook = reply_headers(SimpleNamespace(stopping=drain), 75.0)  # type: ignore[arg-type]

    class Hooked(ProxyRequest):
        async def _prepare_hook(self, response: web.StreamResponse) -> None:
            await hook(self, response)

    request_class = Hooked

    def make_request(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        return request_class(message, payload, protocol, writer, task, loop)

    server = web.Server(handler, request_factory=make_request)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield host, port
    finally:
        await runner.cleanup()


async def exchange(target: tuple[str, int], data: bytes) -> bytes:
    """Send ``data``; what comes back until the server closes or 0.3 s pass in silence."""
    reader, writer = await asyncio.open_connection(*target)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 0.3):
            out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


REQUESTS = {
    "1.1 keep-alive": b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
    "1.1 close": b"POST /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
    "1.0": b"POST /x HTTP/1.0\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
    "1.0 keep-alive": b"POST /x HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
    "HEAD": b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\n",
    "two pipelined": b"GET /x HTTP/1.1\r\nHost: h\r\n\r\nGET /x HTTP/1.1\r\nHost: h\r\n\r\n",
}


@pytest.mark.parametrize("drain", [False, True], ids=["serving", "draining"])
@pytest.mark.parametrize("close", [False, True], ids=["as asked", "force_close"])
@pytest.mark.parametrize("request_bytes", list(REQUESTS.values()), ids=list(REQUESTS))
async def test_a_prepared_reply_is_the_bytes_a_plain_response_sends(
    request_bytes: bytes, close: bool, drain: bool
) -> None:
    template = Template(503, HEADERS, BODY)

    async def prepared(request: web.BaseRequest) -> web.StreamResponse:
        reply = template.reply(request)
        if close:
            reply.force_close()
        return reply

    async def plain(_: web.BaseRequest) -> web.StreamResponse:
        reply = web.Response(status=503, headers=HEADERS, body=BODY)
        if close:
            reply.force_close()
        return reply

    async with low_level_server(prepared, drain) as a, low_level_server(plain, drain) as b:
        ours, theirs = await exchange(a, request_bytes), await exchange(b, request_bytes)
    assert theirs.startswith(b"HTTP/1."), theirs
    assert DATE.sub(b"\r\nDate: -\r\n", ours) == DATE.sub(b"\r\nDate: -\r\n", theirs)
    assert b"\r\nServer: vacancyd\r\n" in ours
    kept = not drain and not close and b"close" not in request_bytes
    kept = kept and (b"HTTP/1.1" in request_bytes or b"keep-alive" in request_bytes)
    assert (b"\r\nKeep-Alive: timeout=75\r\n" in ours) == kept, ours


async def test_a_prepared_reply_reports_its_length_and_keep_alive_to_aiohttp() -> None:
    template = Template(429, {"Retry-After": "2"}, b"{}")
    seen: list[PreparedReply] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        reply = template.reply(request)
        assert isinstance(reply, PreparedReply)
        seen.append(reply)
        return reply

    async with low_level_server(handler) as target:
        data = await exchange(target, REQUESTS["1.1 keep-alive"])
    assert data.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
    (reply,) = seen
    assert reply.prepared and reply.keep_alive
    assert reply.body_length == len(data)  # head and body, as aiohttp counts a reply


def test_a_header_with_a_line_break_is_refused_when_the_template_is_built() -> None:
    with pytest.raises(ValueError, match="line break"):
        Template(503, {"Retry-After": "2\r\nX-Injected: 1"}, b"{}")


async def test_a_refusal_flood_is_counted_and_timed_per_request_and_logged_per_reason(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(access, "WINDOW_S", 600.0)  # one window for the whole test
    app, _ = openai_like_app()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        serve_app(app) as base,
        running_daemon(single_upstream_toml(api=0, proxy=0, target=base)) as d,
    ):
        await d.wait_ready()
        d.state.set_lending(False)
        caplog.set_level(logging.INFO, logger="vacancyd.access.up")
        url = d.proxy_url("up") + "/v1/chat/completions"
        wire_sizes = set()
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(url, json=chat) as r:
                    assert r.status == 503
                    assert r.headers["Retry-After"] == "300"
                    assert r.headers["Server"] == "vacancyd"
                    body = await r.read()
                    assert (await r.json())["error"]["code"] == "lending_disabled"
                    head = len(f"HTTP/1.1 {r.status} {r.reason}\r\n\r\n")
                    head += sum(len(k) + len(v) + 4 for k, v in r.raw_headers)
                    wire_sizes.add(head + len(body))
            async with http.get(d.api_url + "/metrics") as r:
                metrics = await r.text()
        lines = [
            rec
            for rec in caplog.records
            if rec.name == "vacancyd.access.up" and "POST" in rec.getMessage()
        ]
    assert len(lines) == 1  # the first of the window; the other two are in its summary
    (summary,) = [r for r in caplog.records if "more refusals" in r.getMessage()]
    assert summary.__dict__["count"] == 2
    assert summary.__dict__["reason"] == "lending_disabled"
    for rec in lines:
        assert rec.getMessage().split('"')[1] == "POST /v1/chat/completions HTTP/1.1"
        assert rec.__dict__["status"] == 503
        assert rec.__dict__["route_class"] == "work"
        assert rec.__dict__["reason"] == "lending_disabled"
        sent = int(rec.getMessage().split('"')[2].split()[1])
        assert {sent} == wire_sizes  # the bytes sent: head and body, as aiohttp counts them
    assert re.search(
        r'vacancyd_request_duration_seconds_count\{route_class="work",upstream="up"\} 3\.0',
        metrics,
    ), metrics
    assert re.search(
        r'vacancyd_proxy_requests_total\{code="503",route_class="work",upstream="up"\} 3\.0',
        metrics,
    )
