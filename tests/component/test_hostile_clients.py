"""Hostile clients against a real daemon: anonymous floods from one peer leave others served,
probes are answered when a listener is full, the cap is exact, web pages cannot drive a
loopback-trusted daemon, header hygiene both ways, idle and header deadlines apart, and
unparseable requests get the JSON envelope."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from vacancyd.web.site import GuardedTCPSite

TOKEN = "borrow-token-0123456789"
READ = "read-token-0123456789ab"
ADMIN = "admin-token-0123456789a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def config(
    target: str,
    *,
    server: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    upstream_keys: Mapping[str, Any] | None = None,
    listen: str = "127.0.0.1:0",
) -> str:
    """A token-guarded lender (borrow, read and admin tokens) whose headers must arrive
    within 5 s unless ``limits`` says otherwise; ``server``, ``limits`` and
    ``upstream_keys`` are more keys of ``[server]``, ``[server.limits]`` and the upstream."""
    return daemon_toml(
        upstream("up", target, listen=listen, **(upstream_keys or {}), models={"default_mib": 1}),
        server={"trust_loopback": None, **(server or {})},
        tokens=(
            token("cluster", TOKEN, "borrow"),
            token("prom", READ, "read"),
            token("ops", ADMIN, "admin"),
        ),
        limits={"header_read_timeout_s": 5, **(limits or {})},
        collectors={"poll_s": 0.2},
    )


@asynccontextmanager
async def lender(
    *, app: web.Application | None = None, **kw: Any
) -> AsyncIterator[tuple[RunningDaemon, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    if app is None:
        app, seen = openai_like_app()
    async with serve_app(app) as url:
        async with running_daemon(config(url, **kw)) as d:
            await d.wait_ready()
            yield d, seen


def addr(d: RunningDaemon, listener: str) -> tuple[str, int]:
    host, port = d.daemon.bound[listener].rsplit(":", 1)
    return host, int(port)


async def open_from(source: str, target: tuple[str, int]) -> socket.socket:
    """A non-blocking TCP connection from the local address ``source``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    await loop.sock_connect(sock, target)
    return sock


async def raw(target: tuple[str, int], data: bytes, source: str = "127.0.0.1") -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection(*target, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return out


def json_of(response: bytes) -> Any:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


# -- pre-auth flood ------------------------------------------------------------------------


async def test_a_slow_header_flood_from_one_peer_leaves_others_served() -> None:
    async with lender() as (d, _seen), aiohttp.ClientSession() as http:
        flood: list[socket.socket] = []
        try:
            for listener in ("up", "api"):
                for _ in range(500):
                    sock = await open_from("127.0.0.2", addr(d, listener))
                    with suppress(BlockingIOError):
                        sock.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
                    flood.append(sock)
            await asyncio.sleep(0.3)
            for _ in range(20):
                async with http.get(d.proxy_url("up") + "/v1/models", headers=AUTH) as r:
                    assert r.status == 200
                async with http.post(
                    d.proxy_url("up") + "/v1/chat/completions", json={"model": "m"}, headers=AUTH
                ) as r:
                    assert r.status == 200
                async with http.get(d.api_url + "/healthz") as r:
                    assert r.status == 200
            refused = d.daemon.metrics.connections_refused
            assert refused.labels("up", "peer")._value.get() >= 400
        finally:
            for sock in flood:
                sock.close()


async def test_a_flood_does_not_lock_out_its_own_address() -> None:
    """Every local client is 127.0.0.1: a slow-header flood from one address must not lock
    the owner's admin calls, its health checks or a borrower out because they share it. A
    newcomer takes the place of the address's oldest idle connection instead."""
    async with lender() as (d, _seen):
        flood: list[socket.socket] = []
        try:
            for listener in ("up", "api"):
                for _ in range(300):
                    sock = await open_from("127.0.0.2", addr(d, listener))
                    with suppress(BlockingIOError):
                        sock.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
                    flood.append(sock)
            await asyncio.sleep(0.3)
            served: dict[str, int] = {}
            for source in ("127.0.0.2", "127.0.0.3"):
                connector = aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)
                async with aiohttp.ClientSession(connector=connector) as http:
                    for _ in range(5):
                        for what, method, url, headers in (
                            ("healthz", "GET", d.api_url + "/healthz", {}),
                            (
                                "admin",
                                "GET",
                                d.api_url + "/status",
                                {"Authorization": f"Bearer {ADMIN}"},
                            ),
                            ("borrow", "GET", d.proxy_url("up") + "/v1/models", AUTH),
                        ):
                            async with http.request(method, url, headers=headers) as r:
                                key = f"{what} from {source}"
                                served[key] = served.get(key, 0) + (r.status == 200)
            assert served == {
                f"{what} from {source}": 5
                for source in ("127.0.0.2", "127.0.0.3")
                for what in ("healthz", "admin", "borrow")
            }
            # the flood itself stays within its share: its newest connections displaced
            # its oldest, never another address's
            for listener in ("up", "api"):
                guard = guard_of(d, listener)
                assert guard.per_peer["127.0.0.2"] <= guard.limits.max_unauthenticated // 2
            refused = d.daemon.metrics.connections_refused
            assert refused.labels("up", "peer")._value.get() >= 300 - 64
            # the displaced ones were told why (on either loop), none was reset
            answers: Counter[Any] = Counter()
            for sock in flood:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    answers["open"] += 1
                except ConnectionResetError:
                    answers["reset"] += 1
                else:
                    limit = (
                        json_of(data)["error"]["limit"]
                        if data.startswith(b"HTTP/1.1 503 ")
                        else data[:20]
                    )
                    answers[limit] += 1
            assert answers["reset"] == 0 and answers["peer"] >= 2 * (300 - 64), answers
        finally:
            for sock in flood:
                sock.close()


