"""Remote graphical sessions and exclusive apps against a real dbus-daemon and the
systemd-logind look-alike: the daemon runs in-process with ``presence = "logind"`` on the
private bus, the exclusive app is a real process on this host, and borrowed requests go
through the proxy.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, resource, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.dbus import PrivateBus, private_bus
from tests.support.fake_logind import FakeLogind, SessionSpec
from tests.support.slow_openai import SlowOpenAI

pytestmark = pytest.mark.dbus

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
APP = "vcy-exclusive-test"


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    with private_bus(tmp_path) as running:
        yield running


def config(address: str, target: str, state_dir: Path, owner: Mapping[str, Any]) -> str:
    """Presence read from the logind look-alike at ``address``; ``owner``: more keys of
    ``[owner]``. Upstream ``llm`` is gated on memory, ``gpu-llm`` also on a GPU (unread)."""
    return daemon_toml(
        upstream("llm", target, on_owner_return="cancel"),
        upstream("gpu-llm", target, also_requires=["gpu0"]),
        resources=(resource("ram"), resource("gpu0", "gpu", enabled=False)),
        owner={"presence": "logind", "bus_address": address, "release_after_s": 0, **owner},
        collectors={"poll_s": 0.1, "probe_timeout_s": 1.0},
        state_dir=state_dir,
    )


@asynccontextmanager
async def lender(
    bus: PrivateBus,
    tmp_path: Path,
    sessions: list[SessionSpec],
    owner: Mapping[str, Any] | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[RunningDaemon, FakeLogind, aiohttp.ClientSession, SlowOpenAI]]:
    fake = await FakeLogind.start(bus.address, sessions)
    upstream = SlowOpenAI(**kw)
    try:
        async with serve_app(upstream.app()) as target:
            async with running_daemon(config(bus.address, target, tmp_path, owner or {})) as d:
                async with aiohttp.ClientSession() as http:
                    yield d, fake, http, upstream
    finally:
        await fake.stop()


async def borrow(d: RunningDaemon, http: aiohttp.ClientSession, upstream: str = "llm") -> Any:
    async with http.post(f"{d.proxy_url(upstream)}/v1/chat/completions", json=CHAT) as resp:
        if resp.status == 200:
            await resp.read()
            return 200, None
        return resp.status, (await resp.json())["error"]


@pytest.mark.parametrize(
    ("setting", "counts"), [({}, True), ({"remote_graphical": "ignore"}, False)], ids=str
)
async def test_a_remote_desktop_counts_as_the_owner_by_default(
    bus: PrivateBus, tmp_path: Path, setting: dict[str, str], counts: bool
) -> None:
    rdp = SessionSpec("7", type="x11", remote=True, remote_host="10.0.0.7", seat="")
    async with lender(bus, tmp_path, [rdp], setting, chunks=1) as (d, _fake, http, _):
        await d.wait_ready()
        await d.wait_until(lambda: d.state.presence.reading.value is not None)
        code, error = await borrow(d, http)
        if counts:
            assert code == 503 and error["code"] == "owner_active"
            assert "session 7 (graphical, unlocked and in use)" in error["message"]
        else:
            assert code == 200
        async with http.get(f"{d.api_url}/status") as resp:
            (session,) = (await resp.json())["presence"]["sessions"]
        assert session["remote"] is True and session["owner"] is counts
        assert "10.0.0.7" not in str(session)


@contextmanager
def exclusive_app() -> Iterator[subprocess.Popen[bytes]]:
    """A real process whose command name is ``APP`` (argv[0], as a launcher would set it)."""
    proc = subprocess.Popen(["bash", "-c", f"exec -a {APP} sleep 60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_a_host_exclusive_app_cuts_borrowed_work_after_its_grace_and_resumes_later(
    bus: PrivateBus, tmp_path: Path
) -> None:
    owner = {
        "exclusive_apps": [{"name": APP, "scope": "host"}],
        "exclusive_grace_s": 0.5,
        "exclusive_resume_after_s": 1.0,
    }
    away = [SessionSpec("1", locked=True)]
    async with lender(bus, tmp_path, away, owner, chunks=400, interval_s=0.05) as (
        d,
        _fake,
        http,
        upstream,
    ):
        await d.wait_ready()
        resp = await http.post(
            f"{d.proxy_url('llm')}/v1/chat/completions", json={**CHAT, "stream": True}
        )
        assert resp.status == 200
        await upstream.started.wait()
        loop = asyncio.get_running_loop()
        with exclusive_app():
            started = loop.time()
            await d.wait_until(lambda: bool(d.state.holds), 5)
            assert loop.time() - started >= 0.45  # not before the grace
            (hold,) = d.state.holds
            assert hold.detail == f"exclusive application running: {APP}"
            await asyncio.wait_for(upstream.ended_event.wait(), 5)
            assert upstream.ended == ["disconnected"]  # cancel: cut at once
            resp.close()
            for name in ("llm", "gpu-llm"):  # a host-exclusive app holds every upstream
                code, error = await borrow(d, http, name)
                assert code == 503 and error["hold"] == "exclusive_app"
            assert not d.state.veto.engaged  # the owner is still away: this is the app
        gone = loop.time()
        await d.wait_until(lambda: not d.state.holds, 5)
        assert loop.time() - gone >= 0.9  # the resume delay
        async with http.get(f"{d.api_url}/status") as r:
            apps = (await r.json())["owner_controls"]["exclusive_apps"]
        assert apps["host"]["engaged"] is False and apps["host"]["names"] == [APP]


async def test_a_gpu_exclusive_app_holds_only_gpu_upstreams(
    bus: PrivateBus, tmp_path: Path
) -> None:
    owner = {
        "exclusive_apps": [{"name": APP, "scope": "gpu"}],
        "exclusive_grace_s": 0,
        "exclusive_resume_after_s": 0,
    }
    async with lender(bus, tmp_path, [SessionSpec("1", locked=True)], owner, chunks=1) as (
        d,
        _fake,
        http,
        _,
    ):
        await d.wait_ready()
        with exclusive_app():
            await d.wait_until(lambda: bool(d.state.holds), 5)
            code, error = await borrow(d, http, "gpu-llm")
            assert code == 503 and error["hold"] == "exclusive_app"
            assert "GPU-exclusive application running" in error["message"]
            assert (await borrow(d, http, "llm"))[0] == 200
        await d.wait_until(lambda: not d.state.holds, 5)


async def test_pause_until_idle_ends_when_the_owner_has_come_and_gone(
    bus: PrivateBus, tmp_path: Path
) -> None:
    """Paused from the desktop: lending stays paused while the owner works and resumes by
    itself once they lock the screen (the veto releases); a restart in between keeps it."""
    async with lender(bus, tmp_path, [SessionSpec("1")], chunks=1) as (d, fake, http, _):
        await d.wait_until(lambda: d.state.veto.engaged, 5)  # the owner is at the desktop
        async with http.post(f"{d.api_url}/admin/pause", json={"until_idle": True}) as r:
            assert r.status == 200
            pause = (await r.json())["pause"]
        assert pause["kind"] == "until_idle" and pause["seen_owner"] is True
        fake.session("1").set_locked(True)  # the owner leaves
        await d.wait_until(lambda: not d.state.veto.engaged, 5)
        await d.wait_until(lambda: not d.state.holds, 5)
        await d.wait_ready()
        assert (await borrow(d, http))[0] == 200
        await d.wait_until(lambda: not (tmp_path / "pause.json").exists(), 5)


async def test_pause_until_idle_set_while_away_waits_for_the_owner_first(
    bus: PrivateBus, tmp_path: Path
) -> None:
    async with lender(bus, tmp_path, [SessionSpec("1", locked=True)], chunks=1) as (
        d,
        fake,
        http,
        _,
    ):
        await d.wait_ready()
        async with http.post(f"{d.api_url}/admin/pause", json={"until_idle": True}) as r:
            assert (await r.json())["pause"]["seen_owner"] is False
        await asyncio.sleep(0.5)  # several evaluations with the owner away
        assert d.state.holds and (await borrow(d, http))[0] == 503
        fake.session("1").set_locked(False)  # back at the desktop...
        await d.wait_until(
            lambda: d.daemon.owner.pause is not None and d.daemon.owner.pause.seen_owner, 5
        )
        fake.session("1").set_locked(True)  # ...and away again
        await d.wait_until(lambda: not d.state.holds, 5)
