"""A hung upstream: ``upstream_silence_s`` turns a borrowed job's reservation into a hold.

A real in-process daemon in front of an OpenAI-shaped fake that accepts a chat request and
then sends nothing (its response headers wait on an event that is never set, or its stream
pauses after the first chunk). At the limit the borrower gets 504 (or a cut stream), the
job's reservation stays as a hold with reason ``upstream_silent``, and the next borrower is
judged against that hold; /status, /metrics, /events and the log all say so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.slow_openai import SlowOpenAI
from tests.support.streams import next_event, read_all

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def config(target: str, *, silence: float, adapter: str = "openai") -> str:
    """One upstream ``llm`` that gives up on a borrowed job after ``silence`` s of nothing."""
    return daemon_toml(upstream("llm", target, adapter=adapter, upstream_silence_s=silence))


@asynccontextmanager
async def lender(
    fake: SlowOpenAI, **kw: object
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession]]:
    async with serve_app(fake.app()) as target:
        async with running_daemon(config(target, **kw)) as d:  # type: ignore[arg-type]
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client


async def chat(d: RunningDaemon, client: aiohttp.ClientSession) -> tuple[int, dict[str, object]]:
    async with client.post(d.proxy_url("llm") + "/v1/chat/completions", json=CHAT) as r:
        if r.status == 200:
            await r.read()
            return 200, {}
        body = await r.json()
        error = body["error"]
        assert isinstance(error, dict)
        return r.status, error


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_hung_upstream_turns_the_reservation_into_a_hold_at_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    never = asyncio.Event()
    fake = SlowOpenAI(hold_headers=never)  # accepts, then never answers
    caplog.set_level(logging.WARNING, logger="vacancyd")
    async with lender(fake, silence=0.5) as (d, client):
        events = await client.get(f"{d.api_url}/events")
        assert events.status == 200
        began = time.monotonic()
        status, error = await asyncio.wait_for(chat(d, client), 10)
        waited = time.monotonic() - began
        assert fake.started.is_set(), "the request reached the upstream"
        assert status == 504
        assert error["code"] == "upstream_timeout" and error["type"] == "upstream_error"
        assert "0.5 s" in str(error["message"])
        assert 0.5 <= waited < 5, waited

        # the reservation is still there, now as a hold (shown once it is on disk)
        await d.wait_until(lambda: [j.phase.value for j in d.state.ledger.jobs()] == ["held"])
        jobs = d.state.ledger.jobs()
        job_id = jobs[0].id
        assert error["job"] == job_id

        # the next borrower is judged against the hold
        status, error = await chat(d, client)
        assert (status, error["code"]) == (503, "resource_busy")

        async with client.get(f"{d.api_url}/status") as r:
            doc = await r.json()
        (work,) = doc["upstreams"]["llm"]["active_work"]
        assert work["job"] == job_id and work["phase"] == "held"
        assert work["hold"]["reason"] == "upstream_silent"
        assert work["hold"]["release_by"] == "admin"
        assert "0.5 s" in work["hold"]["detail"]

        payload = await next_event(events.content, "job_hold")
        assert payload["job"] == job_id and payload["upstream"] == "llm"
        assert payload["held"] is True and payload["reason"] == "upstream_silent"

        async with client.get(f"{d.api_url}/metrics") as r:
            text = await r.text()
        assert metric(text, "vacancyd_upstream_errors_total", upstream="llm", stage="silent") == 1
        assert metric(text, "vacancyd_active_work", upstream="llm", phase="held") == 1

        assert any(
            "sent nothing for 0.5 s" in r.getMessage()
            and "holding its reservation" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]

        # only its normal means end the hold: here, an administrator
        never.set()
        async with client.post(f"{d.api_url}/admin/jobs/{job_id}/release") as r:
            assert r.status == 200
        payload = await next_event(events.content, "job_hold")
        assert payload["job"] == job_id and payload["held"] is False
        async with asyncio.timeout(5):
            while (await chat(d, client))[0] != 200:  # noqa: ASYNC110 - HTTP poll
                await asyncio.sleep(0.05)
        events.close()


async def test_a_stream_that_goes_silent_is_cut_and_its_job_held() -> None:
    fake = SlowOpenAI(chunks=3, interval_s=60)  # one chunk, then a minute of nothing
    async with lender(fake, silence=0.5) as (d, client):
        resp = await client.post(
            d.proxy_url("llm") + "/v1/chat/completions", json={**CHAT, "stream": True}
        )
        assert resp.status == 200
        data, error = await asyncio.wait_for(read_all(resp), 10)
        assert b"tok0" in data and b"[DONE]" not in data
        assert error is not None, "a silent stream must end in an error, never a clean end"
        await d.wait_until(lambda: [j.phase.value for j in d.state.ledger.jobs()] == ["held"])
        (job,) = d.state.ledger.jobs()
        hold = d.daemon.work.holds.shown()[job.id]
        assert hold.reason.value == "upstream_silent" and hold.release_by.value == "admin"


class HungLlamaServer:
    """A llama-server that takes a chat request and then stops answering; its work goes on
    after the client hangs up (a hung server does not notice) until ``finish`` is set.
    ``GET /slots`` has llama-server's shape: one slot, ``is_processing`` while work runs."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.working = 0
        self.arrived = asyncio.Event()
        self._work: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/slots", self.slots)
        return app

    async def slots(self, _: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "is_processing": self.working > 0}])

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.working += 1
        self.arrived.set()
        work = asyncio.get_running_loop().create_task(self._generate())
        self._work.add(work)
        await asyncio.shield(work)
        return web.json_response({"object": "chat.completion", "choices": []})

    async def _generate(self) -> None:
        try:
            await self.finish.wait()
        finally:
            self.working -= 1


