"""Routing borrowers away in time, with real in-process lenders and a slow API server (the
in-memory fake, every call delayed): a lender is published lendable within 1 s of being
lendable, in both publishing modes; a stopping lender is published terminating at once; a
lender whose /events stream and /status stall is published not ready after its timeout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.fake_kube import FakeKube
from tests.support.k8s_lender import follower_toml, lender_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.core import conditions as c
from vacancyd.core import gate
from vacancyd.core.reasons import Admit
from vacancyd.core.snapshot import RequestFacts
from vacancyd.k8s.companion import Companion

NS = "vacancy"
#: Every API call takes this long: a loaded or distant API server.
SLOW_API_S = 0.1


def companion_toml(url: str, *, timeout_s: float = 2.0) -> str:
    return follower_toml(url, timeout_s=timeout_s, ns=NS)


HOST_SECTION = {
    "node": "pc",
    "address": "192.0.2.10",
    "lender": "pc",
    "namespace": NS,
    "heartbeat_s": 60,
    "resync_s": 60,
    "lendable_stable_s": 0,
}


@asynccontextmanager
async def running_companion(toml: str, kube: FakeKube) -> AsyncIterator[Companion]:
    companion = Companion(parse_companion_config(toml, "<test>"), connect=kube.connect)
    await companion.start()
    try:
        yield companion
    finally:
        await companion.stop()


def gated(kube: FakeKube) -> dict[str, bool] | None:
    body = kube.slices.get((NS, "vacancyd-chat-pc-chat"))
    return None if body is None else dict(body["endpoints"][0]["conditions"])


def lendable_status(kube: FakeKube) -> str | None:
    if "pc" not in kube.nodes:
        return None
    return kube.conditions("pc").get(c.LENDABLE, {}).get("status")


def admits(d: RunningDaemon) -> bool:
    state = d.state
    snap = state.snapshot()
    return isinstance(gate.decide(RequestFacts(), snap, state.upstreams["chat"]), Admit)


async def moment(predicate: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """The loop time at which ``predicate`` first held (polled every 5 ms)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state other tasks change
            await asyncio.sleep(0.005)
    return loop.time()


async def published_within_a_second(d: RunningDaemon, kube: FakeKube) -> None:
    lendable_at = await moment(lambda: admits(d))
    published_at = await moment(
        lambda: (gated(kube) or {}).get("ready") is True and lendable_status(kube) == "True"
    )
    assert published_at - lendable_at < 1.0
    # off and on again, later: the same
    d.state.set_lending(False)
    await moment(lambda: (gated(kube) or {}).get("ready") is False, 2.0)
    d.state.set_lending(True)
    lendable_at = await moment(lambda: admits(d))
    published_at = await moment(lambda: (gated(kube) or {}).get("ready") is True, 2.0)
    assert published_at - lendable_at < 1.0


@pytest.fixture
def kube() -> FakeKube:
    kube = FakeKube()
    kube.add_node("pc")
    kube.delay_s = SLOW_API_S
    return kube


async def test_companion_publishes_a_new_lender_within_a_second(kube: FakeKube) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as d:
        # the companion starts with the lender, before it is lendable: its first passes
        # (Unknown, Starting) are in flight against the slow API while the lender turns
        async with running_companion(companion_toml(d.api_url), kube):
            await published_within_a_second(d, kube)


async def test_host_side_publishes_a_new_lender_within_a_second(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(lender_toml(target, kubernetes=HOST_SECTION)) as d,
    ):
        await published_within_a_second(d, kube)


