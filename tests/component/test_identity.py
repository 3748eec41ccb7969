"""Who a request is from, without ambiguity: a loopback peer that relays for someone else
(forwarding headers) is not the owner unless it is a named trusted proxy and the client it
names is local too; two Authorization headers are a 400 whatever their order; headers
naming another client address, URL or method never reach the upstream; and a management
route refuses an ``Expect: 100-continue`` request before inviting its body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app

BORROW = "borrow-token-0123456789"
ADMIN = "admin-token-0123456789a"
LENDING_OFF = b'{"enabled": false}'
JSON = {"Content-Type": "application/json"}


@asynccontextmanager
async def lender(
    server: Mapping[str, Any] | None = None, adapter: str = "openai"
) -> AsyncIterator[tuple[RunningDaemon, list[dict[str, Any]]]]:
    """A loopback-trusting lender with a borrow and an admin token."""
    app, seen = openai_like_app()
    async with serve_app(app) as url:
        toml = daemon_toml(
            upstream("up", url, adapter=adapter, models={"default_mib": 1}),
            server={"trust_loopback": True, **(server or {})},
            tokens=(token("cluster", BORROW, "borrow"), token("ops", ADMIN, "admin")),
            collectors={"poll_s": 0.2},
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            yield d, seen


async def status_of(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: Mapping[str, str] | CIMultiDict[str],
) -> int:
    data = LENDING_OFF if method == "PUT" else None
    async with http.request(method, url, data=data, headers=headers) as r:
        return r.status


RELAYED = (
    {"X-Forwarded-For": "203.0.113.7"},
    {"Forwarded": "for=203.0.113.7;proto=https"},
    {"X-Real-IP": "203.0.113.7"},
    {"True-Client-IP": "203.0.113.7"},
    {"CF-Connecting-IP": "203.0.113.7"},
    {"X-Forwarded-Proto": "https"},
    {"Via": "1.1 nginx"},
)


async def test_a_loopback_proxy_relaying_for_a_remote_client_is_not_the_owner() -> None:
    async with lender() as (d, _seen), aiohttp.ClientSession() as http:
        admin = d.api_url + "/admin/lending"
        work = d.proxy_url("up") + "/v1/models"
        for relayed in RELAYED:
            assert await status_of(http, "PUT", admin, {**JSON, **relayed}) == 401, relayed
            assert await status_of(http, "GET", d.api_url + "/status", relayed) == 401, relayed
            assert await status_of(http, "GET", work, relayed) == 401, relayed
            # a token still works through the proxy
            with_token = {**JSON, **relayed, "Authorization": f"Bearer {ADMIN}"}
            assert await status_of(http, "GET", d.api_url + "/status", with_token) == 200
        assert d.state.lending_enabled
        # the owner's own tools, which relay for nobody, are still the owner
        assert await status_of(http, "GET", work, {}) == 200
        assert await status_of(http, "PUT", admin, JSON) == 200
        assert not d.state.lending_enabled


async def test_a_named_trusted_proxy_is_believed_about_its_client() -> None:
    async with lender({"trusted_proxies": ["127.0.0.1"]}) as (d, _seen):
        admin = d.api_url + "/status"
        cases: tuple[tuple[str, dict[str, str], int], ...] = (
            ("127.0.0.1", {"X-Forwarded-For": "203.0.113.7"}, 401),
            ("127.0.0.1", {"X-Forwarded-For": "203.0.113.7, 127.0.0.1"}, 401),
            ("127.0.0.1", {"Forwarded": 'for="[2001:db8::1]:4711"'}, 401),
            ("127.0.0.1", {"X-Forwarded-For": "not-an-address"}, 401),
            ("127.0.0.1", {"X-Forwarded-Proto": "https"}, 401),  # names no client
            ("127.0.0.1", {"X-Forwarded-For": "127.0.0.1"}, 200),  # a local client
            ("127.0.0.1", {"Forwarded": "for=127.0.0.5"}, 200),
            ("127.0.0.1", {"X-Real-IP": "::1"}, 200),
            # a proxy that sets X-Real-IP (or Forwarded) and passes its client's own
            # X-Forwarded-For through: the remote client must not pass for a local one
            ("127.0.0.1", {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "203.0.113.7"}, 401),
            ("127.0.0.1", {"X-Forwarded-For": "::1", "Forwarded": "for=203.0.113.7"}, 401),
            ("127.0.0.1", {"Forwarded": "for=127.0.0.1", "X-Real-IP": "bogus"}, 401),
            ("127.0.0.1", {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}, 200),
            ("127.0.0.2", {"X-Forwarded-For": "127.0.0.1"}, 401),  # not the named proxy
            ("127.0.0.2", {}, 200),  # relays for nobody: a local client itself
        )
        for source, headers, want in cases:
            connector = aiohttp.TCPConnector(local_addr=(source, 0))
            async with aiohttp.ClientSession(connector=connector) as http:
                assert await status_of(http, "GET", admin, headers) == want, (source, headers)


def test_trusted_proxies_must_be_addresses() -> None:
    from vacancyd.config import parse_config
    from vacancyd.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"server\.trusted_proxies: 'nginx' is not an IP"):
        parse_config(
            daemon_toml(
                upstream("up", "http://127.0.0.1:1"), server={"trusted_proxies": ["nginx"]}
            ),
            "<test>",
        )


async def test_two_authorization_headers_are_refused_whatever_their_order() -> None:
    async with lender({"trust_loopback": False}) as (d, seen), aiohttp.ClientSession() as http:
        admin, borrow = f"Bearer {ADMIN}", f"Bearer {BORROW}"
        for first, second in ((admin, borrow), (borrow, admin), (admin, admin)):
            both = CIMultiDict([("Authorization", first), ("Authorization", second)])
            async with http.get(d.api_url + "/status", headers=both) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "duplicate_authorization"
            async with http.put(d.api_url + "/admin/lending", data=LENDING_OFF, headers=both) as r:
                assert r.status == 400
            async with http.post(
                d.proxy_url("up") + "/v1/chat/completions", json={"model": "m"}, headers=both
            ) as r:
                assert r.status == 400
        assert d.state.lending_enabled and seen == []
        decisions = d.daemon.metrics.auth_decisions
        assert decisions.value("read", "duplicate") == 3
        assert decisions.value("admin", "duplicate") == 3
        assert decisions.value("borrow", "duplicate") == 3


OVERRIDES = {
    "X-Client-IP": "203.0.113.7",
    "True-Client-IP": "203.0.113.7",
    "CF-Connecting-IP": "203.0.113.7",
    "Fastly-Client-IP": "203.0.113.7",
    "X-Cluster-Client-IP": "203.0.113.7",
    "X-Original-URL": "/admin/secret",
    "X-Rewrite-URL": "/admin/secret",
    "X-HTTP-Method-Override": "DELETE",
    "X-HTTP-Method": "DELETE",
    "X-Method-Override": "DELETE",
    "X-Forwarded-Port": "443",
    "X-Forwarded-Prefix": "/evil",
    "X-Forwarded-Host": "evil.example",
}


async def test_client_address_and_override_headers_never_reach_the_upstream() -> None:
    async with lender({"trust_loopback": False}) as (d, seen), aiohttp.ClientSession() as http:
        async with http.post(
            d.proxy_url("up") + "/v1/chat/completions",
            json={"model": "m"},
            headers={**OVERRIDES, "Authorization": f"Bearer {BORROW}"},
        ) as r:
            assert r.status == 200
        got = {k.lower(): v for k, v in seen[-1]["headers"].items()}
        arrived = sorted(name for name in OVERRIDES if name.lower() in got)
        assert arrived == []
        assert got["x-forwarded-for"] == "127.0.0.1"
        assert got["forwarded"] == "for=127.0.0.1;proto=http"


async def head_after_expect(target: str, request: bytes) -> bytes:
    """Send a request head with ``Expect: 100-continue`` and no body; the first reply head."""
    host, port = target.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()


async def test_management_routes_refuse_before_inviting_the_body() -> None:
    async with lender({"trust_loopback": False}, adapter="llamacpp") as (d, seen):
        expect = b"Expect: 100-continue\r\nContent-Type: application/json\r\n"
        borrower = f"Authorization: Bearer {BORROW}\r\n".encode()
        cases = (
            # a management route (403), an unlisted write (501), unauthenticated (401)
            (d.proxy_url("up"), b"POST /slots/0?action=erase", borrower, b"403"),
            (d.proxy_url("up"), b"POST /v1/fine_tuning/jobs", borrower, b"501"),
            (d.proxy_url("up"), b"POST /slots/0?action=erase", b"", b"401"),
            # the API's admin switches: no token, or a token without the admin scope
            (d.api_url, b"PUT /admin/lending", b"", b"401"),
            (d.api_url, b"PUT /admin/lending", borrower, b"403"),
            (d.api_url, b"PUT /admin/debug", borrower, b"403"),
            (d.api_url, b"POST /admin/reclaim", b"", b"401"),
        )
        for target, line, auth, status in cases:
            head = await head_after_expect(
                target,
                line + b" HTTP/1.1\r\nHost: x\r\n" + auth + expect + b"Content-Length: 18\r\n\r\n",
            )
            assert head.startswith(b"HTTP/1.1 " + status), (line, auth, head[:40])
        # and a request that will be answered is still invited to send its body
        head = await head_after_expect(
            d.api_url,
            b"PUT /admin/lending HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {ADMIN}\r\n".encode()
            + expect
            + b"Content-Length: 18\r\n\r\n",
        )
        assert head.startswith(b"HTTP/1.1 100 Continue")
        assert d.state.lending_enabled and seen == []
