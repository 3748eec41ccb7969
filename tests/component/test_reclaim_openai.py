"""Reclaim on the OpenAI-compatible proxy path (docs/reclaim.md).

A real in-process daemon in front of a slow OpenAI-shaped fake; owner-return edges are raised
through the host policy veto (SharedState.record_presence with an owner signal) and operator
edges through POST /admin/reclaim.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.slow_openai import SlowOpenAI
from tests.support.streams import read_all
from vacancyd.state import PresenceReading

OWNER = PresenceReading(owner_signal=True, evidence_complete=True, detail="test: owner is back")


def config(
    target: str,
    *,
    policy: str = "drain",
    extra: Mapping[str, Any] | None = None,
    release_s: float = 3600,
    adapter: str = "openai",
) -> str:
    """One upstream ``llm`` handing work back by ``policy``; the owner's veto releases
    ``release_s`` after it engages; ``extra``: more keys of the upstream."""
    return daemon_toml(
        upstream("llm", target, adapter=adapter, on_owner_return=policy, **(extra or {})),
        limits={"write_stall_timeout_s": 30},
        owner={"release_after_s": release_s},
    )


@asynccontextmanager
async def lender(
    fake: SlowOpenAI, **kw: object
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession]]:
    async with serve_app(fake.app()) as target:
        async with running_daemon(config(target, **kw)) as d:  # type: ignore[arg-type]
            await d.wait_ready()
            async with aiohttp.ClientSession() as client:
                yield d, client


def owner_returns(d: RunningDaemon) -> None:
    d.daemon.owner.record_presence(OWNER, d.state.clock())


async def start_stream(d: RunningDaemon, client: aiohttp.ClientSession) -> aiohttp.ClientResponse:
    resp = await client.post(
        d.proxy_url("llm") + "/v1/chat/completions",
        json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status == 200, await resp.text()
    return resp


def status(d: RunningDaemon) -> dict[str, object]:
    view = d.state.reclaim_views.get("llm")
    assert view is not None
    return dict(view)


async def test_cancel_cuts_a_long_stream_at_once_and_refuses_new_work() -> None:
    fake = SlowOpenAI(chunks=200, interval_s=0.05)
    async with lender(fake, policy="cancel") as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        data, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is not None, "a cut stream must end in an error, never a clean end"
        assert b"[DONE]" not in data
        await asyncio.wait_for(fake.ended_event.wait(), 5)
        assert fake.ended == ["disconnected"]
        # new work is refused at once, with the owner's reason.
        async with client.post(
            d.proxy_url("llm") + "/v1/chat/completions", json={"model": "tiny", "messages": []}
        ) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "owner_active"
        await d.wait_until(lambda: status(d)["phase"] == "done")
        assert status(d)["outcome"] == "cancelled"


async def test_drain_lets_work_run_until_the_deadline_then_cuts() -> None:
    # A 3 s drain: long enough that the stream visibly flows during it even when a loaded
    # machine stalls this process for a few hundred ms (a 0.6 s drain could pass with one
    # chunk delivered); the cut may come at most 1.9 s after the deadline, as before.
    fake = SlowOpenAI(chunks=1000, interval_s=0.02)
    async with lender(fake, extra={"drain_timeout_s": 3}) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        loop = asyncio.get_running_loop()
        edge_at = loop.time()
        owner_returns(d)
        assert status(d)["phase"] == "waiting"
        data, error = await asyncio.wait_for(read_all(resp), 15)
        elapsed = loop.time() - edge_at
        assert error is not None and b"[DONE]" not in data
        assert 2.9 <= elapsed < 4.9, elapsed
        assert data.count(b"data: ") > 10, "the stream kept flowing during the drain"
        await d.wait_until(lambda: status(d)["phase"] == "done")
        assert status(d)["outcome"] == "cancelled"


async def test_drain_ends_cleanly_when_work_finishes_before_the_deadline() -> None:
    fake = SlowOpenAI(chunks=10, interval_s=0.02)
    async with lender(fake, extra={"drain_timeout_s": 10}) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        data, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is None and data.endswith(b"data: [DONE]\n\n")
        await d.wait_until(lambda: status(d)["phase"] == "done")
        assert status(d)["outcome"] == "work_ended"


async def test_finish_never_cuts_even_past_the_completion_timeout() -> None:
    fake = SlowOpenAI(chunks=40, interval_s=0.02)
    async with lender(fake, policy="finish", extra={"completion_timeout_s": 0.2}) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        data, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is None and data.endswith(b"data: [DONE]\n\n")
        assert fake.ended == ["complete"]
        assert status(d)["outcome"] == "timed_out"


async def test_cut_before_response_headers_answers_503_with_the_reason() -> None:
    hold = asyncio.Event()
    fake = SlowOpenAI(hold_headers=hold)
    async with lender(fake, policy="cancel") as (d, client):
        pending = asyncio.ensure_future(  # noqa: TID251 - test-only concurrency
            client.post(
                d.proxy_url("llm") + "/v1/chat/completions",
                json={"model": "tiny", "stream": True, "messages": []},
            )
        )
        await fake.started.wait()
        owner_returns(d)
        async with await asyncio.wait_for(pending, 5) as resp:
            assert resp.status == 503
            body = await resp.json()
            assert body["error"]["code"] == "owner_active"
            assert resp.headers["Retry-After"]
        hold.set()  # let the fake's handler finish so its server stops promptly


async def test_trigger_clearing_during_drain_stands_down_and_cancels_nothing() -> None:
    # The veto releases 0.1 s after the owner's return; the drain deadline (30 s) and the
    # stream (5 s) both last far longer, so the stand-down is never a race on a slow machine.
    fake = SlowOpenAI(chunks=100, interval_s=0.05)
    async with lender(fake, extra={"drain_timeout_s": 30}, release_s=0.1) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        assert status(d)["phase"] == "waiting"
        # the headless presence loop keeps sampling "nobody there": the veto releases
        await d.wait_until(lambda: status(d)["phase"] != "waiting", 5)
        assert status(d)["phase"] == "stood_down"
        data, error = await asyncio.wait_for(read_all(resp), 30)
        assert error is None and data.endswith(b"data: [DONE]\n\n")
        assert fake.ended == ["complete"]
        async with client.get(d.api_url + "/metrics") as r:
            text = await r.text()
        assert 'outcome="stood_down",trigger="owner",upstream="llm"} 1.0' in text


async def test_two_edges_in_a_row_share_one_deadline() -> None:
    # The second edge comes 0.3 s after the first, well inside the 5 s drain even on a slow
    # machine (with a 0.6 s drain, a stretched pause let the first reclaim end before it).
    fake = SlowOpenAI(chunks=2000, interval_s=0.02)
    async with lender(fake, extra={"drain_timeout_s": 5}) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        first = status(d)
        await asyncio.sleep(0.3)  # the second edge is a later one
        assert status(d)["phase"] == "waiting"
        async with client.post(d.api_url + "/admin/reclaim") as r:
            assert r.status == 200
        second = status(d)
        assert second["deadline"] == first["deadline"], "a later edge must not extend it"
        assert second["edge_triggers"] == ["owner", "admin"]
        async with client.get(d.api_url + "/status") as r:
            doc = await r.json()
        rec = doc["upstreams"]["llm"]["reclaim"]
        assert rec["phase"] == "waiting" and rec["edge_triggers"] == ["owner", "admin"]
        _, error = await asyncio.wait_for(read_all(resp), 20)
        assert error is not None
        await d.wait_until(lambda: status(d)["phase"] == "done")
        async with client.get(d.api_url + "/metrics") as r:
            text = await r.text()
        assert (
            'vacancyd_reclaims_total{outcome="cancelled",trigger="owner",upstream="llm"} 1.0'
            in text
        )


async def test_a_stalled_borrower_does_not_delay_closing_the_upstream_connection() -> None:
    fake = SlowOpenAI(chunks=100_000, interval_s=0, chunk_bytes=16_384)
    async with lender(fake, policy="cancel") as (d, _client):
        host, port = d.daemon.bound["llm"].rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, int(port)))
        body = json.dumps({"model": "tiny", "stream": True, "messages": []}).encode()
        await loop.sock_sendall(
            sock,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        try:
            await fake.started.wait()
            await asyncio.sleep(0.3)  # the borrower reads nothing; buffers fill up
            edge = loop.time()
            owner_returns(d)
            await asyncio.wait_for(fake.ended_event.wait(), 3)
            assert fake.ended == ["disconnected"]
            assert loop.time() - edge < 3  # far below write_stall_timeout_s = 30
        finally:
            sock.close()


def outcomes(d: RunningDaemon) -> list[str | None]:
    """How each job's exchange ended (an OpenAI-compatible job cut is held, not ended)."""
    return [None if j.outcome is None else j.outcome.value for j in d.daemon.work]


