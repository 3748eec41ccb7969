"""``GET /overview`` on a live daemon (read scope): the 24-hour timeline drawn from the
durable history the daemon records from its start, and today's totals per borrower from the
usage ledger (docs/observability.md, "Status page")."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.component.test_api import ADMIN, BORROW, READ, bearer, config
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from vacancyd.core.history import HistorySample
from vacancyd.core.usage import UsageRow

NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture
async def lender() -> AsyncIterator[RunningDaemon]:
    app, _ = openai_like_app()
    async with serve_app(app) as url, running_daemon(config(url)) as d:
        yield d


async def overview(d: RunningDaemon, token: str = READ) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(d.api_url + "/overview", headers=bearer(token)) as r,
    ):
        assert r.status == 200
        assert r.headers["Cache-Control"] == "no-store"
        body: dict[str, object] = await r.json()
        return body


async def history(d: RunningDaemon) -> list[HistorySample]:
    store = d.daemon.usage
    assert store is not None
    return await store.history(0.0)


async def at_least(d: RunningDaemon, n: int) -> list[HistorySample]:
    """The history once it has ``n`` samples (within 5 s)."""
    async with asyncio.timeout(5):
        while len(samples := await history(d)) < n:  # noqa: ASYNC110 - polls the database
            await asyncio.sleep(0.05)
    return samples


async def test_overview_needs_the_read_scope(lender: RunningDaemon) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(lender.api_url + "/overview") as r:
            assert r.status == 401
        async with http.get(lender.api_url + "/overview", headers=bearer(BORROW)) as r:
            assert r.status == 403
    await overview(lender, ADMIN)


async def test_history_starts_with_the_daemon_and_the_timeline_is_never_empty(
    lender: RunningDaemon,
) -> None:
    (first,) = await at_least(lender, 1)
    assert first.lending and not first.owner_present and first.borrowers == {}
    assert abs(first.at_wall - time.time()) < 10

    body = await overview(lender)
    timeline = body["timeline"]
    assert isinstance(timeline, dict)
    assert timeline["error"] is None and timeline["samples"] == 1
    svg = ET.fromstring(str(timeline["svg"]))
    desc = svg.find(NS + "desc")
    assert desc is not None and desc.text and desc.text.startswith("History covers")
    bands = [t.text or "" for t in svg.iter(NS + "title")]
    assert any(b.startswith("lending on") for b in bands)
    assert any(b.startswith("owner away") for b in bands)


async def test_a_lending_edge_is_recorded_at_once(lender: RunningDaemon) -> None:
    await at_least(lender, 1)
    async with (
        aiohttp.ClientSession() as http,
        http.put(
            lender.api_url + "/admin/lending", json={"enabled": False}, headers=bearer(ADMIN)
        ) as r,
    ):
        assert r.status == 200
    samples = await at_least(lender, 2)
    assert [s.lending for s in samples] == [True, False]


async def test_today_is_the_ledger_since_local_midnight_per_borrower(
    lender: RunningDaemon,
) -> None:
    store = lender.daemon.usage
    assert store is not None
    now = time.time()
    tz = lender.daemon.owner.config.tz
    midnight = dt.datetime.combine(
        dt.datetime.fromtimestamp(now, tz).date(), dt.time(), tzinfo=tz
    ).timestamp()

    def row(job_id: int, borrower: str, ended_at: float, energy_j: float | None) -> UsageRow:
        return UsageRow(
            job_id,
            borrower,
            "llm",
            "tiny",
            "ram",
            ended_at - 60,
            ended_at,
            "completed",
            100,
            20,
            energy_j,
            10,
            20,
        )

    for r in (
        row(1, "alice", max(midnight + 1, now - 5), 7200.0),
        row(2, "", max(midnight + 1, now - 5), None),
        row(3, "alice", max(midnight + 1, now - 5), None),
        row(4, "alice", midnight - 60, 1.0),  # yesterday
    ):
        await asyncio.wrap_future(store.record(r))
    today = (await overview(lender))["today"]
    assert isinstance(today, dict)
    assert today["error"] is None
    assert today["day"] == dt.datetime.fromtimestamp(now, tz).date().isoformat()
    assert today["since_wall"] == midnight
    assert today["rows"] == [
        {
            "borrower": "alice",
            "label": "alice",
            "requests": 2,
            "busy_s": 120.0,
            "prompt_tokens": 200,
            "completion_tokens": 40,
            "energy_j": 7200.0,
        },
        {
            "borrower": "",
            "label": "default",
            "requests": 1,
            "busy_s": 60.0,
            "prompt_tokens": 100,
            "completion_tokens": 20,
            "energy_j": None,
        },
    ]


async def test_an_unreadable_database_is_said_in_the_answer_not_a_500(
    lender: RunningDaemon,
) -> None:
    store = lender.daemon.usage
    assert store is not None
    await store.close()
    body = await overview(lender)
    timeline, today = body["timeline"], body["today"]
    assert isinstance(timeline, dict) and isinstance(today, dict)
    assert "could not read the history" in str(timeline["error"])
    assert "No history recorded yet" in str(timeline["svg"])
    assert "could not read the usage ledger" in str(today["error"]) and today["rows"] == []
