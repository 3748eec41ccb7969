"""The companion following real in-process lenders, and host-side publishing.

Kubernetes is the in-memory fake here; test_kube_e2e.py repeats the main scenarios against a
real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import config as cfg
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.fake_kube import FakeKube
from tests.support.gpu import Scenario
from tests.support.k8s_lender import BORROW, follower_toml, lender_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.core import conditions as c
from vacancyd.k8s import companion as comp
from vacancyd.k8s.companion import Companion

NS = "vacancy"


def companion_toml(url: str, *, timeout_s: float = 1.0, poll_s: float = 30.0) -> str:
    return follower_toml(url, timeout_s=timeout_s, poll_s=poll_s, ns=NS)


@asynccontextmanager
async def running_companion(toml: str, kube: FakeKube) -> AsyncIterator[Companion]:
    companion = Companion(parse_companion_config(toml, "<test>"), connect=kube.connect)
    await companion.start()
    try:
        yield companion
    finally:
        await companion.stop()


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state another task changes
            await asyncio.sleep(0.02)


def cond(kube: FakeKube, kind: str = c.LENDABLE) -> dict[str, Any]:
    return dict(kube.nodes["pc"]["status"]["conditions"] and kube.conditions("pc").get(kind, {}))


def ready(kube: FakeKube, service: str = "vacancyd-chat") -> bool | None:
    body = kube.slices.get((NS, f"{service}-pc-chat"))
    return None if body is None else bool(body["endpoints"][0]["conditions"]["ready"])


async def test_companion_follows_a_lender_through_events_and_timeout() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target)) as lender:
            await lender.wait_ready()
            port = int(lender.daemon.bound["chat"].rsplit(":", 1)[1])
            # status_poll_s is 30 s: every change below arrives through /events
            async with running_companion(companion_toml(lender.api_url), kube) as companion:
                await until(lambda: cond(kube).get("status") == "True")
                assert ready(kube) is True
                assert kube.slice(NS, "vacancyd-chat-pc-chat")["ports"][0]["port"] == port
                assert cond(kube, c.OWNER_PRESENT)["status"] == "False"

                lender.state.set_lending(False)
                await until(lambda: cond(kube).get("reason") == "LendingDisabled", 3.0)
                assert cond(kube)["status"] == "False"
                assert ready(kube) is False
                assert ready(kube, "vacancyd-chat-direct") is True

                lender.state.set_lending(True)
                await until(lambda: cond(kube).get("status") == "True", 3.0)

                async with aiohttp.ClientSession() as http:
                    async with http.get(f"http://{companion.address}/metrics") as resp:
                        text = await resp.text()
                    async with http.get(
                        f"http://{companion.address}/metrics",
                        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                    ) as resp:
                        assert resp.content_type == "application/openmetrics-text"
                        assert (await resp.text()).endswith("# EOF\n")
                assert 'vacancyd_companion_lender_up{lender="pc"} 1.0' in text
                assert 'vacancyd_companion_kubernetes_writes_ok{lender="pc"} 1.0' in text

                loop = asyncio.get_running_loop()
                await lender.daemon.shutdown()
                stopped = loop.time()
                await until(lambda: cond(kube).get("reason") == "LenderUnreachable", 5.0)
                # within lender_timeout_s (1 s) plus a little scheduling slack
                assert loop.time() - stopped < 2.5
                assert cond(kube)["status"] == "Unknown"
                assert ready(kube) is False
                assert ready(kube, "vacancyd-chat-direct") is False
            # the companion stopped: the lender is published as stopped
            assert cond(kube)["reason"] == "Stopped"


async def fake_lender(
    events: Callable[[web.Request], Any], status_doc: dict[str, Any]
) -> web.Application:
    app = web.Application()

    async def status(_: web.Request) -> web.Response:
        return web.json_response(status_doc)

    app.router.add_get("/status", status)
    app.router.add_get("/events", events)
    return app


STATUS = {
    "lending_enabled": True,
    "presence": {"sampled": True, "veto": {"active": False}},
    "resources": {},
    "upstreams": {
        "chat": {"lendable": True, "listener": {"address": "0.0.0.0:8000", "bound": True}}
    },
}


@pytest.mark.parametrize(
    "body",
    [b"this is not an event stream\n\n", b"event: veto\ndata: {not json\n\n"],
)
async def test_garbage_on_events_is_logged_and_reconnected(
    body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    connections = 0

    async def garbage(request: web.Request) -> web.StreamResponse:
        nonlocal connections
        connections += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await asyncio.sleep(0.5)
        return resp

    kube = FakeKube()
    kube.add_node("pc")
    app = await fake_lender(garbage, STATUS)
    async with serve_app(app) as url, running_companion(companion_toml(url), kube):
        await until(lambda: connections >= 2)
        # /status still works: the lender is published, and stays alive
        await until(lambda: cond(kube).get("status") == "True")
    assert "/events" in caplog.text
    assert "not a server-sent event line" in caplog.text or "not JSON" in caplog.text


async def test_events_stream_that_breaks_is_reconnected() -> None:
    connections = 0

    async def flaky(request: web.Request) -> web.StreamResponse:
        nonlocal connections
        connections += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: hello\ndata: {"keepalive_s": 5}\n\n')
        return resp  # the stream ends right away

    kube = FakeKube()
    kube.add_node("pc")
    app = await fake_lender(flaky, STATUS)
    async with serve_app(app) as url, running_companion(companion_toml(url), kube):
        await until(lambda: connections >= 3, 8.0)
        assert cond(kube).get("status") == "True"


async def test_lender_that_never_answers_becomes_unreachable() -> None:
    kube = FakeKube()
    kube.add_node("pc")
    # a port nothing listens on (bound, then closed)
    async with serve_app(web.Application()) as url:
        pass
    async with running_companion(companion_toml(url, timeout_s=1.0), kube):
        await until(lambda: cond(kube).get("reason") == "LenderUnreachable", 4.0)
        assert cond(kube)["status"] == "Unknown"


def test_sse_line_parser() -> None:
    assert comp.parse_sse_line("") is None
    assert comp.parse_sse_line(": keepalive") is None
    assert comp.parse_sse_line("event: veto") == ("event", "veto")
    assert comp.parse_sse_line("data:{}") == ("data", "{}")
    with pytest.raises(comp.EventStreamError):
        comp.parse_sse_line("<html>")


async def test_host_side_publishing_never_slows_admission(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server that hangs must not delay a proxied request or stop the daemon."""
    caplog.set_level(logging.WARNING, "vacancyd.k8s")
    kube = FakeKube()
    kube.add_node("pc")
    kube.delay_s = 3600.0
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    section = {
        "node": "pc",
        "address": "192.0.2.10",
        "namespace": "vacancy",
        "request_timeout_s": 0.2,
        "backoff_max_s": 1,
    }
    app, seen = openai_like_app()
    toml = lender_toml
    async with serve_app(app) as target, running_daemon(toml(target, kubernetes=section)) as d:
        await d.wait_ready()
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                started = loop.time()
                async with http.post(
                    f"{d.proxy_url('chat')}/v1/chat/completions",
                    json={"model": "tiny", "messages": []},
                    headers={"Authorization": f"Bearer {BORROW}"},
                ) as resp:
                    assert resp.status == 200
                assert loop.time() - started < 0.5
        await until(lambda: "no answer within" in caplog.text, 3.0)
        assert not d.daemon.supervisor.failed.is_set()
        writes_ok = d.daemon.metrics.registry.get_sample_value("vacancyd_kubernetes_writes_ok")
        assert writes_ok == 0.0
        # the API server recovers: conditions appear
        kube.delay_s = 0.0
        await until(lambda: cond(kube).get("status") == "True", 5.0)
        await until(
            lambda: (
                d.daemon.metrics.registry.get_sample_value("vacancyd_kubernetes_writes_ok") == 1.0
            )
        )
    assert len(seen) == 5
    # clean shutdown: not lendable
    assert cond(kube)["reason"] == "Stopped"


