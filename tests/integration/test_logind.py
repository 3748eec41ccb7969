"""Owner presence against a real dbus-daemon and a systemd-logind look-alike: the
daemon runs in-process with ``presence = "logind"`` and only
``bus_address`` pointing it at the private bus, and borrowed requests go through its proxy.

Scenarios: a local graphical session unlocks; a session locks; the user goes idle and comes
back; an SSH-only host; logind disappears; a method call hangs past the deadline; a session
appears while borrowed work is admitted. Bad input: malformed property types, sessions
without a user, a user name that does not resolve, a bus that drops mid-poll.

Signal tests poll only every 30 s, so anything seen within the test's wait was seen through a
signal, not a poll.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from dbus_fast import Variant

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.dbus import PrivateBus, private_bus
from tests.support.fake_logind import FakeLogind, SessionSpec, monotonic_us
from vacancyd.state import SharedState

pytestmark = pytest.mark.dbus

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    with private_bus(tmp_path) as running:
        yield running


def config(
    address: str,
    target: str,
    *,
    poll_s: float = 30.0,
    on_owner_return: str | None = None,
    **owner: object,
) -> str:
    """Presence read from the logind look-alike at ``address``; ``owner``: more keys of
    ``[owner]``. Upstream ``llm`` is gated on the owner, ``exempt`` only on its resource."""
    return daemon_toml(
        upstream("llm", target, on_owner_return=on_owner_return),
        upstream("exempt", target, owner_scope="resource"),
        owner={"presence": "logind", "bus_address": address, "release_after_s": 0, **owner},
        collectors={"poll_s": poll_s, "probe_timeout_s": 0.5},
    )


@asynccontextmanager
async def lender(
    bus: PrivateBus,
    sessions: list[SessionSpec],
    *,
    app: web.Application | None = None,
    **owner: Any,
) -> AsyncIterator[tuple[RunningDaemon, FakeLogind, aiohttp.ClientSession]]:
    fake = await FakeLogind.start(bus.address, sessions)
    upstream_app = app if app is not None else openai_like_app()[0]
    try:
        async with serve_app(upstream_app) as target:
            async with running_daemon(config(bus.address, target, **owner)) as d:
                async with aiohttp.ClientSession() as http:
                    yield d, fake, http
    finally:
        await fake.stop()


async def borrow(
    d: RunningDaemon, http: aiohttp.ClientSession, upstream: str = "llm"
) -> tuple[int, Mapping[str, object], str | None]:
    async with http.post(f"{d.proxy_url(upstream)}/v1/chat/completions", json=CHAT) as resp:
        body = await resp.json()
        return resp.status, body, resp.headers.get("Retry-After")


async def wait_for(
    state: SharedState, predicate: object, timeout_s: float = 2.0, what: str = "state change"
) -> None:
    """Wait until ``predicate()`` holds, re-checking on each state event and presence attempt.

    Presence failures and repeated readings emit no state event, so the presence loop's
    records are checked too (every 10 ms, bounded by ``timeout_s``).
    """
    assert callable(predicate)
    changed = asyncio.Event()
    unsubscribe = state.subscribe(lambda _event: changed.set())
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                changed.clear()
                try:
                    async with asyncio.timeout(0.01):
                        await changed.wait()
                except TimeoutError:
                    pass
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
    finally:
        unsubscribe()


async def next_sample(state: SharedState, timeout_s: float = 2.0) -> None:
    """Wait until the presence loop records another attempt (success or failure)."""
    obs = state.presence.reading
    before = (obs.observed_at, obs.failed_at)
    async with asyncio.timeout(timeout_s):
        while (state.presence.reading.observed_at, state.presence.reading.failed_at) == before:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def admitted(d: RunningDaemon, http: aiohttp.ClientSession) -> None:
    """Once the daemon is ready (capacity measured too), a borrowed request is admitted."""
    await d.wait_ready()
    status, body, _ = await borrow(d, http)
    assert status == 200, body


def veto(d: RunningDaemon) -> bool:
    return d.state.veto.engaged


async def test_local_graphical_session_unlocks(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", locked=True)]) as (d, fake, http):
        await d.wait_ready()
        await admitted(d, http)
        fake.session("1").set_locked(False)
        await wait_for(d.state, lambda: veto(d), what="the veto to engage on unlock")
        status, body, retry = await borrow(d, http)
        assert status == 503 and retry == "120"
        error = body["error"]
        assert isinstance(error, dict) and error["code"] == "owner_active"
        assert "session 1 (graphical, unlocked and in use)" in str(error["message"])
        # The resource-scoped upstream is exempt and says so in /status.
        assert (await borrow(d, http, "exempt"))[0] == 200
        async with http.get(f"{d.api_url}/status") as resp:
            presence = (await resp.json())["presence"]
        assert presence["exempt_upstreams"] == ["exempt"]
        assert presence["sessions"][0]["owner"] is True


async def test_unlock_request_signal_triggers_a_resample(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", locked=True)]) as (d, fake, http):
        await d.wait_ready()
        fake.session("1").spec.locked = False  # changed without PropertiesChanged...
        fake.session("1").UnlockRequested()  # ...but the Unlock request wakes a full sample
        await wait_for(d.state, lambda: veto(d), what="the veto after an Unlock signal")
        assert (await borrow(d, http))[0] == 503


async def test_polling_only_still_sees_the_owner(bus: PrivateBus) -> None:
    sessions = [SessionSpec("1", locked=True)]
    async with lender(bus, sessions, poll_s=0.1, signals=False) as (d, fake, http):
        await d.wait_ready()
        fake.session("1").set_locked(False)
        await wait_for(d.state, lambda: veto(d), what="the veto from a poll")
        assert d.daemon.presence is not None and d.daemon.presence.client.signals_seen == 0
        assert (await borrow(d, http))[0] == 503


async def test_session_locks(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", type="x11")]) as (d, fake, http):
        await wait_for(d.state, lambda: veto(d), what="the veto for an unlocked desktop")
        assert (await borrow(d, http))[0] == 503
        fake.session("1").set_locked(True)
        await wait_for(d.state, lambda: not veto(d), what="release on lock")
        await admitted(d, http)


async def test_user_goes_idle_and_comes_back(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("c3", type="tty", tty="tty3")]) as (d, fake, http):
        await wait_for(d.state, lambda: veto(d), what="the veto for an active console")
        fake.session("c3").set_idle(True)
        await wait_for(d.state, lambda: not veto(d), what="release on idle")
        await admitted(d, http)
        async with http.get(f"{d.api_url}/status") as resp:
            (entry,) = (await resp.json())["presence"]["sessions"]
        assert entry["kind"] == "console" and entry["idle"] is True and entry["why"] == "idle"
        fake.session("c3").set_idle(False)
        await wait_for(d.state, lambda: veto(d), what="the veto when the user is back")
        assert (await borrow(d, http))[0] == 503


async def test_idle_after_uses_idle_since_hint_monotonic(bus: PrivateBus) -> None:
    long_ago = monotonic_us() - 120_000_000
    recent = monotonic_us()
    sessions = [
        SessionSpec("1", idle=True, idle_since_us=long_ago),
        SessionSpec("2", uid=1001, user="second", idle=True, idle_since_us=recent),
    ]
    async with lender(bus, sessions, idle_after_s=60.0) as (d, fake, _http):
        await wait_for(d.state, lambda: veto(d), what="veto: session 2 idle only briefly")
        assert "session 2" in d.state.presence.reading.value.detail  # type: ignore[union-attr]
        fake.session("2").set_idle(True, since_us=long_ago)
        await wait_for(d.state, lambda: not veto(d), what="release once both idle long enough")


async def test_ssh_only_host(bus: PrivateBus) -> None:
    ssh = SessionSpec("5", type="tty", remote=True, remote_host="10.0.0.9", tty="pts/0", seat="")
    async with lender(bus, [ssh]) as (d, _fake, http):
        await d.wait_ready()
        assert not veto(d)
        await admitted(d, http)
        async with http.get(f"{d.api_url}/status") as resp:
            presence = (await resp.json())["presence"]
        assert presence["session_counts"]["remote"] == 1
        assert presence["sessions"][0]["why"] == "remote session; does not count"
        assert "10.0.0.9" not in str(presence)  # redacted: no remote host
        async with http.get(f"{d.api_url}/metrics") as resp:
            metrics = await resp.text()
        assert 'vacancyd_presence_sessions{kind="remote"} 1.0' in metrics
        assert "vacancyd_presence_owner_signal 0.0" in metrics


async def test_logind_disappears(bus: PrivateBus, caplog: pytest.LogCaptureFixture) -> None:
    async with lender(bus, [SessionSpec("1", locked=True)]) as (d, fake, http):
        await d.wait_ready()
        await admitted(d, http)
        fake.disappear()  # NameOwnerChanged wakes the loop; no 30 s poll needed
        await next_sample(d.state)
        status, body, retry = await borrow(d, http)
        assert status == 503 and retry == "30"
        message = str(body["error"]["message"])  # type: ignore[index]
        assert "presence unreadable" in message and "ServiceUnknown" in message
        assert any("owner presence unreadable" in r.getMessage() for r in caplog.records)


async def test_method_call_hangs_past_the_deadline(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", locked=True)], poll_s=0.2) as (d, fake, http):
        await d.wait_ready()
        fake.hang.add("GetAll")
        async with asyncio.timeout(3):
            while "did not answer GetAll" not in (d.state.presence.reading.error or ""):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        status, _body, retry = await borrow(d, http)
        assert status == 503 and retry == "30"
        fake.hang.clear()  # the collector reconnects and reads again
        await wait_for(d.state, lambda: d.state.presence_view(d.state.clock()).evidence_complete)
        assert d.daemon.presence is not None and d.daemon.presence.client.connects >= 2
        await admitted(d, http)


async def test_session_appears_while_borrowed_work_is_admitted(bus: PrivateBus) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        started.set()
        await release.wait()
        return web.json_response({"id": "c1", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow)
    edges: list[Mapping[str, object]] = []
    async with lender(bus, [], app=app) as (d, fake, http):
        d.state.subscribe(lambda e: edges.append(e.payload()) if e.kind == "veto" else None)
        await d.wait_ready()
        in_flight = asyncio.get_running_loop().create_task(borrow(d, http))
        await asyncio.wait_for(started.wait(), 2)
        fake.add(SessionSpec("7", type="wayland"))  # someone logs in at the desktop
        await wait_for(d.state, lambda: veto(d), what="the veto on SessionNew")
        assert edges and edges[0]["active"] is True and "session 7" in str(edges[0]["detail"])
        status, _body, _retry = await borrow(d, http)
        assert status == 503
        release.set()
        assert (await in_flight)[0] == 200  # drained by policy: it finished inside drain_timeout_s


async def test_owner_login_cancels_borrowed_work_under_cancel_policy(bus: PrivateBus) -> None:
    """The veto's rising edge from a logind signal is what the reclaimer acts on."""
    started = asyncio.Event()

    async def slow(_request: web.Request) -> web.Response:
        started.set()
        await asyncio.sleep(30)  # a long generation; the reclaim must not wait for it
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow)
    fake = await FakeLogind.start(bus.address, [])
    try:
        async with serve_app(app) as target:
            toml = config(bus.address, target, on_owner_return="cancel")
            assert 'on_owner_return = "cancel"' in toml
            async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
                await d.wait_ready()
                in_flight = asyncio.get_running_loop().create_task(borrow(d, http))
                await asyncio.wait_for(started.wait(), 2)
                fake.add(SessionSpec("8", type="x11"))
                status, body, _ = await asyncio.wait_for(in_flight, 5)
                assert status == 503
                error = body["error"]
                assert isinstance(error, dict) and error["code"] == "owner_active"
                assert "reclaimed 'llm' (owner)" in str(error["message"])
    finally:
        await fake.stop()


