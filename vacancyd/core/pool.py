"""Choosing a pool member: one listener in front of several servers on different GPUs.

Each member is a full upstream policy of its own (its own target, resource, slots and
residency observation). A borrowed request goes to the member that can lend it with the most
room left afterwards; it is refused only when no member can take it. Pure: the snapshot
carries the time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vacancyd.core import gate
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Admit, Refuse
from vacancyd.core.snapshot import RequestFacts, Snapshot


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen member, the gate's admission on it, and the MiB it leaves to lend
    (None where the member's primary resource has no byte capacity)."""

    member: UpstreamPolicy
    admit: Admit
    room_mib: float | None


def room_after(snap: Snapshot, member: UpstreamPolicy, admit: Admit) -> float | None:
    """MiB the member's primary resource can still lend once ``admit`` is charged."""
    view = snap.resources.get(member.resource)
    if view is None or not view.policy.has_bytes or view.capacity.value is None:
        return None
    free = view.capacity.value.free_mib
    if free is None:
        return None
    return free - view.policy.min_free_mib - view.charged_mib - (admit.charged_mib or 0)


def choose_member(
    facts: RequestFacts,
    snap: Snapshot,
    members: Sequence[UpstreamPolicy],
    slots: Callable[[UpstreamPolicy], Refuse | None],
) -> Choice | Refuse:
    """Pick the member for a request, or the refusal to answer with.

    ``slots(member)`` is the ledger's slot check for a new job on that member (None: a slot
    is free). Among members the gate admits and that have a free slot, the one with the most
    room after the charge wins (a residency credit lowers the charge, so a member holding the
    model resident is preferred over one that would load it); ties go to the earlier member,
    and members without byte capacity count as no room. When every member refuses, the answer
    is the refusal with the shortest Retry-After (the member likely to free up first), ties
    to the earlier member. Raises ValueError for an empty ``members``.
    """
    if not members:
        raise ValueError("a pool needs at least one member")
    best: Choice | None = None
    refusals: list[Refuse] = []
    for member in members:
        decision = gate.decide(facts, snap, member)
        if isinstance(decision, Refuse):
            refusals.append(decision)
            continue
        busy = slots(member)
        if busy is not None:
            refusals.append(busy)
            continue
        room = room_after(snap, member, decision)
        if best is None or (room if room is not None else float("-inf")) > (
            best.room_mib if best.room_mib is not None else float("-inf")
        ):
            best = Choice(member, decision, room)
    if best is not None:
        return best
    return min(refusals, key=lambda r: r.retry_after_s)