async def test_with_the_default_damping_a_new_lender_is_still_published_within_a_second(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lendable_stable_s (10 s by default) damps returns to lendable, not a new lender: the
    refusals of a daemon whose first samples are not in yet do not start the damping."""
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    default_host = {k: v for k, v in HOST_SECTION.items() if k != "lendable_stable_s"}
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        for mode in ("companion", "host"):
            kube.slices.clear()
            section = default_host if mode == "host" else None
            async with running_daemon(lender_toml(target, kubernetes=section)) as d:
                async with contextlib.AsyncExitStack() as stack:
                    if mode == "companion":
                        toml = follower_toml(
                            d.api_url, timeout_s=2.0, ns=NS, lendable_stable_s=None
                        )
                        assert "lendable_stable_s" not in toml
                        await stack.enter_async_context(running_companion(toml, kube))
                    lendable_at = await moment(lambda: admits(d))
                    published_at = await moment(
                        lambda: (gated(kube) or {}).get("ready") is True, 5.0
                    )
                    assert published_at - lendable_at < 1.0, mode
                    assert kube.conditions("pc")[c.LENDABLE]["reason"] == "Lendable"


async def test_a_stopping_lender_tells_its_companion_at_once(kube: FakeKube) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target)) as d:
            async with running_companion(companion_toml(d.api_url, timeout_s=5.0), kube):
                await moment(lambda: (gated(kube) or {}).get("ready") is True)
                loop = asyncio.get_running_loop()
                stopping = loop.create_task(d.daemon.shutdown())
                began = loop.time()
                at = await moment(lambda: (gated(kube) or {}).get("terminating") is True, 3.0)
                # told through /events: well before lender_timeout_s (5 s)
                assert at - began < 1.0
                assert gated(kube) == {"ready": False, "serving": False, "terminating": True}
                assert kube.conditions("pc")[c.LENDABLE]["reason"] == "Terminating"
                await stopping


async def test_host_side_sigterm_publishes_terminating_then_stopped(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    seen: list[dict[str, bool]] = []
    apply = kube.apply_endpoint_slice

    async def recording(body: Any, manager: str) -> None:
        await apply(body, manager)
        if body["metadata"]["name"] == "vacancyd-chat-pc-chat":
            seen.append(dict(body["endpoints"][0]["conditions"]))

    monkeypatch.setattr(kube, "apply_endpoint_slice", recording)
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target, kubernetes=HOST_SECTION)):
            await moment(lambda: (gated(kube) or {}).get("ready") is True)
    assert seen[-2:] == [
        {"ready": False, "serving": False, "terminating": True},
        {"ready": False, "serving": False, "terminating": False},
    ]
    assert kube.conditions("pc")[c.LENDABLE]["reason"] == "Stopped"


async def test_a_stalled_lender_is_published_not_ready_after_its_timeout(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """/events goes silent (no keepalive) and /status hangs: not ready after the timeout."""
    stalled = asyncio.Event()
    status_doc = {
        "lending_enabled": True,
        "presence": {"sampled": True, "veto": {"active": False}},
        "resources": {},
        "upstreams": {
            "chat": {"lendable": True, "listener": {"address": "0.0.0.0:8000", "bound": True}}
        },
    }

    async def status(_: web.Request) -> web.Response:
        if stalled.is_set():
            await asyncio.sleep(3600)
        return web.json_response(status_doc)

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: hello\ndata: {"keepalive_s": 0.2}\n\n')
        while not stalled.is_set():
            await resp.write(b": keepalive\n\n")
            await asyncio.sleep(0.2)
        await asyncio.sleep(3600)  # the stream stays open and says nothing
        return resp

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/events", events)
    kube.delay_s = 0.0
    async with serve_app(app) as url, running_companion(companion_toml(url, timeout_s=1.0), kube):
        await moment(lambda: (gated(kube) or {}).get("ready") is True)
        loop = asyncio.get_running_loop()
        stalled.set()
        began = loop.time()
        at = await moment(lambda: (gated(kube) or {}).get("ready") is False, 5.0)
        assert 0.8 <= at - began < 2.5  # lender_timeout_s is 1 s
        assert lendable_status(kube) == "Unknown"
        await moment(lambda: "nothing received for" in caplog.text, 8.0)


async def test_a_host_side_lender_stands_down_for_an_uninstall(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The uninstall marker appears: the lender stops writing at once, and its shutdown
    writes nothing either (an uninstall's cleanup must not be undone)."""
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    kube.delay_s = 0.0
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target, kubernetes=HOST_SECTION)) as d:
            await moment(lambda: (gated(kube) or {}).get("ready") is True)
            await kube.apply_endpoint_slice(c.uninstall_marker(NS), "vacancyd-cleanup")
            await moment(lambda: "no more writes for pc" in caplog.text, 5.0)
            kube.slices = {k: v for k, v in kube.slices.items() if k[1] == c.UNINSTALL_MARKER}
            kube.nodes["pc"]["status"]["conditions"] = []
            d.state.set_lending(False)  # a change that would be published at once
            await asyncio.sleep(0.5)
    assert list(kube.slices) == [(NS, c.UNINSTALL_MARKER)]
    assert kube.nodes["pc"]["status"]["conditions"] == []
