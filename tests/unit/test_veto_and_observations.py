"""Veto hysteresis, observation quality, probe policy and refusal rendering."""

from __future__ import annotations

import pytest

from vacancyd.core.observations import CapacityReading, Observation, Quality
from vacancyd.core.policy import ResourceKind, ResourcePolicy
from vacancyd.core.reasons import Reason, Refuse
from vacancyd.core.refusal import render_refusal
from vacancyd.core.veto import VetoTracker


def test_veto_engages_on_one_sample_and_releases_after_consecutive_clear_time() -> None:
    veto = VetoTracker(release_after_s=10)
    assert not veto.observe(False, 0)
    assert veto.observe(True, 1) and veto.engaged
    assert not veto.observe(False, 5)
    assert veto.release_in_s(5) == pytest.approx(6)
    assert not veto.observe(True, 8)  # a match restarts the clear run
    assert not veto.observe(False, 17) and veto.engaged
    assert veto.observe(False, 18) and not veto.engaged
    assert veto.release_in_s(18) is None


def test_observation_quality() -> None:
    empty: Observation[int] = Observation()
    assert empty.quality(0, 5) is Quality.UNKNOWN and empty.age_s(0) is None
    ok = empty.succeeded(1, now=10)
    assert ok.quality(14, 5) is Quality.READY
    assert ok.quality(15.5, 5) is Quality.STALE
    failed = ok.failed("boom", now=11)
    assert failed.quality(12, 5) is Quality.UNKNOWN and failed.value == 1
    recovered = failed.succeeded(2, now=12)
    assert recovered.quality(12, 5) is Quality.READY and recovered.error == "boom"


def test_probe_policy() -> None:
    gpu = ResourcePolicy("gpu0", ResourceKind.GPU, min_free_mib=1000, max_utilization=0.5)
    assert gpu.evaluate(CapacityReading(2000, 8000, 0.1)) is None
    assert "1000 MiB" in (gpu.evaluate(CapacityReading(500, 8000, 0.1)) or "")
    assert "utilization" in (gpu.evaluate(CapacityReading(2000, 8000, 0.9)) or "")
    assert "not reported" in (gpu.evaluate(CapacityReading(2000, 8000, None)) or "")
    cpu = ResourcePolicy("cpu", ResourceKind.CPU, max_utilization=0.8)
    assert not cpu.has_bytes
    assert cpu.evaluate(CapacityReading(None, None, 0.5)) is None


def test_refusal_envelope() -> None:
    status, headers, body = render_refusal(
        Refuse.of(Reason.LENDING_DISABLED, "lending is off"), "llama"
    )
    assert status == 503
    assert headers["Retry-After"] == "300"
    assert headers["x-should-retry"] == "false"
    err = body["error"]
    assert err["type"] == "no_vacancy" and err["code"] == "lending_disabled"
    assert err["param"] is None and err["source"] == "vacancyd"
    assert "lending is off" in err["message"]
    status, headers, _ = render_refusal(Refuse.of(Reason.RESOURCE_BUSY, "busy"), "x", status=429)
    assert status == 429 and headers["Retry-After"] == "2" and "x-should-retry" not in headers
