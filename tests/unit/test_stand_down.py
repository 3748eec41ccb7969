"""A reclaim's stand-down check (vacancyd.core.reclaim.trigger_cleared): a refused
resource's reading must be fresh, calibrated, not engaged, at or below its threshold (not
building towards engagement), and every other pressure-gated dependency must admit."""

from __future__ import annotations

from vacancyd.core.observations import CapacityReading, Observation, Quality
from vacancyd.core.policy import OwnerScope, ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.pressure import Attribution, LearnerSettings, PressurePolicy
from vacancyd.core.reclaim import (
    Edge,
    OnOwnerReturn,
    Reclaim,
    ReclaimPolicy,
    Trigger,
    open_reclaim,
    trigger_cleared,
)
from vacancyd.core.snapshot import PresenceView, PressureView, ResourceView, Snapshot, pressure_view
from vacancyd.state import PresenceReading, PressureSample, SharedState

DRAIN = ReclaimPolicy(OnOwnerReturn.DRAIN, drain_timeout_s=30)
UP = UpstreamPolicy("u", "ollama", "gpu0", also_requires=("gpu1",), owner_scope=OwnerScope.RESOURCE)
CALM = PressureView(Quality.READY, calibrated=True, engaged=False)
BUILDING = PressureView(Quality.READY, calibrated=True, engaged=False, above_threshold=True)
ENGAGED = PressureView(Quality.READY, calibrated=True, engaged=True)
UNCALIBRATED = PressureView(Quality.READY, calibrated=False, engaged=False)
STALE = PressureView(Quality.STALE, calibrated=True, engaged=False)


def gpu(name: str, pressure: PressureView | None, *, free_mib: float = 8000) -> ResourceView:
    empty: Observation[CapacityReading] = Observation()
    return ResourceView(
        policy=ResourcePolicy(name, ResourceKind.GPU, min_free_mib=1000),
        switch_on=True,
        capacity=empty.succeeded(CapacityReading(free_mib=free_mib, total_mib=8000), 9.0),
        pressure=pressure,
    )


def snap(gpu0: PressureView | None, gpu1: ResourceView, *, sampled: bool = True) -> Snapshot:
    return Snapshot(
        now=10.0,
        lending_enabled=True,
        presence=PresenceView("t", sampled, 9.5 if sampled else None, True, False, 15.0),
        resources={"gpu0": gpu("gpu0", gpu0), "gpu1": gpu1},
    )


def pressure_reclaim(resource: str = "gpu0") -> Reclaim:
    reclaim, _ = open_reclaim(None, Edge(Trigger.PRESSURE, 0.0, resource), "u", DRAIN)
    return reclaim


def test_a_reading_building_towards_engagement_does_not_stand_down() -> None:
    r = pressure_reclaim()
    assert trigger_cleared(r, snap(CALM, gpu("gpu1", CALM)), UP)
    assert not trigger_cleared(r, snap(BUILDING, gpu("gpu1", CALM)), UP)
    for reading in (ENGAGED, UNCALIBRATED, STALE, None):
        assert not trigger_cleared(r, snap(reading, gpu("gpu1", CALM)), UP)


def test_every_other_pressure_gated_dependency_must_admit() -> None:
    r = pressure_reclaim()
    for other in (ENGAGED, UNCALIBRATED, STALE):
        assert not trigger_cleared(r, snap(CALM, gpu("gpu1", other)), UP)
    # a dependency whose capacity no longer admits refuses too, when it is pressure-gated
    assert not trigger_cleared(r, snap(CALM, gpu("gpu1", CALM, free_mib=10)), UP)
    # ...but a dependency without a pressure guard is not part of the check
    assert trigger_cleared(r, snap(CALM, gpu("gpu1", None, free_mib=10)), UP)
    # a building reading on the other dependency does not block: only refused ones must be
    # below their threshold, the others must admit (and the gate still admits it)
    assert trigger_cleared(r, snap(CALM, gpu("gpu1", BUILDING)), UP)


def test_the_owner_checks_apply_to_a_pressure_reclaim_too() -> None:
    r = pressure_reclaim()
    assert not trigger_cleared(r, snap(CALM, gpu("gpu1", CALM), sampled=False), UP)


def test_the_state_marks_a_reading_above_threshold_before_it_engages() -> None:
    state = SharedState(
        {"gpu0": ResourcePolicy("gpu0", ResourceKind.GPU)},
        {"llm": UpstreamPolicy("llm", "openai", "gpu0")},
        presence_source="headless",
        pressure={
            "gpu0": PressurePolicy(
                poll_s=1.0,
                engage_after_s=5.0,
                release_after_s=10.0,
                learner=LearnerSettings(fixed=0.2),
            )
        },
        clock=lambda: 0.0,
    )
    state.record_presence(PresenceReading(False, True, "away"), 0.0)
    state.record_capacity("gpu0", CapacityReading(free_mib=8000, total_mib=8000), 0.0)

    def load(owner: float, at: float) -> PressureView:
        state.record_pressure("gpu0", PressureSample(Attribution(owner, 0.0, {}), "GPU-x"), at)
        view = pressure_view(state.pressure["gpu0"], at)
        assert view is not None
        return view

    assert not load(0.1, 1.0).above_threshold
    rising = load(0.5, 2.0)
    assert rising.above_threshold and not rising.engaged  # the engage timer runs
    up = UpstreamPolicy("llm", "openai", "gpu0")
    reclaim = pressure_reclaim()
    assert not trigger_cleared(reclaim, state.snapshot(2.0), up)
    assert not load(0.1, 3.0).above_threshold
    state.record_capacity("gpu0", CapacityReading(free_mib=8000, total_mib=8000), 3.0)
    assert trigger_cleared(reclaim, state.snapshot(3.0), up)
