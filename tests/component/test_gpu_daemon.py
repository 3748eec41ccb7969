"""GPU pressure end to end in a real daemon over the fake NVML, and the state rules behind it.

Gate step 5 (pressure engaged → resource_pressured; unknown/uncalibrated → resource_unmeasured),
the ``pressure`` state event, metrics, /status and ``vacancyd status``, and the
calibration cache surviving a restart.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.gpu import Scenario
from vacancyd.cli import format_status
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.pressure import Attribution, LearnerSettings, PressurePolicy
from vacancyd.core.snapshot import pressure_view
from vacancyd.core.status import StatusDocument
from vacancyd.state import PressureSample, SharedState

OWNER_PID = 4_000_000


def config(
    state_dir: Path, target: str, on_owner_return: str | None = None, **pressure: Any
) -> str:
    """One upstream ``llm`` on the fake NVML's card 0, its pressure polled every 100 ms."""
    return daemon_toml(
        upstream("llm", target, resource="gpu0", on_owner_return=on_owner_return),
        resources=(gpu("gpu0", 0, pressure={"poll_ms": 100, **pressure}),),
        collectors={"poll_s": 0.2},
        state_dir=state_dir,
    )


async def chat(d: RunningDaemon) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            d.proxy_url("llm") + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        ) as r,
    ):
        return r.status, await r.json()


async def test_owner_gpu_work_refuses_then_releases(nvml: Scenario, tmp_path: Path) -> None:
    app, _ = openai_like_app()
    events: list[tuple[str, dict[str, object]]] = []
    async with (
        serve_app(app) as target,
        running_daemon(
            config(
                tmp_path / "state",
                target,
                fixed_threshold=0.2,
                engage_after_s=0,
                release_after_s=1.5,
            )
        ) as d,
    ):
        d.state.subscribe(lambda e: events.append((e.kind, e.payload())))
        await d.wait_ready()
        status, _ = await chat(d)
        assert status == 200

        nvml.procs = [(0, "graphics", OWNER_PID, 3000)]
        nvml.sample(OWNER_PID, 70)
        nvml.write()
        ps = d.state.pressure["gpu0"]
        await d.wait_until(lambda: ps.tracker.engaged, what="engaged")
        status, body = await chat(d)
        assert status == 503
        assert body["error"]["code"] == "resource_pressured"
        assert "owner load 70%" in body["error"]["message"]
        edges = [e for k, e in events if k == "pressure" and e["edge"]]
        assert edges and edges[0]["cause"] == "engaged" and edges[0]["resource"] == "gpu0"

        async with aiohttp.ClientSession() as s:
            async with s.get(d.api_url + "/metrics") as r:
                metrics = await r.text()
            async with s.get(d.api_url + "/status") as r:
                doc = await r.json()
        assert 'vacancyd_gpu_pressure_engaged{resource="gpu0"} 1.0' in metrics
        assert 'vacancyd_gpu_pressure_threshold_ratio{resource="gpu0"} 0.2' in metrics
        assert 'vacancyd_gpu_pressure_calibrated{resource="gpu0"} 1.0' in metrics
        assert 'vacancyd_gpu_owner_load_ratio{resource="gpu0"} 0.7' in metrics
        assert 'vacancyd_resource_used_bytes{resource="gpu0"}' in metrics
        assert 'vacancyd_gpu_pressure_quality{quality="ready",resource="gpu0"} 1.0' in metrics
        pressure = doc["resources"]["gpu0"]["pressure"]
        assert pressure["engaged"] is True and pressure["owner_load_ratio"] == 0.7
        assert "ENGAGED" in format_status(StatusDocument.from_json(doc))

        # no new samples: the owner's load is gone; release after release_after_s of quiet
        await d.wait_until(lambda: not ps.tracker.engaged, what="released")
        assert ("pressure", {"resource": "gpu0", "edge": False, "engaged": False}) in events
        status, _ = await chat(d)
        assert status == 200


async def test_nvml_error_refuses_at_once(nvml: Scenario, tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(config(tmp_path / "state", target, fixed_threshold=0.2)) as d,
    ):
        await d.wait_ready()
        nvml.errors = {"procutil": 15}
        nvml.write()
        ps = d.state.pressure["gpu0"]
        await d.wait_until(lambda: ps.reading.error is not None and "lost" in ps.reading.error)
        status, body = await chat(d)
        assert status == 503
        assert body["error"]["code"] == "resource_unmeasured"
        assert "GPU is lost" in body["error"]["message"]


async def test_uncalibrated_gpu_is_not_lendable(nvml: Scenario, tmp_path: Path) -> None:
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(config(tmp_path / "state", target, calibration_s=3600)) as d,
    ):
        ps = d.state.pressure["gpu0"]
        await d.wait_until(lambda: ps.reading.value is not None)
        status, body = await chat(d)
        assert status == 503
        assert body["error"]["code"] == "resource_unmeasured"
        assert "uncalibrated" in body["error"]["message"]


async def test_calibration_survives_a_restart(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        toml = config(state_dir, target, calibration_s=0.6)
        async with running_daemon(toml) as d:
            ps = d.state.pressure["gpu0"]
            await d.wait_until(lambda: ps.learner.ready, what="calibrated")
        cache = state_dir / "calibration" / "gpu0.json"
        saved = json.loads(cache.read_text())
        assert saved["gpu"] == nvml.gpus[0].uuid and saved["observed_s"] >= 0.6

        caplog.set_level(logging.INFO, logger="vacancyd.state")
        async with running_daemon(toml) as d:
            ps = d.state.pressure["gpu0"]
            await d.wait_until(lambda: ps.gpu is not None)
            assert ps.learner.observed_s >= saved["observed_s"]
            assert ps.learner.ready
        assert "calibration restored" in caplog.text

        cache.write_text("{not json", encoding="utf-8")
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="vacancyd.runtime.calibration")
        async with running_daemon(toml) as d:
            ps = d.state.pressure["gpu0"]
            await d.wait_until(lambda: ps.gpu is not None)
            assert ps.learner.observed_s < 0.6
        assert "calibration cache ignored" in caplog.text and "not valid JSON" in caplog.text


