"""``lend_while_present``: a host-scoped upstream that lends small models (within
``present_max_model_mib``) while the owner's desktop is in use, but not while an owner
program holds the machine; an owner edge still hands its running work back."""

from __future__ import annotations

import tomllib

import pytest

from tests.support.config import daemon_toml, upstream
from vacancyd.config import ConfigError, parse_config
from vacancyd.core import gate
from vacancyd.core.events import EdgeRaised, StateEvent
from vacancyd.core.observations import CapacityReading
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.reasons import Admit, Reason, Refuse
from vacancyd.core.reclaim import Edge, ReclaimPolicy, Trigger, open_reclaim, trigger_cleared
from vacancyd.core.snapshot import RequestFacts
from vacancyd.state import PresenceReading, SharedState

OPTED = UpstreamPolicy(
    "desk",
    "openai",
    "ram",
    footprint_mib={"small": 2000, "big": 9000},
    present_max_model_mib=4096,
    lend_while_present=True,
)
PLAIN = UpstreamPolicy("plain", "openai", "ram", footprint_mib={"small": 2000})
AT_DESK = PresenceReading(True, True, "session 1 (graphical, unlocked and in use)")
PROGRAM = PresenceReading(
    True,
    True,
    "session 1 (graphical, idle, but runs owner process steam)",
    sessions=({"id": "1", "kind": "graphical", "owner": True, "owner_processes": ["steam"]},),
)


def make_state(*upstreams: UpstreamPolicy) -> SharedState:
    state = SharedState(
        {"ram": ResourcePolicy("ram", ResourceKind.MEMORY, stale_after_s=1e9)},
        {u.name: u for u in upstreams},
        presence_source="logind",
        presence_max_age_s=1e9,
        clock=lambda: 0.0,
    )
    state.record_capacity("ram", CapacityReading(free_mib=16000, total_mib=32000), 0.0)
    return state


def decide(state: SharedState, up: UpstreamPolicy, model: str) -> Admit | Refuse:
    return gate.decide(RequestFacts(model), state.snapshot(1.0), up)


def test_small_models_are_lent_while_the_owner_is_at_the_desk() -> None:
    state = make_state(OPTED, PLAIN)
    state.record_presence(AT_DESK, 0.5)
    assert state.veto.engaged
    assert isinstance(decide(state, OPTED, "small"), Admit)
    big = decide(state, OPTED, "big")
    assert isinstance(big, Refuse) and big.reason is Reason.OWNER_ACTIVE
    assert "at most 4096 MiB (present_max_model_mib)" in big.detail
    plain = decide(state, PLAIN, "small")  # not opted in: refused as before
    assert isinstance(plain, Refuse) and plain.retry_after_s == 120


def test_an_owner_program_refuses_and_reclaims_even_small_models() -> None:
    state = make_state(OPTED)
    events: list[StateEvent] = []
    state.subscribe(events.append)
    state.record_presence(AT_DESK, 0.5)
    state.record_presence(PROGRAM, 0.7)
    refusal = decide(state, OPTED, "small")
    assert isinstance(refusal, Refuse) and "the owner is using this machine" in refusal.detail
    edges = [e for e in events if isinstance(e, EdgeRaised)]
    assert [(e.trigger, e.at) for e in edges] == [(Trigger.OWNER, 0.7)]
    state.record_presence(PROGRAM, 0.9)  # still running: no further edge
    assert len([e for e in events if isinstance(e, EdgeRaised)]) == 1


def test_no_extra_edge_without_an_upstream_that_lends_while_present() -> None:
    state = make_state(PLAIN)
    events: list[StateEvent] = []
    state.subscribe(events.append)
    state.record_presence(AT_DESK, 0.5)
    state.record_presence(PROGRAM, 0.7)
    assert not [e for e in events if isinstance(e, EdgeRaised)]


def test_an_owner_edge_on_it_does_not_stand_down_while_the_owner_is_present() -> None:
    state = make_state(OPTED)
    state.record_presence(AT_DESK, 0.5)
    reclaim, _ = open_reclaim(None, Edge(Trigger.OWNER, 0.5), "desk", ReclaimPolicy())
    # New small work is admissible, but the work running at the edge is still handed back.
    assert gate.decide_owner(state.snapshot(1.0), OPTED) is None
    assert gate.decide_owner(state.snapshot(1.0), OPTED, strict=True) is not None
    assert not trigger_cleared(reclaim, state.snapshot(1.0), OPTED)


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            'owner_scope = "resource"\nlend_while_present = true\n',
            "lend_while_present applies to host-scoped upstreams",
        ),
        ("lend_while_present = true\n", "lend_while_present needs \\[owner\\] present_max"),
    ],
)
def test_lend_while_present_config_errors(extra: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config(
            daemon_toml(upstream("a", "http://127.0.0.1:1", **tomllib.loads(extra)), defaults=False)
        )
