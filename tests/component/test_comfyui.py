"""The comfyui adapter, its prompt tracking and reclaim, and the /ws tunnel, against a look-alike
ComfyUI whose queue keeps prompts after answering /prompt."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
from typing import Any

import aiohttp
import pytest

from tests.support.daemon import RunningDaemon
from tests.support.fake_comfyui import UUID_RE, FakeComfy
from tests.support.lender import lender, owner_returns, reclaim_view

WORKFLOW = {"3": {"class_type": "KSampler", "inputs": {"seed": 1}}}


async def submit(
    client: aiohttp.ClientSession, d: RunningDaemon, path: str = "/prompt", **extra: object
) -> tuple[int, dict[str, Any]]:
    async with client.post(d.proxy_url("up") + path, json={"prompt": WORKFLOW, **extra}) as r:
        return r.status, await r.json()


def job_phases(d: RunningDaemon) -> list[str]:
    return [j.phase.value for j in d.state.ledger.jobs()]


async def test_routes_and_vacancyd_assigned_prompt_ids() -> None:
    fake = FakeComfy(steps=4, step_s=0.05)
    async with lender(fake.app(), adapter="comfyui") as (d, client):
        url = d.proxy_url("up")
        # a borrower-chosen id (here someone else's) is always replaced
        status, body = await submit(
            client, d, "/api/prompt", prompt_id="0" * 8 + "-0000-4000-8000-" + "0" * 12
        )
        assert status == 200
        pid = str(body["prompt_id"])
        assert UUID_RE.match(pid) and not pid.startswith("00000000")
        assert fake.calls[0][2]["prompt_id"] == pid
        # ComfyUI answered before running: the job stays reserved while it is queued
        assert job_phases(d) == ["tracking"]
        status, busy = await submit(client, d)
        assert status == 503 and busy["error"]["code"] == "resource_busy"
        await d.wait_until(lambda: job_phases(d) == [], 5)
        async with client.get(f"{url}/history/{pid}") as r:
            assert r.status == 200 and pid in await r.json()
        async with client.get(f"{url}/api/history/{pid}") as r:
            assert r.status == 200
        foreign = fake.add_foreign()
        for path in (f"/history/{foreign}", f"/api/jobs/{foreign}"):
            async with client.get(url + path) as r:
                assert r.status == 404, path
                assert (await r.json())["error"]["code"] == "unknown_result"
        async with client.get(url + "/api/object_info") as r:
            assert r.status == 200
        for path in ("/queue", "/api/queue", "/system_stats", "/history"):
            async with client.get(url + path) as r:
                assert r.status == 403, path
        async with client.post(url + "/interrupt", json={}) as r:
            assert r.status == 403


@pytest.mark.parametrize("jobs_api", [True, False])
async def test_owner_returns_while_a_borrowed_prompt_runs(jobs_api: bool) -> None:
    fake = FakeComfy(steps=200, step_s=0.02, jobs_api=jobs_api)
    async with lender(
        fake.app(), adapter="comfyui", policy="cancel", extra="yield_on_veto = true"
    ) as (d, client):
        _, body = await submit(client, d)
        pid = body["prompt_id"]
        await fake.started.wait()
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        interrupts = [c for c in fake.calls if "interrupt" in c[1] or "cancel" in c[1]]
        if jobs_api:
            assert interrupts == [("POST", f"/api/jobs/{pid}/cancel", None)]
        else:
            assert interrupts == [
                ("POST", f"/api/jobs/{pid}/cancel", None),
                ("POST", "/interrupt", {"prompt_id": pid}),
            ]
        await d.wait_until(lambda: pid in fake.history, 5)
        assert fake.history[pid]["status"]["status_str"] == "error"  # interrupted
        assert fake.free_requests == [{"unload_models": True, "free_memory": True}]
        await d.wait_until(lambda: job_phases(d) == [], 5)


async def test_owner_returns_while_a_borrowed_prompt_is_pending() -> None:
    fake = FakeComfy(paused=True)
    async with lender(fake.app(), adapter="comfyui", policy="cancel") as (d, client):
        _, body = await submit(client, d)
        pid = body["prompt_id"]
        assert fake.queued_ids() == [pid]
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert ("POST", "/queue", {"delete": [pid]}) in fake.calls
        assert not [c for c in fake.calls if "interrupt" in c[1] or "cancel" in c[1]]
        assert fake.queued_ids() == []
        await d.wait_until(lambda: job_phases(d) == [], 5)


async def test_a_foreign_prompt_in_the_queue_prevents_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "vacancyd.control.upstreamcalls")
    fake = FakeComfy(paused=True)
    async with lender(
        fake.app(), adapter="comfyui", policy="cancel", extra="yield_on_veto = true"
    ) as (d, client):
        _, body = await submit(client, d)
        foreign = fake.add_foreign()
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert fake.free_requests == []
        assert any(
            "skipped" in r.getMessage() and foreign in r.getMessage() for r in caplog.records
        )
        # only the borrowed ID was named; the owner's prompt is untouched
        named = json.dumps([c for c in fake.calls if c[1] != "/prompt"])
        assert foreign not in named and str(body["prompt_id"]) in named
        assert foreign in fake.queued_ids()


async def test_a_submission_in_flight_at_the_deadline_is_cancelled_once_it_lands() -> None:
    gate = asyncio.Event()
    fake = FakeComfy(paused=True, reply_gate=gate)
    async with lender(fake.app(), adapter="comfyui", policy="cancel") as (d, client):
        loop = asyncio.get_running_loop()
        pending = loop.create_task(submit(client, d))
        await fake.queued.wait()
        pid = fake.queued_ids()[0]
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert fake.queued_ids() == [pid]  # nothing could be named before the reply landed
        gate.set()
        status, body = await asyncio.wait_for(pending, 5)
        assert status == 503 and body["error"]["code"] == "owner_active"
        await d.wait_until(lambda: fake.queued_ids() == [], 5)
        assert ("POST", "/queue", {"delete": [pid]}) in fake.calls
        assert job_phases(d) == []


async def test_websocket_progress_for_a_borrowed_prompt_reaches_the_borrower() -> None:
    fake = FakeComfy(steps=3, step_s=0.02)
    async with lender(fake.app(), adapter="comfyui") as (d, client):
        async with client.ws_connect(d.proxy_url("up") + "/ws?clientId=abc") as ws:
            hello = await ws.receive_json(timeout=5)
            assert hello["type"] == "status" and hello["data"]["sid"] == "abc"
            await ws.send_str("ping-text")
            assert (await ws.receive_json(timeout=5)) == {"type": "echo", "data": "ping-text"}
            _, body = await submit(client, d)
            pid = body["prompt_id"]
            progress, previews = [], []
            while True:
                msg = await ws.receive(timeout=5)
                if msg.type is aiohttp.WSMsgType.BINARY:
                    previews.append(msg.data)
                    continue
                data = json.loads(msg.data)
                if data["type"] == "progress":
                    progress.append(data["data"])
                if data["type"] == "executing" and data["data"]["node"] is None:
                    break
            assert [p["value"] for p in progress] == [1, 2, 3]
            assert {p["prompt_id"] for p in progress} == {pid}
            assert previews == [struct.pack(">II", 1, 2) + b"\x89PNG-preview"] * 3
        # closing the borrower's side tore down the upstream side too
        await d.wait_until(lambda: not fake.sockets, 5)


async def test_closing_the_upstream_side_closes_the_borrowers_tunnel() -> None:
    fake = FakeComfy()
    async with lender(fake.app(), adapter="comfyui") as (d, client):
        async with client.ws_connect(d.proxy_url("up") + "/api/ws") as ws:
            await ws.receive_json(timeout=5)
            await fake.sockets[0].close(code=4001, message=b"bye")
            msg = await ws.receive(timeout=5)
            assert msg.type is aiohttp.WSMsgType.CLOSE
            assert ws.close_code == 4001


async def test_websocket_cap_and_idle_timeout() -> None:
    fake = FakeComfy()
    extra = "websocket_max_tunnels = 1\nwebsocket_idle_timeout_s = 0.3"
    async with lender(fake.app(), adapter="comfyui", extra=extra) as (d, client):
        url = d.proxy_url("up") + "/ws"
        async with client.ws_connect(url) as ws:
            await ws.receive_json(timeout=5)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect(url)
            assert refused.value.status == 503
            msg = await ws.receive(timeout=5)  # idle: the tunnel closes itself
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert re.match(r"127\.0\.0\.1:\d+", d.daemon.bound["up"])


async def test_drain_waits_for_a_borrowed_prompt_that_finishes_in_time() -> None:
    fake = FakeComfy(steps=10, step_s=0.03)
    async with lender(
        fake.app(), adapter="comfyui", extra="drain_timeout_s = 10\nyield_on_veto = true"
    ) as (d, client):
        _, body = await submit(client, d)
        await fake.started.wait()
        owner_returns(d)
        assert reclaim_view(d)["phase"] == "waiting"
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done", 5)
        assert reclaim_view(d)["outcome"] == "work_ended"
        assert fake.history[str(body["prompt_id"])]["status"]["completed"] is True
        assert not [c for c in fake.calls if c[1] in ("/queue", "/interrupt")]
        assert fake.free_requests == [{"unload_models": True, "free_memory": True}]