# -- state rules with an explicit clock ------------------------------------------------------


def make_state(**learner: Any) -> SharedState:
    resource = ResourcePolicy("gpu0", ResourceKind.GPU)
    upstream = UpstreamPolicy("llm", "openai", "gpu0")
    policy = PressurePolicy(
        poll_s=1.0,
        engage_after_s=2.0,
        release_after_s=10.0,
        learner=LearnerSettings(**({"fixed": 0.2} | learner)),
    )
    return SharedState(
        {"gpu0": resource},
        {"llm": upstream},
        presence_source="headless",
        pressure={"gpu0": policy},
        clock=lambda: 0.0,
    )


def sample(owner: float = 0.0, seen: bool = False) -> PressureSample:
    return PressureSample(Attribution(owner, 0.0, {"llm": seen}), "GPU-x")


def test_unknown_refuses_at_once_and_raises_the_edge_after_the_gap() -> None:
    state = make_state()
    events: list[tuple[str, dict[str, object]]] = []
    state.subscribe(lambda e: events.append((e.kind, e.payload())))
    state.record_pressure("gpu0", sample(), 0.0)
    ready = pressure_view(state.pressure["gpu0"], 0.5)
    assert ready is not None and ready.quality.value == "ready"
    state.record_pressure_failure("gpu0", "NVML query failed: GPU is lost", 1.0)
    view = pressure_view(state.pressure["gpu0"], 1.0)
    assert view is not None and view.quality.value == "unknown" and "lost" in view.detail
    for t in range(2, 20):
        state.record_pressure_failure("gpu0", "NVML query failed: GPU is lost", float(t))
    assert not [e for k, e in events if k == "pressure"]
    state.record_pressure_failure("gpu0", "NVML query failed: GPU is lost", 20.0)
    (edge,) = [e for k, e in events if k == "pressure"]
    assert edge["edge"] is True and edge["cause"] == "unknown" and edge["unknown_for_s"] == 19.0


def test_unseen_gpu_work_after_three_samples_and_cleared_when_seen() -> None:
    state = make_state()
    job = state.ledger.reserve("llm", ("gpu0",), 0.0)
    assert not isinstance(job, type(None))
    for t in (1.0, 2.0):
        state.record_pressure("gpu0", sample(), t)
    assert "llm" not in state.unseen_gpu_work
    state.record_pressure("gpu0", sample(), 3.0)
    assert "no process of the upstream's tree" in state.unseen_gpu_work["llm"]
    from vacancyd.api.status import render_status

    doc = render_status(state, 0.0)
    assert doc["upstreams"]["llm"]["unseen_gpu_work"]
    assert "unseen GPU work:" in format_status(StatusDocument.from_json(doc))
    state.record_pressure("gpu0", sample(seen=True), 4.0)
    assert "llm" not in state.unseen_gpu_work


def test_no_unseen_report_without_admitted_work() -> None:
    state = make_state()
    for t in range(1, 6):
        state.record_pressure("gpu0", sample(), float(t))
    assert state.unseen_gpu_work == {}


def test_learning_pauses_while_presence_is_stale() -> None:
    from vacancyd.state import PresenceReading

    state = make_state(fixed=None, calibration_s=10.0)
    learner = state.pressure["gpu0"].learner
    state.record_presence(PresenceReading(owner_signal=False, evidence_complete=True), 0.0)
    for t in range(1, 8):
        state.record_pressure("gpu0", sample(), float(t))
    learned = learner.observed_s
    assert learned == 6.0
    for t in range(20, 40):  # presence last sampled at 0: stale past 15 s
        state.record_pressure("gpu0", sample(0.9), float(t))
    assert learner.observed_s == learned


def test_status_line_while_calibrating() -> None:
    from vacancyd.api.status import render_status

    state = make_state(fixed=None, calibration_s=1800.0)
    for t in range(0, 11, 2):
        state.record_pressure("gpu0", sample(0.03), float(t))
    text = format_status(StatusDocument.from_json(render_status(state, 0.0)))
    assert "GPU pressure: ready clear owner=3% threshold=- calibrating (10/1800 s)" in text


async def test_pressure_edge_reclaims_borrowed_work(nvml: Scenario, tmp_path: Path) -> None:
    """Pressure reclaim across both halves: a GPU pressure edge from the NVML collector starts a
    reclaim,
    and a ``cancel`` upstream's in-flight stream is cut (never a clean end)."""
    from tests.support.slow_openai import SlowOpenAI

    slow = SlowOpenAI(chunks=400, interval_s=0.05)
    async with (
        serve_app(slow.app()) as target,
        running_daemon(
            config(
                tmp_path / "state",
                target,
                on_owner_return="cancel",
                fixed_threshold=0.2,
                engage_after_s=0,
                release_after_s=30,
            )
        ) as d,
    ):
        await d.wait_ready()
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                d.proxy_url("llm") + "/v1/chat/completions",
                json={"model": "tiny", "stream": True, "messages": []},
            )
            assert resp.status == 200
            await slow.started.wait()
            nvml.procs = [(0, "graphics", OWNER_PID, 3000)]
            nvml.sample(OWNER_PID, 80)
            nvml.write()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            resp.release()
        await d.wait_until(lambda: slow.ended == ["disconnected"], what="upstream cut")
        view = d.state.reclaim_views["llm"]
        assert view["trigger"] == "pressure" and view["resource"] == "gpu0"
