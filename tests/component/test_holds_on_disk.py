"""A hold is shown only once it is on disk (docs/footprints.md, "Held jobs survive a restart").

A borrowed stream on an OpenAI-compatible server is cut by an operator's reclaim, so the job
is held (the server may still be generating). While ``holds.json`` is being written, nothing
shows the hold yet (``/status``, ``job_hold`` events, the log) and its resource lends nothing;
a write that fails (a full disk) refuses ``state_write_failed`` with the error, and is retried
until it succeeds, with no further change needed.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.slow_openai import SlowOpenAI
from vacancyd.core.events import JobHoldChanged, StateEvent
from vacancyd.runtime import durable

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


@asynccontextmanager
async def lender(
    state_dir: Path,
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession, SlowOpenAI]]:
    fake = SlowOpenAI(chunks=400, interval_s=0.02)
    toml = daemon_toml(upstream("up", "TARGET", on_owner_return="cancel"), state_dir=state_dir)
    async with serve_app(fake.app()) as target:
        async with running_daemon(toml.replace("TARGET", target)) as d:
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client, fake


async def cut_a_stream(d: RunningDaemon, client: aiohttp.ClientSession, fake: SlowOpenAI) -> None:
    """Start a borrowed stream and have an operator's reclaim cut it (the job is held)."""
    stream = await client.post(
        d.proxy_url("up") + "/v1/chat/completions", json={**CHAT, "stream": True}
    )
    assert stream.status == 200, await stream.text()
    await fake.started.wait()
    async with client.post(d.api_url + "/admin/reclaim", json={}) as r:
        assert r.status == 200, await r.text()
    stream.close()


async def status(client: aiohttp.ClientSession, d: RunningDaemon) -> dict[str, Any]:
    async with client.get(d.api_url + "/status") as r:
        doc: dict[str, Any] = await r.json()
        return doc


async def borrow(client: aiohttp.ClientSession, d: RunningDaemon) -> tuple[int, dict[str, Any]]:
    async with client.post(d.proxy_url("up") + "/v1/chat/completions", json=CHAT) as r:
        body: dict[str, Any] = await r.json()
        return r.status, body


def holds_writes(monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> list[list[int]]:
    """Run ``before`` (on the writer's thread) ahead of every write of ``holds.json``; the
    list returned gets the job ids of each write once it has completed (fsynced, renamed)."""
    real = durable.write_state
    on_disk: list[list[int]] = [[]]

    def write(path: Path, data: Any) -> None:
        if path.name == "holds.json":
            before()
        real(path, data)
        if path.name == "holds.json":
            on_disk.append([h["job"] for h in data["holds"]])

    monkeypatch.setattr(durable, "write_state", write)
    return on_disk


def events_with_disk(
    d: RunningDaemon, on_disk: list[list[int]]
) -> list[tuple[bool, list[int], int]]:
    """Every ``job_hold`` event as (held, jobs in holds.json when it was emitted, job)."""
    seen: list[tuple[bool, list[int], int]] = []

    def on(event: StateEvent) -> None:
        if isinstance(event, JobHoldChanged):
            seen.append((event.held, on_disk[-1], event.job))

    d.state.subscribe(on)
    return seen


def saved_jobs(state_dir: Path) -> list[int]:
    data = json.loads((state_dir / "holds.json").read_text(encoding="utf-8"))
    return [h["job"] for h in data["holds"]]


async def test_a_hold_is_not_shown_before_it_is_on_disk_and_its_resource_lends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    writing, finish = threading.Event(), threading.Event()

    def slow() -> None:
        writing.set()
        finish.wait(10)

    on_disk = holds_writes(monkeypatch, slow)
    caplog.set_level(logging.INFO)
    state_dir = tmp_path / "state"
    async with lender(state_dir) as (d, client, fake):
        seen = events_with_disk(d, on_disk)
        await cut_a_stream(d, client, fake)
        await asyncio.to_thread(writing.wait, 10)  # held now, its write under way
        doc = await status(client, d)
        work = doc["upstreams"]["up"]["active_work"]
        assert [j["phase"] for j in work] != ["held"] and all(j["hold"] is None for j in work)
        assert seen == []
        assert not any("holding its reservation" in r.getMessage() for r in caplog.records)
        code, body = await borrow(client, d)
        assert code == 503 and body["error"]["code"] == "resource_busy"
        assert (
            doc["resources"]["ram"]["why_not"]
            == "a held job is being written to the state directory"
        )

        finish.set()
        await d.wait_until(lambda: bool(d.daemon.work.holds.shown()))
        ((held, written, job),) = seen
        assert held and written == [job]  # on disk before the event said so
        assert await asyncio.to_thread(saved_jobs, state_dir) == [job]
        doc = await status(client, d)
        (shown,) = doc["upstreams"]["up"]["active_work"]
        assert shown["phase"] == "held" and shown["hold"]["reason"] == "cut_uncertain"
        assert any("holding its reservation" in r.getMessage() for r in caplog.records)
        code, body = await borrow(client, d)
        assert code == 503 and body["error"]["code"] == "resource_busy"


async def test_a_hold_that_cannot_be_written_refuses_its_resource_until_a_retry_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    full = threading.Event()
    full.set()

    def maybe_full() -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")

    on_disk = holds_writes(monkeypatch, maybe_full)
    caplog.set_level(logging.INFO)
    state_dir = tmp_path / "state"
    async with lender(state_dir) as (d, client, fake):
        seen = events_with_disk(d, on_disk)
        await cut_a_stream(d, client, fake)
        holds_file = str(state_dir / "holds.json")
        await d.wait_until(lambda: holds_file in d.state.write_errors)
        code, body = await borrow(client, d)
        assert code == 503, body
        error = body["error"]
        assert error["code"] == "state_write_failed"
        assert "No space left on device" in error["message"] and "holds.json" in error["message"]
        doc = await status(client, d)
        ram = doc["resources"]["ram"]
        assert "No space left on device" in ram["hold_write_error"]
        assert "cannot be written" in ram["why_not"]
        assert doc["upstreams"]["up"]["refusal"]["reason"] == "state_write_failed"
        assert all(j["hold"] is None for j in doc["upstreams"]["up"]["active_work"])
        assert seen == []
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("state_write_failed" in m and "No space left" in m for m in logged)

        full.clear()  # space returns: the retry writes it, with nothing else changing
        await d.wait_until(lambda: bool(d.daemon.work.holds.shown()), 15)
        ((held, written, job),) = seen
        assert held and written == [job]
        assert await asyncio.to_thread(saved_jobs, state_dir) == [job]
        assert "ram" not in d.state.unsaved_holds
        code, body = await borrow(client, d)
        assert code == 503 and body["error"]["code"] == "resource_busy"
        doc = await status(client, d)
        assert doc["resources"]["ram"]["hold_write_error"] is None
        assert doc["upstreams"]["up"]["active_work"][0]["phase"] == "held"