async def test_a_silent_llamacpp_job_is_held_until_its_slots_show_it_idle() -> None:
    fake = HungLlamaServer()
    async with serve_app(fake.app()) as target:
        async with running_daemon(config(target, silence=0.5, adapter="llamacpp")) as d:
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                status, error = await asyncio.wait_for(chat(d, client), 10)
                assert fake.arrived.is_set()
                assert (status, error["code"]) == (504, "upstream_timeout")
                (job,) = d.state.ledger.jobs()
                await d.wait_until(lambda: job.id in d.daemon.work.holds.shown())  # once on disk
                assert d.daemon.work.holds.shown()[job.id].release_by.value == "server_idle"
                # the server still works on it (its slot is busy): the hold outlasts polls
                await asyncio.sleep(0.6)
                assert [j.phase.value for j in d.state.ledger.jobs()] == ["held"]
                status, error = await chat(d, client)
                assert (status, error["code"]) == (503, "resource_busy")
                # the server finishes; a /slots observation shows it idle and ends the hold
                fake.finish.set()
                await d.wait_until(lambda: d.state.ledger.jobs() == [], 5)


async def test_zero_means_no_silence_limit() -> None:
    answer = asyncio.Event()
    fake = SlowOpenAI(chunks=1, hold_headers=answer)
    async with lender(fake, silence=0) as (d, client):
        waiting = asyncio.get_running_loop().create_task(chat(d, client))
        await fake.started.wait()
        await asyncio.sleep(1.0)  # twice the limit the other tests use
        assert not waiting.done()
        assert [j.phase.value for j in d.state.ledger.jobs()] == ["forwarding"]
        answer.set()
        assert (await asyncio.wait_for(waiting, 5))[0] == 200
        await d.wait_until(lambda: d.state.ledger.jobs() == [], 5)


async def test_a_hung_pass_through_request_ends_with_504_and_reserves_nothing() -> None:
    never = asyncio.Event()

    async def models(_: web.Request) -> web.Response:
        await never.wait()  # accepts the request, then sends nothing
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as target, running_daemon(config(target, silence=0.5)) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as client:
            began = time.monotonic()
            async with asyncio.timeout(10), client.get(d.proxy_url("llm") + "/v1/models") as r:
                assert r.status == 504
                error = (await r.json())["error"]
            assert 0.5 <= time.monotonic() - began < 5
            assert error["code"] == "upstream_timeout" and "job" not in error
            assert d.state.ledger.jobs() == []
            async with client.get(f"{d.api_url}/metrics") as m:
                text = await m.text()
            errors = metric(text, "vacancyd_upstream_errors_total", upstream="llm", stage="silent")
            assert errors == 1
        never.set()
