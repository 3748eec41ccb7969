"""The owner's return is a chain of direct calls (ARCHITECTURE.md, "The owner's return"):
presence reading → owner controls → state → reclaimer → Work's cut → the unload. The state's
event bus is for observers only, so the whole chain works with the bus silenced."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.fake_ollama import FakeOllama, Runner
from tests.support.lender import OWNER, lender, reclaim_view
from vacancyd.core.events import StateEvent
from vacancyd.state import PresenceReading


async def test_with_the_event_bus_silenced_the_owner_return_still_cuts_and_unloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeOllama(tokens=500, token_interval_s=0.02)
    async with lender(
        fake.app(), adapter="ollama", policy="cancel", extra="yield_on_veto = true"
    ) as (d, client):
        body = {"model": "tiny", "prompt": "long story", "stream": True}
        stream = await client.post(d.proxy_url("up") + "/api/generate", json=body)
        assert stream.status == 200
        await fake.streaming.wait()
        fake.loaded.setdefault("embedder:latest", Runner())
        heard: list[StateEvent] = []
        monkeypatch.setattr(d.state.events, "emit", heard.append)  # no subscriber hears anything

        reclaimed = d.daemon.owner.record_presence(OWNER, d.state.clock())

        assert reclaimed == ["up"]  # answered within the call: published, new work refused
        assert reclaim_view(d)["trigger"] == "owner"
        async with client.post(d.proxy_url("up") + "/api/generate", json=body) as refused:
            assert refused.status == 503
            assert (await refused.json())["code"] == "owner_active"
        with pytest.raises(aiohttp.ClientPayloadError):  # cut, not ended cleanly
            await asyncio.wait_for(stream.read(), 5)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert sorted(fake.unload_requests) == ["embedder:latest", "tiny:latest"]
        assert fake.loaded == {}
        assert {e.kind for e in heard} >= {"veto", "reclaim"}  # still told, to nobody


async def test_a_presence_reading_that_raises_no_edge_reclaims_nothing() -> None:
    fake = FakeOllama(tokens=1)
    async with lender(fake.app(), adapter="ollama") as (d, _client):
        away = PresenceReading(owner_signal=False, evidence_complete=True, detail="away")
        assert d.daemon.owner.record_presence(away, d.state.clock()) == []
        assert reclaim_view(d) == {}