async def test_a_cut_resets_a_stalled_borrower_and_counts_as_cut() -> None:
    """The cut reaches a borrower that stopped reading mid-stream by resetting its
    connection (the forwarding is stuck writing to it, not reading the upstream): the
    borrower sees its stream end at once, and the job ends as cut, not as a disconnect."""
    fake = SlowOpenAI(chunks=100_000, interval_s=0, chunk_bytes=16_384)
    async with lender(fake, policy="cancel") as (d, _client):
        host, port = d.daemon.bound["llm"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), limit=4096)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": "tiny", "stream": True, "messages": []}).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            await fake.started.wait()
            await asyncio.sleep(0.3)  # the borrower reads nothing; buffers fill up
            owner_returns(d)
            await d.wait_until(lambda: outcomes(d) != [None], 3)
            assert outcomes(d) == ["cut"]
            with pytest.raises(ConnectionError):  # reset, never a clean end
                async with asyncio.timeout(3):
                    while await reader.read(1 << 20):
                        pass
        finally:
            writer.close()


@pytest.mark.parametrize("policy", ["drain", "cancel", "finish"])
async def test_config_rejects_yield_on_veto_for_servers_without_unload(policy: str) -> None:
    from vacancyd.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="yield_on_veto"):
        parse_config(
            config("http://127.0.0.1:1", policy=policy, extra={"yield_on_veto": True}), "<t>"
        )


