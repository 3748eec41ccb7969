"""The pure reclaim planner (vacancyd.core.reclaim; docs/reclaim.md)."""

from __future__ import annotations

import pytest

from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope, UpstreamPolicy
from vacancyd.core.reasons import Reason
from vacancyd.core.reclaim import (
    Edge,
    OnOwnerReturn,
    Proceed,
    ReclaimPhase,
    ReclaimPolicy,
    StandDown,
    Trigger,
    Wait,
    affected_upstreams,
    decided,
    open_reclaim,
    plan,
)
from vacancyd.core.reclaim import refusal as reclaim_refusal

DRAIN = ReclaimPolicy(OnOwnerReturn.DRAIN, drain_timeout_s=30)
CANCEL = ReclaimPolicy(OnOwnerReturn.CANCEL, yield_on_veto=True)
FINISH = ReclaimPolicy(OnOwnerReturn.FINISH, completion_timeout_s=60)

UPSTREAMS = {
    "host_gpu0": UpstreamPolicy("host_gpu0", "ollama", "gpu0"),
    "host_gpu1": UpstreamPolicy("host_gpu1", "ollama", "gpu1", also_requires=("ram",)),
    "res_gpu1": UpstreamPolicy("res_gpu1", "comfyui", "gpu1", owner_scope=OwnerScope.RESOURCE),
}


def test_owner_edges_reclaim_host_scoped_upstreams_only() -> None:
    edge = Edge(Trigger.OWNER, 1.0)
    assert affected_upstreams(edge, UPSTREAMS, veto_active=True) == ["host_gpu0", "host_gpu1"]


def test_pressure_edges_follow_resource_dependencies_per_channel() -> None:
    ram = Edge(Trigger.PRESSURE, 1.0, resource="ram")
    gpu1 = Edge(Trigger.PRESSURE, 1.0, resource="gpu1")
    assert affected_upstreams(ram, UPSTREAMS, veto_active=False) == ["host_gpu1"]
    assert affected_upstreams(gpu1, UPSTREAMS, veto_active=False) == ["host_gpu1", "res_gpu1"]
    # while the owner veto holds, the host-scoped ones were already reclaimed by it
    assert affected_upstreams(gpu1, UPSTREAMS, veto_active=True) == ["res_gpu1"]


@pytest.mark.parametrize(("policy", "deadline"), [(DRAIN, 40.0), (CANCEL, 10.0), (FINISH, 70.0)])
def test_the_first_edge_fixes_the_deadline_and_later_edges_coalesce(
    policy: ReclaimPolicy, deadline: float
) -> None:
    first, new = open_reclaim(None, Edge(Trigger.OWNER, 10.0), "u", policy)
    assert new and first.deadline == deadline
    second, new = open_reclaim(first, Edge(Trigger.PRESSURE, 25.0, "gpu0"), "u", policy)
    assert not new and second.deadline == deadline
    assert [e.trigger for e in second.edges] == [Trigger.OWNER, Trigger.PRESSURE]
    # a decided reclaim does not absorb a later edge: that one starts its own
    done = decided(second, StandDown("clear"), 26.0)
    third, new = open_reclaim(done, Edge(Trigger.OWNER, 27.0), "u", policy)
    assert new and third.edges == (Edge(Trigger.OWNER, 27.0),)


def test_plan_waits_then_cuts_at_the_drain_deadline() -> None:
    r, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.0), "u", DRAIN)
    assert plan(r, trigger_cleared=False, active_work=1, now=5.0) == Wait(30.0)
    assert plan(r, trigger_cleared=False, active_work=1, now=30.0) == Proceed(
        cut=True, unload=False, outcome="cancelled"
    )
    assert plan(r, trigger_cleared=False, active_work=0, now=5.0) == Proceed(
        cut=False, unload=False, outcome="work_ended"
    )


def test_stand_down_applies_to_drain_and_finish_but_not_cancel() -> None:
    for policy in (DRAIN, FINISH):
        r, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.0), "u", policy)
        assert isinstance(plan(r, trigger_cleared=True, active_work=1, now=1.0), StandDown)
        assert decided(r, StandDown("x"), 1.0).phase is ReclaimPhase.STOOD_DOWN
    r, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.0), "u", CANCEL)
    assert plan(r, trigger_cleared=True, active_work=1, now=0.0) == Proceed(
        cut=True, unload=True, outcome="cancelled"
    )


def test_finish_never_cuts() -> None:
    r, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.0), "u", FINISH)
    assert plan(r, trigger_cleared=False, active_work=2, now=59.0) == Wait(60.0)
    assert plan(r, trigger_cleared=False, active_work=2, now=60.0) == Proceed(
        cut=False, unload=False, outcome="timed_out"
    )
    unlimited, _ = open_reclaim(
        None, Edge(Trigger.OWNER, 0.0), "u", ReclaimPolicy(OnOwnerReturn.FINISH)
    )
    assert plan(unlimited, trigger_cleared=False, active_work=1, now=1e9) == Wait(None)


