"""Concurrency slots and the bounded wait through a real daemon and proxy (HTTP level).

The upstream is a small OpenAI-compatible server (the chat completions JSON shape) whose
replies are held until the test lets them go, so the tests decide exactly when a slot frees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.held_openai import HeldOpenAI
from tests.support.lender import owner_returns


def config(target: str, sharing: Mapping[str, Any], *, max_connections: int = 256) -> str:
    """One upstream ``up`` with the sharing keys ``sharing``; the owner's veto holds an hour.

    These tests are about slots and the wait queue, not the connection guard: every
    connection may stay unauthenticated (one peer, all at once) up to ``max_connections``,
    so a burst that the loaded loop has not yet read headers for is never refused by the
    guard's per-peer budget instead of by the queue."""
    limits = {
        "max_connections": max_connections,
        "max_unauthenticated_connections": max_connections,
        "max_unauthenticated_per_peer": max_connections,
        "body_idle_timeout_s": 5,
    }
    return daemon_toml(
        upstream("up", target, **sharing),
        limits=limits,
        owner={"release_after_s": 3600},
    )


@asynccontextmanager
async def lender(
    sharing: Mapping[str, Any], **kw: Any
) -> AsyncIterator[tuple[RunningDaemon, HeldOpenAI, aiohttp.ClientSession]]:
    fake = HeldOpenAI()
    async with serve_app(fake.app()) as url, running_daemon(config(url, sharing, **kw)) as d:
        await d.wait_ready()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as client:
            yield d, fake, client


