"""Reclaim planning: what to do with accepted borrowed work when the owner wants the GPU back.

See docs/reclaim.md. Pure: no I/O and no clock; every time is monotonic seconds
passed in by the caller. ``vacancyd.control.reclaim`` executes the plans.

An *edge* is a rising owner-return (host policy veto), resource-pressure or operator event.
Each affected upstream gets one :class:`Reclaim`; further edges while it is undecided coalesce
into it and never move its deadline (the first edge fixes the deadline). A reclaim ends
in one of two ways:

* **stood down** — a drain or finish wait re-checked its trigger with admission's own checks
  and found it cleared. Nothing is cancelled or unloaded.
* **proceeded** — the affected work ended, or the policy's deadline passed. Drain and cancel
  cut what is still running; finish never cuts. Upstreams with ``yield_on_veto`` then unload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from vacancyd.core import gate
from vacancyd.core.holds import decide_holds
from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope, UpstreamPolicy
from vacancyd.core.reasons import Reason, ReclaimOutcome, Refuse
from vacancyd.core.snapshot import Snapshot


class OnOwnerReturn(StrEnum):
    """An upstream's ``on_owner_return`` policy (docs/reclaim.md)."""

    DRAIN = "drain"  #: let accepted work run for ``drain_timeout_s``, then cut it
    CANCEL = "cancel"  #: cut accepted work at once
    FINISH = "finish"  #: never cut; unload after work ends or ``completion_timeout_s``


class Trigger(StrEnum):
    """What raised an edge. The values are metric labels and /status strings."""

    OWNER = "owner"  #: host policy veto engaged (owner returned)
    PRESSURE = "pressure"  #: a resource's attributed GPU pressure engaged
    ADMIN = "admin"  #: an operator asked for a reclaim (POST /admin/reclaim); never clears
    #: an owner hold began (schedule window closed, pause, battery, exclusive app)
    HOLD = "hold"
    #: a GPU stayed above its ``max_temperature_c`` for ``hot_yield_after_s``
    THERMAL = "thermal"


class ReclaimPhase(StrEnum):
    """Published per upstream in /status."""

    WAITING = "waiting"
    STOOD_DOWN = "stood_down"
    PROCEEDING = "proceeding"
    DONE = "done"


#: Phases in which a reclaim still owns the upstream: new work is refused.
OPEN_PHASES = frozenset({ReclaimPhase.WAITING, ReclaimPhase.PROCEEDING})


@dataclass(frozen=True, slots=True)
class ReclaimPolicy:
    """The reclaim keys of one ``[[upstream]]`` (docs/configuration.md).

    ``drain_timeout_s``: seconds accepted work may keep running in drain mode.
    ``completion_timeout_s``: in finish mode, seconds after which the unload goes ahead even
    though work still runs (None: wait for the work to end). Finish never cuts work.
    ``yield_on_veto``: ask the server to unload its models once the work is dealt with.
    """

    on_owner_return: OnOwnerReturn = OnOwnerReturn.DRAIN
    drain_timeout_s: float = 30.0
    completion_timeout_s: float | None = None
    yield_on_veto: bool = False

    def deadline(self, first_edge_at: float) -> float | None:
        """When a reclaim that began at ``first_edge_at`` proceeds regardless of work."""
        if self.on_owner_return is OnOwnerReturn.CANCEL:
            return first_edge_at
        if self.on_owner_return is OnOwnerReturn.DRAIN:
            return first_edge_at + self.drain_timeout_s
        if self.completion_timeout_s is None:
            return None
        return first_edge_at + self.completion_timeout_s


@dataclass(frozen=True, slots=True)
class Edge:
    """One rising edge. ``resource`` is set for pressure edges; ``at`` is monotonic seconds."""

    trigger: Trigger
    at: float
    resource: str | None = None
    detail: str = ""

    @property
    def reason(self) -> Reason:
        """The refusal reason for work this edge refuses or cancels before its headers."""
        if self.trigger in (Trigger.OWNER, Trigger.HOLD):
            return Reason.OWNER_ACTIVE
        if self.trigger is Trigger.PRESSURE:
            return Reason.RESOURCE_PRESSURED
        if self.trigger is Trigger.THERMAL:
            return Reason.GPU_TOO_HOT
        return Reason.RECLAIMED


