"""The lendability probe (docs/balancers.md) against a real in-process daemon: its answers,
its token rule, ``?model=``, 404s, and a probe flood that costs no upstream call and never
changes an admission; headroom in /status and /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import config as cfg
from tests.support.daemon import RunningDaemon, running_daemon, serve_app

READ = "read-token-0123456789abc"
BORROW = "borrow-token-0123456789"
PROBE = "probe-token-0123456789ab"
PATH = "/.well-known/vacancyd/lendable"
HUGE_MIB = 10**9


def config(target: str, **upstream_keys: Any) -> str:
    """A token-guarded Ollama lender (read, borrow and probe tokens) that keeps 64 MiB free;
    model ``Huge`` never fits. ``upstream_keys`` are more keys of the upstream."""
    return cfg.daemon_toml(
        cfg.upstream(
            "llm",
            target,
            adapter="ollama",
            **upstream_keys,
            models={"default_mib": 1, "footprint_mib": {"tiny": 1, "small": 2, "Huge": HUGE_MIB}},
        ),
        resources=(cfg.resource("ram", min_free_mib=64),),
        server={"trust_loopback": None},
        tokens=(
            cfg.token("prom", READ, "read"),
            cfg.token("cluster", BORROW, "borrow"),
            cfg.token("balancer", PROBE, "probe"),
        ),
        collectors={"poll_s": 0.2},
    )


#: What vacancyd's own Ollama residency observer reads on its cadence (not probe traffic).
OBSERVER_READS = ("/api/ps", "/api/version")


class Upstream:
    """An Ollama-shaped /api/chat that holds each request until released; counts calls
    other than the residency observer's own reads."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    def app(self) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            self.calls.append(request.path)
            body = await request.json()
            await self.release.wait()
            return web.json_response(
                {
                    "model": body.get("model"),
                    "created_at": "2026-01-01T00:00:00Z",
                    "message": {"role": "assistant", "content": "hi"},
                    "done": True,
                }
            )

        async def anything(request: web.Request) -> web.Response:
            if request.path not in OBSERVER_READS:
                self.calls.append(request.path)
            return web.json_response({"models": []})

        app = web.Application()
        app.router.add_post("/api/chat", chat)
        app.router.add_route("*", "/{tail:.*}", anything)
        return app


@pytest.fixture
async def lender() -> AsyncIterator[tuple[RunningDaemon, Upstream]]:
    upstream = Upstream()
    async with serve_app(upstream.app()) as url, running_daemon(config(url)) as d:
        await d.wait_ready()
        yield d, upstream


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def get(url: str, token: str | None = PROBE, method: str = "GET") -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=auth(token) if token else {}) as resp:
            body = await resp.json() if method == "GET" and resp.content_length != 0 else None
            return resp.status, resp.headers, body


async def test_probe_answers_lendable_and_refusing_with_retry_after(
    lender: tuple[RunningDaemon, Upstream],
) -> None:
    d, upstream = lender
    probe = d.proxy_url("llm") + PATH
    status, headers, body = await get(probe)
    assert status == 200
    assert body == {"lendable": True, "upstream": "llm", "model": None}
    assert headers["Cache-Control"] == "no-store"
    status, _, body = await get(probe, method="HEAD")
    assert status == 200 and body is None
    # the same answer on the API listener
    status, _, body = await get(f"{d.api_url}/lendable/llm")
    assert status == 200 and body["lendable"] is True

    d.state.set_lending(False)
    status, headers, body = await get(probe)
    assert status == 503
    assert headers["Retry-After"] == "300" and headers["x-should-retry"] == "false"
    assert body == {
        "lendable": False,
        "upstream": "llm",
        "model": None,
        "reason": "lending_disabled",
        "retry_after_s": 300,
    }
    assert "detail" not in body and "message" not in str(body)
    status, _, _ = await get(f"{d.api_url}/lendable/llm")
    assert status == 503
    assert upstream.calls == []  # not one probe reached the inference server


