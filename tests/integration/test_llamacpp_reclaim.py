"""Owner return against a real llama-server stream, in each ``on_owner_return`` policy
(reclaim issue: "the llama-server from the foundation issue serves the drain/cancel tests
for OpenAI-compatible streams"; docs/reclaim.md).

The tiny model streams about 3000 tokens over several seconds (``ignore_eos`` and context
shift), long enough for an owner to come back in the middle of it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.lender import lender, owner_returns, reclaim_view
from tests.support.llamacpp import LlamaServer, require_llama_server, running_llama_server

pytestmark = pytest.mark.llama

LONG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": 3000,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    require_llama_server()
    # The tiny model's context holds 512 tokens; context shift lets it go on to max_tokens,
    # a stream of about 3000 tokens (3 s on an idle 2-core machine, longer under load).
    args = ["--ctx-size", "4096", "--context-shift"]
    async with running_llama_server(tmp_path, extra_args=args) as server:
        yield server


async def read_stream(resp: aiohttp.ClientResponse) -> tuple[int, bool]:
    """(data chunks seen, whether the stream ended with ``data: [DONE]``)."""
    chunks, done = 0, False
    async for line in resp.content:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data:"):
            chunks += 1
    return chunks, done


async def test_cancel_cuts_the_stream_and_refuses_new_work(llama: LlamaServer) -> None:
    async with lender(None, target=llama.base_url, adapter="llamacpp", policy="cancel") as (
        d,
        http,
    ):
        url = d.proxy_url("up") + "/v1/chat/completions"
        async with http.post(url, json=LONG) as resp:
            assert resp.status == 200
            await resp.content.readline()
            owner_returns(d)
            with pytest.raises(aiohttp.ClientPayloadError):
                await read_stream(resp)
        async with http.post(url, json={**LONG, "stream": False, "max_tokens": 2}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "owner_active"
        view = reclaim_view(d)
        assert view["trigger"] == "owner" and view["policy"] == "cancel"
        # llama-server may go on generating after the connection closed: the job is held
        # until /slots shows the server idle, then released.
        await d.wait_until(lambda: not d.state.ledger.jobs(), 60)


async def test_drain_cuts_at_the_deadline_never_a_clean_end(llama: LlamaServer) -> None:
    async with lender(
        None,
        target=llama.base_url,
        adapter="llamacpp",
        policy="drain",
        extra="drain_timeout_s = 0.4",
    ) as (d, http):
        async with http.post(d.proxy_url("up") + "/v1/chat/completions", json=LONG) as resp:
            assert resp.status == 200
            await resp.content.readline()
            owner_returns(d)
            started = time.monotonic()
            with pytest.raises(aiohttp.ClientPayloadError):
                await read_stream(resp)
            assert time.monotonic() - started >= 0.3  # ran on until the drain deadline
        await d.wait_until(lambda: not d.state.ledger.jobs(), 60)


@pytest.mark.timeout(300)
async def test_finish_lets_the_stream_end_cleanly(llama: LlamaServer) -> None:
    # The whole stream is read: 1,500 tokens are plenty to show it ran on past the owner's
    # return, and take a loaded machine (where a token costs ten times what it does idle)
    # half as long as 3,000; the time limit follows the machine, not the daemon.
    body = {**LONG, "max_tokens": 1500}
    async with lender(None, target=llama.base_url, adapter="llamacpp", policy="finish") as (
        d,
        http,
    ):
        async with http.post(d.proxy_url("up") + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            owner_returns(d)
            chunks, done = await read_stream(resp)
        assert done and chunks > 1000
        await d.wait_until(lambda: not d.state.ledger.jobs(), 60)
