"""Probe loops: deadlines, failures as unknown quality, a stuck
probe not stalling its neighbours, on-demand samples, NVML absent, and task supervision."""

from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon
from vacancyd.collectors import system
from vacancyd.collectors.base import ProbeError, run_probe_loop
from vacancyd.core.observations import CapacityReading, ProbeFailure, Quality, SampleKey
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
            wake=state.samples.wanted(SampleKey.capacity("fast")),
        ),
        name="collector fast",
        essential=True,
    )
    try:
        await asyncio.sleep(0.1)
        first = state.capacity["fast"].observed_at
        assert first is not None
        asked = state.clock()
        assert await state.samples.fresh(SampleKey.capacity("fast"), 2.0)
        second = state.capacity["fast"].observed_at
        assert second is not None and second >= asked > first
        assert not await state.samples.fresh(SampleKey.capacity("nobody-samples-this"), 0.1)
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
    toml = daemon_toml()

    async def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("presence loop crashed")

    async with running_daemon(toml) as d:
        d.daemon.supervisor.spawn(boom(), name="collector doomed", essential=True)
        assert await asyncio.wait_for(d.daemon.wait(), 2) == 1
        assert "collector doomed" in (d.daemon.supervisor.failure or "")


async def test_every_failed_sample_is_counted_by_kind() -> None:
    """``count`` hears each failure's kind: a ProbeError is ``failed``, anything else
    ``unexpected``, a probe past its deadline ``timeout`` and then, while it still runs,
    ``stuck``."""
    calls = 0
    release = threading.Event()

    def probe() -> CapacityReading:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ProbeError("sensor unplugged")
        if calls == 2:
            raise KeyError("a bug")
        if calls == 3:
            release.wait(10)  # past the deadline, and past the next round too
        return CapacityReading(10, 20)

    kinds: list[ProbeFailure] = []
    task = asyncio.get_running_loop().create_task(
        run_probe_loop(
            "flaky",
            probe,
            interval_s=0.02,
            timeout_s=0.1,
            on_sample=lambda r, t: None,
            on_error=lambda e, t: None,
            count=kinds.append,
        )
    )
    try:
        async with asyncio.timeout(5):
            while ProbeFailure.STUCK not in kinds:  # noqa: ASYNC110 - the loop's own task
                await asyncio.sleep(0.02)
    finally:
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert kinds[:4] == [
        ProbeFailure.FAILED,
        ProbeFailure.UNEXPECTED,
        ProbeFailure.TIMEOUT,
        ProbeFailure.STUCK,
    ]


async def test_the_daemon_exports_collector_errors_by_collector_and_kind() -> None:
    """``vacancyd_collector_errors_total{collector,error}`` on /metrics: every collector's
    series from the start (at 0), and the failures of an upstream whose server does not
    answer its observation (llama-server's /slots) counted as ``failed``."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"http://127.0.0.1:{s.getsockname()[1]}"
    toml = daemon_toml(upstream("chat", target, adapter="llamacpp"))

    async def scrape(d: RunningDaemon) -> dict[tuple[str, str], float]:
        async with aiohttp.ClientSession() as http:
            async with http.get(d.api_url + "/metrics") as resp:
                text = await resp.text()
        return {
            (s.labels["collector"], s.labels["error"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "vacancyd_collector_errors"
            for s in family.samples
            if s.name == "vacancyd_collector_errors_total"
        }

    async with running_daemon(toml) as d:
        await d.wait_until(
            lambda: d.daemon.metrics.collector_errors.value("server:chat", "failed") >= 1,
            what="a failed observation counted",
        )
        error = d.state.servers["chat"].error
        assert error is not None and "/slots" in error  # what /status shows beside the count
        counts = await scrape(d)
    kinds = {k.value for k in ProbeFailure}
    for collector in ("capacity:ram", "presence", "server:chat"):
        assert {e for c, e in counts if c == collector} == kinds, counts
    assert counts[("server:chat", "failed")] >= 1
    assert counts[("capacity:ram", "failed")] == 0
