"""vacancyd in front of a real llama.cpp ``llama-server`` serving a tiny random-weight model,
with the ``openai`` Python client as the borrower (foundation issue, "Real components").

The generated text is noise; what is asserted is that the proxy serves the real server's
answers, streams them chunk by chunk, refuses correctly, and that a borrower disconnecting
mid-stream releases the ledger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.component.test_borrowers import ledger_rows
from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon
from tests.support.llamacpp import LlamaServer, require_llama_server, running_llama_server

pytestmark = pytest.mark.llama


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    require_llama_server()
    async with running_llama_server(tmp_path) as server:
        yield server


@pytest.fixture
async def lender(llama: LlamaServer) -> AsyncIterator[RunningDaemon]:
    toml = daemon_toml(
        upstream("llama", llama.base_url, adapter="llamacpp", models={"default_mib": 512}),
        collectors={"poll_s": 0.5},
    )
    async with running_daemon(toml) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "llama" in d.state.servers, 10)
        yield d


def client(lender: RunningDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=lender.proxy_url("llama") + "/v1", api_key="unused", max_retries=0
    )


async def test_openai_client_non_streaming(lender: RunningDaemon, llama: LlamaServer) -> None:
    async with client(lender) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    assert reply.choices and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert lender.state.ledger.jobs() == []


async def test_openai_client_streaming_arrives_chunk_by_chunk(lender: RunningDaemon) -> None:
    async with client(lender) as c:
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=16,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    assert len(chunks) > 2
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None


async def test_refusal_reaches_the_openai_client_as_503(lender: RunningDaemon) -> None:
    lender.state.set_lending(False)
    async with client(lender) as c:
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
        assert info.value.status_code == 503
        assert info.value.response.headers["Retry-After"] == "300"
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "lending_disabled"
        assert body["type"] == "no_vacancy" and body["source"] == "vacancyd"
        # discovery keeps working while lending is off
        assert [m.id for m in (await c.models.list()).data] == ["tiny"]
    lender.state.set_lending(True)
    async with client(lender) as c:
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
        assert reply.choices


async def test_slots_is_management_and_disconnect_releases(lender: RunningDaemon) -> None:
    base = lender.proxy_url("llama")
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/slots") as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "management_denied"
        async with http.get(base + "/health") as r:
            assert r.status == 200
        resp = await http.post(
            base + "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 200,
                "stream": True,
            },
        )
        assert resp.status == 200
        await resp.content.readline()
        assert len(lender.state.ledger.jobs()) == 1
        resp.close()
    await lender.wait_until(lambda: not lender.state.ledger.jobs(), 10)
    # the server is still usable through the proxy afterwards
    async with client(lender) as c:
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
        assert reply.choices
    await asyncio.sleep(0)


async def test_the_ledger_records_the_tokens_the_real_server_reported(
    lender: RunningDaemon,
) -> None:
    """Issue 23: one usage-ledger row per job, with the usage llama-server reported (the
    last streamed chunk with ``include_usage``, and the JSON reply)."""
    async with client(lender) as c:
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    streamed = chunks[-1].usage
    assert reply.usage is not None and streamed is not None
    rows = await ledger_rows(lender, 2)
    got = [(r["prompt_tokens"], r["completion_tokens"]) for r in rows]
    assert got == [
        (reply.usage.prompt_tokens, reply.usage.completion_tokens),
        (streamed.prompt_tokens, streamed.completion_tokens),
    ]
    assert all(r["borrower"] == "" and r["outcome"] == "completed" for r in rows)