def affected_upstreams(
    edge: Edge, upstreams: Mapping[str, UpstreamPolicy], *, veto_active: bool
) -> list[str]:
    """The upstreams an edge reclaims, by name (docs/reclaim.md).

    Owner return reclaims host-scoped upstreams only. A pressure edge on a resource reclaims
    every upstream that depends on it (primary or ``also_requires``); while the owner veto is
    active it reclaims only resource-scoped ones, since the veto already reclaimed the rest.
    An operator edge names no resource and reclaims every upstream. A hold edge reclaims
    every upstream (whatever its owner scope), or with a resource (a GPU-exclusive app) every
    upstream that depends on it. A thermal edge names its GPU and reclaims every upstream
    that depends on it, whatever its owner scope.
    """
    names = []
    for name, up in sorted(upstreams.items()):
        if edge.trigger is Trigger.OWNER:
            hit = up.owner_scope is OwnerScope.HOST
        elif edge.trigger is Trigger.PRESSURE:
            hit = edge.resource in up.resources and (
                not veto_active or up.owner_scope is OwnerScope.RESOURCE
            )
        else:
            hit = edge.resource is None or edge.resource in up.resources
        if hit:
            names.append(name)
    return names


@dataclass(frozen=True, slots=True)
class Reclaim:
    """One upstream's reclaim. ``edges`` lists every edge it answers, the first one first.

    ``deadline`` (monotonic s) is fixed by the first edge; None means no time limit (finish
    without ``completion_timeout_s``). ``outcome`` is set once it leaves ``waiting``.
    """

    upstream: str
    policy: ReclaimPolicy
    edges: tuple[Edge, ...]
    deadline: float | None
    phase: ReclaimPhase = ReclaimPhase.WAITING
    decided_at: float | None = None
    outcome: str | None = None

    @property
    def first(self) -> Edge:
        return self.edges[0]

    @property
    def is_open(self) -> bool:
        return self.phase in OPEN_PHASES

    def view(self) -> dict[str, object]:
        """The reclaim as plain JSON values (monotonic times): phase, policy, trigger,
        resource, edges_at, edge_triggers, deadline, decided_at, outcome."""
        return {
            "phase": self.phase.value,
            "policy": self.policy.on_owner_return.value,
            "trigger": self.first.trigger.value,
            "resource": self.first.resource,
            "edges_at": [e.at for e in self.edges],
            "edge_triggers": [e.trigger.value for e in self.edges],
            "deadline": self.deadline,
            "decided_at": self.decided_at,
            "outcome": self.outcome,
        }


def refusal(reclaim: Reclaim | None) -> Refuse | None:
    """The refusal new work on an upstream gets while ``reclaim`` (its latest, or None) is
    open: the first edge's reason, saying what raised it and that accepted work is being
    handed back; None when no reclaim is open."""
    if reclaim is None or not reclaim.is_open:
        return None
    edge = reclaim.first
    if edge.trigger is Trigger.OWNER:
        what = "the owner returned"
    elif edge.trigger is Trigger.PRESSURE:
        what = f"resource {edge.resource!r} is under owner GPU pressure"
    elif edge.trigger is Trigger.ADMIN:
        what = "an operator reclaimed this upstream"
    elif edge.trigger is Trigger.THERMAL:
        what = f"GPU {edge.resource!r} stayed too hot ({edge.detail})"
    else:
        what = f"the owner's controls hold this host ({edge.detail})"
    return Refuse.of(
        edge.reason,
        f"{what}; accepted work is being handed back ({reclaim.phase})",
        resource=edge.resource,
    )


