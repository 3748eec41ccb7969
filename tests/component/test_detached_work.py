"""A borrower who disconnects from a server that goes on generating (docs/footprints.md
"After a borrower disconnects").

llama-server keeps working on a request whose client went away until it notices, so the job
stays reserved (``tracking``) until a ``/slots`` observation taken after the disconnect shows
the server idle, or is held once ``detached_work_timeout_s`` passes with the server still
busy. A generic OpenAI-compatible server offers no such evidence: its jobs end at the
disconnect. Every job's end is counted by outcome (``vacancyd_jobs_total``) and logged with
an ``outcome`` field. The real llama-server's side is in
tests/integration/test_llamacpp_detached.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.slow_openai import SlowOpenAI
from tests.support.streams import read_all

CHAT = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def lender(
    fake: SlowOpenAI, *, adapter: str = "llamacpp", extra: Mapping[str, Any] | None = None
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession]]:
    async with serve_app(fake.app()) as target:
        toml = daemon_toml(upstream("llm", target, adapter=adapter, **(extra or {})))
        async with running_daemon(toml) as d:
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client


async def disconnect_mid_stream(d: RunningDaemon, client: aiohttp.ClientSession) -> None:
    """Start a stream through the daemon, read its first chunk and go away."""
    resp = await client.post(d.proxy_url("llm") + "/v1/chat/completions", json=CHAT)
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    resp.close()


async def chat_status(d: RunningDaemon, client: aiohttp.ClientSession) -> tuple[int, str]:
    """A borrowed request's status and error code; a stream that is admitted is closed."""
    async with client.post(d.proxy_url("llm") + "/v1/chat/completions", json=CHAT) as r:
        if r.status == 200:
            return 200, ""
        return r.status, (await r.json())["error"]["code"]


def phases(d: RunningDaemon) -> list[str]:
    return [j.phase.value for j in d.state.ledger.jobs()]


async def scrape(d: RunningDaemon, client: aiohttp.ClientSession) -> dict[str, float]:
    """``vacancyd_jobs_total`` by outcome and ``vacancyd_active_work`` by phase (upstream llm)."""
    async with client.get(d.api_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("upstream") != "llm":
                continue
            if sample.name == "vacancyd_jobs_total":
                out[sample.labels["outcome"]] = sample.value
            elif sample.name == "vacancyd_active_work":
                out["active:" + sample.labels["phase"]] = sample.value
    return out


async def test_a_disconnected_llamacpp_job_stays_reserved_until_slots_show_it_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd.control.work")
    stops = asyncio.Event()
    fake = SlowOpenAI(chunks=400, interval_s=0.02, detached_busy=stops)
    async with lender(fake) as (d, client):
        await disconnect_mid_stream(d, client)
        await asyncio.wait_for(fake.ended_event.wait(), 5)
        assert fake.ended == ["disconnected"]
        # The server goes on generating: the job is not released at the disconnect.
        assert phases(d) == ["tracking"]
        assert await chat_status(d, client) == (503, "resource_busy")
        metrics = await scrape(d, client)
        assert metrics.get("active:tracking") == 1
        assert metrics.get("borrower_disconnected", 0) == 0
        async with client.get(d.api_url + "/status") as r:
            work = (await r.json())["upstreams"]["llm"]["active_work"]
        assert [w["phase"] for w in work] == ["tracking"]
        # The server stops; the next /slots observation shows it idle and ends the job.
        stops.set()
        await d.wait_until(lambda: not d.state.ledger.jobs(), 10)
        assert await chat_status(d, client) == (200, "")
        await d.wait_until(lambda: len(fake.ended) == 2 and not d.state.ledger.jobs(), 10)
        metrics = await scrape(d, client)
        assert metrics.get("borrower_disconnected") == 2
        assert metrics.get("active:tracking", 0) == 0
    ends = [r for r in caplog.records if getattr(r, "job", None) == work[0]["job"]]
    assert [getattr(r, "outcome", None) for r in ends] == ["borrower_disconnected"]


async def test_detached_work_still_busy_at_its_bound_is_held_until_slots_show_it_idle() -> None:
    stops = asyncio.Event()
    fake = SlowOpenAI(chunks=400, interval_s=0.02, detached_busy=stops)
    async with lender(fake, extra={"detached_work_timeout_s": 0.3}) as (d, client):
        await disconnect_mid_stream(d, client)
        await d.wait_until(lambda: phases(d) == ["held"], 10)
        async with client.get(d.api_url + "/status") as r:
            work = (await r.json())["upstreams"]["llm"]["active_work"]
        assert work[0]["hold"]["reason"] == "detached_work"
        assert work[0]["hold"]["release_by"] == "server_idle"
        assert await chat_status(d, client) == (503, "resource_busy")
        stops.set()
        await d.wait_until(lambda: not d.state.ledger.jobs(), 10)
        assert (await scrape(d, client)).get("borrower_disconnected") == 1


async def test_a_disconnected_openai_job_ends_at_the_disconnect() -> None:
    # Nothing a generic OpenAI-compatible server offers shows when detached work stops, so the
    # job ends with the exchange (docs/footprints.md says why).
    fake = SlowOpenAI(chunks=400, interval_s=0.02, detached_busy=asyncio.Event())
    async with lender(fake, adapter="openai") as (d, client):
        await disconnect_mid_stream(d, client)
        await asyncio.wait_for(fake.ended_event.wait(), 5)
        assert phases(d) == []
        assert (await scrape(d, client)).get("borrower_disconnected") == 1


async def test_every_job_end_is_counted_by_outcome() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        assert request.transport is not None
        request.transport.abort()
        return resp

    fake = SlowOpenAI(chunks=3, interval_s=0.01)
    app = fake.app()
    app.router.add_post("/v1/completions", broken)
    async with serve_app(app) as target:
        toml = daemon_toml(upstream("llm", target, adapter="openai"))
        async with running_daemon(toml) as d, aiohttp.ClientSession() as client:
            await d.wait_ready()
            async with client.post(d.proxy_url("llm") + "/v1/chat/completions", json=CHAT) as r:
                _, error = await read_all(r)
                assert error is None
            await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
            async with client.post(d.proxy_url("llm") + "/v1/completions", json={}) as r:
                _, error = await read_all(r)
                assert error is not None
            await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
            metrics = await scrape(d, client)
    assert metrics.get("completed") == 1
    assert metrics.get("upstream_failed") == 1
