"""Rules that used to live inside SharedState, now pure: readiness, the learning pause and
unseen GPU work; and the typed state events' stream payloads."""

from __future__ import annotations

from vacancyd.core.events import (
    CapacityChanged,
    EdgeRaised,
    PressureEdgeRaised,
    PressureReleased,
    UnseenGpuWorkChanged,
    VetoChanged,
)
from vacancyd.core.observations import CapacityReading, Observation, Quality
from vacancyd.core.policy import ResourceKind, ResourcePolicy
from vacancyd.core.pressure import EdgeCause, UnseenChange, UnseenGpuWork
from vacancyd.core.readiness import not_ready
from vacancyd.core.reclaim import Trigger
from vacancyd.core.snapshot import PresenceView, PressureView, ResourceView, Snapshot


def presence(observed_at: float | None, *, refuses: bool = True) -> PresenceView:
    return PresenceView(
        source="headless",
        sampled=observed_at is not None,
        observed_at=observed_at,
        evidence_complete=True,
        veto_active=False,
        max_age_s=15.0,
        refuses=refuses,
    )


def resource(
    name: str, observed_at: float | None, *, on: bool = True, pressure: Quality | None = None
) -> ResourceView:
    obs: Observation[CapacityReading] = Observation()
    if observed_at is not None:
        obs = obs.succeeded(CapacityReading(free_mib=100.0, total_mib=200.0), observed_at)
    return ResourceView(
        policy=ResourcePolicy(name=name, kind=ResourceKind.MEMORY, stale_after_s=5.0),
        switch_on=on,
        capacity=obs,
        pressure=None if pressure is None else PressureView(pressure, True, False),
    )


def snap(now: float, pres: PresenceView, *res: ResourceView, stopping: bool = False) -> Snapshot:
    return Snapshot(
        now=now,
        lending_enabled=True,
        presence=pres,
        resources={r.name: r for r in res},
        stopping=stopping,
    )


def test_ready_needs_bound_listeners_fresh_presence_and_fresh_required_resources() -> None:
    good = snap(10.0, presence(9.0), resource("ram", 9.5), resource("spare", None))
    assert not_ready(good, listeners={"llm": True}, required={"ram"}) == []
    assert not_ready(good, listeners={"llm": False}, required={"ram"}) == ["listener llm not bound"]
    # a resource nobody depends on, or one switched off, never holds readiness back
    assert not_ready(good, listeners={}, required={"spare"}) == ["resource spare unknown"]
    off = snap(10.0, presence(9.0), resource("spare", None, on=False))
    assert not_ready(off, listeners={}, required={"spare"}) == []


def test_not_ready_reasons_in_order() -> None:
    s = snap(
        100.0,
        presence(50.0),
        resource("ram", 10.0),
        resource("gpu0", 99.0, pressure=Quality.UNKNOWN),
        stopping=True,
    )
    assert not_ready(s, listeners={"b": False, "a": True}, required={"ram", "gpu0"}) == [
        "stopping",
        "listener b not bound",
        "presence stale",
        "resource gpu0 pressure unknown",
        "resource ram stale",
    ]
    never = snap(1.0, presence(None), resource("ram", 1.0))
    assert not_ready(never, listeners={}, required={"ram"}) == ["presence not sampled"]
    # a platform without a presence backend does not hold readiness
    assert not_ready(snap(1.0, presence(None, refuses=False)), listeners={}, required=()) == []


def test_learning_pauses_only_while_refusing_presence_is_stale() -> None:
    assert presence(90.0).allows_learning(100.0)
    assert not presence(80.0).allows_learning(100.0)
    assert presence(None).allows_learning(100.0)  # never sampled: nothing to pause on yet
    assert presence(10.0, refuses=False).allows_learning(100.0)


def test_unseen_gpu_work_flags_after_three_busy_samples_and_clears_when_seen() -> None:
    unseen = UnseenGpuWork()
    gpu_of: dict[str, str | None] = {"llm": "gpu0", "cpu-only": None}
    seen = {"llm": False, "cpu-only": False}
    assert unseen.observe("gpu0", seen, {"llm"}, gpu_of) == []
    assert unseen.observe("gpu0", seen, {"llm"}, gpu_of) == []
    (change,) = unseen.observe("gpu0", seen, {"llm"}, gpu_of)
    assert change.upstream == "llm" and change.active and "3 samples" in (change.detail or "")
    assert "llm" in unseen.flagged
    assert unseen.observe("gpu0", seen, {"llm"}, gpu_of) == []  # reported once
    assert unseen.observe("gpu0", {"llm": True}, {"llm"}, gpu_of) == [UnseenChange("llm", False)]
    assert unseen.flagged == {}


def test_idle_samples_reset_the_unseen_count() -> None:
    unseen = UnseenGpuWork()
    gpu_of: dict[str, str | None] = {"llm": "gpu0"}
    for busy in ({"llm"}, {"llm"}, set(), {"llm"}, {"llm"}):
        assert unseen.observe("gpu0", {"llm": False}, busy, gpu_of) == []
    # another GPU's samples never count for this upstream
    for _ in range(5):
        assert unseen.observe("gpu1", {"llm": False}, {"llm"}, gpu_of) == []


def test_event_payloads_are_the_stream_shapes() -> None:
    assert CapacityChanged("ram", Quality.READY).payload() == {
        "resource": "ram",
        "quality": "ready",
    }
    assert CapacityChanged("ram", Quality.UNKNOWN, "boom").payload()["error"] == "boom"
    assert PressureReleased("gpu0").payload() == {
        "resource": "gpu0",
        "edge": False,
        "engaged": False,
    }
    edge = PressureEdgeRaised("gpu0", True, EdgeCause.ENGAGED, 3.0, 0.0, 0.7, 0.5).payload()
    assert edge["cause"] == "engaged" and edge["edge"] is True and edge["threshold"] == 0.5
    assert UnseenGpuWorkChanged("llm", False).payload() == {"upstream": "llm", "active": False}
    assert VetoChanged(True, "owner", 1.0).kind == "veto"
    assert EdgeRaised(Trigger.ADMIN, 2.0).payload() == {
        "trigger": "admin",
        "at": 2.0,
        "resource": None,
        "detail": "",
    }
