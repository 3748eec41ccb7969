"""The gate's steps 1–6 and its refusal detail (docs/architecture.md), each step and the order
between steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vacancyd.core import gate
from vacancyd.core.holds import Hold, HoldKind
from vacancyd.core.observations import CapacityReading, Observation, Quality
from vacancyd.core.policy import OwnerScope, ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.reasons import Admit, Reason, Refresh, Refuse
from vacancyd.core.snapshot import (
    PresenceView,
    PressureView,
    RequestFacts,
    ResourceView,
    ServerState,
    Snapshot,
)

NOW = 1000.0


def presence(**kw: object) -> PresenceView:
    base = PresenceView(
        source="test",
        sampled=True,
        observed_at=NOW - 1,
        evidence_complete=True,
        veto_active=False,
        max_age_s=15.0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def resource(
    name: str = "gpu0",
    free: float | None = 10_000,
    total: float = 24_000,
    kind: ResourceKind = ResourceKind.GPU,
    **kw: object,
) -> ResourceView:
    policy_kw = {k: kw.pop(k) for k in ("min_free_mib", "max_utilization") if k in kw}
    policy = ResourcePolicy(name=name, kind=kind, stale_after_s=10.0, **policy_kw)  # type: ignore[arg-type]
    capacity: Observation[CapacityReading] = Observation(
        value=CapacityReading(free, total if kind is not ResourceKind.CPU else None, 0.1),
        observed_at=NOW - 1,
    )
    view = ResourceView(policy=policy, switch_on=True, capacity=capacity)
    return replace(view, **kw)  # type: ignore[arg-type]


def snapshot(*resources: ResourceView, **kw: object) -> Snapshot:
    res = resources or (resource(),)
    base = Snapshot(
        now=NOW,
        lending_enabled=True,
        presence=presence(),
        resources={r.name: r for r in res},
    )
    return replace(base, **kw)  # type: ignore[arg-type]


UP = UpstreamPolicy(
    name="ollama",
    adapter="openai",
    resource="gpu0",
    default_mib=4000,
    footprint_mib={"big": 14_000, "small": 2_000},
)


def decide(snap: Snapshot, up: UpstreamPolicy = UP, model: str | None = None) -> Admit | Refuse:
    return gate.decide(RequestFacts(model=model), snap, up)


def refused(decision: Admit | Refuse) -> tuple[Reason, int]:
    assert isinstance(decision, Refuse), decision
    return decision.reason, decision.retry_after_s


def test_admits_when_everything_is_fine() -> None:
    decision = decide(snapshot())
    assert isinstance(decision, Admit)
    assert decision.resources == ("gpu0",)
    assert decision.charged_mib == 4000


# -- step 1: lending switch ------------------------------------------------------------------------


def test_a1_lending_switch_off() -> None:
    assert refused(decide(snapshot(lending_enabled=False))) == (Reason.LENDING_DISABLED, 300)


# -- steps 2–4: presence ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("presence_kw", "scope", "expected"),
    [
        ({"sampled": False, "observed_at": None}, OwnerScope.HOST, (Reason.OWNER_ACTIVE, 5)),
        ({"sampled": False, "observed_at": None}, OwnerScope.RESOURCE, (Reason.OWNER_ACTIVE, 5)),
        ({"observed_at": NOW - 16}, OwnerScope.HOST, (Reason.OWNER_ACTIVE, 5)),
        ({"observed_at": NOW - 16}, OwnerScope.RESOURCE, None),
        ({"evidence_complete": False}, OwnerScope.HOST, (Reason.OWNER_ACTIVE, 30)),
        ({"evidence_complete": False}, OwnerScope.RESOURCE, None),
        ({"veto_active": True}, OwnerScope.HOST, (Reason.OWNER_ACTIVE, 120)),
        ({"veto_active": True}, OwnerScope.RESOURCE, None),
        ({"observed_at": NOW - 15}, OwnerScope.HOST, None),
    ],
    ids=[
        "a2-never-sampled-host",
        "a2-never-sampled-resource-scope-too",
        "a2-stale-host",
        "a2-stale-resource-exempt",
        "a3-incomplete-host",
        "a3-incomplete-resource-exempt",
        "a4-veto-host",
        "a4-veto-resource-exempt",
        "a2-at-the-age-limit-is-fresh",
    ],
)
def test_owner_steps(
    presence_kw: dict[str, object], scope: OwnerScope, expected: tuple[Reason, int] | None
) -> None:
    up = replace(UP, owner_scope=scope)
    decision = decide(snapshot(presence=presence(**presence_kw)), up)
    if expected is None:
        assert isinstance(decision, Admit)
    else:
        assert refused(decision) == expected


def test_c7_presence_that_does_not_refuse_skips_owner_steps() -> None:
    snap = snapshot(presence=presence(sampled=False, observed_at=None, refuses=False))
    assert isinstance(decide(snap), Admit)


# -- step 5: resources -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        (resource(switch_on=False), (Reason.RESOURCE_DISABLED, 300)),
        (resource(capacity=Observation()), (Reason.RESOURCE_UNMEASURED, 30)),
        (
            resource(capacity=Observation(CapacityReading(9000, 24000), observed_at=NOW - 11)),
            (Reason.RESOURCE_UNMEASURED, 30),
        ),
        (
            resource(
                capacity=Observation(
                    CapacityReading(9000, 24000),
                    observed_at=NOW - 2,
                    failed_at=NOW - 1,
                    error="NVML: GPU is lost",
                )
            ),
            (Reason.RESOURCE_UNMEASURED, 30),
        ),
        (resource(released_at=NOW - 1), (Reason.RESOURCE_BUSY, 2)),
        (resource(min_free_mib=12_000), (Reason.INSUFFICIENT_CAPACITY, 30)),
        (resource(max_utilization=0.05), (Reason.INSUFFICIENT_CAPACITY, 30)),
        (
            resource(pressure=PressureView(Quality.UNKNOWN, calibrated=True, engaged=False)),
            (Reason.RESOURCE_UNMEASURED, 30),
        ),
        (
            resource(pressure=PressureView(Quality.STALE, calibrated=True, engaged=False)),
            (Reason.RESOURCE_UNMEASURED, 30),
        ),
        (
            resource(pressure=PressureView(Quality.READY, calibrated=False, engaged=False)),
            (Reason.RESOURCE_UNMEASURED, 30),
        ),
        (
            resource(pressure=PressureView(Quality.READY, calibrated=True, engaged=True)),
            (Reason.RESOURCE_PRESSURED, 30),
        ),
        (resource(pressure=PressureView(Quality.READY, calibrated=True, engaged=False)), None),
        (resource(released_at=NOW - 2), None),
    ],
    ids=[
        "switch-off",
        "never-measured",
        "stale",
        "newest-attempt-failed",
        "no-sample-since-release",
        "min-free-policy",
        "utilization-policy",
        "pressure-unknown",
        "pressure-stale",
        "pressure-uncalibrated",
        "pressure-engaged",
        "pressure-clear",
        "sample-after-release",
    ],
)
def test_a5_resource_steps(view: ResourceView, expected: tuple[Reason, int] | None) -> None:
    decision = decide(snapshot(view))
    if expected is None:
        assert isinstance(decision, Admit), decision
    else:
        assert refused(decision) == expected
        assert isinstance(decision, Refuse) and decision.resource == "gpu0"


def test_a5_error_text_reaches_the_refusal_detail() -> None:
    view = resource(
        capacity=Observation(None, None, failed_at=NOW - 1, error="NVML library not found")
    )
    decision = decide(snapshot(view))
    assert isinstance(decision, Refuse)
    assert "NVML library not found" in decision.detail


def test_a5_checks_also_requires_after_the_primary_in_order() -> None:
    up = replace(UP, also_requires=("ram", "cpu"))
    ram = resource("ram", kind=ResourceKind.MEMORY, switch_on=False)
    cpu = resource("cpu", free=None, kind=ResourceKind.CPU, capacity=Observation())
    decision = decide(snapshot(resource(), ram, cpu), up)
    assert refused(decision) == (Reason.RESOURCE_DISABLED, 300)
    assert isinstance(decision, Refuse) and decision.resource == "ram"

    ram_on = resource("ram", kind=ResourceKind.MEMORY)
    decision = decide(snapshot(resource(), ram_on, cpu), up)
    assert isinstance(decision, Refuse) and decision.resource == "cpu"
    assert decision.reason is Reason.RESOURCE_UNMEASURED

    cpu_ok = resource("cpu", free=None, kind=ResourceKind.CPU)
    decision = decide(snapshot(resource(), ram_on, cpu_ok), up)
    assert isinstance(decision, Admit)
    assert decision.resources == ("gpu0", "ram", "cpu")


# -- step 6: footprint -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "model", "expected_charge"),
    [
        (11_400, "small", 2_000),
        (11_400, None, 4_000),
        (11_400, "unlisted", 4_000),
        (11_400, "big", None),
        (14_000, "big", 14_000),
        (3_999, None, None),
    ],
)
def test_a6_per_model_footprint(
    free: float, model: str | None, expected_charge: int | None
) -> None:
    decision = decide(snapshot(resource(free=free)), model=model)
    if expected_charge is None:
        assert refused(decision) == (Reason.INSUFFICIENT_CAPACITY, 30)
        assert isinstance(decision, Refuse) and "no residency credit" in decision.detail
    else:
        assert isinstance(decision, Admit)
        assert decision.charged_mib == expected_charge


def test_a6_min_free_reserve_counts_against_the_footprint() -> None:
    view = resource(free=5_000, min_free_mib=2_000)
    assert refused(decide(snapshot(view))) == (Reason.INSUFFICIENT_CAPACITY, 30)
    view = resource(free=6_000, min_free_mib=2_000)
    assert isinstance(decide(snapshot(view)), Admit)


def test_a6_cpu_primary_has_no_footprint_step() -> None:
    up = replace(UP, resource="cpu")
    cpu = resource("cpu", free=None, kind=ResourceKind.CPU)
    decision = decide(snapshot(cpu), up, model="big")
    assert isinstance(decision, Admit)
    assert decision.charged_mib is None


# -- residency credit on proof, refusal detail -------------------------------------------------

LLAMA = replace(
    UP,
    adapter="llamacpp",
    needs_model_observation=True,
    resident_min_free_mib=500,
    model_observation_max_age_s=10.0,
)


def server(age: float = 1.0, idle: bool = True, **kw: object) -> Observation[ServerState]:
    base: Observation[ServerState] = Observation(
        value=ServerState(resident_models=None, idle=idle), observed_at=NOW - age
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_llamacpp_needs_a_fresh_server_observation() -> None:
    decision = decide(snapshot(), LLAMA)
    assert refused(decision) == (Reason.RESOURCE_UNMEASURED, 30)
    assert isinstance(decision, Refuse) and decision.refresh is Refresh.SERVER
    decision = decide(snapshot(servers={"ollama": server(age=11)}), LLAMA)
    assert refused(decision) == (Reason.RESOURCE_UNMEASURED, 30)


def test_a7_credit_charges_resident_min_free() -> None:
    snap = snapshot(resource(free=1_000), servers={"ollama": server()})
    decision = decide(snap, LLAMA)
    assert isinstance(decision, Admit)
    assert decision.charged_mib == 500
    assert decision.credit is not None and decision.credit.applied


def test_a7_credit_never_charges_more_than_the_requirement() -> None:
    up = replace(LLAMA, resident_min_free_mib=9_000)
    decision = decide(snapshot(servers={"ollama": server()}), up)
    assert isinstance(decision, Admit) and decision.charged_mib == 4_000


@pytest.mark.parametrize(
    ("obs", "view", "why", "only_age"),
    [
        (server(idle=False), resource(free=1_000), "processing", False),
        (server(age=5), resource(free=1_000), "5.0 s old", True),
        (
            server(age=3),
            resource(
                free=1_000,
                released_at=NOW - 2.5,
            ),
            "predates",
            True,
        ),
        (
            server(failed_at=NOW - 0.5, error="GET /slots answered 503"),
            resource(free=1_000),
            "failed",
            False,
        ),
    ],
    ids=["busy", "too-old", "before-last-job", "failed"],
)
def test_a8_refusal_says_why_no_credit_and_whether_age_alone_failed(
    obs: Observation[ServerState], view: ResourceView, why: str, only_age: bool
) -> None:
    # the capacity sample must postdate the release for step 5 to pass
    if view.released_at is not None:
        view = replace(view, capacity=replace(view.capacity, observed_at=NOW - 0.1))
    decision = gate.decide(
        RequestFacts(),
        snapshot(view, servers={"ollama": obs}),
        replace(LLAMA, model_observation_max_age_s=10.0),
    )
    if obs.failed_at is not None:
        # a failed newest observation is not a fresh observation at all (step 5)
        assert refused(decision) == (Reason.RESOURCE_UNMEASURED, 30)
        return
    assert refused(decision) == (Reason.INSUFFICIENT_CAPACITY, 30)
    assert isinstance(decision, Refuse) and decision.credit is not None
    assert not decision.credit.applied
    assert why in decision.credit.why
    assert decision.credit.failed_only_for_age is only_age
    assert (decision.refresh is Refresh.SERVER) is only_age


def test_residency_requires_the_model_when_the_server_lists_models() -> None:
    obs = server(value=ServerState(resident_models=frozenset({"llama3.2:latest"}), idle=True))
    snap = snapshot(resource(free=1_000), servers={"ollama": obs})
    assert isinstance(decide(snap, LLAMA, model="llama3.2:latest"), Admit)
    decision = decide(snap, LLAMA, model="qwen")
    assert isinstance(decision, Refuse) and "not resident" in decision.detail


# -- ordering -----------------------------------------------------------------------------


def test_order_lending_before_owner_before_resources_before_model() -> None:
    everything_wrong = snapshot(
        resource(switch_on=False, free=10),
        lending_enabled=False,
        presence=presence(veto_active=True, evidence_complete=False),
    )
    assert refused(decide(everything_wrong, model="big"))[0] is Reason.LENDING_DISABLED
    snap = replace(everything_wrong, lending_enabled=True)
    assert refused(decide(snap, model="big")) == (Reason.OWNER_ACTIVE, 30)
    snap = replace(snap, presence=presence(veto_active=True))
    assert refused(decide(snap, model="big")) == (Reason.OWNER_ACTIVE, 120)
    snap = replace(snap, presence=presence())
    assert refused(decide(snap, model="big"))[0] is Reason.RESOURCE_DISABLED
    snap = snapshot(resource(free=10))
    assert refused(decide(snap, model="big"))[0] is Reason.INSUFFICIENT_CAPACITY


def test_order_within_a_resource() -> None:
    view = resource(
        capacity=Observation(),
        min_free_mib=99_999,
        pressure=PressureView(Quality.READY, calibrated=True, engaged=True),
    )
    assert refused(decide(snapshot(view)))[0] is Reason.RESOURCE_UNMEASURED
    view = replace(view, capacity=resource().capacity)
    assert refused(decide(snapshot(view)))[0] is Reason.INSUFFICIENT_CAPACITY
    view = replace(view, policy=replace(view.policy, min_free_mib=0))
    assert refused(decide(snapshot(view)))[0] is Reason.RESOURCE_PRESSURED


def test_decide_before_body_matches_decide_for_non_model_refusals() -> None:
    snap = snapshot(lending_enabled=False)
    early = gate.decide_before_body(snap, UP)
    assert early is not None and early.reason is Reason.LENDING_DISABLED
    assert gate.decide_before_body(snapshot(resource(free=10)), UP) is None


BUDGETED = replace(UP, owner_scope=OwnerScope.RESOURCE, present_max_model_mib=4096)


@pytest.mark.parametrize(
    ("veto", "model", "outcome"),
    [
        (True, "small", "admit"),  # 2000 MiB, within the budget
        (True, None, "admit"),  # default 4000 MiB, within it
        (True, "big", "owner_active"),  # 14000 MiB while the owner is present
        (False, "big", "admit"),  # the owner is away: no budget
    ],
)
def test_present_budget_lends_only_small_models_while_the_owner_is_present(
    veto: bool, model: str | None, outcome: str
) -> None:
    snap = snapshot(resource(free=20_000), presence=presence(veto_active=veto))
    decision = decide(snap, BUDGETED, model)
    if outcome == "admit":
        assert isinstance(decision, Admit)
    else:
        assert refused(decision) == (Reason.OWNER_ACTIVE, 120)
        assert isinstance(decision, Refuse)
        assert "at most 4096 MiB (present_max_model_mib)" in decision.detail
        assert "needs 14000 MiB (table footprint)" in decision.detail


def test_present_budget_does_not_override_pressure() -> None:
    pressed = resource(pressure=PressureView(Quality.READY, True, True))
    snap = snapshot(pressed, presence=presence(veto_active=True))
    assert refused(decide(snap, BUDGETED, "small"))[0] is Reason.RESOURCE_PRESSURED


def test_present_budget_is_only_set_on_resource_scoped_upstreams() -> None:
    from tests.support import config as cfg
    from vacancyd.config import parse_config
    from vacancyd.config.policies import upstream_policy

    settings = parse_config(
        cfg.daemon_toml(
            cfg.upstream("a", "http://127.0.0.1:1", resource="gpu0", owner_scope="resource"),
            cfg.upstream("b", "http://127.0.0.1:1", resource="gpu0"),
            resources=(cfg.resource("gpu0", "gpu"),),
            owner={"present_max_model_mib": 4096},
            defaults=False,
        )
    )
    a, b = (upstream_policy(settings, u, needs_model_observation=False) for u in settings.upstream)
    assert (a.present_max_model_mib, b.present_max_model_mib) == (4096, None)


OWNER_CASES = {
    "away": {},
    "never-sampled": {"sampled": False, "observed_at": None},
    "stale": {"observed_at": NOW - 16},
    "incomplete": {"evidence_complete": False},
    "present": {"veto_active": True},
    "present-no-refusing-source": {"veto_active": True, "refuses": False},
}
HOLDS = {
    "no hold": (),
    "paused": (Hold(HoldKind.PAUSE, "paused by the owner", until=NOW + 60, ends_in_s=60),),
    "other card": (Hold(HoldKind.EXCLUSIVE_APP, "exclusive", resources=frozenset({"gpu9"})),),
}


@pytest.mark.parametrize("scope", list(OwnerScope))
@pytest.mark.parametrize("holds", list(HOLDS.values()), ids=list(HOLDS))
@pytest.mark.parametrize("presence_kw", list(OWNER_CASES.values()), ids=list(OWNER_CASES))
def test_the_owner_steps_alone_answer_as_the_snapshot_gate_does(
    presence_kw: dict[str, object], holds: tuple[Hold, ...], scope: OwnerScope
) -> None:
    # The proxy asks these before building a snapshot: when they refuse, decide_before_body
    # would have refused the same way; when they do not, the later steps decide.
    up = replace(UP, owner_scope=scope)
    view = presence(**presence_kw)
    snap = snapshot(resource(switch_on=False), presence=view, holds=holds)  # step 5 refuses
    alone = gate.decide_owner_steps(holds, view, NOW, up)
    full = gate.decide_before_body(snap, up)
    assert full is not None
    if alone is None:
        assert full.reason is Reason.RESOURCE_DISABLED
    else:
        assert alone == full
