"""The ollama adapter and its reclaim against a look-alike Ollama,
with the real ``ollama`` Python package as the borrower's client."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import ollama
import pytest

from tests.support.fake_ollama import FakeOllama, Runner
from tests.support.lender import lender, owner_returns, reclaim_view


@asynccontextmanager
async def ollama_client(url: str) -> AsyncIterator[ollama.AsyncClient]:
    """The real ``ollama`` package's async client, closed afterwards."""
    borrower = ollama.AsyncClient(host=url)
    try:
        yield borrower
    finally:
        await borrower.close()  # type: ignore[no-untyped-call]


async def test_routes_host_header_and_the_real_client_through_the_proxy() -> None:
    fake = FakeOllama(tokens=3)
    async with lender(fake.app(), adapter="ollama") as (d, client):
        url = d.proxy_url("up")
        async with ollama_client(url) as borrower:
            await _use(borrower, fake)
        # /api/ps shows the owner's loaded models: management, refused.
        async with client.get(url + "/api/ps") as r:
            assert r.status == 403
            # in Ollama's own flat error shape, as on every native route
            payload = await r.json()
            assert isinstance(payload["error"], str) and payload["code"] == "management_denied"
        async with client.post(url + "/api/pull", json={"model": "x"}) as r:
            assert r.status == 403
        # the quirk: the model stays loaded after the request ended
        assert "tiny:latest" in fake.loaded


async def _use(borrower: ollama.AsyncClient, fake: FakeOllama) -> None:
    """Stream a chat and list models with the real client; check Ollama's Host guard."""
    parts = [
        part["message"]["content"]
        async for part in await borrower.chat(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    ]
    assert "".join(parts) == "t0 t1 t2 "
    listed = await borrower.list()
    assert [m.model for m in listed.models] == ["tiny:latest", "embedder:latest"]
    # Ollama's Host guard accepted every forwarded request (the proxy sends its own).
    assert all(h.startswith("127.0.0.1:") for h in fake.hosts_seen)


async def test_owner_return_cancels_a_stream_and_unloads_every_resident_model() -> None:
    fake = FakeOllama(tokens=500, token_interval_s=0.02)
    async with (
        lender(fake.app(), adapter="ollama", policy="cancel", extra="yield_on_veto = true") as (
            d,
            _client,
        ),
        ollama_client(d.proxy_url("up")) as borrower,
    ):
        stream = await borrower.generate(model="tiny", prompt="long story", stream=True)
        got = []

        async def consume() -> None:
            async for part in stream:
                got.append(part["response"])

        consumer = asyncio.get_running_loop().create_task(consume())
        await fake.streaming.wait()
        fake.loaded.setdefault("embedder:latest", Runner())
        owner_returns(d)
        with pytest.raises(Exception) as caught:
            await asyncio.wait_for(consumer, 5)
        assert not isinstance(caught.value, TimeoutError)
        assert len(got) < 500
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
        assert sorted(fake.unload_requests) == ["embedder:latest", "tiny:latest"]
        assert fake.loaded == {}
        assert fake.stream_ends == ["disconnected"]
        async with _client.get(d.api_url + "/metrics") as r:
            text = await r.text()
        assert (
            'vacancyd_unload_duration_seconds_count{outcome="unloaded",upstream="up"} 1.0' in text
        )
        assert 'vacancyd_reclaim_cancelled_jobs_total{kind="stream",upstream="up"} 1.0' in text


async def test_drain_with_no_work_unloads_the_model_left_resident() -> None:
    fake = FakeOllama(tokens=1)
    async with lender(fake.app(), adapter="ollama", extra="yield_on_veto = true") as (d, _):
        async with ollama_client(d.proxy_url("up")) as borrower:
            await borrower.generate(model="tiny", prompt="x")
        assert "tiny:latest" in fake.loaded
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
        assert reclaim_view(d)["outcome"] == "work_ended"
        assert fake.loaded == {}


async def test_unreachable_ollama_during_unload_neither_blocks_nor_crashes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.WARNING, "vacancyd.control.upstreamcalls")
    async with lender(
        None, target=f"http://127.0.0.1:{port}", adapter="ollama", extra="yield_on_veto = true"
    ) as (d, _):
        loop = asyncio.get_running_loop()
        start = loop.time()
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert loop.time() - start < 5
        assert any("unload of up failed" in r.getMessage() for r in caplog.records)
        # presence sampling went on meanwhile
        before = d.state.presence.reading.observed_at
        await d.wait_until(lambda: d.state.presence.reading.observed_at != before, 2)
        assert d.daemon.supervisor.failure is None


async def test_warm_reload_after_lending_resumes() -> None:
    fake = FakeOllama(tokens=1)
    async with lender(
        fake.app(),
        adapter="ollama",
        extra='yield_on_veto = true\nwarm_model = "tiny"',
        release_s=0.2,
    ) as (d, _):
        fake.loaded["tiny:latest"] = Runner()
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
        assert fake.loaded == {} or not d.state.veto.engaged
        await d.wait_until(lambda: not d.state.veto.engaged, 5)
        await d.wait_until(lambda: "tiny:latest" in fake.loaded, 5)


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("llama3.2", "llama3.2:latest"),
        ("Llama3.2", "llama3.2:latest"),
        ("library/llama3.2:latest", "llama3.2:latest"),
        ("registry.ollama.ai/library/qwen2.5:7b", "qwen2.5:7b"),
        ("someone/custom:q4", "someone/custom:q4"),
        ("hf.co/org/model:Q4_K_M", "hf.co/org/model:q4_k_m"),
    ],
)
def test_model_names_are_canonical_the_way_ollama_matches_them(name: str, canonical: str) -> None:
    from vacancyd.adapters.ollama import canonical_model

    assert canonical_model(name) == canonical


async def test_footprints_match_whatever_spelling_ollama_accepts() -> None:
    """The footprint table says ``llama3.2``; a request for ``Library/Llama3.2:latest`` is
    the same model to Ollama, so it is charged the same footprint (gate step 6)."""
    fake = FakeOllama(tokens=1)
    extra = "\n".join(
        [
            "[upstream.models]",
            "default_mib = 1",
            "[upstream.models.footprint_mib]",
            '"llama3.2" = 100000000',
        ]
    )
    async with lender(fake.app(), adapter="ollama", extra=extra) as (d, client):
        url = d.proxy_url("up") + "/api/generate"
        for spelling in (
            "llama3.2",
            "Library/Llama3.2:latest",
            "registry.ollama.ai/library/llama3.2",
        ):
            async with client.post(url, json={"model": spelling, "prompt": "x"}) as r:
                assert r.status == 503, spelling
                assert (await r.json())["code"] == "insufficient_capacity"
        async with client.post(url, json={"model": "tiny", "prompt": "x", "stream": False}) as r:
            assert r.status == 200