async def test_probes_are_answered_and_the_cap_is_exact_when_the_listener_is_full() -> None:
    limits = {
        "max_connections": 32,
        "max_unauthenticated_connections": 32,
        "max_unauthenticated_per_peer": 1000,
    }
    async with lender(limits=limits) as (d, _seen), aiohttp.ClientSession() as http:
        # a burst from many addresses at once: never more than 32 open, the rest get 503
        site = next(iter(d.daemon._runners["api"].sites))
        assert isinstance(site, GuardedTCPSite)
        guard = site.guard
        peak = 0
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, guard.open)
                await asyncio.sleep(0)

        sampler = asyncio.get_running_loop().create_task(sample())
        target = addr(d, "api")
        burst = await asyncio.gather(
            *(open_from(f"127.0.1.{i % 250 + 1}", target) for i in range(300))
        )
        try:
            await asyncio.sleep(2)  # refused ones may wait 1 s for a probe's head first
            refused = 0
            for sock in burst:
                with suppress(BlockingIOError):
                    if sock.recv(65536).startswith(b"HTTP/1.1 503"):
                        refused += 1
            sampling = False
            await sampler
            assert guard.open == 32 and peak == 32
            assert refused >= 300 - 32 - 128  # the rest may still wait in the accept backlog
            assert d.daemon.bound  # still running
            async with http.get(d.api_url + "/healthz") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with http.get(d.api_url + "/readyz") as r:
                assert r.status == 200 and (await r.json())["status"] == "ready"
            async with http.get(
                d.api_url + "/status", headers={"Authorization": f"Bearer {READ}"}
            ) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "connection_limit"
        finally:
            for sock in burst:
                sock.close()


def guard_of(d: RunningDaemon, listener: str) -> Any:
    site = next(iter(d.daemon._runners[listener].sites))
    assert isinstance(site, GuardedTCPSite)
    return site.guard


#: Budgets that make one kind of refusal happen after four idle connections, and where
#: those four (and the refused fifth) come from.
REFUSALS = {
    "connections": (
        {
            "max_connections": 4,
            "max_unauthenticated_connections": 4,
            "max_unauthenticated_per_peer": 100,
        },
        ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4"],
        "127.0.1.5",
    ),
    "unauthenticated": (
        {"max_unauthenticated_connections": 4, "max_unauthenticated_per_peer": 100},
        ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4"],
        "127.0.1.5",
    ),
}