async def chat(d: RunningDaemon, client: aiohttp.ClientSession, user: str) -> tuple[int, Any]:
    async with client.post(
        d.proxy_url("up") + "/v1/chat/completions",
        json={"model": "tiny", "user": user, "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        return r.status, (await r.json(), r.headers.get("Retry-After"))


def waiting(d: RunningDaemon) -> int:
    return d.daemon.waiting.waiting("up")


async def metrics(d: RunningDaemon, client: aiohttp.ClientSession) -> str:
    async with client.get(d.api_url + "/metrics") as r:
        return await r.text()


async def test_max_concurrent_admits_that_many_and_refuses_the_next() -> None:
    async with lender({"max_concurrent": 3}) as (d, fake, client):
        running = [asyncio.create_task(chat(d, client, f"u{i}")) for i in range(3)]
        await fake.until_arrived(3)
        assert len(d.state.ledger.jobs()) == 3
        status, (body, retry) = await chat(d, client, "fourth")
        assert status == 503 and body["error"]["code"] == "resource_busy" and retry == "2"
        assert "at most 3 may run on it at once" in body["error"]["message"]
        text = await metrics(d, client)
        assert 'vacancyd_resource_jobs{resource="ram"} 3.0' in text
        for i in range(3):
            fake.release(f"u{i}")
        assert [s for s, _ in await asyncio.gather(*running)] == [200, 200, 200]
        await d.wait_until(lambda: not d.state.ledger.jobs())


async def test_waiters_are_served_in_arrival_order() -> None:
    async with lender({"busy": "wait", "wait_timeout_s": 20}) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        queued = []
        for i in range(3):
            queued.append(asyncio.create_task(chat(d, client, f"w{i}")))

            def queued_n(n: int = i + 1) -> bool:
                return waiting(d) == n

            await d.wait_until(queued_n)
        assert 'vacancyd_waiting{upstream="up"} 3.0' in await metrics(d, client)
        fake.release("first")
        for i in range(3):
            await fake.until_arrived(2 + i)
            fake.release(f"w{i}")
        assert (await first)[0] == 200 and [s for s, _ in await asyncio.gather(*queued)] == [
            200
        ] * 3
        assert fake.arrived == ["first", "w0", "w1", "w2"]
        text = await metrics(d, client)
        assert 'vacancyd_wait_seconds_count{outcome="admitted",upstream="up"} 3.0' in text


async def test_a_wait_that_times_out_gets_resource_busy() -> None:
    async with lender({"busy": "wait", "wait_timeout_s": 0.3}) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        started = time.monotonic()
        status, (body, retry) = await chat(d, client, "late")
        assert time.monotonic() - started >= 0.3
        assert status == 503 and body["error"]["code"] == "resource_busy" and retry == "2"
        assert "stayed taken for the whole wait" in body["error"]["message"]
        assert waiting(d) == 0
        fake.release("first")
        assert (await first)[0] == 200


async def test_owner_return_refuses_every_waiter_at_once_with_the_real_reason() -> None:
    sharing = {"busy": "wait", "wait_timeout_s": 30, "on_owner_return": "finish"}
    async with lender(sharing) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        queued = [asyncio.create_task(chat(d, client, f"w{i}")) for i in range(5)]
        await d.wait_until(lambda: waiting(d) == 5)
        started = time.monotonic()
        owner_returns(d)
        answers = await asyncio.gather(*queued)
        assert time.monotonic() - started < 2.0
        assert {(s, b["error"]["code"]) for s, (b, _) in answers} == {(503, "owner_active")}
        assert fake.arrived == ["first"]
        fake.release("first")
        assert (await first)[0] == 200


async def test_lending_switched_off_refuses_every_waiter() -> None:
    async with lender({"busy": "wait", "wait_timeout_s": 30}) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        queued = [asyncio.create_task(chat(d, client, f"w{i}")) for i in range(3)]
        await d.wait_until(lambda: waiting(d) == 3)
        d.state.set_lending(False)
        answers = await asyncio.gather(*queued)
        assert {b["error"]["code"] for _, (b, _) in answers} == {"lending_disabled"}
        fake.release("first")
        await first


async def test_a_client_that_disconnects_leaves_the_queue_at_once() -> None:
    async with lender({"busy": "wait", "wait_timeout_s": 30}) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        gone = asyncio.create_task(chat(d, client, "gone"))
        await d.wait_until(lambda: waiting(d) == 1)
        stays = asyncio.create_task(chat(d, client, "stays"))
        await d.wait_until(lambda: waiting(d) == 2)
        gone.cancel()  # closes the connection
        await asyncio.gather(gone, return_exceptions=True)
        await d.wait_until(lambda: waiting(d) == 1, 2.0, "the disconnected waiter to leave")
        fake.release("first")
        await fake.until_arrived(2)
        assert fake.arrived == ["first", "stays"]
        fake.release("stays")
        assert (await stays)[0] == 200 and (await first)[0] == 200
        assert 'outcome="disconnected"' in await metrics(d, client)


async def test_a_request_still_uploading_its_body_holds_no_place_in_the_queue() -> None:
    sharing = {"busy": "wait", "wait_timeout_s": 30, "max_waiting": 1}
    async with lender(sharing) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        body = b'{"model": "tiny", "user": "slow", "messages": []}'
        host, port = d.daemon.bound["up"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        assert waiting(d) == 0  # uploading: not queued
        complete = asyncio.create_task(chat(d, client, "complete"))
        await d.wait_until(lambda: waiting(d) == 1)
        writer.write(body[10:])
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        rest = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 503") and b"wait queue is full" in rest
        fake.release("first")
        await fake.until_arrived(2)
        fake.release("complete")
        assert (await complete)[0] == 200 and fake.arrived == ["first", "complete"]
        await first


async def test_a_thousand_requests_at_once_stay_bounded_and_leave_no_task() -> None:
    sharing = {"busy": "wait", "wait_timeout_s": 60, "max_waiting": 50}
    async with lender(sharing, max_connections=2000) as (d, fake, client):
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        await asyncio.sleep(0.1)
        before = len(asyncio.all_tasks())
        burst = [asyncio.create_task(chat(d, client, f"b{i}")) for i in range(1000)]
        await d.wait_until(lambda: sum(t.done() for t in burst) == 950, 60, "950 refusals")
        assert waiting(d) == 50
        refused = [t.result() for t in burst if t.done()]
        assert all(s == 503 and b["error"]["code"] == "resource_busy" for s, (b, _) in refused)
        assert all(
            "wait queue is full (50 waiting)" in b["error"]["message"] for _, (b, _) in refused
        )
        d.state.set_lending(False)
        answers = await asyncio.gather(*burst)
        assert sum(b["error"]["code"] == "lending_disabled" for _, (b, _) in answers) == 50
        assert waiting(d) == 0
        fake.release("first")
        await first
        await d.wait_until(lambda: len(asyncio.all_tasks()) <= before, 10, "tasks to finish")


@pytest.mark.parametrize(
    "bad", [{"max_concurrent": 0}, {"max_concurrent": -1}, {"max_waiting": 3}], ids=str
)
async def test_bad_sharing_keys_refuse_to_start(bad: dict[str, int]) -> None:
    from vacancyd.config import ConfigError

    with pytest.raises(ConfigError):
        async with running_daemon(config("http://127.0.0.1:9", bad)):
            pass
