"""State transitions as typed values.

:class:`~vacancyd.state.SharedState` tells its subscribers about every transition with one of
these events. Each has a stable ``kind`` (the SSE ``event:`` name on ``GET /events``) and a
``payload()``: the JSON object that stream carries, whose keys are the event's fields. Times
are monotonic seconds on the daemon's clock; loads and thresholds are 0–1 ratios.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from vacancyd.core.observations import Quality
from vacancyd.core.pressure import EdgeCause
from vacancyd.core.reclaim import ReclaimPhase, Trigger


@dataclass(frozen=True, slots=True)
class LendingSwitched:
    """The global lending switch flipped."""

    kind: ClassVar[str] = "lending"
    enabled: bool

    def payload(self) -> dict[str, object]:
        return {"enabled": self.enabled}


@dataclass(frozen=True, slots=True)
class ResourceSwitched:
    """One resource's runtime switch flipped."""

    kind: ClassVar[str] = "resource_switch"
    resource: str
    enabled: bool

    def payload(self) -> dict[str, object]:
        return {"resource": self.resource, "enabled": self.enabled}


@dataclass(frozen=True, slots=True)
class CapacityChanged:
    """A resource became measured (``ready``) or unmeasured (``unknown``, with the error)."""

    kind: ClassVar[str] = "capacity"
    resource: str
    quality: Quality
    error: str | None = None

    def payload(self) -> dict[str, object]:
        data: dict[str, object] = {"resource": self.resource, "quality": self.quality.value}
        if self.error is not None:
            data["error"] = self.error
        return data


@dataclass(frozen=True, slots=True)
class PressureReleased:
    """A GPU's owner pressure released (hysteresis disengaged)."""

    kind: ClassVar[str] = "pressure"
    resource: str

    def payload(self) -> dict[str, object]:
        return {"resource": self.resource, "edge": False, "engaged": False}


@dataclass(frozen=True, slots=True)
class PressureEdgeRaised:
    """A rising pressure edge on a GPU: engaged, or unknown for too long.

    ``at``: monotonic s. ``unknown_for_s``: how long the reading had been unknown (0 when
    engaged by load). ``owner_load`` / ``threshold``: the newest reading and the threshold
    in force, where known.
    """

    kind: ClassVar[str] = "pressure"
    resource: str
    engaged: bool
    cause: EdgeCause
    at: float
    unknown_for_s: float
    owner_load: float | None
    threshold: float | None

    def payload(self) -> dict[str, object]:
        return {
            "resource": self.resource,
            "edge": True,
            "engaged": self.engaged,
            "cause": self.cause.value,
            "at": self.at,
            "unknown_for_s": self.unknown_for_s,
            "owner_load": self.owner_load,
            "threshold": self.threshold,
        }


@dataclass(frozen=True, slots=True)
class UnseenGpuWorkChanged:
    """An upstream's admitted work stopped (or started again) showing on its GPU."""

    kind: ClassVar[str] = "unseen_gpu_work"
    upstream: str
    active: bool
    detail: str | None = None

    def payload(self) -> dict[str, object]:
        data: dict[str, object] = {"upstream": self.upstream, "active": self.active}
        if self.detail is not None:
            data["detail"] = self.detail
        return data


@dataclass(frozen=True, slots=True)
class PresenceSampled:
    """Owner presence was read for the first time."""

    kind: ClassVar[str] = "presence"

    def payload(self) -> dict[str, object]:
        return {"sampled": True}


@dataclass(frozen=True, slots=True)
class VetoChanged:
    """The host policy veto engaged (owner back) or released, at monotonic ``at``."""

    kind: ClassVar[str] = "veto"
    active: bool
    detail: str
    at: float

    def payload(self) -> dict[str, object]:
        return {"active": self.active, "detail": self.detail, "at": self.at}


