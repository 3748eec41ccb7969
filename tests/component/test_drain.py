"""The drain on stop, with real sockets: after the stop begins every listener keeps
answering (new work gets 503 ``shutting_down`` with Retry-After, never a refused
connection), /readyz is 503, /events followers hear ``stopping`` and, last, ``shutdown``;
borrowed work in flight may finish within ``shutdown_grace_s``; what is left when the grace
ends is cut unmistakably (a reset stream, a 1001 close frame on both legs of a WebSocket
tunnel); a second stop request ends the drain at once; with host-side Kubernetes
publishing the lender is published terminating while its listeners still answer."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.fake_kube import FakeKube
from tests.support.fake_ollama import FakeOllama
from tests.support.slow_openai import SlowOpenAI
from vacancyd.config import parse_config
from vacancyd.runtime import daemon as daemon_module
from vacancyd.runtime import durable
from vacancyd.runtime.daemon import Daemon

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def drained_lender(
    tmp_path: Path,
    *,
    slow: SlowOpenAI,
    comfy: FakeComfy | None = None,
    kubernetes: dict[str, Any] | None = None,
    **server: Any,
) -> AsyncIterator[RunningDaemon]:
    """A daemon in front of ``slow`` (upstream ``chat``) and, when given, ``comfy``
    (upstream ``comfy``); the test calls ``daemon.shutdown()`` itself."""
    async with serve_app(slow.app()) as chat_target:
        ups = [upstream("chat", chat_target)]
        if comfy is not None:
            async with serve_app(comfy.app()) as comfy_target:
                ups.append(upstream("comfy", comfy_target, adapter="comfyui"))
                async with _daemon(tmp_path, ups, kubernetes, server) as d:
                    yield d
            return
        async with _daemon(tmp_path, ups, kubernetes, server) as d:
            yield d


@asynccontextmanager
async def _daemon(
    tmp_path: Path, ups: list[Any], kubernetes: dict[str, Any] | None, server: dict[str, Any]
) -> AsyncIterator[RunningDaemon]:
    toml = daemon_toml(
        *ups,
        server=server,
        collectors={"poll_s": 0.2},
        kubernetes=kubernetes,
        state_dir=tmp_path,
    )
    settings = parse_config(toml, "<test>")
    daemon = Daemon(settings)
    await daemon.start()
    d = RunningDaemon(daemon)
    try:
        await d.wait_ready()
        yield d
    finally:
        if not daemon.state.stopping:
            await daemon.shutdown()


async def follow_events(url: str, into: list[tuple[str, dict[str, Any]]]) -> None:
    """Collect ``/events`` (name, data) pairs until the stream ends."""
    async with aiohttp.ClientSession() as http, http.get(url + "/events") as resp:
        assert resp.status == 200
        name = None
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name is not None:
                into.append((name, json.loads(line.removeprefix("data: "))))
                name = None


async def post_work(url: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A fresh connection (never a pooled one), so a refused connection would show."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r,
    ):
        return r.status, dict(r.headers), await r.json()


async def read_to_end(resp: aiohttp.ClientResponse) -> bytes:
    data = b""
    async for chunk in resp.content.iter_any():
        data += chunk
    return data


async def test_listeners_answer_through_the_grace_then_cut_what_is_left(tmp_path: Path) -> None:
    slow = SlowOpenAI(chunks=100_000, interval_s=0.05)
    comfy = FakeComfy()
    grace = 1.5
    async with drained_lender(tmp_path, slow=slow, comfy=comfy, shutdown_grace_s=grace) as d:
        events: list[tuple[str, dict[str, Any]]] = []
        loop = asyncio.get_running_loop()
        follower = loop.create_task(follow_events(d.api_url, events))
        await d.wait_until(lambda: bool(events), 5)  # hello: the stream is open
        http = aiohttp.ClientSession()
        stream: aiohttp.ClientResponse | None = None
        try:
            stream = await http.post(d.proxy_url("chat") + "/v1/chat/completions", json=CHAT)
            assert stream.status == 200
            await stream.content.readuntil(b"\n\n")  # the first chunk has arrived
            ws = await http.ws_connect(d.proxy_url("comfy") + "/ws?clientId=abc")
            assert (await ws.receive_json(timeout=5))["type"] == "status"
            upstream_ws = comfy.sockets[0]

            began = loop.time()
            stopping = loop.create_task(d.daemon.shutdown())
            await asyncio.sleep(0.3)
            # the drain: every listener accepts and answers
            status, headers, body = await post_work(d.proxy_url("chat"))
            assert status == 503
            assert body["error"]["code"] == "shutting_down"
            assert body["error"]["type"] == "no_vacancy"
            assert headers["Retry-After"] == "10"
            assert headers["Connection"].lower() == "close"  # clients' pools move off
            async with aiohttp.ClientSession() as fresh:
                async with fresh.get(d.api_url + "/readyz") as r:
                    assert r.status == 503
                async with fresh.get(d.api_url + "/healthz") as r:
                    assert r.status == 200
            assert not stopping.done()
            # the stream still flows during the grace
            await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 2)

            # the grace ends: the stream is cut (reset), never a clean end
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
                await asyncio.wait_for(read_to_end(stream), grace + 5)
            # the tunnel ends with Going Away on both legs
            msg = await ws.receive(timeout=5)
            assert msg.type is aiohttp.WSMsgType.CLOSE, msg
            assert ws.close_code == 1001
            await d.wait_until(lambda: upstream_ws.closed, 5)
            assert upstream_ws.close_code == 1001

            await asyncio.wait_for(stopping, 10)
            took = loop.time() - began
            assert grace - 0.1 <= took < grace + 4, took
            await asyncio.wait_for(follower, 5)  # the /events stream ended
        finally:
            if stream is not None:
                stream.close()  # cut mid-body: its connection is given up, not left to GC
            await http.close()
    names = [name for name, _ in events]
    assert names[0] == "hello"
    assert names[-1] == "shutdown", names  # the last event before the stream ended
    stop = next(data for name, data in events if name == "stopping")
    assert stop["grace_s"] == grace and stop["in_flight"] == 1
    last = events[-1][1]
    assert last["cut"] == 2 and last["hurried"] is False  # the stream and the tunnel
    assert names.index("stopping") < names.index("shutdown")


async def test_the_drain_ends_when_the_work_in_flight_finishes(tmp_path: Path) -> None:
    slow = SlowOpenAI(chunks=20, interval_s=0.05)  # about a second
    async with drained_lender(tmp_path, slow=slow, shutdown_grace_s=15) as d:
        async with aiohttp.ClientSession() as http:
            async with http.post(d.proxy_url("chat") + "/v1/chat/completions", json=CHAT) as s:
                assert s.status == 200
                await slow.started.wait()
                loop = asyncio.get_running_loop()
                began = loop.time()
                stopping = loop.create_task(d.daemon.shutdown())
                body = await asyncio.wait_for(read_to_end(s), 10)
            assert body.rstrip().endswith(b"data: [DONE]")  # finished, not cut
            await asyncio.wait_for(stopping, 10)
            assert loop.time() - began < 5  # not the 15 s grace
    assert slow.ended == ["complete"]


async def test_the_delay_keeps_an_idle_lender_answering(tmp_path: Path) -> None:
    slow = SlowOpenAI()
    async with drained_lender(tmp_path, slow=slow, shutdown_delay_s=1.0) as d:
        loop = asyncio.get_running_loop()
        began = loop.time()
        stopping = loop.create_task(d.daemon.shutdown())
        await asyncio.sleep(0.2)
        status, _headers, body = await post_work(d.proxy_url("chat"))
        assert status == 503 and body["error"]["code"] == "shutting_down"
        await asyncio.wait_for(stopping, 10)
        assert loop.time() - began >= 0.95
        # and once it is over the listener is gone
        with pytest.raises(aiohttp.ClientConnectionError):
            await post_work(d.proxy_url("chat"))


async def test_a_second_stop_request_ends_the_drain_now(tmp_path: Path) -> None:
    slow = SlowOpenAI(chunks=100_000, interval_s=0.05)
    async with drained_lender(tmp_path, slow=slow, shutdown_grace_s=60) as d:
        events: list[tuple[str, dict[str, Any]]] = []
        loop = asyncio.get_running_loop()
        follower = loop.create_task(follow_events(d.api_url, events))
        await d.wait_until(lambda: bool(events), 5)
        async with aiohttp.ClientSession() as http:
            stream = await http.post(d.proxy_url("chat") + "/v1/chat/completions", json=CHAT)
            await slow.started.wait()
            d.daemon.request_stop()  # the first signal: what run_daemon's handler calls
            stopping = loop.create_task(d.daemon.shutdown())
            await asyncio.sleep(0.5)
            assert not stopping.done()  # draining: 60 s of grace
            began = loop.time()
            d.daemon.request_stop()  # the second signal
            await asyncio.wait_for(stopping, 5)
            assert loop.time() - began < 3
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
                await asyncio.wait_for(read_to_end(stream), 5)
            stream.close()
        await asyncio.wait_for(follower, 5)
    assert events[-1] == ("shutdown", {**events[-1][1], "cut": 1, "hurried": True})


HOST_KUBE = {
    "node": "pc",
    "address": "192.0.2.10",
    "lender": "pc",
    "namespace": "vacancy",
    "heartbeat_s": 60,
    "resync_s": 60,
}


async def test_kubernetes_hears_terminating_while_the_listeners_still_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube = FakeKube()
    kube.add_node("pc")
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)

    def conditions() -> dict[str, bool] | None:
        body = kube.slices.get(("vacancy", "vacancyd-chat-pc-chat"))
        return None if body is None else dict(body["endpoints"][0]["conditions"])

    slow = SlowOpenAI()
    async with drained_lender(tmp_path, slow=slow, kubernetes=HOST_KUBE) as d:
        await d.wait_until(lambda: (conditions() or {}).get("ready") is True, 10)
        assert d.daemon.settings.shutdown_delay_s == 2.0  # the default with [kubernetes]
        loop = asyncio.get_running_loop()
        stopping = loop.create_task(d.daemon.shutdown())
        await d.wait_until(lambda: (conditions() or {}).get("terminating") is True, 2)
        # published terminating and not serving, while the listener still answers
        assert conditions() == {"ready": False, "serving": False, "terminating": True}
        status, _headers, body = await post_work(d.proxy_url("chat"))
        assert status == 503 and body["error"]["code"] == "shutting_down"
        assert not stopping.done()
        await asyncio.wait_for(stopping, 10)
    assert conditions() == {"ready": False, "serving": False, "terminating": False}


async def test_a_stream_cut_by_the_stop_counts_as_cut_not_as_a_disconnect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The borrower did not leave: the stop reset its connection. On Ollama (a closed
    connection stops it, so nothing is held) the job ends ``cut``."""
    caplog.set_level(logging.INFO, logger="vacancyd.control.work")
    fake = FakeOllama(tokens=100_000, token_interval_s=0.05)
    async with serve_app(fake.app()) as target:
        ups = [upstream("ol", target, adapter="ollama")]
        async with _daemon(tmp_path, ups, None, {"shutdown_grace_s": 60}) as d:
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as http:
                body = {"model": "tiny", "prompt": "x", "stream": True}
                stream = await http.post(d.proxy_url("ol") + "/api/generate", json=body)
                assert stream.status == 200
                await fake.streaming.wait()
                d.daemon.request_stop()
                stopping = loop.create_task(d.daemon.shutdown())
                await asyncio.sleep(0.2)
                d.daemon.request_stop()  # the second signal: what is in flight is cut now
                await asyncio.wait_for(stopping, 10)
                stream.close()
            registry = d.daemon.metrics.registry
            jobs = {
                outcome: registry.get_sample_value(
                    "vacancyd_jobs_total", {"upstream": "ol", "outcome": outcome}
                )
                for outcome in ("cut", "borrower_disconnected")
            }
    assert jobs == {"cut": 1.0, "borrower_disconnected": None}
    ends = [r for r in caplog.records if getattr(r, "outcome", None) is not None]
    assert [getattr(r, "outcome", None) for r in ends] == ["cut"]


