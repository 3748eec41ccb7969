"""A borrower who disconnects from a real llama-server (docs/footprints.md "After a borrower
disconnects").

llama-server goes on with a request whose client went away: a non-streamed one to its last
token, a streamed one until a write to the closed connection fails. vacancyd keeps the job
reserved (phase ``tracking``) until a ``/slots`` observation taken after the disconnect shows
the server idle, so a borrowed request arriving meanwhile is refused ``resource_busy`` rather
than admitted onto a busy server; once the server is seen idle the job is released and the
next request admitted. Each test prints how long the server went on after the disconnect (the
figure docs/footprints.md quotes), read from ``/slots`` directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon
from tests.support.llamacpp import LlamaServer, require_llama_server, running_llama_server

pytestmark = pytest.mark.llama

#: Hundreds of tokens (context shift lets the tiny model go past its context): most of a
#: second on an idle machine, long enough to give up on in the middle.
LONG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": 600,
    "ignore_eos": True,
}
SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    require_llama_server()
    args = ["--ctx-size", "4096", "--context-shift"]
    async with running_llama_server(tmp_path, extra_args=args) as server:
        yield server


@pytest.fixture
async def lender(llama: LlamaServer) -> AsyncIterator[RunningDaemon]:
    toml = daemon_toml(
        upstream("llama", llama.base_url, adapter="llamacpp", models={"default_mib": 64}),
        collectors={"poll_s": 0.5},
    )
    async with running_daemon(toml) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "llama" in d.state.servers, 10)
        yield d


def phases(d: RunningDaemon) -> list[str]:
    return [j.phase.value for j in d.state.ledger.jobs()]


async def slots_busy(http: aiohttp.ClientSession, llama: LlamaServer) -> bool:
    """Whether the real server shows a slot processing (asked directly, not through vacancyd)."""
    async with http.get(llama.base_url + "/slots") as r:
        assert r.status == 200
        return any(slot["is_processing"] for slot in await r.json())


async def until_idle(http: aiohttp.ClientSession, llama: LlamaServer) -> float:
    """Poll the server's ``/slots`` until no slot processes; the monotonic time it was seen idle."""
    async with asyncio.timeout(240):
        while await slots_busy(http, llama):  # noqa: ASYNC110 - polls the real server
            await asyncio.sleep(0.005)
    return time.monotonic()


async def borrow(d: RunningDaemon, http: aiohttp.ClientSession) -> tuple[int, str]:
    async with http.post(d.proxy_url("llama") + "/v1/chat/completions", json=SHORT) as r:
        body = await r.json()
        return r.status, "" if r.status == 200 else body["error"]["code"]


async def give_up_on(
    d: RunningDaemon, llama: LlamaServer, http: aiohttp.ClientSession, body: dict[str, object]
) -> float:
    """Send ``body`` through vacancyd, wait until the real server works on it, then disconnect;
    returns the monotonic time of the disconnect, once vacancyd has seen it."""
    url = d.proxy_url("llama") + "/v1/chat/completions"

    async def borrower() -> None:
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            async for _ in resp.content:  # a stream is read as it comes
                pass

    task = asyncio.create_task(borrower())
    async with asyncio.timeout(30):
        while not (phases(d) == ["forwarding"] and await slots_busy(http, llama)):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if body.get("stream"):
            await asyncio.sleep(0.1)  # tokens are flowing to the borrower
    task.cancel()
    disconnected = time.monotonic()
    await d.wait_until(lambda: phases(d) != ["forwarding"], 10)
    return disconnected


@pytest.mark.timeout(300)
async def test_a_borrowed_request_is_refused_until_llama_server_stops_the_abandoned_one(
    lender: RunningDaemon, llama: LlamaServer
) -> None:
    d = lender
    async with aiohttp.ClientSession() as http:
        disconnected = await give_up_on(d, llama, http, LONG)
        # A non-streamed request runs on to its last token: the job is not released.
        assert phases(d) == ["tracking"]
        assert await borrow(d, http) == (503, "resource_busy")
        stopped = await until_idle(http, llama)
        print(f"\nllama-server went on for {stopped - disconnected:.3f} s after the disconnect")
        # Once /slots shows it idle the job ends and borrowed work is admitted again.
        await d.wait_until(lambda: not d.state.ledger.jobs(), 60)
        assert await borrow(d, http) == (200, "")
    assert d.daemon.metrics.jobs.value("llama", "borrower_disconnected") == 1
    assert d.daemon.metrics.jobs.value("llama", "completed") == 1


@pytest.mark.timeout(300)
async def test_a_disconnected_stream_is_released_once_llama_server_is_seen_idle(
    lender: RunningDaemon, llama: LlamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    # llama-server stops a stream within milliseconds of its first failed write, so the
    # tracking is short: what ended it is read from the log rather than caught in the act.
    caplog.set_level(logging.INFO, logger="vacancyd.control.work")
    d = lender
    async with aiohttp.ClientSession() as http:
        body = {**LONG, "max_tokens": 3000, "stream": True}
        disconnected = await give_up_on(d, llama, http, body)
        stopped = await until_idle(http, llama)
        print(f"\nllama-server went on for {stopped - disconnected:.3f} s after a stream ended")
        await d.wait_until(lambda: not d.state.ledger.jobs(), 60)
        assert await borrow(d, http) == (200, "")
    assert d.daemon.metrics.jobs.value("llama", "borrower_disconnected") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "llama: server idle after the borrower disconnected; releasing job 1" in messages