async def _chat_status(d: RunningDaemon, client: aiohttp.ClientSession) -> tuple[int, str]:
    async with client.post(
        d.proxy_url("llm") + "/v1/chat/completions", json={"model": "tiny", "messages": []}
    ) as r:
        if r.status == 200:
            return 200, ""
        body = await r.json()
        return r.status, body.get("error", {}).get("code", "")


async def test_a_cut_openai_job_is_held_until_an_administrator_releases_it() -> None:
    fake = SlowOpenAI(chunks=200, interval_s=0.02)
    async with lender(fake, policy="cancel", release_s=0.2) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        _, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is not None
        await d.wait_until(lambda: [j.phase.value for j in d.state.ledger.jobs()] == ["held"])
        await d.wait_until(lambda: not d.state.veto.engaged, 5)
        assert await _chat_status(d, client) == (503, "resource_busy")
        job = d.state.ledger.jobs()[0]
        async with client.post(f"{d.api_url}/admin/jobs/{job.id}/release") as r:
            assert r.status == 200
        async with asyncio.timeout(5):
            while (await _chat_status(d, client))[0] != 200:  # noqa: ASYNC110 - HTTP poll
                await asyncio.sleep(0.05)


async def test_a_cut_llamacpp_job_is_released_once_slots_show_the_server_idle() -> None:
    fake = SlowOpenAI(chunks=200, interval_s=0.02)
    async with lender(fake, policy="cancel", adapter="llamacpp") as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        _, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is not None
        await d.wait_until(lambda: d.state.ledger.jobs() == [], 5)


async def test_a_failing_reclaim_still_cuts_its_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import vacancyd.control.reclaim as control

    def broken(*_: object, **__: object) -> bool:
        raise RuntimeError("planner bug")

    monkeypatch.setattr(control, "trigger_cleared", broken)
    fake = SlowOpenAI(chunks=400, interval_s=0.02)
    async with lender(fake, extra={"drain_timeout_s": 30}) as (d, client):
        resp = await start_stream(d, client)
        await fake.started.wait()
        owner_returns(d)
        _, error = await asyncio.wait_for(read_all(resp), 5)
        assert error is not None
        await d.wait_until(lambda: status(d)["phase"] == "done")
        assert status(d)["outcome"] == "failed"
        assert d.daemon.supervisor.failure is None
