"""Pool member choice (vacancyd.core.pool): most room wins, residency credit counts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_gate import NOW, resource, snapshot
from vacancyd.core.observations import Observation
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.pool import Choice, choose_member
from vacancyd.core.reasons import Reason, Refuse
from vacancyd.core.snapshot import RequestFacts, ServerState

A = UpstreamPolicy("a", "llamacpp", "gpu0", default_mib=6000, resident_min_free_mib=500)
B = UpstreamPolicy("b", "llamacpp", "gpu1", default_mib=6000, resident_min_free_mib=500)
FACTS = RequestFacts(model="m")


def free_slots(_: UpstreamPolicy) -> Refuse | None:
    return None


def resident(idle: bool = True) -> Observation[ServerState]:
    return Observation(value=ServerState(resident_models=None, idle=idle), observed_at=NOW - 1)


def test_the_member_with_the_most_room_wins() -> None:
    snap = snapshot(resource("gpu0", free=9000), resource("gpu1", free=12_000))
    choice = choose_member(FACTS, snap, [A, B], free_slots)
    assert isinstance(choice, Choice) and choice.member is B and choice.room_mib == 6000


def test_residency_credit_counts_towards_room() -> None:
    # b has more free memory, but a holds the model resident and is charged 500 MiB only
    snap = snapshot(
        resource("gpu0", free=9000), resource("gpu1", free=10_000), servers={"a": resident()}
    )
    choice = choose_member(FACTS, snap, [A, B], free_slots)
    assert isinstance(choice, Choice) and choice.member is A and choice.room_mib == 8500
    assert choice.admit.credit is not None and choice.admit.credit.applied


def test_charges_of_running_jobs_reduce_room() -> None:
    snap = snapshot(resource("gpu0", free=12_000, charged_mib=5000), resource("gpu1", free=9000))
    choice = choose_member(FACTS, snap, [A, B], free_slots)
    assert isinstance(choice, Choice) and choice.member is B


def test_a_member_without_a_slot_is_skipped_and_ties_go_to_the_first() -> None:
    snap = snapshot(resource("gpu0", free=9000), resource("gpu1", free=9000))
    choice = choose_member(FACTS, snap, [A, B], free_slots)
    assert isinstance(choice, Choice) and choice.member is A

    def a_full(p: UpstreamPolicy) -> Refuse | None:
        return Refuse.of(Reason.RESOURCE_BUSY, "full") if p is A else None

    choice = choose_member(FACTS, snap, [A, B], a_full)
    assert isinstance(choice, Choice) and choice.member is B


def test_refused_only_when_no_member_can_take_it() -> None:
    snap = snapshot(resource("gpu0", free=3000), resource("gpu1", free=9000))

    def b_full(p: UpstreamPolicy) -> Refuse | None:
        return Refuse.of(Reason.RESOURCE_BUSY, "b is full") if p is B else None

    refusal = choose_member(FACTS, snap, [A, B], b_full)
    # a cannot lend 6000 MiB (30 s), b is busy (2 s): the sooner one answers
    assert isinstance(refusal, Refuse) and refusal.reason is Reason.RESOURCE_BUSY
    off = replace(snap, lending_enabled=False)
    refusal = choose_member(FACTS, off, [A, B], free_slots)
    assert isinstance(refusal, Refuse) and refusal.reason is Reason.LENDING_DISABLED
    with pytest.raises(ValueError, match="at least one member"):
        choose_member(FACTS, snap, [], free_slots)
