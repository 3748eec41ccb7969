"""Per-resource reclaim channels and scopes (docs/reclaim.md) through a running daemon.

Pressure edges are answered with Reclaimer.answer, as the pressure loop's readings are
(Reclaimer.record_pressure); operator edges with POST /admin/reclaim.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.config import RAM, daemon_toml, resource, upstream
from tests.support.daemon import running_daemon, serve_app
from tests.support.lender import owner_returns
from tests.support.slow_openai import SlowOpenAI
from vacancyd.core.reclaim import Edge, Trigger


def config(a: str, b: str) -> str:
    return daemon_toml(
        upstream("a", a, on_owner_return="cancel"),
        upstream("b", b, resource="ram2", owner_scope="resource", on_owner_return="cancel"),
        resources=(RAM, resource("ram2")),
        owner={"release_after_s": 3600},
    )


async def test_a_pressure_edge_reclaims_only_the_upstreams_on_its_resource() -> None:
    fa, fb = SlowOpenAI(chunks=300, interval_s=0.02), SlowOpenAI(chunks=300, interval_s=0.02)
    async with serve_app(fa.app()) as ua, serve_app(fb.app()) as ub:
        async with running_daemon(config(ua, ub)) as d, aiohttp.ClientSession() as client:
            await d.wait_ready()
            body = {"model": "tiny", "stream": True, "messages": []}
            ra = await client.post(d.proxy_url("a") + "/v1/chat/completions", json=body)
            rb = await client.post(d.proxy_url("b") + "/v1/chat/completions", json=body)
            await fa.started.wait()
            await fb.started.wait()
            edge = Edge(Trigger.PRESSURE, d.state.clock(), resource="ram2")
            d.daemon.reclaimer.answer([edge])
            await asyncio.wait_for(fb.ended_event.wait(), 5)
            assert fb.ended == ["disconnected"]
            assert "a" not in d.state.reclaim_views
            assert not fa.ended_event.is_set()
            async with client.post(
                d.proxy_url("b") + "/v1/chat/completions", json={"model": "t", "messages": []}
            ) as r:
                # the cut job is held (its server may still run it), so b stays refused
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "resource_busy"
            # owner return reclaims the host-scoped upstream, never the resource-scoped one
            owner_returns(d)
            await asyncio.wait_for(fa.ended_event.wait(), 5)
            assert d.state.reclaim_views["b"]["edge_triggers"] == ["pressure"]
            ra.close()
            rb.close()


async def test_admin_reclaim_validates_its_body() -> None:
    fa, fb = SlowOpenAI(), SlowOpenAI()
    async with serve_app(fa.app()) as ua, serve_app(fb.app()) as ub:
        async with running_daemon(config(ua, ub)) as d, aiohttp.ClientSession() as client:
            async with client.post(d.api_url + "/admin/reclaim", json={"resource": "nope"}) as r:
                assert r.status == 400
            async with client.post(d.api_url + "/admin/reclaim", json={"resource": "ram"}) as r:
                assert r.status == 200
                doc = await r.json()
            assert set(doc["reclaim"]) == {"a"}
