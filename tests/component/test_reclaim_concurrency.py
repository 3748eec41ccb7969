"""Unloads run per upstream, concurrently, each under its own deadline (docs/reclaim.md):
a hung Ollama neither delays ComfyUI's /free nor the presence loop."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

import vacancyd.control.upstreamcalls as calls
from tests.support.config import daemon_toml, upstream
from tests.support.daemon import running_daemon, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.lender import owner_returns


async def test_a_hung_unload_does_not_delay_another_upstreams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calls, "UNLOAD_DEADLINE_S", 0.5)
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"models": []})

    hung = web.Application()
    hung.router.add_get("/api/ps", hang)
    comfy = FakeComfy()
    async with serve_app(hung) as ollama_url, serve_app(comfy.app()) as comfy_url:
        toml = daemon_toml(
            upstream("ollama", ollama_url, adapter="ollama", yield_on_veto=True),
            upstream("comfy", comfy_url, adapter="comfyui", yield_on_veto=True),
            owner={"release_after_s": 3600},
        )
        async with running_daemon(toml) as d, aiohttp.ClientSession() as client:
            await d.wait_ready()
            loop = asyncio.get_running_loop()
            start = loop.time()
            owner_returns(d)
            await d.wait_until(lambda: bool(comfy.free_requests), 2)
            assert loop.time() - start < 0.4  # not behind the hung Ollama's deadline
            views = d.state.reclaim_views
            await d.wait_until(lambda: views["ollama"].get("phase") == "done", 3)
            assert 0.4 <= loop.time() - start < 3
            async with client.get(d.api_url + "/metrics") as r:
                text = await r.text()
            assert (
                'vacancyd_unload_duration_seconds_count{outcome="timed_out",upstream="ollama"}'
                in text
            )
            release.set()