async def test_readyz_unready_until_presence_sampled(tmp_path: Path) -> None:
    nowhere = f"unix:path={tmp_path}/no-bus.sock"
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(config(nowhere, target, poll_s=0.2)) as d:
            await next_sample(d.state)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{d.api_url}/readyz") as resp:
                    assert resp.status == 503
                status, body, retry = await borrow(d, http)
                assert status == 503 and retry == "5"
                assert "not been sampled" in str(body["error"])
            assert "cannot connect" in (d.state.presence.reading.error or "")


# -- bad input ---------------------------------------------------------------------------


async def test_malformed_property_types_refuse(
    bus: PrivateBus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd")
    async with lender(bus, [SessionSpec("1", locked=True)], poll_s=0.2) as (d, fake, http):
        await d.wait_ready()
        props = fake.proper_properties("1")
        props["LockedHint"] = Variant("s", "yes")
        fake.serve_malformed("1", props)
        await wait_for(d.state, lambda: veto(d), what="the veto on an unreadable session")
        status, body, retry = await borrow(d, http)
        assert status == 503 and retry == "30"
        assert "LockedHint has D-Bus type 's', expected 'b'" in str(body["error"])
        lines = [
            r.getMessage() for r in caplog.records if "session 1 is unreadable" in r.getMessage()
        ]
        assert len(lines) == 1  # logged once, though every poll (0.2 s) still finds it
        assert "LockedHint has D-Bus type 's'" in lines[0]
        await next_sample(d.state)
        await next_sample(d.state)
        assert len([r for r in caplog.records if "session 1 is unreadable" in r.getMessage()]) == 1
        # Fixed: the problem clears, the veto releases (release_after_s = 0) and lending resumes.
        fake.malformed.clear()
        await wait_for(d.state, lambda: not veto(d), what="release once readable again")
        assert any("session 1 is unreadable no more" in r.getMessage() for r in caplog.records)
        await admitted(d, http)


async def test_session_without_a_user_refuses(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", user="", locked=True)]) as (d, _fake, http):
        await wait_for(d.state, lambda: veto(d), what="the veto on a session without a user")
        status, body, _ = await borrow(d, http)
        assert status == 503 and "session has no user" in str(body["error"])


async def test_unresolvable_user_with_owner_processes_refuses(
    bus: PrivateBus, caplog: pytest.LogCaptureFixture
) -> None:
    ghost = SessionSpec("9", uid=4242, user="vacancyd-no-such-user", idle=True)
    async with lender(bus, [ghost], processes=["vacancyd-owner-game"]) as (d, _fake, http):
        await wait_for(d.state, lambda: veto(d), what="the veto on an unresolvable user")
        status, body, retry = await borrow(d, http)
        assert status == 503 and retry == "30"
        assert "does not resolve" in str(body["error"])
        assert any("does not resolve" in r.getMessage() for r in caplog.records)


async def test_bus_drops_mid_poll(bus: PrivateBus) -> None:
    async with lender(bus, [SessionSpec("1", locked=True)], poll_s=0.2) as (d, fake, http):
        await d.wait_ready()
        fake.hang.add("GetAll")
        calls = fake.calls.count("GetAll")
        async with asyncio.timeout(2):
            while fake.calls.count("GetAll") == calls:  # noqa: ASYNC110 - no event for calls
                await asyncio.sleep(0.005)
        # A poll is now waiting on a GetAll that will never be answered...
        bus.stop()  # ...and the bus goes away under it
        async with asyncio.timeout(3):
            while "connect" not in (d.state.presence.reading.error or ""):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        error = d.state.presence.reading.error or ""
        assert "lost the connection" in error or "cannot connect" in error
        status, _, retry = await borrow(d, http)
        assert status == 503 and retry == "30"


async def test_owner_process_holds_an_idle_desktop(bus: PrivateBus, tmp_path: Path) -> None:
    game = tmp_path / "vacancyd-owner-game"
    game.symlink_to("/bin/sleep")
    me = SessionSpec("1", uid=os.getuid(), user=_my_user(), idle=True)
    async with lender(bus, [me], poll_s=0.2, processes=["vacancyd-owner-game"]) as (d, _f, http):
        await d.wait_ready()
        await admitted(d, http)
        proc = await asyncio.create_subprocess_exec(str(game), "30")
        try:
            await wait_for(d.state, lambda: veto(d), what="the veto on an owner process")
            (entry,) = d.state.presence.reading.value.sessions  # type: ignore[union-attr]
            assert entry["owner_processes"] == ["vacancyd-owner-game"]
            assert (await borrow(d, http))[0] == 503
        finally:
            proc.terminate()
            await proc.wait()
        await wait_for(d.state, lambda: not veto(d), what="release when the program exits")


def _my_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
