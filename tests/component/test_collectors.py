"""Probe loops: deadlines, failures as unknown quality, a stuck
probe not stalling its neighbours, on-demand samples, NVML absent, and task supervision."""

from __future__ import annotations

import asyncio
import threading

from vacancyd.collectors import system
from vacancyd.collectors.base import ProbeError, run_probe_loop
from vacancyd.core.observations import CapacityReading, Quality
from vacancyd.core.policy import ResourceKind, ResourcePolicy
from vacancyd.runtime.tasks import Supervisor
from vacancyd.state import SharedState


def make_state() -> SharedState:
    policies = {
        n: ResourcePolicy(n, ResourceKind.MEMORY, stale_after_s=5) for n in ("slow", "fast")
    }
    return SharedState(policies, {}, presence_source="test")


async def test_stuck_probe_is_unknown_and_does_not_stall_others() -> None:
    state = make_state()
    release = threading.Event()

    def stuck() -> CapacityReading:
        release.wait(10)
        return CapacityReading(1, 2)

    sup = Supervisor()
    sup.spawn(
        run_probe_loop(
            "slow",
            stuck,
            interval_s=0.05,
            timeout_s=0.1,
            on_sample=lambda r, t: state.record_capacity("slow", r, t),
            on_error=lambda e, t: state.record_capacity_failure("slow", e, t),
        ),
        name="collector slow",
        essential=True,
    )
    sup.spawn(
        run_probe_loop(
            "fast",
            system.sample_memory,
            interval_s=0.05,
            timeout_s=1,
            on_sample=lambda r, t: state.record_capacity("fast", r, t),
            on_error=lambda e, t: state.record_capacity_failure("fast", e, t),
        ),
        name="collector fast",
        essential=True,
    )
    try:
        await asyncio.sleep(0.5)
        now = state.clock()
        slow, fast = state.capacity["slow"], state.capacity["fast"]
        assert slow.quality(now, 5) is Quality.UNKNOWN
        assert slow.error is not None and "deadline" in slow.error
        assert fast.quality(now, 5) is Quality.READY
        assert fast.value is not None and fast.value.free_mib is not None
        assert fast.value.total_mib is not None and fast.value.free_mib <= fast.value.total_mib
        release.set()
        await asyncio.sleep(0.3)
        assert state.capacity["slow"].quality(state.clock(), 5) is Quality.READY
        assert not sup.failed.is_set()
    finally:
        release.set()
        await sup.stop()


async def test_probe_errors_are_recorded_and_sampling_goes_on() -> None:
    state = make_state()
    calls = 0

    def flaky() -> CapacityReading:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise ProbeError("sensor unplugged")
        return CapacityReading(10, 20)

    errors: list[str] = []
    task = asyncio.get_running_loop().create_task(
        run_probe_loop(
            "flaky",
            flaky,
            interval_s=0.02,
            timeout_s=1,
            on_sample=lambda r, t: state.record_capacity("slow", r, t),
            on_error=lambda e, t: errors.append(e),
        )
    )
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert calls >= 4 and "sensor unplugged" in errors
    assert state.capacity["slow"].value == CapacityReading(10, 20)


async def test_fresh_sample_on_demand() -> None:
    state = make_state()
    sup = Supervisor()
    sup.spawn(
        run_probe_loop(
            "fast",
            system.sample_memory,
            interval_s=60,
            timeout_s=1,
            on_sample=lambda r, t: state.record_capacity("fast", r, t),
            on_error=lambda e, t: state.record_capacity_failure("fast", e, t),
            wake=state.sample_wanted("fast"),
        ),
        name="collector fast",
        essential=True,
    )
    try:
        await asyncio.sleep(0.1)
        first = state.capacity["fast"].observed_at
        assert first is not None
        asked = state.clock()
        assert await state.fresh_sample("fast", 2.0)
        second = state.capacity["fast"].observed_at
        assert second is not None and second >= asked > first
        assert not await state.fresh_sample("nobody-samples-this", 0.1)
    finally:
        await sup.stop()


async def test_essential_task_exit_is_a_failure() -> None:
    sup = Supervisor()

    async def dies() -> None:
        raise RuntimeError("collector bug")

    async def lives() -> None:
        await asyncio.sleep(30)

    sup.spawn(lives(), name="collector fine", essential=True)
    sup.spawn(dies(), name="collector broken", essential=True)
    await asyncio.wait_for(sup.failed.wait(), 2)
    assert sup.failure is not None and "collector broken" in sup.failure
    await sup.stop()


async def test_daemon_exits_nonzero_when_an_essential_task_dies() -> None:
    from tests.support.config import daemon_toml
    from tests.support.daemon import running_daemon

    toml = daemon_toml()

    async def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("presence loop crashed")

    async with running_daemon(toml) as d:
        d.daemon.supervisor.spawn(boom(), name="collector doomed", essential=True)
        assert await asyncio.wait_for(d.daemon.wait(), 2) == 1
        assert "collector doomed" in (d.daemon.supervisor.failure or "")
