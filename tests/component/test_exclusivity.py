"""Ollama and ComfyUI on one card (``exclusive_of``), against the Ollama and ComfyUI fakes.

Asserted through the servers' own call order: concurrent LLM streams; an image job waits
for them to end and stops new LLM admissions meanwhile; Ollama's models are unloaded and
confirmed gone from ``/api/ps`` before ``/prompt`` is forwarded; ComfyUI ``/free`` follows
the job before any LLM work runs again; the warm model is loaded again after.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.config import daemon_toml, resource, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.fake_ollama import FakeOllama

PROMPT = {"prompt": {"3": {"class_type": "KSampler", "inputs": {}}}}
Calls = list[tuple[str, str, str, Any]]


def record(app: web.Application, server: str, calls: Calls) -> web.Application:
    """Log (server, method, path, detail) as each response is sent; ``/api/ps`` details are
    the model names it listed."""

    async def prepared(request: web.Request, response: web.StreamResponse) -> None:
        detail: Any = None
        if request.path == "/api/ps" and isinstance(response, web.Response) and response.body:
            detail = [m["name"] for m in json.loads(bytes(response.body))["models"]]  # type: ignore[arg-type]
        calls.append((server, request.method, request.path, detail))

    app.on_response_prepare.append(prepared)
    return app


def config(ollama: str, comfy: str, comfy_keys: Mapping[str, Any]) -> str:
    """Ollama and ComfyUI sharing one card ``card``, the image server exclusive of the LLM
    server; ``comfy_keys`` are more keys of the ComfyUI upstream."""
    return daemon_toml(
        upstream(
            "ollama",
            ollama,
            adapter="ollama",
            resource="card",
            max_concurrent=3,
            busy="wait",
            wait_timeout_s=20,
            warm_model="tiny",
        ),
        upstream(
            "comfy",
            comfy,
            adapter="comfyui",
            resource="card",
            exclusive_of=["ollama"],
            busy="wait",
            wait_timeout_s=20,
            **comfy_keys,
        ),
        resources=(resource("card"),),
    )


@asynccontextmanager
async def card(
    comfy_keys: Mapping[str, Any] | None = None, **ollama_kw: Any
) -> AsyncIterator[tuple[RunningDaemon, FakeOllama, FakeComfy, Calls, aiohttp.ClientSession]]:
    calls: Calls = []
    ollama = FakeOllama(**ollama_kw)
    comfy = FakeComfy(steps=4, step_s=0.05)
    async with (
        serve_app(record(ollama.app(), "ollama", calls)) as ollama_url,
        serve_app(record(comfy.app(), "comfy", calls)) as comfy_url,
        running_daemon(config(ollama_url, comfy_url, comfy_keys or {})) as d,
    ):
        await d.wait_ready()
        async with aiohttp.ClientSession() as client:
            yield d, ollama, comfy, calls, client


async def llm(d: RunningDaemon, client: aiohttp.ClientSession) -> tuple[int, str]:
    async with client.post(
        d.proxy_url("ollama") + "/api/chat",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        return r.status, await r.text()


async def image(d: RunningDaemon, client: aiohttp.ClientSession) -> tuple[int, Any]:
    async with client.post(d.proxy_url("comfy") + "/prompt", json=PROMPT) as r:
        return r.status, await r.json()


def index(calls: Calls, server: str, method: str, path: str, start: int = 0) -> int:
    for i, (s, m, p, _) in enumerate(calls[start:], start):
        if (s, m, p) == (server, method, path):
            return i
    raise AssertionError(f"no {server} {method} {path} after #{start} in {calls}")


def state_gauge(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("vacancyd_exclusivity_state{") and line.endswith(" 1.0"):
            return line.split('state="')[1].split('"')[0]
    raise AssertionError("no exclusivity state")


async def metrics(d: RunningDaemon, client: aiohttp.ClientSession) -> str:
    async with client.get(d.api_url + "/metrics") as r:
        return await r.text()


async def test_image_job_waits_for_llm_work_unloads_first_and_frees_after() -> None:
    async with card(tokens=30, token_interval_s=0.05) as (d, ollama, comfy, calls, client):
        streams = [asyncio.create_task(llm(d, client)) for _ in range(2)]
        await d.wait_until(lambda: sum(r.refs for r in ollama.loaded.values()) == 2)
        assert state_gauge(await metrics(d, client)) == "shared"

        img = asyncio.create_task(image(d, client))
        await d.wait_until(lambda: d.daemon.waiting.waiting("comfy") == 1)
        # the pending image job stops new LLM admissions although a third slot is free
        late = asyncio.create_task(llm(d, client))
        await d.wait_until(lambda: d.daemon.waiting.waiting("ollama") == 1)
        assert [s for s, _ in await asyncio.gather(*streams)] == [200, 200]

        status, reply = await img
        assert status == 200 and "prompt_id" in reply
        assert state_gauge(await metrics(d, client)) == "exclusive"
        assert not late.done()  # LLM work waits for the whole image job, /free included
        assert (await late)[0] == 200
        await d.wait_until(
            lambda: sum(c[:3] == ("ollama", "POST", "/api/generate") for c in calls) == 2, 5
        )

    unload = index(calls, "ollama", "POST", "/api/generate")  # keep_alive 0, no prompt
    assert ollama.unload_requests == ["tiny:latest"]
    # (the residency observer polls /api/ps too: the confirmation is the first empty one
    # after the unload)
    confirmed = next(
        i
        for i, c in enumerate(calls)
        if i > unload and c[:3] == ("ollama", "GET", "/api/ps") and c[3] == []
    )
    prompt = index(calls, "comfy", "POST", "/prompt")
    free = index(calls, "comfy", "POST", "/free", prompt)
    after = index(calls, "ollama", "POST", "/api/chat", prompt)
    assert unload < confirmed < prompt < free < after, calls
    # the LLM requests before the image job both streamed before the unload
    assert [i for i, c in enumerate(calls) if c[2] == "/api/chat"][:2] < [unload, unload]
    assert comfy.free_requests == [{"unload_models": True, "free_memory": True}]
    # the warm reload: a load of the warm model (no prompt) after /free
    warm = index(calls, "ollama", "POST", "/api/generate", free)
    assert warm > free


@pytest.mark.parametrize("choice", ["forward", "refuse"])
async def test_an_unload_that_does_not_complete_in_time_is_the_configured_choice(
    choice: str,
) -> None:
    extra = {"unload_timeout_s": 0.5, "on_unload_timeout": choice}
    async with card(extra, tokens=200, token_interval_s=0.02) as (d, ollama, _, calls, client):
        # the owner's own request, straight to Ollama, keeps the model resident
        owner = asyncio.create_task(
            client.post(
                str(d.daemon.settings.upstream[0].target).rstrip("/") + "/api/chat",
                json={"model": "tiny", "messages": [{"role": "user", "content": "mine"}]},
            )
        )
        await d.wait_until(lambda: sum(r.refs for r in ollama.loaded.values()) == 1)
        status, reply = await image(d, client)
        if choice == "refuse":
            assert status == 503 and reply["error"]["code"] == "resource_busy"
            assert "did not unload their models in time" in reply["error"]["message"]
            assert "tiny:latest" in reply["error"]["message"]
            assert not any(c[:3] == ("comfy", "POST", "/prompt") for c in calls)
            await d.wait_until(lambda: not d.state.ledger.jobs())
        else:
            assert status == 200 and "prompt_id" in reply
        assert ollama.unload_requests == ["tiny:latest"]
        text = await metrics(d, client)
        assert (
            'vacancyd_exclusive_unload_seconds_count{outcome="timed_out",upstream="comfy"} 1.0'
            in text
        )
        resp = await owner
        resp.close()


async def test_a_reclaim_during_the_unload_refuses_the_image_job() -> None:
    extra = {"unload_timeout_s": 1.5, "on_unload_timeout": "forward", "on_owner_return": "cancel"}
    async with card(extra, tokens=200, token_interval_s=0.02) as (d, ollama, _, calls, client):
        owner = asyncio.create_task(
            client.post(
                str(d.daemon.settings.upstream[0].target).rstrip("/") + "/api/chat",
                json={"model": "tiny", "messages": [{"role": "user", "content": "mine"}]},
            )
        )
        await d.wait_until(lambda: sum(r.refs for r in ollama.loaded.values()) == 1)
        img = asyncio.create_task(image(d, client))
        await d.wait_until(lambda: bool(ollama.unload_requests))  # the unload has begun
        async with client.post(d.api_url + "/admin/reclaim", json={}) as r:
            assert r.status in (200, 202)
        status, reply = await img
        assert status == 503 and "before the job was forwarded" in reply["error"]["message"]
        assert not any(c[:3] == ("comfy", "POST", "/prompt") for c in calls)
        await d.wait_until(lambda: not d.state.ledger.jobs())
        resp = await owner
        resp.close()
