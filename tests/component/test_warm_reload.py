"""Warm reload after every kind of hold (docs/reclaim.md, ``warm_model``).

A reclaim with ``yield_on_veto`` unloads the Ollama look-alike's models whatever stopped
lending: the owner's return, one of the owner's holds (schedule, pause, battery, exclusive
app) or GPU pressure. When lending resumes, the ``warm_model`` is loaded again, by the same
rule as after the owner's return, at most once per ``WARM_MIN_INTERVAL_S`` per upstream.
The owner's holds are driven through the owner controls' own evaluation, with the rules
that compute them (clock, battery probe, process scan) replaced by the hold under test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import vacancyd.control.reclaim as control
from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_ollama import FakeOllama, Runner
from tests.support.gpu import Scenario
from tests.support.lender import lender, reclaim_view
from vacancyd.core.holds import Hold, HoldKind

WARM = 'yield_on_veto = true\nwarm_model = "tiny"'
OWNER_PID = 4_000_000

HOLDS = [
    Hold(HoldKind.SCHEDULE, "outside the owner's lending schedule"),
    Hold(HoldKind.PAUSE, "paused by the owner"),
    Hold(HoldKind.BATTERY, "running on battery (40% charged)"),
    Hold(HoldKind.EXCLUSIVE_APP, "exclusive application running: game"),
]


def drive_holds(d: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> list[Hold]:
    """The owner controls' holds become whatever the returned list holds (evaluate() after
    changing it, as the owner-controls loop does)."""
    holding: list[Hold] = []
    monkeypatch.setattr(d.daemon.owner, "holds", lambda _wall, _mono: tuple(holding))
    return holding


async def hold_then_release(
    d: RunningDaemon, fake: FakeOllama, holding: list[Hold], hold: Hold
) -> None:
    """Engage ``hold`` until the reclaim has unloaded the model, then release it."""
    fake.loaded["tiny:latest"] = Runner()
    holding.append(hold)
    d.daemon.owner.evaluate()
    await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
    assert fake.loaded == {}, "the reclaim unloads the model"
    holding.clear()
    d.daemon.owner.evaluate()


@pytest.mark.parametrize("hold", HOLDS, ids=[h.kind.value for h in HOLDS])
async def test_a_model_unloaded_for_an_owner_hold_is_warmed_when_the_hold_ends(
    hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOllama(tokens=1)
    async with lender(fake.app(), adapter="ollama", policy="cancel", extra=WARM) as (d, _):
        holding = drive_holds(d, monkeypatch)
        fake.loaded["tiny:latest"] = Runner()
        holding.append(hold)
        d.daemon.owner.evaluate()
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
        assert reclaim_view(d)["trigger"] == "hold"
        assert fake.loaded == {}
        await asyncio.sleep(0.3)  # samples and events go on: no reload while the hold lasts
        assert fake.loads == []
        holding.clear()
        d.daemon.owner.evaluate()
        await d.wait_until(lambda: "tiny:latest" in fake.loaded, 5)
        assert [name for name, _ in fake.loads] == ["tiny:latest"]


async def test_a_model_unloaded_for_gpu_pressure_is_warmed_when_the_pressure_releases(
    nvml: Scenario, tmp_path: Path
) -> None:
    fake = FakeOllama(tokens=1)
    async with serve_app(fake.app()) as target:
        toml = daemon_toml(
            upstream(
                "up",
                target,
                adapter="ollama",
                resource="gpu0",
                on_owner_return="cancel",
                yield_on_veto=True,
                warm_model="tiny",
            ),
            resources=(
                gpu(
                    "gpu0",
                    0,
                    pressure={
                        "poll_ms": 100,
                        "fixed_threshold": 0.2,
                        "engage_after_s": 0,
                        "release_after_s": 1,
                    },
                ),
            ),
            collectors={"poll_s": 0.2},
            state_dir=tmp_path / "state",
        )
        async with running_daemon(toml) as d:
            await d.wait_ready()
            fake.loaded["tiny:latest"] = Runner()
            nvml.procs = [(0, "graphics", OWNER_PID, 3000)]
            nvml.sample(OWNER_PID, 70)
            nvml.write()
            ps = d.state.pressure["gpu0"]
            await d.wait_until(lambda: ps.tracker.engaged, what="engaged")
            await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
            assert reclaim_view(d)["trigger"] == "pressure"
            assert fake.loaded == {}
            assert fake.loads == []  # not while the pressure lasts
            # no new samples: the owner's load is gone and the guard releases
            await d.wait_until(lambda: not ps.tracker.engaged, what="released")
            await d.wait_until(lambda: "tiny:latest" in fake.loaded, 5)


async def test_warm_reloads_are_rate_limited_per_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control, "WARM_MIN_INTERVAL_S", 3.0)
    pause = HOLDS[1]
    fake = FakeOllama(tokens=1)
    async with lender(fake.app(), adapter="ollama", policy="cancel", extra=WARM) as (d, _):
        holding = drive_holds(d, monkeypatch)
        await hold_then_release(d, fake, holding, pause)
        await d.wait_until(lambda: len(fake.loads) == 1, 5)  # the first comes at once
        await hold_then_release(d, fake, holding, pause)
        await asyncio.sleep(0.3)
        assert len(fake.loads) == 1, "a second reload within the interval waits"
        await d.wait_until(lambda: len(fake.loads) == 2, 10)  # ... and then comes
