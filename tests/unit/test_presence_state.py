"""Presence in shared state and the gate (docs/architecture.md steps 2–4):
the veto's hysteresis fed by readings, stale unreadable presence engaging the veto, the
owner steps of the gate for host- and resource-scoped upstreams, and readiness."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from vacancyd.core import gate
from vacancyd.core.observations import CapacityReading
from vacancyd.core.policy import OwnerScope, ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.reasons import Reason, Refuse
from vacancyd.state import PresenceReading, SharedState

CLEAR = PresenceReading(owner_signal=False, evidence_complete=True, detail="owner away")
OWNER = PresenceReading(owner_signal=True, evidence_complete=True, detail="owner present")
UNREADABLE = PresenceReading(owner_signal=True, evidence_complete=False, detail="session 2: ?")


def make_state(*, refuses: bool = True, release_after_s: float = 60.0) -> SharedState:
    resources = {"ram": ResourcePolicy("ram", ResourceKind.MEMORY, stale_after_s=1e9)}
    upstreams = {
        "host": UpstreamPolicy("host", "openai", "ram"),
        "res": UpstreamPolicy("res", "openai", "ram", owner_scope=OwnerScope.RESOURCE),
    }
    state = SharedState(
        resources,
        upstreams,
        presence_source="logind",
        presence_refuses=refuses,
        presence_max_age_s=15.0,
        release_after_s=release_after_s,
        clock=lambda: 0.0,
    )
    state.record_capacity("ram", CapacityReading(free_mib=8000, total_mib=16000), 0.0)
    return state


def owner_refusal(state: SharedState, upstream: str, now: float) -> tuple[Reason, int] | None:
    decision = gate.decide_before_body(state.snapshot(now), state.upstreams[upstream])
    if decision is None:
        return None
    assert isinstance(decision, Refuse)
    return decision.reason, decision.retry_after_s


def events(state: SharedState) -> list[tuple[str, Mapping[str, object]]]:
    seen: list[tuple[str, Mapping[str, object]]] = []
    state.subscribe(lambda e: seen.append((e.kind, e.payload())))
    return seen


def test_veto_engages_on_one_sample_and_releases_after_clear_run() -> None:
    state = make_state(release_after_s=10.0)
    seen = events(state)
    state.record_presence(OWNER, 1.0)
    assert state.veto.engaged
    assert ("veto", {"active": True, "detail": "owner present", "at": 1.0}) in seen
    state.record_presence(CLEAR, 5.0)
    assert state.veto.engaged  # 4 s of clear is not 10
    state.record_presence(CLEAR, 11.0)
    assert not state.veto.engaged
    assert seen[-1] == ("veto", {"active": False, "detail": "owner away", "at": 11.0})


@pytest.mark.parametrize(
    ("reading", "host", "res"),
    [
        (None, (Reason.OWNER_ACTIVE, 5), (Reason.OWNER_ACTIVE, 5)),  # never sampled
        (CLEAR, None, None),
        (UNREADABLE, (Reason.OWNER_ACTIVE, 30), None),  # incomplete evidence first
        (OWNER, (Reason.OWNER_ACTIVE, 120), None),  # the veto; resource scope exempt
    ],
)
def test_gate_owner_steps(
    reading: PresenceReading | None, host: tuple[Reason, int] | None, res: object
) -> None:
    state = make_state()
    if reading is not None:
        state.record_presence(reading, 1.0)
    assert owner_refusal(state, "host", 2.0) == host
    assert owner_refusal(state, "res", 2.0) == res


def test_stale_presence_refuses_host_scope_only() -> None:
    state = make_state()
    state.record_presence(CLEAR, 0.0)
    assert owner_refusal(state, "host", 15.0) is None
    assert owner_refusal(state, "host", 15.5) == (Reason.OWNER_ACTIVE, 5)
    assert owner_refusal(state, "res", 15.5) is None
    assert state.ready(15.5) == (False, ["presence stale"])


def test_failure_refuses_at_once_and_engages_the_veto_only_once_stale() -> None:
    state = make_state(release_after_s=10.0)
    seen = events(state)
    state.record_presence(CLEAR, 0.0)
    state.record_presence_failure("ListSessions failed: ServiceUnknown", 1.0)
    assert owner_refusal(state, "host", 1.0) == (Reason.OWNER_ACTIVE, 30)
    assert not state.veto.engaged  # one failed poll does not reclaim borrowed work
    state.record_presence_failure("ListSessions failed: ServiceUnknown", 14.0)
    assert not state.veto.engaged
    state.record_presence_failure("ListSessions failed: ServiceUnknown", 16.0)
    assert state.veto.engaged
    assert seen[-1][0] == "veto" and "stale" in str(seen[-1][1]["detail"])
    assert seen[-1][1]["at"] == 16.0  # the reclaim edge is dated at the engaging failure
    # Readable again and clear: the veto holds until release_after_s since the last match.
    state.record_presence(CLEAR, 17.0)
    assert state.veto.engaged and owner_refusal(state, "host", 17.0) == (Reason.OWNER_ACTIVE, 120)
    state.record_presence(CLEAR, 26.5)
    assert not state.veto.engaged and owner_refusal(state, "host", 26.5) is None


def test_failure_before_any_sample_does_not_engage() -> None:
    state = make_state()
    state.record_presence_failure("cannot connect", 100.0)
    assert not state.veto.engaged
    assert owner_refusal(state, "host", 100.0) == (Reason.OWNER_ACTIVE, 5)


def test_failures_log_once_per_distinct_error(caplog: pytest.LogCaptureFixture) -> None:
    state = make_state()
    state.record_presence(CLEAR, 0.0)
    for t in (1.0, 2.0, 3.0):
        state.record_presence_failure("boom", t)
    state.record_presence_failure("other", 4.0)
    lines = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert lines == ["owner presence unreadable: boom", "owner presence unreadable: other"]


def test_readiness_waits_for_presence() -> None:
    state = make_state()
    assert state.ready(0.0) == (False, ["presence not sampled"])
    state.record_presence(CLEAR, 0.5)
    assert state.ready(1.0) == (True, [])


def test_unsupported_platform_does_not_refuse() -> None:
    state = make_state(refuses=False)
    assert state.ready(0.0) == (True, [])
    assert owner_refusal(state, "host", 0.0) is None
