"""vLLM sleep as the yield action: a reclaim puts a sleep-mode server to sleep (confirmed with
/is_sleeping), the next borrowed request wakes it before it is forwarded, and a server that
refuses sleep leaves the upstream refusing only, said in /status. Against the vLLM look-alike
(tests/support/fake_vllm.py) behind a real in-process daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_vllm import FakeVllm
from vacancyd.state import PresenceReading

CHAT = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}]}


def config(target: str, state_dir: Path, yield_on_veto: bool = True) -> str:
    """One vLLM upstream cancelling borrowed work on the owner's return, put to sleep (when
    ``yield_on_veto``) while the owner is back; the veto releases at once."""
    return daemon_toml(
        upstream(
            "vllm",
            target,
            adapter="vllm",
            on_owner_return="cancel",
            yield_on_veto=yield_on_veto,
        ),
        owner={"release_after_s": 0},
        state_dir=state_dir,
    )


@asynccontextmanager
async def lender(
    fake: FakeVllm, tmp_path: Path, **kw: Any
) -> AsyncIterator[tuple[RunningDaemon, aiohttp.ClientSession]]:
    async with serve_app(fake.app()) as target:
        async with running_daemon(config(target, tmp_path, **kw)) as d:
            await d.wait_ready()
            async with aiohttp.ClientSession() as http:
                yield d, http


async def sleep_view(d: RunningDaemon, http: aiohttp.ClientSession) -> Any:
    async with http.get(d.api_url + "/status") as r:
        return (await r.json())["upstreams"]["vllm"].get("sleep")


async def reclaim_by_pause(d: RunningDaemon, http: aiohttp.ClientSession) -> None:
    async with http.post(d.api_url + "/admin/pause", json={}) as r:
        assert r.status == 200
    await d.wait_until(lambda: d.state.reclaim_views["vllm"]["phase"] == "done", 15)


async def resume(d: RunningDaemon, http: aiohttp.ClientSession) -> None:
    async with http.post(d.api_url + "/admin/resume", json={}) as r:
        assert r.status == 200


async def borrow(d: RunningDaemon, http: aiohttp.ClientSession) -> tuple[int, Any]:
    async with http.post(d.proxy_url("vllm") + "/v1/chat/completions", json=CHAT) as r:
        return r.status, await r.json()


async def test_reclaim_sleeps_and_the_next_borrower_wakes_it_first(tmp_path: Path) -> None:
    fake = FakeVllm(settle_s=0.3)  # answers before the engine has finished, as vLLM may
    async with lender(fake, tmp_path) as (d, http):
        assert (await sleep_view(d, http))["state"] == "awake"
        await reclaim_by_pause(d, http)
        assert fake.sleeping
        assert ("POST", "/sleep?level=1") in fake.calls
        after_sleep = fake.calls[fake.calls.index(("POST", "/sleep?level=1")) + 1 :]
        assert after_sleep and all(c == ("GET", "/is_sleeping") for c in after_sleep)
        assert len(after_sleep) >= 2  # the first poll still said awake
        view = await sleep_view(d, http)
        assert view["state"] == "asleep" and "level 1" in view["detail"]
        # While held, borrowers are refused by vacancyd, not by the sleeping server.
        code, body = await borrow(d, http)
        assert code == 503 and body["error"]["source"] == "vacancyd"
        await resume(d, http)
        fake.calls.clear()
        code, body = await borrow(d, http)
        assert code == 200, body
        wake = fake.calls.index(("POST", "/wake_up"))
        chat = fake.calls.index(("POST", "/v1/chat/completions"))
        assert wake < chat
        assert ("GET", "/is_sleeping") in fake.calls[wake:chat]
        view = await sleep_view(d, http)
        assert view["state"] == "awake" and view["last_wake_s"] >= 0.25
        # Awake now: the next request goes straight through.
        fake.calls.clear()
        assert (await borrow(d, http))[0] == 200
        assert ("POST", "/wake_up") not in fake.calls
        async with http.get(d.api_url + "/metrics") as r:
            metrics = await r.text()
        assert 'vacancyd_wake_duration_seconds_count{outcome="woken",upstream="vllm"} 1.0' in (
            metrics
        )


async def test_an_owner_return_sleeps_the_server_too(tmp_path: Path) -> None:
    fake = FakeVllm()
    async with lender(fake, tmp_path) as (d, _http):
        owner = PresenceReading(True, True, "test: owner back")
        d.daemon.owner.record_presence(owner, d.state.clock())
        await d.wait_until(lambda: fake.sleeping, 10)
        assert d.state.reclaim_views["vllm"]["trigger"] == "owner"


@pytest.mark.parametrize(
    ("fake", "state", "detail"),
    [
        (FakeVllm(sleep_mode=False), "unavailable", "answered 404: the server runs without sleep"),
        (FakeVllm(sleep_status=500), "sleep_failed", "POST /sleep answered 500"),
    ],
    ids=["no-sleep-mode", "engine-error"],
)
async def test_a_refused_sleep_falls_back_to_refusing_only(
    tmp_path: Path, fake: FakeVllm, state: str, detail: str
) -> None:
    async with lender(fake, tmp_path) as (d, http):
        await reclaim_by_pause(d, http)
        view = await sleep_view(d, http)
        assert view["state"] == state and detail in view["detail"]
        code, body = await borrow(d, http)
        assert code == 503 and body["error"]["code"] == "owner_active"  # refused, as today
        await resume(d, http)
        fake.calls.clear()
        assert (await borrow(d, http))[0] == 200
        assert ("POST", "/wake_up") not in fake.calls  # it never slept: nothing to wake
        # Without sleep mode, a second reclaim does not ask again.
        sleeps = [c for c in fake.calls if c[1].startswith("/sleep")]
        await reclaim_by_pause(d, http)
        again = [c for c in fake.calls if c[1].startswith("/sleep")]
        assert len(again) == len(sleeps) + (0 if state == "unavailable" else 1)


async def test_without_yield_on_veto_the_server_is_never_put_to_sleep(tmp_path: Path) -> None:
    fake = FakeVllm()
    async with lender(fake, tmp_path, yield_on_veto=False) as (d, http):
        await reclaim_by_pause(d, http)
        assert not any(path.startswith("/sleep") for _, path in fake.calls)
        assert (await sleep_view(d, http))["state"] == "awake"


@pytest.mark.parametrize(
    "answer",
    [{"is_sleeping": "yes"}, {"sleeping": True}, ["is_sleeping"]],
    ids=["not-a-bool", "wrong-key", "not-an-object"],
)
async def test_a_malformed_is_sleeping_answer_is_an_upstream_error(answer: object) -> None:
    from aiohttp import web

    from vacancyd.adapters.base import UpstreamError
    from vacancyd.adapters.vllm import VllmController

    async def sleep(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/sleep", sleep)
    app.router.add_get("/is_sleeping", is_sleeping)
    async with serve_app(app) as target, aiohttp.ClientSession() as session:
        from yarl import URL

        controller = VllmController(session, URL(target))
        with pytest.raises(UpstreamError, match="is_sleeping"):
            await controller.unload(frozenset())
        assert controller.state == "awake"  # never claimed asleep without proof