async def test_a_comfyui_prompt_still_queued_at_the_stop_is_written_as_a_hold(
    tmp_path: Path,
) -> None:
    """The restarted daemon does not follow the prompt, so it is held for an administrator
    rather than forgotten while the server still runs it (the follower's cancellation at
    the stop does not end the hold)."""
    slow = SlowOpenAI(chunks=1, interval_s=0.01)
    comfy = FakeComfy(paused=True)
    async with drained_lender(tmp_path, slow=slow, comfy=comfy, shutdown_grace_s=5) as d:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": {"3": {"class_type": "KSampler", "inputs": {"seed": 1}}}}
            async with http.post(d.proxy_url("comfy") + "/prompt", json=body) as r:
                assert r.status == 200, await r.text()
        await d.wait_until(lambda: [j.phase.value for j in d.state.ledger.jobs()] == ["tracking"])
        await asyncio.wait_for(d.daemon.shutdown(), 10)
        held = json.loads((tmp_path / "holds.json").read_text(encoding="utf-8"))["holds"]
    assert [(h["upstream"], h["reason"], h["release_by"]) for h in held] == [
        ("comfy", "tracking_lost", "admin")
    ]


async def test_a_hold_the_stop_cannot_write_is_logged_and_does_not_hold_up_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write of ``holds.json`` that never returns (a hung disk) gets ``SAVE_AT_STOP_S``,
    then the stop goes on and says which held job is not on disk."""
    caplog.set_level(logging.ERROR, logger="vacancyd.runtime.daemon")
    monkeypatch.setattr(daemon_module, "SAVE_AT_STOP_S", 0.5)
    stuck, release = threading.Event(), threading.Event()
    real = durable.write_state

    def write(path: Path, data: Any) -> None:
        if path.name == "holds.json":
            stuck.set()
            release.wait(30)
        real(path, data)

    monkeypatch.setattr(durable, "write_state", write)
    slow = SlowOpenAI(chunks=100_000, interval_s=0.05)
    try:
        async with drained_lender(tmp_path, slow=slow, shutdown_grace_s=60) as d:
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as http:
                stream = await http.post(d.proxy_url("chat") + "/v1/chat/completions", json=CHAT)
                assert stream.status == 200
                await slow.started.wait()
                d.daemon.request_stop()
                stopping = loop.create_task(d.daemon.shutdown())
                await asyncio.sleep(0.2)
                d.daemon.request_stop()  # the stream is cut and held (openai: uncertain)
                await asyncio.wait_for(stopping, 10)
                stream.close()
            assert stuck.is_set()
            assert not (tmp_path / "holds.json").exists()
    finally:
        release.set()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("before stopping" in m and "will not hold" in m for m in errors), errors