def open_reclaim(
    current: Reclaim | None, edge: Edge, upstream: str, policy: ReclaimPolicy
) -> tuple[Reclaim, bool]:
    """Answer ``edge`` on ``upstream``: (the reclaim now in charge, whether it is new).

    An open reclaim absorbs the edge and keeps its deadline; otherwise a new one starts with
    the deadline the policy gives the edge.
    """
    if current is not None and current.is_open:
        return replace(current, edges=(*current.edges, edge)), False
    return Reclaim(upstream, policy, (edge,), policy.deadline(edge.at)), True


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do yet; decide again at ``until`` (None: on the next change)."""

    until: float | None


@dataclass(frozen=True, slots=True)
class StandDown:
    """The trigger cleared during a drain or finish wait: cancel nothing, unload nothing."""

    why: str


@dataclass(frozen=True, slots=True)
class Proceed:
    """Go ahead: ``cut`` accepted work (drain and cancel only), then ``unload`` if configured.

    ``outcome`` is the metric label: ``work_ended`` (nothing left to cut), ``cancelled``
    (work cut at the deadline), ``timed_out`` (finish mode's completion timeout).
    """

    cut: bool
    unload: bool
    outcome: str


Action = Wait | StandDown | Proceed


def plan(reclaim: Reclaim, *, trigger_cleared: bool, active_work: int, now: float) -> Action:
    """Decide the next step of a waiting reclaim.

    ``trigger_cleared``: admission's own checks would admit again for every edge this reclaim
    answers. ``active_work``: borrowed jobs on the upstream admitted before the first edge that
    have not ended (held jobs excluded: they never defer the unload).
    """
    policy = reclaim.policy
    if trigger_cleared and policy.on_owner_return is not OnOwnerReturn.CANCEL:
        return StandDown("the trigger cleared before the deadline")
    if active_work == 0:
        return Proceed(cut=False, unload=policy.yield_on_veto, outcome=ReclaimOutcome.WORK_ENDED)
    if reclaim.deadline is not None and now >= reclaim.deadline:
        if policy.on_owner_return is OnOwnerReturn.FINISH:
            return Proceed(cut=False, unload=policy.yield_on_veto, outcome=ReclaimOutcome.TIMED_OUT)
        return Proceed(cut=True, unload=policy.yield_on_veto, outcome=ReclaimOutcome.CANCELLED)
    return Wait(reclaim.deadline)


def decided(reclaim: Reclaim, action: StandDown | Proceed, now: float) -> Reclaim:
    """The reclaim after ``action`` was chosen at ``now``."""
    if isinstance(action, StandDown):
        return replace(
            reclaim,
            phase=ReclaimPhase.STOOD_DOWN,
            decided_at=now,
            outcome=ReclaimOutcome.STOOD_DOWN,
        )
    return replace(reclaim, phase=ReclaimPhase.PROCEEDING, decided_at=now, outcome=action.outcome)


def trigger_cleared(reclaim: Reclaim, snap: Snapshot, upstream: UpstreamPolicy) -> bool:
    """Would admission's own checks admit ``upstream`` again, for every edge answered?.

    A drain or finish wait stands down only when all of these hold:

    * the owner checks admit the upstream (presence sampled and fresh; for a host-scoped
      upstream complete session evidence and no veto);
    * every resource a pressure edge of this reclaim named has a fresh, calibrated pressure
      reading that is not engaged and is at or below its threshold (so not building towards
      engagement), and passes the resource's own admission checks;
    * every other pressure-gated resource the upstream depends on admits;
    * every GPU a thermal edge of this reclaim named has cooled (not hot, not above its
      maximum) and passes the resource's own admission checks;
    * no owner hold (schedule, pause, battery, exclusive app) covers the upstream.

    Operator edges never clear by themselves.
    """
    refused: set[str] = set()
    hot: set[str] = set()
    for edge in reclaim.edges:
        if edge.trigger is Trigger.ADMIN:
            return False
        if edge.trigger is Trigger.PRESSURE:
            refused.add(edge.resource or "")
        if edge.trigger is Trigger.THERMAL:
            hot.add(edge.resource or "")
    if gate.decide_owner(snap, upstream, strict=True) is not None:
        return False
    if decide_holds(snap.holds, upstream.resources) is not None:
        return False
    for name in hot:
        view = snap.resources.get(name)
        thermal = None if view is None else view.thermal
        if view is None or thermal is None or thermal.hot or thermal.above_since is not None:
            return False
        if gate.decide_resource(view, name, snap.now) is not None:
            return False
    for name in refused:
        view = snap.resources.get(name)
        if view is None or view.pressure is None:
            return False
        p = view.pressure
        if p.quality is not Quality.READY or not p.calibrated or p.engaged or p.above_threshold:
            return False
        if gate.decide_resource(view, name, snap.now) is not None:
            return False
    for name in upstream.resources:
        view = snap.resources.get(name)
        if name in refused or view is None or view.pressure is None:
            continue
        if gate.decide_resource(view, name, snap.now) is not None:
            return False
    return True


def lending_resumed(snap: Snapshot, upstream: UpstreamPolicy) -> bool:
    """Would ``upstream`` lend again as far as everything that makes a reclaim unload goes?

    True when the daemon is not stopping, lending is switched on, no owner hold (schedule,
    pause, battery, exclusive app) covers the upstream, the owner checks admit it as a
    reclaim's stand-down does (``strict``: a host-scoped upstream needs the veto released),
    and no GPU it depends on has its pressure guard engaged or is too hot. Capacity and the
    rest of the gate are not asked: a warm reload is what makes the next borrower's request
    cheap, not a promise that it is admitted.
    """
    if snap.stopping or not snap.lending_enabled:
        return False
    if decide_holds(snap.holds, upstream.resources) is not None:
        return False
    if gate.decide_owner(snap, upstream, strict=True) is not None:
        return False
    for name in upstream.resources:
        view = snap.resources.get(name)
        if view is not None and view.pressure is not None and view.pressure.engaged:
            return False
        if view is not None and view.thermal is not None and view.thermal.hot:
            return False
    return True


def warm_delay_s(last_warm_at: float | None, now: float, min_interval_s: float) -> float:
    """Seconds to wait before the next warm reload of an upstream whose previous one was at
    ``last_warm_at`` (monotonic s; None: never), so reloads come at most every
    ``min_interval_s`` seconds however often lending stops and resumes."""
    if last_warm_at is None:
        return 0.0
    return max(0.0, last_warm_at + min_interval_s - now)