async def test_a_follower_that_dies_stops_the_companion(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a follower must not leave a companion that silently publishes nothing."""

    async def broken(self: comp.LenderFollower) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(comp.LenderFollower, "run", broken)
    kube = FakeKube()
    kube.add_node("pc")
    async with running_companion(companion_toml("http://127.0.0.1:9"), kube) as companion:
        async with asyncio.timeout(5):
            await companion.wait()
        assert companion.failure is not None
        assert "follower pc" in companion.failure and "RuntimeError('bug')" in companion.failure
    assert "the companion stops" in caplog.text


async def test_owner_gpu_load_shows_as_gpu_pressure(nvml: Scenario, tmp_path: Path) -> None:
    """Real GPU pressure (fake NVML under the real collector) reaches VacancyGPUPressure."""
    owner_pid = 4_000_001

    def lender_config(target: str) -> str:
        return cfg.daemon_toml(
            cfg.upstream("chat", target, resource="gpu0"),
            resources=(
                cfg.gpu(
                    "gpu0",
                    0,
                    pressure={
                        "poll_ms": 100,
                        "fixed_threshold": 0.2,
                        "engage_after_s": 0,
                        "release_after_s": 1.5,
                    },
                ),
            ),
            collectors={"poll_s": 0.2},
            state_dir=tmp_path / "state",
        )

    kube = FakeKube()
    kube.add_node("pc")
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_config(target)) as lender:
            await lender.wait_ready()
            async with running_companion(companion_toml(lender.api_url), kube):
                await until(lambda: cond(kube, c.GPU_PRESSURE).get("status") == "False")
                assert cond(kube, c.GPU_PRESSURE)["reason"] == "NoPressure"

                nvml.procs = [(0, "graphics", owner_pid, 3000)]
                nvml.sample(owner_pid, 70)
                nvml.write()
                await until(lambda: cond(kube, c.GPU_PRESSURE).get("status") == "True")
                assert cond(kube, c.GPU_PRESSURE)["reason"] == "ResourcePressured"
                assert "gpu0" in cond(kube, c.GPU_PRESSURE)["message"]
                assert cond(kube)["reason"] == "ResourcePressured"
                assert ready(kube) is False and ready(kube, "vacancyd-chat-direct") is True

                # no more owner samples: released after release_after_s of quiet
                await until(lambda: cond(kube, c.GPU_PRESSURE).get("status") == "False", 8.0)
                await until(lambda: cond(kube).get("status") == "True", 5.0)


async def test_a_followed_lender_is_published_not_ready_before_its_listener_closes() -> None:
    """A lender without ``[kubernetes]`` and without ``shutdown_delay_s`` (0 by default),
    followed by the companion: at SIGTERM the companion hears ``stopping`` and publishes it
    not ready while its proxy listener still accepts connections; the listener closes
    after that write, never before it."""
    kube = FakeKube()
    kube.add_node("pc")
    app, _ = openai_like_app()
    loop = asyncio.get_running_loop()
    #: (what, loop time, whether the proxy listener accepted a connection then)
    seen: list[tuple[str, float, bool]] = []
    applied = kube.apply_endpoint_slice

    async def accepts(address: str) -> bool:
        host, port = address.rsplit(":", 1)
        try:
            _reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return False
        writer.close()
        return True

    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target)) as lender:
            await lender.wait_ready()
            assert lender.daemon.settings.shutdown_delay_s == 0  # the default without k8s
            address = lender.daemon.bound["chat"]

            async def apply(body: Any, field_manager: str) -> None:
                await applied(body, field_manager)
                if (
                    body["metadata"]["name"] == "vacancyd-chat-pc-chat"
                    and not body["endpoints"][0]["conditions"]["ready"]
                ):
                    seen.append(("published not ready", loop.time(), await accepts(address)))

            kube.apply_endpoint_slice = apply  # type: ignore[method-assign]
            async with running_companion(companion_toml(lender.api_url), kube):
                await until(lambda: ready(kube) is True)
                await until(lambda: lender.state.event_followers == 1)
                closing = lender.daemon._close_listeners

                async def close(runners: Any) -> None:
                    if "chat" in runners:
                        seen.append(("listener closing", loop.time(), await accepts(address)))
                    await closing(runners)

                lender.daemon._close_listeners = close  # type: ignore[method-assign]
                seen.append(("SIGTERM", loop.time(), await accepts(address)))
                await lender.daemon.shutdown()
                seen.append(("stopped", loop.time(), await accepts(address)))
                order = list(seen)
    began = order[0][1]
    print(
        "\n".join(f"{what}: +{at - began:.4f} s (listener accepts: {up})" for what, at, up in order)
    )
    kinds = [what for what, _, _ in order]
    published, closed = kinds.index("published not ready"), kinds.index("listener closing")
    assert published < closed, order
    assert order[published][2], order  # the listener still answered when it was published
    assert not order[-1][2]  # and it did close


async def test_a_borrowed_jobs_events_do_not_make_the_follower_read_status_again() -> None:
    """A job's start and end say nothing of lendability; a read after each would catch the
    lender between a release and its fresh sample (and, published, hold it back for
    ``lendable_stable_s`` after every job it serves). Every other change reads again."""
    async with aiohttp.ClientSession() as session:
        (follower,) = comp.make_followers(
            parse_companion_config(companion_toml("http://127.0.0.1:9"), "<test>"),
            session,
            FakeKube().connect,
        )
        follower._on_event("job", '{"job": 1, "change": "ended"}')
        assert not follower._refresh.is_set()
        follower._on_event("reclaim", '{"upstream": "chat"}')
        assert follower._refresh.is_set()
