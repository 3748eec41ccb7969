"""Named borrowers through a real daemon and its listeners (issue 23, items 1, 2, 3 and 5):
who borrows in the access log, /status, /events and the metrics; 403 off a borrower's
upstreams; 429 ``quota_exhausted`` and ``borrower_busy``; a loopback request with a
borrower's token is that borrower; one ledger row per job with the tokens the server
reported (OpenAI- and Ollama-shaped) and the energy the fake NVML counted; a quota kept
across a restart."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_ollama import FakeOllama
from tests.support.gpu import Gpu, Scenario
from vacancyd.runtime.usage import USAGE_FILE

FRIEND = "friend-token-0123456789abcdef"
OTHER = "other-token-0123456789abcdefg"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def usage_app(*, delay_s: float = 0.0, gate: asyncio.Event | None = None) -> web.Application:
    """An OpenAI-shaped server that reports ``usage``: in the JSON reply, or in the last
    streamed chunk when ``stream_options.include_usage`` is set. ``gate``: each reply waits
    for it (a job that stays running)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if gate is not None:
            await gate.wait()
        if delay_s:
            await asyncio.sleep(delay_s)
        if not body.get("stream"):
            return web.json_response(
                {"id": "c", "object": "chat.completion", "choices": [], "usage": USAGE}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def borrowers_toml(
    tmp: Path,
    target: str,
    *,
    friend: dict[str, Any] | None = None,
    state_dir: Path | None = None,
    resources: Any = None,
    resource: str = "ram",
) -> str:
    """Upstreams ``llm`` and ``other`` in front of ``target``; borrowers ``friend`` (only
    ``llm``, and ``friend``'s keys) and ``other``; loopback trusted, as a local gateway."""
    (tmp / "friend.token").write_text(FRIEND)
    (tmp / "other.token").write_text(OTHER)
    keys = {"upstreams": ["llm"], **(friend or {})}
    lines = ["[[borrower]]", 'name = "friend"', f'token_file = "{tmp / "friend.token"}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    lines += ["", "[[borrower]]", 'name = "other"', f'token_file = "{tmp / "other.token"}"']
    extra = "\n".join(lines)
    kw: dict[str, Any] = {"state_dir": state_dir or tmp / "state", "extra": extra}
    if resources is not None:
        kw["resources"] = resources
        kw["collectors"] = {"poll_s": 0.1}
    return daemon_toml(
        upstream("llm", target, resource=resource),
        upstream("other", target, resource=resource),
        **kw,
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def chat(
    d: RunningDaemon, token: str | None, upstream_name: str = "llm", **body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = bearer(token) if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            d.proxy_url(upstream_name) + "/v1/chat/completions",
            json={**CHAT, **body},
            headers=headers,
        ) as r,
    ):
        text = await r.text()
        try:
            doc = json.loads(text)
        except ValueError:
            doc = {"text": text}
        return r.status, doc, dict(r.headers)


async def api_get(d: RunningDaemon, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(d.api_url + path) as r:
        return await r.json() if path != "/metrics" else await r.text()


def _rows(path: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM jobs ORDER BY job_id")]
    finally:
        db.close()


async def ledger_rows(d: RunningDaemon, count: int) -> list[dict[str, Any]]:
    """The ledger's rows once ``count`` are there (written on the store's thread)."""
    path = d.daemon.settings.state_dir / USAGE_FILE
    rows: list[dict[str, Any]] = []
    for _ in range(200):
        rows = await asyncio.to_thread(_rows, path)
        if len(rows) >= count:
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError(f"the ledger has {len(rows)} rows, not {count}")


@pytest.fixture
async def target() -> AsyncIterator[str]:
    async with serve_app(usage_app()) as url:
        yield url


async def test_a_named_borrower_is_attributed_everywhere(
    tmp_path: Path, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd.access")
    async with running_daemon(borrowers_toml(tmp_path, target)) as d:
        await d.wait_ready()
        events: list[str] = []

        async def follow() -> None:
            async with aiohttp.ClientSession() as s, s.get(d.api_url + "/events") as r:
                async for line in r.content:
                    events.append(line.decode())

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.2)
        # A trusted loopback request that presents friend's token is friend.
        status, _, _ = await chat(d, FRIEND, stream=True, stream_options={"include_usage": True})
        assert status == 200
        status, _, _ = await chat(d, None)  # trusted loopback, no token: the unnamed borrower
        assert status == 200
        rows = await ledger_rows(d, 2)
        await d.wait_until(lambda: any('"ended"' in e for e in events), what="job events")
        follower.cancel()
        metrics = await api_get(d, "/metrics")
    assert [r["borrower"] for r in rows] == ["friend", ""]
    assert rows[0]["prompt_tokens"] == 11 and rows[0]["completion_tokens"] == 7
    assert rows[0]["upstream"] == "llm" and rows[0]["outcome"] == "completed"
    assert rows[0]["bytes_in"] > 0 and rows[0]["bytes_out"] > 0
    assert rows[0]["energy_j"] is None  # memory has no energy counter
    lines = [r.getMessage() for r in caplog.records if r.name == "vacancyd.access.llm"]
    assert any(line.endswith("borrower=friend") for line in lines), lines
    assert any(line.endswith("borrower=default") for line in lines), lines
    job_events = [json.loads(e[5:]) for e in events if e.startswith("data:") and '"change"' in e]
    assert {(e["borrower"], e["change"]) for e in job_events} >= {
        ("friend", "started"),
        ("friend", "ended"),
        ("default", "started"),
    }
    assert (
        'vacancyd_borrower_requests_total{borrower="friend",outcome="admitted",upstream="llm"} 1.0'
        in metrics
    )
    assert (
        'vacancyd_borrower_tokens_total{borrower="friend",direction="prompt",upstream="llm"} 11.0'
        in metrics
    )
    assert 'vacancyd_borrower_busy_seconds_total{borrower="friend",resource="ram"}' in metrics
    assert "vacancyd_borrower_energy_joules_total{" not in metrics


async def test_a_running_job_shows_its_borrower_in_status(tmp_path: Path) -> None:
    gate = asyncio.Event()
    async with (
        serve_app(usage_app(gate=gate)) as url,
        running_daemon(borrowers_toml(tmp_path, url)) as d,
    ):
        await d.wait_ready()
        job = asyncio.create_task(chat(d, FRIEND))
        await d.wait_until(lambda: any(True for _ in d.daemon.work), what="a running job")
        doc = await api_get(d, "/status")
        (work,) = doc["upstreams"]["llm"]["active_work"]
        assert work["borrower"] == "friend"
        gate.set()
        assert (await job)[0] == 200


async def test_off_its_upstreams_a_borrower_gets_403_and_never_reaches_the_server(
    tmp_path: Path,
) -> None:
    seen: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with serve_app(app) as url, running_daemon(borrowers_toml(tmp_path, url)) as d:
        await d.wait_ready()
        status, body, _ = await chat(d, FRIEND, "other")
        assert status == 403
        assert body["error"]["type"] == "permission_error"
        assert body["error"]["code"] == "upstream_not_allowed"
        assert "'friend'" in body["error"]["message"] and "'other'" in body["error"]["message"]
        async with (
            aiohttp.ClientSession() as s,
            s.get(d.proxy_url("other") + "/v1/models", headers=bearer(FRIEND)) as r,
        ):
            assert r.status == 403
        async with (  # answered before the body is sent
            aiohttp.ClientSession() as s,
            s.post(
                d.proxy_url("other") + "/v1/chat/completions",
                json=CHAT,
                headers=bearer(FRIEND),
                expect100=True,
            ) as r,
        ):
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "upstream_not_allowed"
        status, _, _ = await chat(d, OTHER, "other")  # another borrower may
        assert status == 200
        metrics = await api_get(d, "/metrics")
    assert seen == ["/v1/chat/completions"]  # only the other borrower's request
    assert (
        'vacancyd_borrower_requests_total{borrower="friend",outcome="refused",upstream="other"}'
        in metrics
    )
    assert 'vacancyd_admission_decisions_total{outcome="refused"' not in metrics


async def test_a_used_up_quota_is_429_until_midnight_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    async with serve_app(usage_app(delay_s=0.3)) as url:
        toml = borrowers_toml(tmp_path, url, friend={"daily_busy_s": 0.2})
        async with running_daemon(toml) as d:
            await d.wait_ready()
            assert (await chat(d, FRIEND))[0] == 200  # under the quota when it began
            status, body, headers = await chat(d, FRIEND)
            assert status == 429
            assert body["error"]["code"] == "quota_exhausted"
            assert "local time" in body["error"]["message"]
            day = d.daemon.borrowers.day
            retry = int(headers["Retry-After"])
            assert 0 < retry <= day.end - day.start + 1
            assert (await chat(d, OTHER))[0] == 200  # others are unaffected
            await ledger_rows(d, 2)
        async with running_daemon(toml) as d:
            await d.wait_ready()
            status, body, _ = await chat(d, FRIEND)
            assert status == 429 and body["error"]["code"] == "quota_exhausted"


async def test_max_concurrent_refuses_borrower_busy(tmp_path: Path) -> None:
    gate = asyncio.Event()
    async with serve_app(usage_app(gate=gate)) as url:
        toml = borrowers_toml(
            tmp_path, url, friend={"max_concurrent": 1, "upstreams": ["llm", "other"]}
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            first = asyncio.create_task(chat(d, FRIEND, "llm"))
            await d.wait_until(lambda: any(True for _ in d.daemon.work), what="a running job")
            status, body, headers = await chat(d, FRIEND, "other")
            assert status == 429 and body["error"]["code"] == "borrower_busy"
            assert headers["Retry-After"] == "2"
            # Another borrower is held only by the lender's own slot (one job on "ram").
            status, body, _ = await chat(d, OTHER, "other")
            assert status == 503 and body["error"]["code"] == "resource_busy"
            gate.set()
            assert (await first)[0] == 200
            assert (await chat(d, FRIEND, "other"))[0] == 200


async def test_ollama_counts_and_gpu_energy_reach_the_ledger(
    nvml: Scenario, tmp_path: Path
) -> None:
    nvml.gpus = [Gpu(energy_mj=1_000_000)]
    nvml.write()
    fake = FakeOllama(tokens=3, token_interval_s=0.1)
    async with serve_app(fake.app()) as url:
        toml = daemon_toml(
            upstream("up", url, adapter="ollama", resource="gpu0"),
            resources=(gpu("gpu0", 0, pressure={"enabled": False}),),
            collectors={"poll_s": 0.1},
            state_dir=tmp_path / "state",
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            job = asyncio.create_task(_ollama_chat(d))
            # the card draws 200 W while the job runs (2 J per 10 ms of counter)
            for step in range(1, 8):
                await asyncio.sleep(0.05)
                nvml.gpus = [Gpu(energy_mj=1_000_000 + step * 10_000)]
                nvml.write()
            assert await job == 200
            (row,) = await ledger_rows(d, 1)
            metrics = await api_get(d, "/metrics")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 5)
    assert row["energy_j"] is not None and row["energy_j"] > 0
    assert 'vacancyd_borrower_energy_joules_total{borrower="default",resource="gpu0"}' in metrics


async def _ollama_chat(d: RunningDaemon) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            d.proxy_url("up") + "/api/chat",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        ) as r,
    ):
        await r.read()
        return r.status