async def test_probe_for_a_model_uses_its_footprint_and_the_adapters_name_rule(
    lender: tuple[RunningDaemon, Upstream],
) -> None:
    d, _ = lender
    probe = d.proxy_url("llm") + PATH
    status, _, body = await get(probe + "?model=tiny")
    assert status == 200 and body["model"] == "tiny:latest"  # Ollama's name rule
    status, headers, body = await get(probe + "?model=huge")
    assert status == 503 and body["reason"] == "insufficient_capacity"
    assert int(headers["Retry-After"]) == body["retry_after_s"]
    status, _, body = await get(probe + "?model=nope")
    assert status == 404 and body["error"]["code"] == "unknown_model"
    assert body["error"]["models"] == ["huge:latest", "small:latest", "tiny:latest"]
    status, _, body = await get(probe + "?model=")
    assert status == 404 and body["error"]["code"] == "unknown_model"
    status, _, body = await get(f"{d.api_url}/lendable/nope")
    assert status == 404 and body["error"]["code"] == "unknown_upstream"
    assert body["error"]["upstreams"] == ["llm"]
    async with aiohttp.ClientSession() as http:
        async with http.post(probe, headers=auth(PROBE)) as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "GET, HEAD"


async def test_probe_needs_a_token_unless_the_operator_makes_it_public() -> None:
    upstream = Upstream()
    async with serve_app(upstream.app()) as url:
        async with running_daemon(config(url)) as d:
            await d.wait_ready()
            probe = d.proxy_url("llm") + PATH
            assert (await get(probe, token=None))[0] == 401
            assert (await get(f"{d.api_url}/lendable/llm", token=None))[0] == 401
            assert (await get(f"{d.api_url}/lendable/nope", token=None))[0] == 401
            for token in (PROBE, READ, BORROW):
                assert (await get(probe, token=token))[0] == 200
            # a probe token borrows nothing and reads nothing
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{d.api_url}/status", headers=auth(PROBE)) as resp:
                    assert resp.status == 403
                async with http.post(
                    d.proxy_url("llm") + "/api/chat",
                    json={"model": "tiny", "messages": []},
                    headers=auth(PROBE),
                ) as resp:
                    assert resp.status == 403
        async with running_daemon(config(url, public_probe=True, refusal_status=429)) as d:
            await d.wait_ready()
            probe = d.proxy_url("llm") + PATH
            assert (await get(probe, token=None))[0] == 200
            status, _, body = await get(f"{d.api_url}/lendable/nope", token=None)
            assert status == 404 and "upstreams" not in body["error"]  # names stay private
            d.state.set_lending(False)
            status, headers, _ = await get(probe, token=None)
            assert status == 429 and headers["Retry-After"] == "300"


async def test_a_probe_flood_costs_no_upstream_call_and_changes_no_admission(
    lender: tuple[RunningDaemon, Upstream],
) -> None:
    d, upstream = lender
    probe = d.proxy_url("llm") + PATH
    chat = d.proxy_url("llm") + "/api/chat"
    upstream.release.clear()
    async with aiohttp.ClientSession() as http:

        async def one_probe() -> int:
            async with http.get(probe, headers=auth(PROBE)) as resp:
                await resp.read()
                return resp.status

        loop = asyncio.get_running_loop()
        flood = [loop.create_task(one_probe()) for _ in range(300)]

        # a borrowed request admitted in the middle of the flood
        async def borrow() -> aiohttp.ClientResponse:
            return await http.post(
                chat, json={"model": "tiny", "messages": []}, headers=auth(BORROW)
            )

        job = loop.create_task(borrow())
        await d.wait_until(lambda: len(d.state.ledger.jobs()) == 1, 5.0)
        # while it runs, the probe says busy, and the ledger still holds that one job only
        async with http.get(probe, headers=auth(PROBE)) as resp:
            body = await resp.json()
            assert resp.status == 503 and body["reason"] == "resource_busy"
            assert resp.headers["Retry-After"] == "2"
        statuses = await asyncio.gather(*flood)
        assert set(statuses) <= {200, 503}
        assert [j.upstream for j in d.state.ledger.jobs()] == ["llm"]
        upstream.release.set()
        resp = await job
        assert resp.status == 200
        resp.release()
    assert upstream.calls == ["/api/chat"]  # the probes reached no server
    admitted = d.daemon.metrics.registry.get_sample_value(
        "vacancyd_admission_decisions_total",
        {"upstream": "llm", "outcome": "admitted", "reason": ""},
    )
    assert admitted == 1.0


