"""``max_concurrent`` against a real llama-server started with four slots (``-np 4``), with
the real ``openai`` client as the borrower: four streams admitted and completing at once,
the fifth refused ``resource_busy`` or waiting, per the config.

The four streams start together (about 800 tokens each, ``ignore_eos`` and context shift);
once llama-server shows all four slots processing, the server process is paused (SIGSTOP)
for the moment the fifth request needs, so a fast machine cannot finish a stream first, and
resumed (SIGCONT) before anything waits on it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon
from tests.support.llamacpp import LlamaServer, require_llama_server, running_llama_server

pytestmark = pytest.mark.llama

MESSAGES: Any = [{"role": "user", "content": "tell me everything"}]
LONG = {"max_tokens": 800, "extra_body": {"ignore_eos": True}}


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    require_llama_server()
    args = ["--ctx-size", "4096", "--context-shift"]
    async with running_llama_server(tmp_path, parallel=4, extra_args=args) as server:
        yield server


def config(target: str, sharing: Mapping[str, Any]) -> str:
    """A lender in front of a four-slot llama-server; ``sharing``: more upstream keys."""
    return daemon_toml(
        upstream("llama", target, adapter="llamacpp", max_concurrent=4, **sharing),
        collectors={"poll_s": 0.2},
    )


async def lender(llama: LlamaServer, sharing: Mapping[str, Any]) -> Any:
    return running_daemon(config(llama.base_url, sharing))


def client(d: RunningDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=d.proxy_url("llama") + "/v1", api_key="unused", max_retries=0, timeout=120
    )


async def start_streams(c: openai.AsyncOpenAI, n: int) -> list[Any]:
    """Open ``n`` streams at once and read the first chunk of each (all admitted, running)."""
    streams = await asyncio.gather(
        *(
            c.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **LONG)  # type: ignore[call-overload]
            for _ in range(n)
        )
    )
    iterators = [s.__aiter__() for s in streams]
    await asyncio.gather(*(it.__anext__() for it in iterators))
    return iterators


@contextlib.contextmanager
def paused(llama: LlamaServer) -> Iterator[None]:
    """Stop the server process for the duration (its streams cannot end meanwhile)."""
    os.kill(llama.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(llama.process.pid, signal.SIGCONT)


async def finish(it: Any) -> int:
    chunks = 1
    async for _ in it:
        chunks += 1
    return chunks


async def processing_slots(llama: LlamaServer) -> int:
    async with aiohttp.ClientSession() as http, http.get(llama.base_url + "/slots") as r:
        return sum(bool(s.get("is_processing")) for s in await r.json())


async def test_four_streams_at_once_and_the_fifth_is_refused(llama: LlamaServer) -> None:
    async with await lender(llama, {}) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "llama" in d.state.servers, 10)
        async with client(d) as c:
            streams = await start_streams(c, 4)
            assert await processing_slots(llama) == 4  # the server really runs all four
            with paused(llama):
                assert len(d.state.ledger.jobs()) == 4
                with pytest.raises(openai.APIStatusError) as info:
                    await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            error = info.value.response.json()["error"]
            assert info.value.status_code == 503 and error["code"] == "resource_busy"
            assert "at most 4 may run on it at once" in error["message"]
            chunks = await asyncio.gather(*(finish(s) for s in streams))
            assert all(n > 100 for n in chunks), chunks
            await d.wait_until(lambda: not d.state.ledger.jobs(), 30)
            reply = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            assert reply.choices


async def test_the_fifth_waits_for_a_slot_and_completes(llama: LlamaServer) -> None:
    async with await lender(llama, {"busy": "wait", "wait_timeout_s": 120}) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "llama" in d.state.servers, 10)
        async with client(d) as c:
            streams = await start_streams(c, 4)
            with paused(llama):
                assert len(d.state.ledger.jobs()) == 4
                fifth = asyncio.create_task(
                    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
                )
                await d.wait_until(lambda: d.daemon.waiting.waiting("llama") == 1, 10)
            assert not fifth.done()
            chunks = await asyncio.gather(*(finish(s) for s in streams))
            assert all(n > 100 for n in chunks), chunks
            reply = await fifth
            assert reply.choices and reply.usage is not None
            await d.wait_until(lambda: not d.state.ledger.jobs(), 30)