def test_edge_reasons() -> None:
    assert Edge(Trigger.OWNER, 0).reason is Reason.OWNER_ACTIVE
    assert Edge(Trigger.PRESSURE, 0, "gpu0").reason is Reason.RESOURCE_PRESSURED
    assert Edge(Trigger.ADMIN, 0).reason is Reason.RECLAIMED


def test_trigger_cleared_reuses_admissions_owner_and_pressure_checks() -> None:
    from vacancyd.core.observations import CapacityReading, Observation
    from vacancyd.core.policy import ResourceKind, ResourcePolicy
    from vacancyd.core.reclaim import trigger_cleared
    from vacancyd.core.snapshot import PresenceView, PressureView, ResourceView, Snapshot

    def snap(*, veto: bool, pressure: PressureView | None) -> Snapshot:
        empty: Observation[CapacityReading] = Observation()
        view = ResourceView(
            policy=ResourcePolicy("gpu0", ResourceKind.GPU),
            switch_on=True,
            capacity=empty.succeeded(CapacityReading(free_mib=8000, total_mib=8000), 9.0),
            pressure=pressure,
        )
        return Snapshot(
            now=10.0,
            lending_enabled=True,
            presence=PresenceView("t", True, 9.5, True, veto, 15.0),
            resources={"gpu0": view},
        )

    up = UpstreamPolicy("u", "ollama", "gpu0")
    owner, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.0), "u", DRAIN)
    assert not trigger_cleared(owner, snap(veto=True, pressure=None), up)
    assert trigger_cleared(owner, snap(veto=False, pressure=None), up)
    p, _ = open_reclaim(None, Edge(Trigger.PRESSURE, 0.0, "gpu0"), "u", DRAIN)
    calm = PressureView(Quality.READY, calibrated=True, engaged=False)
    hot = PressureView(Quality.READY, calibrated=True, engaged=True)
    assert trigger_cleared(p, snap(veto=False, pressure=calm), up)
    assert not trigger_cleared(p, snap(veto=False, pressure=hot), up)
    assert not trigger_cleared(p, snap(veto=False, pressure=None), up)
    both, _ = open_reclaim(p, Edge(Trigger.OWNER, 1.0), "u", DRAIN)
    assert not trigger_cleared(both, snap(veto=True, pressure=calm), up)
    admin, _ = open_reclaim(None, Edge(Trigger.ADMIN, 0.0), "u", DRAIN)
    assert not trigger_cleared(admin, snap(veto=False, pressure=calm), up)


@pytest.mark.parametrize(
    ("edge", "reason", "says"),
    [
        (Edge(Trigger.OWNER, 1.0), Reason.OWNER_ACTIVE, "the owner returned"),
        (Edge(Trigger.HOLD, 1.0, detail="paused"), Reason.OWNER_ACTIVE, "hold this host (paused)"),
        (Edge(Trigger.PRESSURE, 1.0, "gpu0"), Reason.RESOURCE_PRESSURED, "'gpu0' is under owner"),
        (Edge(Trigger.ADMIN, 1.0), Reason.RECLAIMED, "an operator reclaimed"),
        (Edge(Trigger.THERMAL, 1.0, "gpu0", "91 °C"), Reason.GPU_TOO_HOT, "stayed too hot"),
    ],
    ids=lambda v: v.trigger.value if isinstance(v, Edge) else "",
)
def test_an_open_reclaim_refuses_new_work_with_its_first_edges_reason(
    edge: Edge, reason: Reason, says: str
) -> None:
    reclaim, _ = open_reclaim(None, edge, "up", DRAIN)
    refusal = reclaim_refusal(reclaim)
    assert refusal is not None and refusal.reason is reason
    assert says in refusal.detail and "being handed back (waiting)" in refusal.detail
    assert refusal.resource == edge.resource
    later, _ = open_reclaim(reclaim, Edge(Trigger.ADMIN, 2.0), "up", DRAIN)
    assert reclaim_refusal(later) == refusal  # the first edge speaks for the reclaim
    done = decided(reclaim, Proceed(cut=True, unload=False, outcome="cancelled"), 5.0)
    assert reclaim_refusal(done) == refusal.__class__.of(
        reason, refusal.detail.replace("(waiting)", "(proceeding)"), resource=edge.resource
    )
    assert reclaim_refusal(decided(reclaim, StandDown("cleared"), 5.0)) is None
    assert reclaim_refusal(None) is None