async def test_headroom_in_status_and_metrics(lender: tuple[RunningDaemon, Upstream]) -> None:
    d, _ = lender
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{d.api_url}/status", headers=auth(READ)) as resp:
            doc = await resp.json()
        async with http.get(f"{d.api_url}/metrics", headers=auth(READ)) as resp:
            text = await resp.text()
    ram = doc["resources"]["ram"]
    assert ram["lendable_mib"] == pytest.approx(ram["free_mib"] - 64, abs=1024)
    room = doc["upstreams"]["llm"]["headroom"]
    assert room["largest_model"] == "small:latest" and room["largest_model_mib"] == 2
    assert room["lendable_mib"] == pytest.approx(ram["lendable_mib"], abs=1024)
    assert doc["stopping"] is False
    assert 'vacancyd_upstream_largest_model_info{model="small:latest",upstream="llm"} 1.0' in text
    sample = d.daemon.metrics.registry.get_sample_value
    assert sample("vacancyd_upstream_largest_model_bytes", {"upstream": "llm"}) == 2 * 2**20
    assert "vacancyd_resource_lendable_bytes{resource=" in text
    d.state.set_lending(False)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{d.api_url}/status", headers=auth(READ)) as resp:
            room = (await resp.json())["upstreams"]["llm"]["headroom"]
    assert room == {"lendable_mib": 0.0, "largest_model": None, "largest_model_mib": None}


async def _until_probe(url: str, status: int, timeout_s: float = 10.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            got, headers, body = await get(url)
            if got == status:
                return headers, body
            await asyncio.sleep(0.05)


async def test_probe_says_upstream_unreachable_while_the_server_is_down() -> None:
    """The server behind the listener stops: the probe answers 503 upstream_unreachable
    (from the daemon's own connection check, no probe reaches the server), and 200 again
    once the server is back on its port."""
    upstream = Upstream()
    runner = web.AppRunner(upstream.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with running_daemon(config(f"http://127.0.0.1:{port}")) as d:
            await d.wait_ready()
            await asyncio.sleep(0.5)
            assert "llm" not in d.state.reach  # nobody probes: no connection is opened
            probe = d.proxy_url("llm") + PATH
            assert (await get(probe))[0] == 200
            await runner.cleanup()  # the inference server goes away
            headers, body = await _until_probe(probe, 503)
            assert body == {
                "lendable": False,
                "upstream": "llm",
                "model": None,
                "reason": "upstream_unreachable",
                "retry_after_s": 5,
            }
            assert headers["Retry-After"] == "5"
            status, _, body = await get(f"{d.api_url}/lendable/llm")
            assert status == 503 and body["reason"] == "upstream_unreachable"
            status, _, body = await get(probe + "?model=tiny")
            assert status == 503 and body["reason"] == "upstream_unreachable"
            assert "cannot connect to 127.0.0.1" in d.state.reach["llm"].error
            # /status and /metrics say so too
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{d.api_url}/status", headers=auth(READ)) as resp:
                    seen = (await resp.json())["upstreams"]["llm"]["reachable"]
            assert seen["ok"] is False and "cannot connect to" in seen["error"]
            gauge = d.daemon.metrics.registry.get_sample_value
            assert gauge("vacancyd_upstream_reachable", {"upstream": "llm"}) == 0.0
            # the server being gone is named before any refusal of the lender's own
            d.state.set_lending(False)
            assert (await get(probe))[2]["reason"] == "upstream_unreachable"
            d.state.set_lending(True)
            # the server comes back on the same port: lendable again within a few checks
            runner = web.AppRunner(upstream.app(), handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            _, body = await _until_probe(probe, 200)
            assert body == {"lendable": True, "upstream": "llm", "model": None}
            assert gauge("vacancyd_upstream_reachable", {"upstream": "llm"}) == 1.0
    finally:
        await runner.cleanup()
    assert upstream.calls == []  # neither the probes nor the checks sent the server a request


async def test_a_borrowed_request_that_cannot_connect_turns_the_probe_at_once() -> None:
    """No wait for the next connection check: a borrowed request whose connection failed
    (502 to its borrower) is evidence enough, and the probe says so right after."""
    upstream = Upstream()
    runner = web.AppRunner(upstream.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # checks every 2 s (the cap), so the evidence below comes from the request
    slow_checks = config(f"http://127.0.0.1:{port}").replace("poll_s = 0.2", "poll_s = 30")
    async with running_daemon(slow_checks) as d:
        await d.wait_ready(timeout_s=40)
        probe = d.proxy_url("llm") + PATH
        assert (await get(probe))[0] == 200  # a probe starts the connection check
        await d.wait_until(lambda: d.state.reach.get("llm") is not None)
        await runner.cleanup()
        async with aiohttp.ClientSession() as http:
            async with http.post(
                d.proxy_url("llm") + "/api/chat",
                json={"model": "tiny", "messages": []},
                headers=auth(BORROW),
            ) as resp:
                assert resp.status == 502
        status, _, body = await get(probe)
        assert status == 503 and body["reason"] == "upstream_unreachable"
        assert d.state.reach["llm"].error.startswith("a borrowed request: ")
