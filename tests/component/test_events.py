"""GET /events on the lender's API listener: read scope, SSE framing, transitions."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import READ, lender_toml
from tests.support.streams import read_event
from vacancyd.api import events
from vacancyd.core.events import LendabilityChanged
from vacancyd.core.policy import ResourceKind, ResourcePolicy
from vacancyd.state import SharedState


async def test_events_needs_the_read_scope() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{lender.api_url}/events") as resp:
                assert resp.status == 401


async def test_events_stream_hello_then_transitions() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"{lender.api_url}/events", headers={"Authorization": f"Bearer {READ}"}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                kind, data = await read_event(resp.content)
                assert kind == "hello" and data["keepalive_s"] == events.KEEPALIVE_S
                lender.state.set_lending(False)
                kind, data = await read_event(resp.content)
                assert kind == "lending"
                assert data["enabled"] is False and isinstance(data["at_wall"], float)
                lender.state.set_resource_switch("ram", False)
                kind, data = await read_event(resp.content)
                assert kind == "resource_switch"
                assert (data["resource"], data["enabled"]) == ("ram", False)


def test_format_event_is_one_sse_message() -> None:
    raw = events.format_event(7, "veto\nx", {"detail": "line1\nline2"}).decode()
    assert raw.endswith("\n\n")
    lines = raw.rstrip("\n").split("\n")
    assert lines == ["id: 7", "event: vetox", 'data: {"detail":"line1\\nline2"}']


async def test_shutdown_ends_open_streams_promptly() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as http:
            async with running_daemon(lender_toml(target)) as lender:
                resp = await http.get(
                    f"{lender.api_url}/events", headers={"Authorization": f"Bearer {READ}"}
                )
                await read_event(resp.content)
                started = loop.time()
            assert loop.time() - started < 5.0
            resp.release()


async def test_a_client_that_falls_behind_is_cut_off_not_waited_for() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"{lender.api_url}/events", headers={"Authorization": f"Bearer {READ}"}
            ) as resp:
                await read_event(resp.content)
                # transitions faster than the stream drains: the emitter never blocks
                for i in range(events.QUEUE_MAX + 50):
                    lender.state.set_lending(i % 2 == 1)
                async with asyncio.timeout(10):
                    rest = (await resp.content.read()).decode()
        kinds = [line for line in rest.splitlines() if line.startswith("event: ")]
        assert kinds[-1] == "event: overflow"
        # a collector's own transition (capacity, lendable) may slip in beside the burst
        others = [k for k in kinds[:-1] if k != "event: lending"]
        assert events.QUEUE_MAX + 1 <= len(kinds) <= events.QUEUE_MAX + 1 + len(others)
        assert kinds.count("event: lending") < events.QUEUE_MAX + 50


def test_recent_events_keep_the_last_hour_and_only_changed_verdicts() -> None:
    state = SharedState(
        {"ram": ResourcePolicy("ram", ResourceKind.MEMORY)}, {}, presence_source="test"
    )
    now = [1_000_000.0]
    log = events.EventLog(state, clock=lambda: now[0])
    state.set_lending(False)
    verdict = {"up": {"lendable": True, "reason": None, "headroom_mib": 1024}}
    state.events.emit(LendabilityChanged(verdict))
    moved = {"up": {"lendable": True, "reason": None, "headroom_mib": 2048}}
    state.events.emit(LendabilityChanged(moved))  # only the headroom moved: not kept
    now[0] += 3000
    state.events.emit(LendabilityChanged({"up": {"lendable": False, "reason": "owner_active"}}))
    assert [e["kind"] for e in log.recent()] == ["lending", "lendable", "lendable"]
    now[0] += 700  # the first two are now more than an hour old
    recent = log.recent()
    assert [e["kind"] for e in recent] == ["lendable"]
    assert recent[0]["at_wall"] == 1_003_000.0
    log.unsubscribe()
    state.set_lending(True)
    assert len(log.recent()) == 1


async def test_recent_events_need_the_read_scope() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        lender.state.set_lending(False)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{lender.api_url}/events/recent") as resp:
                assert resp.status == 401
            async with http.get(
                f"{lender.api_url}/events/recent", headers={"Authorization": f"Bearer {READ}"}
            ) as resp:
                assert resp.status == 200
                doc = await resp.json()
        assert doc["window_s"] == 3600
        assert any(e["kind"] == "lending" and e["enabled"] is False for e in doc["events"])
