"""Supervision: every background task is named and declared essential or not, a listener
that dies (its socket stops accepting) stops the daemon with exit status 1, and the
component suite fails a test in which daemon code blocks the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import aiohttp
import pytest
from blockbuster import BlockingError

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, serve_app
from vacancyd.config import parse_config
from vacancyd.runtime import durable
from vacancyd.runtime.daemon import Daemon


def config(target: str, state_dir: Path) -> str:
    return daemon_toml(
        upstream("a", target),
        upstream("b", target),
        collectors={"poll_s": 0.2},
        state_dir=state_dir,
    )


async def started(target: str, state_dir: Path) -> Daemon:
    daemon = Daemon(parse_config(config(target, state_dir), "<test>"))
    await daemon.start()
    await RunningDaemon(daemon).wait_ready()
    return daemon


async def test_every_listener_and_loop_is_a_named_essential_task(tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        daemon = await started(target, tmp_path)
        try:
            running = daemon.supervisor.running()
            bound = daemon.bound
            assert running[f"api@{bound['api']}"] is True
            assert running[f"listener a@{bound['a']}"] is True
            assert running[f"listener b@{bound['b']}"] is True
            assert running["collector ram"] is True
            assert running["collector presence"] is True
        finally:
            await daemon.shutdown()


def _from_vacancyd(task: asyncio.Task[object]) -> bool:
    """True when ``task`` runs a coroutine defined in the vacancyd package."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and f"{os.sep}vacancyd{os.sep}" in code.co_filename


async def test_every_task_the_daemon_runs_is_supervised_named_and_flagged(tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        before = asyncio.all_tasks()
        daemon = await started(target, tmp_path)
        try:
            supervised = daemon.supervisor.tasks()
            ours = [t for t in asyncio.all_tasks() - before if _from_vacancyd(t)]
            assert ours, "the daemon runs no task of its own"
            outside = sorted(t.get_name() for t in ours if t not in supervised)
            assert not outside, f"daemon tasks outside the supervisor: {outside}"
            for task, essential in supervised.items():
                assert not re.fullmatch(r"Task-\d+", task.get_name()), task
                assert isinstance(essential, bool)
            flags = {t.get_name(): e for t, e in supervised.items()}
            bound = daemon.bound
            for name in (f"api@{bound['api']}", f"listener a@{bound['a']}", "collector ram"):
                assert flags[name] is True
            assert flags["owner controls"] is True
            for name in ("state saver", "target listeners", "lendability watcher"):
                assert flags[name] is False
        finally:
            await daemon.shutdown()


@pytest.mark.parametrize("which", ["b", "api"])
async def test_a_listener_that_dies_stops_the_daemon_nonzero(which: str, tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        daemon = await started(target, tmp_path)
        try:
            waiting = asyncio.get_running_loop().create_task(daemon.wait())
            await asyncio.sleep(0.05)
            assert not waiting.done()
            (site,) = daemon._runners[which].sites
            await site.stop()  # the listening socket goes away under a running daemon
            assert await asyncio.wait_for(waiting, 5) == 1
            failure = daemon.supervisor.failure or ""
            assert "stopped accepting connections" in failure
            assert daemon.bound[which] in failure
        finally:
            await daemon.shutdown()


async def test_a_clean_shutdown_is_not_a_listener_failure(tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        daemon = await started(target, tmp_path)
        url = f"http://{daemon.bound['a']}/v1/models"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
        daemon.request_stop()
        assert await daemon.wait() == 0
        await daemon.shutdown()
        assert daemon.supervisor.failure is None


async def test_blocking_the_loop_from_daemon_code_fails_the_test(tmp_path: Path) -> None:
    """The component suite's blockbuster fixture is active: the durable-state writer, which
    the daemon only ever runs in a worker thread, raises when called on the loop itself."""
    with pytest.raises(BlockingError):
        durable.write_state(tmp_path / "on-loop.json", {"version": 1})
    assert not (tmp_path / "on-loop.json").exists()
    await asyncio.to_thread(durable.write_state, tmp_path / "off-loop.json", {"version": 1})
    assert json.loads((tmp_path / "off-loop.json").read_text()) == {"version": 1}