@dataclass(frozen=True, slots=True)
class EdgeRaised:
    """A reclaim edge (pressure, operator, tests) at monotonic ``at``; owner edges come
    from :class:`VetoChanged`. ``resource``: the resource it concerns (None: all)."""

    kind: ClassVar[str] = "edge"
    trigger: Trigger
    at: float
    resource: str | None = None
    detail: str = ""

    def payload(self) -> dict[str, object]:
        return {
            "trigger": self.trigger.value,
            "at": self.at,
            "resource": self.resource,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class HoldChanged:
    """One of the owner's holds (``vacancyd.core.holds``: schedule, pause, battery, an
    exclusive app) came into force or ended, at monotonic ``at``. ``hold`` is its key
    (``pause``, ``exclusive_app:gpu``, ...)."""

    kind: ClassVar[str] = "hold"
    hold: str
    active: bool
    detail: str
    at: float

    def payload(self) -> dict[str, object]:
        return {"hold": self.hold, "active": self.active, "detail": self.detail, "at": self.at}


@dataclass(frozen=True, slots=True)
class JobHoldChanged:
    """A borrowed job was held (``held`` true) or its hold ended (false), at monotonic
    ``at``. ``reason`` (``cut_uncertain``, ``tracking_lost``, ``upstream_silent``),
    ``release_by`` (``server_idle``, ``admin``) and ``detail`` describe the hold; they are
    repeated when it ends. ``borrower``: whose job it is, as shown (a ``[[borrower]]`` name
    or ``default``)."""

    kind: ClassVar[str] = "job_hold"
    job: int
    upstream: str
    held: bool
    reason: str
    release_by: str
    detail: str
    at: float
    borrower: str = "default"

    def payload(self) -> dict[str, object]:
        return {
            "job": self.job,
            "upstream": self.upstream,
            "borrower": self.borrower,
            "held": self.held,
            "reason": self.reason,
            "release_by": self.release_by,
            "detail": self.detail,
            "at": self.at,
        }


@dataclass(frozen=True, slots=True)
class JobChanged:
    """A borrowed job started (``change`` ``started``: admitted, its resources reserved) or
    ended (``ended``, with its ``outcome``: a ``vacancyd_jobs_total`` outcome), at monotonic
    ``at``. ``borrower``: whose job it is, as shown (a ``[[borrower]]`` name or
    ``default``); ``model``: as the request named it."""

    kind: ClassVar[str] = "job"
    job: int
    upstream: str
    borrower: str
    change: str
    model: str | None
    outcome: str | None
    at: float

    def payload(self) -> dict[str, object]:
        return {
            "job": self.job,
            "upstream": self.upstream,
            "borrower": self.borrower,
            "change": self.change,
            "model": self.model,
            "outcome": self.outcome,
            "at": self.at,
        }


#: Event kinds sent once per borrowed job (its start and its end): a busy lender sends them
#: by the hundred a second and none of them says whether it can lend, so the readers that
#: act on lender changes (the Kubernetes publishers, the diagnostics bundle) pass them by.
PER_JOB_EVENTS: frozenset[str] = frozenset({JobChanged.kind})


@dataclass(frozen=True, slots=True)
class ReclaimChanged:
    """An upstream's reclaim moved to ``phase``."""

    kind: ClassVar[str] = "reclaim"
    upstream: str
    phase: ReclaimPhase

    def payload(self) -> dict[str, object]:
        return {"upstream": self.upstream, "phase": self.phase.value}


@dataclass(frozen=True, slots=True)
class ListenerChanged:
    """An upstream's proxy listener was bound or unbound."""

    kind: ClassVar[str] = "listener"
    upstream: str
    bound: bool

    def payload(self) -> dict[str, object]:
        return {"upstream": self.upstream, "bound": self.bound}


@dataclass(frozen=True, slots=True)
class Stopping:
    """The daemon began shutting down (its drain): new work is refused from now on, and
    borrowed work in flight has at most ``grace_s`` seconds left (None: not stated)."""

    kind: ClassVar[str] = "stopping"
    grace_s: float | None = None
    in_flight: int = 0

    def payload(self) -> dict[str, object]:
        if self.grace_s is None:
            return {}
        return {"grace_s": self.grace_s, "in_flight": self.in_flight}


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The drain ended and the listeners close now: the last event an ``/events`` stream
    carries before it ends. ``cut``: borrowed exchanges still in flight that were cut
    (their connections reset); ``hurried``: a second signal ended the drain early."""

    kind: ClassVar[str] = "shutdown"
    cut: int = 0
    hurried: bool = False

    def payload(self) -> dict[str, object]:
        return {"cut": self.cut, "hurried": self.hurried}


@dataclass(frozen=True, slots=True)
class ThermalChanged:
    """A GPU's temperature guard changed (docs/configuration.md, ``max_temperature_c``):
    ``change`` is ``hot`` (above its maximum: new work refused), ``cooled`` (below its resume
    temperature: lending may resume) or ``yield`` (above its maximum for
    ``hot_yield_after_s``: running work is yielded). ``temperature_c`` in °C; ``at``:
    monotonic s."""

    kind: ClassVar[str] = "thermal"
    resource: str
    change: str
    hot: bool
    temperature_c: float
    at: float

    def payload(self) -> dict[str, object]:
        return {
            "resource": self.resource,
            "change": self.change,
            "hot": self.hot,
            "temperature_c": self.temperature_c,
            "at": self.at,
        }


@dataclass(frozen=True, slots=True)
class LendabilityChanged:
    """What a borrowed request would get changed, transition or not (a reading went stale,
    free memory crossed a limit, another model fits). ``upstreams``: per upstream, a
    summary ``{"lendable", "reason", "headroom_mib", "largest_model"}``."""

    kind: ClassVar[str] = "lendable"
    upstreams: Mapping[str, Mapping[str, object]]

    def payload(self) -> dict[str, object]:
        return {"upstreams": {k: dict(v) for k, v in self.upstreams.items()}}


StateEvent = (
    Stopping
    | Shutdown
    | LendabilityChanged
    | LendingSwitched
    | ResourceSwitched
    | CapacityChanged
    | PressureReleased
    | PressureEdgeRaised
    | ThermalChanged
    | UnseenGpuWorkChanged
    | PresenceSampled
    | VetoChanged
    | EdgeRaised
    | HoldChanged
    | JobHoldChanged
    | JobChanged
    | ReclaimChanged
    | ListenerChanged
)