@pytest.mark.parametrize("why", sorted(REFUSALS))
async def test_every_connection_refusal_is_a_json_503_and_never_a_traceback(
    why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On either event loop (uvloop's transports are not ``asyncio.Transport``s) a connection
    over a budget gets the documented 503, and a probe on a full API listener its answer."""
    limits, fillers, source = REFUSALS[why]
    async with lender(limits=limits) as (d, _seen):
        held: list[socket.socket] = []
        try:
            for listener in ("up", "api"):
                for address in fillers:
                    held.append(await open_from(address, addr(d, listener)))
                guard = guard_of(d, listener)
                await d.wait_until(lambda g=guard: g.open == len(fillers))  # type: ignore[misc]
            request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
            data = await raw(addr(d, "up"), request.encode(), source=source)
            assert data.startswith(b"HTTP/1.1 503 "), data[:80]
            head = data.split(b"\r\n\r\n", 1)[0]
            assert b"Retry-After: " in head and b"Connection: close" in head
            error = json_of(data)["error"]
            assert (error["code"], error["limit"]) == ("connection_limit", why)
            health = await raw(addr(d, "api"), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", source)
            assert health.startswith(b"HTTP/1.1 200 "), health[:80]
            assert json_of(health)["status"] == "ok"
            refused = d.daemon.metrics.connections_refused
            assert refused.labels("up", why)._value.get() == 1
            assert refused.labels("api", why)._value.get() == 1
        finally:
            for sock in held:
                sock.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_a_refused_client_reads_its_503_even_while_still_sending() -> None:
    """Closing a socket whose client is still sending makes the kernel reset the connection,
    which can destroy the 503 before the client reads it: each of 100 clients sending its
    request as the refusal goes out must read the whole 503."""
    limits = {"max_connections": 2, "max_unauthenticated_connections": 2}
    async with lender(limits=limits) as (d, _seen):
        target = addr(d, "up")
        held = [await open_from(f"127.0.1.{i}", target) for i in (1, 2)]
        guard = guard_of(d, "up")
        await d.wait_until(lambda: guard.open == 2)
        request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        answers: Counter[str] = Counter()
        try:
            for i in range(100):
                reader, writer = await asyncio.open_connection(
                    *target, local_addr=(f"127.0.2.{i + 1}", 0)
                )
                try:
                    writer.write(request.encode())
                    for _ in range(20):  # headers still coming while the refusal is sent
                        writer.write(b"X-Filler: " + b"y" * 200 + b"\r\n")
                        await asyncio.sleep(0)
                    writer.write(b"\r\n")
                    data = await asyncio.wait_for(reader.read(), 10)
                    answers[data[:12].decode() or "closed"] += 1
                except (ConnectionError, RuntimeError) as exc:  # reset, or written to after it
                    answers[type(exc).__name__] += 1
                finally:
                    writer.close()
        finally:
            for sock in held:
                sock.close()
        assert answers == {"HTTP/1.1 503": 100}


async def test_events_subscribers_have_their_own_cap() -> None:
    async with lender(limits={"max_event_subscribers": 2}) as (d, _seen):
        async with aiohttp.ClientSession() as http:
            read = {"Authorization": f"Bearer {READ}"}
            streams = [await http.get(d.api_url + "/events", headers=read) for _ in range(2)]
            try:
                for s in streams:
                    assert s.status == 200
                async with http.get(d.api_url + "/events", headers=read) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "too_many_subscribers"
                async with http.get(d.api_url + "/healthz") as r:
                    assert r.status == 200
            finally:
                for s in streams:
                    s.close()


# -- deadlines -----------------------------------------------------------------------------


async def test_keepalive_and_header_deadline_are_separate() -> None:
    limits = {"header_read_timeout_s": 0.5, "keepalive_timeout_s": 10, "body_idle_timeout_s": 5}
    async with lender(limits=limits) as (d, _s):
        target = addr(d, "up")
        loop = asyncio.get_running_loop()
        # unfinished headers: closed at the header deadline
        started = loop.time()
        assert await raw(target, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n") == b""
        assert loop.time() - started < 3
        # an idle kept-alive connection outlives the header deadline
        reader, writer = await asyncio.open_connection(*target)
        request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        for _ in range(2):
            writer.write(request.encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(1.5)
        writer.close()
        # a body still arriving after both the header deadline and a second is not cut
        reader, writer = await asyncio.open_connection(*target)
        body = json.dumps({"model": "m", "messages": []}).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        for i in range(0, len(body), 8):
            writer.write(body[i : i + 8])
            await writer.drain()
            await asyncio.sleep(0.2)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()


# -- browser guards ------------------------------------------------------------------------


async def test_a_web_page_cannot_drive_a_loopback_trusted_daemon() -> None:
    server = {"trust_loopback": True, "server_names": ["gpu-box.lan"]}
    async with lender(server=server) as (d, _seen), aiohttp.ClientSession() as http:
        api = d.api_url
        port = addr(d, "api")[1]
        body = b'{"enabled": false}'
        # a cross-site text/plain POST (a form or no-cors fetch)
        async with http.post(
            api + "/admin/reclaim", data=b"{}", headers={"Content-Type": "text/plain"}
        ) as r:
            assert r.status == 415
        async with http.post(
            api + "/admin/reclaim",
            data=b"{}",
            headers={"Content-Type": "application/json", "Origin": "https://evil.example"},
        ) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
        async with http.post(
            f"{api}/admin/jobs/1/release", headers={"Sec-Fetch-Site": "cross-site"}
        ) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "cross_site_request"
        # DNS rebinding: the page's own name in Host
        for method, path in (("PUT", "/admin/lending"), ("GET", "/status"), ("GET", "/metrics")):
            async with http.request(
                method,
                api + path,
                data=body if method == "PUT" else None,
                headers={"Host": f"rebind.evil.example:{port}", "Content-Type": "application/json"},
            ) as r:
                assert r.status == 403, path
                assert (await r.json())["error"]["code"] == "host_not_allowed"
        assert d.state.lending_enabled
        # the owner's own tools: an IP, localhost, or a configured server name
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"gpu-box.lan:{port}"):
            async with http.put(
                api + "/admin/lending",
                data=body,
                headers={"Host": host, "Content-Type": "application/json"},
            ) as r:
                assert r.status == 200, host
        # a token-authenticated client may use any name
        async with http.get(
            api + "/status",
            headers={"Host": "lender.example", "Authorization": f"Bearer {READ}"},
        ) as r:
            assert r.status == 200
        # borrowed work from a browser origin
        async with http.post(
            d.proxy_url("up") + "/v1/chat/completions",
            json={"model": "m"},
            headers={"Origin": "https://evil.example"},
        ) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
        async with http.get(
            d.proxy_url("up") + "/v1/models", headers={"Host": "rebind.evil.example"}
        ) as r:
            assert r.status == 403


async def test_browser_work_from_an_allowed_origin_is_admitted() -> None:
    upstream = {"allowed_origins": ["https://app.example"]}
    async with lender(upstream_keys=upstream) as (d, _seen), aiohttp.ClientSession() as http:
        url = d.proxy_url("up") + "/v1/chat/completions"
        async with http.post(
            url, json={"model": "m"}, headers={**AUTH, "Origin": "https://app.example"}
        ) as r:
            assert r.status == 200
        async with http.post(
            url, json={"model": "m"}, headers={**AUTH, "Origin": "https://other.example"}
        ) as r:
            assert r.status == 403


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else str(address)


async def test_allow_unauthenticated_remote_admits_remote_borrowers() -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback address on this machine")
    app, _seen = openai_like_app()
    async with serve_app(app) as url:
        toml = config(url, server={"allow_unauthenticated_remote": True}, listen="0.0.0.0:0")
        async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
            await d.wait_ready()
            port = addr(d, "up")[1]
            base = f"http://{address}:{port}"
            async with http.post(base + "/v1/chat/completions", json={"model": "m"}) as r:
                assert r.status == 200
            async with http.post(
                base + "/v1/chat/completions",
                json={"model": "m"},
                headers={"Authorization": "Bearer wrong-token-000000000"},
            ) as r:
                assert r.status == 401  # a wrong token is still wrong
            async with http.put(d.api_url + "/admin/lending", json={"enabled": False}) as r:
                assert r.status == 401  # admin still needs an admin token


# -- header hygiene and malformed requests -------------------------------------------------


async def test_header_hygiene_both_ways() -> None:
    seen: list[dict[str, str]] = []

    async def noisy(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        port = request.url.port
        resp = web.json_response({"ok": True}, status=201)
        resp.headers["Set-Cookie"] = "session=upstream"
        resp.headers["Access-Control-Allow-Origin"] = "*"
        resp.headers["Server"] = "ollama/0.9.9"
        resp.headers["Alt-Svc"] = 'h3=":443"'
        resp.headers["Location"] = f"http://0.0.0.0:{port}/v1/models/a"
        resp.headers["Content-Location"] = f"http://[::1]:{port}/v1/models/b"
        resp.headers["Link"] = f"<http://127.0.0.9:{port}/v1/models/c>; rel=next"
        resp.headers["Refresh"] = f"3; url=http://localhost:{port}/v1/models/d"
        return resp

    app = web.Application()
    app.router.add_get("/v1/models/x", noisy)
    async with lender(app=app) as (d, _seen), aiohttp.ClientSession() as http:
        async with http.get(
            d.proxy_url("up") + "/v1/models/x",
            headers={
                **AUTH,
                "X-Forwarded-For": "6.6.6.6",
                "Forwarded": "for=6.6.6.6",
                "X-Real-IP": "6.6.6.6",
            },
        ) as r:
            assert r.status == 201
            h = r.headers
            for dropped in ("Set-Cookie", "Access-Control-Allow-Origin", "Alt-Svc"):
                assert dropped not in h
            assert h["Server"] == "vacancyd"
            assert h["Location"] == "/v1/models/a"
            assert h["Content-Location"] == "/v1/models/b"
            assert h["Link"] == "</v1/models/c>; rel=next"
            assert h["Refresh"] == "3; url=/v1/models/d"
        got = seen[-1]
        assert got["X-Forwarded-For"] == "127.0.0.1"
        assert got["Forwarded"] == "for=127.0.0.1;proto=http"
        assert "X-Real-IP" not in got
        async with http.get(d.api_url + "/healthz") as r:
            assert r.headers["Server"] == "vacancyd"


async def test_malformed_requests_get_the_json_envelope_and_are_counted() -> None:
    async with lender() as (d, _seen):
        for listener in ("up", "api"):
            data = await raw(addr(d, listener), b"GET /v1/models HTTP/1.1\r\nBad Header\r\n\r\n")
            assert data.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), data[:60]
            assert b"Server: vacancyd" in data
            assert json_of(data)["error"]["code"] == "bad_request"
            assert d.daemon.metrics.malformed_requests.labels(listener)._value.get() == 1
        # an encoded newline in the path reaches the handler (auth first, then JSON)
        data = await raw(
            addr(d, "up"), b"GET /v1/%0a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert data.startswith(b"HTTP/1.1 401"), data[:60]
        assert json_of(data)["error"]["code"] == "missing_token"


async def test_a_connect_tunnel_request_gets_the_json_envelope_on_every_listener() -> None:
    # An authority-form CONNECT target has no path, so the router never reaches a handler;
    # aiohttp's own 404 used to answer it as text/plain on the proxy listener.
    async with lender() as (d, seen):
        for listener in ("up", "api"):
            data = await raw(
                addr(d, listener),
                b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\nConnection: close\r\n\r\n",
            )
            head = data.split(b"\r\n\r\n", 1)[0]
            assert data.startswith(b"HTTP/1.1 404"), data[:60]
            assert b"Content-Type: application/json" in head, head
            error = json_of(data)["error"]
            assert error["code"] == "not_found"
            assert error["message"] == "CONNECT 127.0.0.1:22: Not Found"
        assert seen == []


# -- cut streams ---------------------------------------------------------------------------


async def test_an_http_1_0_borrower_sees_a_cut_stream_as_a_reset() -> None:
    """HTTP/1.0 has no chunked framing: a reply ends where the connection does, so a cut
    that closed cleanly would look complete. A reset cannot."""
    from tests.support.lender import config as reclaim_config
    from tests.support.lender import owner_returns
    from tests.support.slow_openai import SlowOpenAI

    fake = SlowOpenAI(chunks=10_000, interval_s=0.02)
    async with serve_app(fake.app()) as target:
        async with running_daemon(reclaim_config(target, adapter="openai", policy="cancel")) as d:
            await d.wait_ready()
            reader, writer = await asyncio.open_connection(*addr(d, "up"))
            body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.0\r\nHost: localhost\r\n"
                + b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
            await fake.started.wait()
            owner_returns(d)
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(10):
                    while await reader.read(65536):
                        pass
            writer.close()
