"""``lend_power_limit_w`` end to end in a real daemon over the fake NVML (issue 23, item 6):
the limit applied when borrowed work starts and restored when it ends, when the owner comes
back, at the stop and, after a crash, at the next start from ``power-limits.json``; the
driver's refusals (not root, out of range, not supported) shown in /status and the log,
never fatal, and lending goes on."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.gpu import Gpu, Scenario
from tests.support.slow_openai import SlowOpenAI
from vacancyd.runtime import powerlimit
from vacancyd.runtime.powerlimit import POWER_LIMITS_FILE

DEFAULT_MW, MIN_MW, MAX_MW = 300_000, 100_000, 350_000


def card(nvml: Scenario, power: tuple[int, int, int] | None = (DEFAULT_MW, MIN_MW, MAX_MW)) -> None:
    nvml.gpus = [Gpu(temp_c=50, power_mw=power)]
    nvml.euid = 0  # as root, unless a test says otherwise
    nvml.write()


def config(state_dir: Path, target: str, lend_w: float = 150, **up: Any) -> str:
    return daemon_toml(
        upstream("llm", target, resource="gpu0", **up),
        resources=(gpu("gpu0", 0, pressure={"enabled": False}, lend_power_limit_w=lend_w),),
        collectors={"poll_s": 0.1},
        state_dir=state_dir,
    )


async def status(d: RunningDaemon) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(d.api_url + "/status") as r:
        body: dict[str, Any] = await r.json()
        power: dict[str, Any] = body["resources"]["gpu0"]["power_limit"]
        return power


async def chat(d: RunningDaemon) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            d.proxy_url("llm") + "/v1/chat/completions", json={"model": "m", "messages": []}
        ) as r,
    ):
        await r.read()
        return r.status


def saved(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / POWER_LIMITS_FILE
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


async def test_applied_while_borrowed_work_runs_and_restored_when_it_ends(
    nvml: Scenario, tmp_path: Path
) -> None:
    card(nvml)
    state_dir = tmp_path / "state"
    slow = SlowOpenAI(chunks=20, interval_s=0.05)
    async with (
        serve_app(slow.app()) as target,
        running_daemon(config(state_dir, target)) as d,
    ):
        await d.wait_ready()
        assert nvml.power_limit_mw() is None  # nothing changed before any job
        assert await status(d) == {
            "lend_w": 150.0,
            "original_w": None,
            "applied": False,
            "problem": None,
            "error": None,
        }
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                d.proxy_url("llm") + "/v1/chat/completions",
                json={"model": "m", "stream": True, "messages": []},
            )
            await slow.started.wait()
            await d.wait_until(lambda: nvml.power_limit_mw() == 150_000, what="lend limit")
            record = saved(state_dir)
            assert record is not None and record["version"] == 1
            assert record["gpus"]["gpu0"]["original_mw"] == DEFAULT_MW
            assert record["gpus"]["gpu0"]["uuid"] == Gpu().uuid
            power = await status(d)
            assert power["applied"] is True and power["original_w"] == 300.0
            await resp.read()
            resp.release()
        await d.wait_until(lambda: nvml.power_limit_mw() == DEFAULT_MW, what="restored")
        await d.wait_until(lambda: saved(state_dir) is None, what="file removed")
        assert (await status(d))["applied"] is False


async def test_the_owner_coming_back_restores_it_while_work_still_runs(
    nvml: Scenario, tmp_path: Path
) -> None:
    card(nvml)
    slow = SlowOpenAI(chunks=400, interval_s=0.05)
    async with (
        serve_app(slow.app()) as target,
        running_daemon(config(tmp_path / "state", target, on_owner_return="finish")) as d,
        aiohttp.ClientSession() as s,
    ):
        await d.wait_ready()
        resp = await s.post(
            d.proxy_url("llm") + "/v1/chat/completions",
            json={"model": "m", "stream": True, "messages": []},
        )
        await slow.started.wait()
        await d.wait_until(lambda: nvml.power_limit_mw() == 150_000, what="lend limit")
        async with s.post(d.api_url + "/admin/pause", json={"for": "30m"}) as r:
            assert r.status == 200
        await d.wait_until(lambda: nvml.power_limit_mw() == DEFAULT_MW, what="restored")
        assert not slow.ended  # the borrowed stream goes on (finish), at the card's own limit
        resp.close()


async def test_restored_at_the_stop(nvml: Scenario, tmp_path: Path) -> None:
    card(nvml)
    state_dir = tmp_path / "state"
    slow = SlowOpenAI(chunks=400, interval_s=0.05)
    async with serve_app(slow.app()) as target, aiohttp.ClientSession() as s:
        async with running_daemon(config(state_dir, target, on_owner_return="finish")) as d:
            await d.wait_ready()
            resp = await s.post(
                d.proxy_url("llm") + "/v1/chat/completions",
                json={"model": "m", "stream": True, "messages": []},
            )
            await slow.started.wait()
            await d.wait_until(lambda: nvml.power_limit_mw() == 150_000, what="lend limit")
        # the daemon stopped while the stream ran
        assert nvml.power_limit_mw() == DEFAULT_MW
        assert saved(state_dir) is None
        resp.close()


async def test_a_limit_a_crash_left_is_restored_at_the_next_start(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    card(nvml, (250_000, MIN_MW, MAX_MW))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # What a killed run left: the card at the lending limit, its own limit on disk.
    nvml.limits_path.write_text("0 150000\n", encoding="utf-8")
    (state_dir / POWER_LIMITS_FILE).write_text(
        json.dumps(
            {
                "version": 1,
                "gpus": {"gpu0": {"device": "0", "uuid": Gpu().uuid, "original_mw": 280_000}},
            }
        ),
        encoding="utf-8",
    )
    app, _ = openai_like_app()
    caplog.set_level(logging.INFO, "vacancyd.runtime.powerlimit")
    async with (
        serve_app(app) as target,
        running_daemon(config(state_dir, target)) as d,
    ):
        await d.wait_until(lambda: nvml.power_limit_mw() == 280_000, what="restored")
        await d.wait_until(lambda: saved(state_dir) is None, what="file removed")
        assert "stopped without restoring its power limit" in caplog.text
        await d.wait_ready()
        assert await chat(d) == 200  # and lending goes on, applying the limit again
        await d.wait_until(lambda: saved(state_dir) is None, what="released again")
        assert nvml.power_limit_mw() == 280_000


async def test_a_leftover_for_a_card_no_longer_limited_is_restored_too(
    nvml: Scenario, tmp_path: Path
) -> None:
    card(nvml)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    nvml.limits_path.write_text("0 120000\n", encoding="utf-8")
    (state_dir / POWER_LIMITS_FILE).write_text(
        json.dumps(
            {
                "version": 1,
                "gpus": {"old": {"device": "0", "uuid": Gpu().uuid, "original_mw": DEFAULT_MW}},
            }
        ),
        encoding="utf-8",
    )
    app, _ = openai_like_app()
    toml = daemon_toml(
        upstream("llm", "http://127.0.0.1:1", resource="gpu0"),
        resources=(gpu("gpu0", 0, pressure={"enabled": False}),),
        state_dir=state_dir,
    )
    async with serve_app(app), running_daemon(toml) as d:
        await d.wait_until(lambda: nvml.power_limit_mw() == DEFAULT_MW, what="restored")
        await d.wait_until(lambda: saved(state_dir) is None, what="file removed")
        assert "old" not in d.state.power_limits


@pytest.mark.parametrize(
    ("euid", "power", "lend_w", "problem"),
    [
        (1000, (DEFAULT_MW, MIN_MW, MAX_MW), 150, "no_permission"),
        (0, (DEFAULT_MW, MIN_MW, MAX_MW), 50, "out_of_range"),
        (0, None, 150, "not_supported"),
    ],
)
async def test_a_refused_limit_is_reported_and_lending_goes_on(
    nvml: Scenario,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    euid: int,
    power: tuple[int, int, int] | None,
    lend_w: float,
    problem: str,
) -> None:
    card(nvml, power)
    nvml.euid = euid
    nvml.write()
    state_dir = tmp_path / "state"
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(config(state_dir, target, lend_w=lend_w)) as d,
    ):
        await d.wait_ready()
        assert await chat(d) == 200
        await d.wait_until(lambda: d.state.power_limits["gpu0"].problem is not None)
        power_status = await status(d)
        assert power_status["problem"] == problem and power_status["applied"] is False
        assert power_status["error"]
        assert "lending goes on without it" in caplog.text
        assert nvml.power_limit_mw() is None  # the card was never changed
        assert saved(state_dir) is None
        assert await chat(d) == 200  # the next job tries again, and is lent again


async def test_a_restore_the_driver_refuses_is_kept_reported_and_retried(
    nvml: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(powerlimit, "RETRY_S", 0.2)
    card(nvml)
    nvml.euid = 1000  # vacancyd restarted without root
    nvml.write()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    nvml.limits_path.write_text("0 150000\n", encoding="utf-8")
    leftover = {
        "version": 1,
        "gpus": {"gpu0": {"device": "0", "uuid": Gpu().uuid, "original_mw": DEFAULT_MW}},
    }
    (state_dir / POWER_LIMITS_FILE).write_text(json.dumps(leftover), encoding="utf-8")
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(config(state_dir, target)) as d,
    ):
        await d.wait_until(lambda: d.state.power_limits["gpu0"].problem is not None)
        power = await status(d)
        assert power["problem"] == "no_permission" and power["applied"] is True
        assert power["original_w"] == 300.0
        assert saved(state_dir) == leftover  # kept for a later try, or the next start
        await d.wait_ready()
        assert await chat(d) == 200  # lending goes on
        nvml.euid = 0
        nvml.write()
        await d.wait_until(lambda: nvml.power_limit_mw() == DEFAULT_MW, what="restored")
        await d.wait_until(lambda: saved(state_dir) is None, what="file removed")
        assert (await status(d))["problem"] is None
