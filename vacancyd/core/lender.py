"""The lender's state as the Kubernetes publishers see it, read from its status document.

A lender is one vacancyd. Its :class:`LenderState` says where it is in its life (starting,
alive, unreachable, stopped), whether the owner is present and a GPU pressed, and, per
upstream, whether it is lendable now and what fits on it. The host-side publisher and the
in-cluster companion both build it here from the same status document (the companion reads
it over HTTP); :mod:`vacancyd.core.nodeconditions` and :mod:`vacancyd.core.endpoints` turn
it into what they write. :class:`LendableDamper` decides when a flapping upstream is
published lendable again. Pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from vacancyd.core.observations import Quality
from vacancyd.core.reasons import PublishReason, Reason
from vacancyd.core.status import ResourceStatus, StatusDocument


class Phase(StrEnum):
    """Where the lender is in its life, as the publisher knows it."""

    STARTING = "starting"  #: nothing read yet: every condition Unknown
    ALIVE = "alive"  #: a /status document was read recently
    UNREACHABLE = "unreachable"  #: the lender stopped answering within the timeout
    STOPPED = "stopped"  #: clean shutdown: not lendable


@dataclass(frozen=True, slots=True)
class UpstreamState:
    """One upstream of a lender, read from /status ``upstreams.NAME``.

    ``reason`` is the gate's wire code when not lendable (``owner_active``), else None.
    ``port`` is the proxy listener's bound port (None when /status did not say).
    """

    name: str
    lendable: bool
    bound: bool
    port: int | None
    reason: str | None = None
    detail: str = ""
    #: The largest model of the upstream's footprint table a borrowed request for would be
    #: admitted now, and its footprint (MiB); None when no configured model would be.
    largest_model: str | None = None
    largest_model_mib: int | None = None
    #: Lendable MiB left on the upstream's primary resource, rounded down to
    #: ``HEADROOM_STEP_MIB`` (None: the resource has no byte capacity or is unmeasured).
    headroom_mib: int | None = None


#: Published headroom is rounded down to this many MiB, so free memory moving by a few MiB
#: does not rewrite cluster objects.
HEADROOM_STEP_MIB = 256


def quantize_mib(value: float | None) -> int | None:
    """``value`` MiB rounded down to a multiple of ``HEADROOM_STEP_MIB`` (never negative)."""
    if value is None:
        return None
    return max(0, int(value // HEADROOM_STEP_MIB) * HEADROOM_STEP_MIB)


@dataclass(frozen=True, slots=True)
class LenderState:
    """Everything the publisher needs about one lender at one moment.

    ``owner_present``/``gpu_pressure`` are None when the lender cannot tell (presence not yet
    sampled; a GPU's capacity or pressure unmeasured). ``terminating``: the lender (or its
    publisher) is shutting down; its endpoints are published terminating and not ready.
    """

    phase: Phase
    detail: str = ""
    lending_enabled: bool = False
    owner_present: bool | None = None
    owner_detail: str = ""
    gpu_pressure: bool | None = None
    gpu_detail: str = ""
    upstreams: Mapping[str, UpstreamState] = field(default_factory=dict)
    terminating: bool = False
    #: What the lender has not sampled even once yet (presence, a resource's capacity), as a
    #: sentence; None once its first full sample is in.
    unsampled: str | None = None

    @classmethod
    def starting(cls, detail: str = "vacancyd has not reported its state yet") -> LenderState:
        return cls(Phase.STARTING, detail)

    @classmethod
    def unreachable(cls, detail: str, previous: LenderState | None = None) -> LenderState:
        """Keep the upstream list (so endpoints turn not-ready rather than vanish)."""
        return cls(Phase.UNREACHABLE, detail, upstreams=previous.upstreams if previous else {})

    @classmethod
    def stopped(cls, detail: str, previous: LenderState | None = None) -> LenderState:
        return cls(Phase.STOPPED, detail, upstreams=previous.upstreams if previous else {})

    def as_terminating(self, detail: str, *, refusing: bool = False) -> LenderState:
        """This state, marked terminating. ``refusing``: the lender itself is shutting
        down and refuses all new work (so no endpoint is ``serving`` either); otherwise it
        is the publisher that stops and the lender's last known state stands."""
        upstreams = self.upstreams
        if refusing:
            upstreams = {
                name: replace(up, lendable=False, reason=Reason.SHUTTING_DOWN, detail=detail)
                for name, up in upstreams.items()
            }
        return replace(self, terminating=True, detail=detail, upstreams=upstreams)

    @property
    def alive(self) -> bool:
        return self.phase is Phase.ALIVE


class StatusFormatError(ValueError):
    """A /status document does not have the shape vacancyd.api.status renders."""


def _port_of(address: object) -> int | None:
    if not isinstance(address, str):
        return None
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    value = int(port)
    return value if 0 < value < 65536 else None


def lender_from_status(doc: Any) -> LenderState:
    """Parse a /status document into a :class:`LenderState`.

    Raises :class:`StatusFormatError` (a ValueError) when the document is not a /status
    document, so a follower can log it and keep the previous state.
    """
    if not isinstance(doc, dict):
        raise StatusFormatError("/status is not a JSON object")
    try:
        presence = doc["presence"]
        raw_upstreams = doc["upstreams"]
        resources = doc.get("resources", {})
        if not isinstance(presence, dict) or not isinstance(raw_upstreams, dict):
            raise TypeError("presence and upstreams must be objects")
        upstreams: dict[str, UpstreamState] = {}
        for name, up in raw_upstreams.items():
            if not isinstance(up, dict):
                raise TypeError(f"upstream {name!r} is not an object")
            listener = up.get("listener") or {}
            refusal = up.get("refusal") or {}
            headroom = up.get("headroom") or {}
            if not isinstance(headroom, dict):
                raise TypeError(f"upstream {name!r} headroom is not an object")
            upstreams[str(name)] = UpstreamState(
                name=str(name),
                lendable=bool(up["lendable"]),
                bound=bool(listener.get("bound", False)),
                port=_port_of(listener.get("address")),
                reason=None
                if up["lendable"]
                else str(refusal.get("reason", PublishReason.UNKNOWN.value)),
                detail=str(refusal.get("detail", "")),
                largest_model=_opt_str(headroom.get("largest_model")),
                largest_model_mib=_opt_int(headroom.get("largest_model_mib")),
                headroom_mib=quantize_mib(_opt_float(headroom.get("lendable_mib"))),
            )
        veto = presence.get("veto") or {}
        owner_present: bool | None = bool(veto.get("active", False))
        owner_detail = str(presence.get("detail") or "")
        if not presence.get("sampled", False):
            owner_present = None
            owner_detail = "owner presence has not been sampled yet"
        gpu_pressure, gpu_detail = _gpu_pressure(resources, upstreams)
        unsampled = [] if presence.get("sampled", False) else ["owner presence"]
        unsampled += [
            f"capacity of {name}"
            for name, r in sorted((resources or {}).items())
            if isinstance(r, dict)
            and "age_s" in r
            and r["age_s"] is None
            and r.get("error") is None
            and r.get("quality") != "ready"
        ]
        return LenderState(
            Phase.ALIVE,
            lending_enabled=bool(doc.get("lending_enabled", False)),
            owner_present=owner_present,
            owner_detail=owner_detail,
            gpu_pressure=gpu_pressure,
            gpu_detail=gpu_detail,
            upstreams=upstreams,
            terminating=bool(doc.get("stopping", False)),
            unsampled="not sampled yet: " + ", ".join(unsampled) if unsampled else None,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise StatusFormatError(f"/status has an unexpected shape: {exc!r}") from exc


def lender_from_document(doc: StatusDocument) -> LenderState:
    """The :class:`LenderState` of a typed status document, read in-process (the host-side
    publisher) without going through JSON. For every document it equals
    :func:`lender_from_status` on ``doc.to_json()``, the companion's reading of the same
    document over HTTP (``tests/unit/test_status_model.py`` checks it); headroom is read as
    ``/status`` rounds it (0.1 MiB) before it is quantized. Raises nothing."""
    upstreams: dict[str, UpstreamState] = {}
    for name, up in doc.upstreams.items():
        listener, refusal, headroom = up.listener, up.refusal, up.headroom
        lendable_mib = None if headroom is None else headroom.lendable_mib
        upstreams[name] = UpstreamState(
            name=name,
            lendable=up.lendable,
            bound=listener is not None and listener.bound,
            port=None if listener is None else _port_of(listener.address),
            reason=None if refusal is None else refusal.reason,
            detail="" if refusal is None else refusal.detail,
            largest_model=None if headroom is None else headroom.largest_model,
            largest_model_mib=None if headroom is None else headroom.largest_model_mib,
            headroom_mib=quantize_mib(None if lendable_mib is None else round(lendable_mib, 1)),
        )
    presence = doc.presence
    owner_present: bool | None = presence.veto.active
    owner_detail = presence.detail
    if not presence.sampled:
        owner_present = None
        owner_detail = "owner presence has not been sampled yet"
    gpu_pressure, gpu_detail = _typed_gpu_pressure(doc.resources, upstreams)
    unsampled = [] if presence.sampled else ["owner presence"]
    unsampled += [
        f"capacity of {name}"
        for name, r in sorted(doc.resources.items())
        if r.age_s is None and r.error is None and r.quality is not Quality.READY
    ]
    return LenderState(
        Phase.ALIVE,
        lending_enabled=doc.lending_enabled,
        owner_present=owner_present,
        owner_detail=owner_detail,
        gpu_pressure=gpu_pressure,
        gpu_detail=gpu_detail,
        upstreams=upstreams,
        terminating=doc.stopping,
        unsampled="not sampled yet: " + ", ".join(unsampled) if unsampled else None,
    )


def _typed_gpu_pressure(
    resources: Mapping[str, ResourceStatus], upstreams: Mapping[str, UpstreamState]
) -> tuple[bool | None, str]:
    """:func:`_gpu_pressure` on the typed document's resources."""
    gpus = {name: r for name, r in resources.items() if r.kind == "gpu"}
    engaged = [
        f"{name}: {r.pressure.detail or 'engaged'}"
        for name, r in sorted(gpus.items())
        if r.pressure is not None and r.pressure.engaged
    ]
    engaged += [
        f"{u.name}: {u.detail}" for u in upstreams.values() if u.reason == Reason.RESOURCE_PRESSURED
    ]
    if engaged:
        return True, "; ".join(engaged)
    if not gpus:
        return False, "no GPU resource is declared on this lender"
    unclear = []
    for name, r in sorted(gpus.items()):
        pressure = r.pressure
        if r.quality is not Quality.READY:
            unclear.append(f"{name}: capacity {r.quality.value}")
        elif pressure is not None and pressure.quality is not Quality.READY:
            unclear.append(f"{name}: pressure {pressure.quality.value}")
        elif pressure is not None and not pressure.calibrated:
            unclear.append(f"{name}: pressure threshold still calibrating")
    if unclear:
        return None, "GPU pressure cannot be told: " + "; ".join(unclear)
    return False, "no GPU is pressed by the owner's work"


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _opt_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _opt_int(value: Any) -> int | None:
    number = _opt_float(value)
    return None if number is None else int(number)


def _gpu_pressure(
    resources: Any, upstreams: Mapping[str, UpstreamState]
) -> tuple[bool | None, str]:
    """(pressed, detail) from /status: True when a GPU's pressure guard is engaged or an
    upstream refuses with ``resource_pressured``; None when a GPU's capacity or pressure
    reading is not ready (or not yet calibrated), so nobody can tell."""
    gpus = {
        str(name): r
        for name, r in (resources or {}).items()
        if isinstance(r, dict) and r.get("kind") == "gpu"
    }
    engaged = []
    for name, r in sorted(gpus.items()):
        pressure = r.get("pressure")
        if isinstance(pressure, dict) and pressure.get("engaged"):
            engaged.append(f"{name}: {pressure.get('detail') or 'engaged'}")
    engaged += [
        f"{u.name}: {u.detail}" for u in upstreams.values() if u.reason == Reason.RESOURCE_PRESSURED
    ]
    if engaged:
        return True, "; ".join(engaged)
    if not gpus:
        return False, "no GPU resource is declared on this lender"
    unclear = []
    for name, r in sorted(gpus.items()):
        pressure = r.get("pressure")
        if r.get("quality") != "ready":
            unclear.append(f"{name}: capacity {r.get('quality', 'unknown')}")
        elif isinstance(pressure, dict) and pressure.get("quality") != "ready":
            unclear.append(f"{name}: pressure {pressure.get('quality', 'unknown')}")
        elif isinstance(pressure, dict) and not pressure.get("calibrated", True):
            unclear.append(f"{name}: pressure threshold still calibrating")
    if unclear:
        return None, "GPU pressure cannot be told: " + "; ".join(unclear)
    return False, "no GPU is pressed by the owner's work"


@dataclass
class LendableDamper:
    """Publish not-lendable at once, lendable again only after ``stable_s`` seconds of it.

    A flapping lender (free memory around a policy's limit, an owner who comes and goes)
    would otherwise rewrite every Service's endpoints on each flip. The first lendable
    observation of an upstream is published at once; the damping starts with its first
    not-lendable one (or the lender becoming unreachable or stopped). Until an upstream has
    been lendable once, a refusal that only says "not measured yet" (presence never
    sampled, ``resource_unmeasured``) does not count: a daemon that has just started refuses
    so until its first samples arrive, and its first lendable state must not wait for
    ``stable_s``. Times are monotonic seconds, passed in.
    """

    stable_s: float = 0.0
    _lendable_since: dict[str, float] = field(default_factory=dict)
    _seen_unlendable: set[str] = field(default_factory=set)
    _seen_lendable: set[str] = field(default_factory=set)

    def observe(self, lender: LenderState, now: float) -> None:
        """Record ``lender`` as observed at ``now``."""
        if lender.phase is Phase.STARTING:
            return
        for name, up in lender.upstreams.items():
            if lender.alive and not lender.terminating and up.lendable:
                self._lendable_since.setdefault(name, now)
                self._seen_lendable.add(name)
                continue
            self._lendable_since.pop(name, None)
            unmeasured = lender.alive and (
                lender.owner_present is None or up.reason == Reason.RESOURCE_UNMEASURED.value
            )
            if name in self._seen_lendable or not unmeasured:
                self._seen_unlendable.add(name)

    def apply(self, lender: LenderState, now: float) -> tuple[LenderState, float | None]:
        """(``lender`` as it should be published at ``now``, when that may change next).

        An upstream still inside its stable period is published not lendable, reason
        ``settling``.
        """
        if self.stable_s <= 0 or not lender.alive or lender.terminating:
            return lender, None
        changed: dict[str, UpstreamState] = {}
        next_at: float | None = None
        for name, up in lender.upstreams.items():
            since = self._lendable_since.get(name)
            if not up.lendable or since is None or name not in self._seen_unlendable:
                continue
            due = since + self.stable_s
            if now >= due:
                continue
            next_at = due if next_at is None else min(next_at, due)
            changed[name] = replace(
                up,
                lendable=False,
                reason=PublishReason.SETTLING,
                detail=(
                    f"lendable again for {now - since:.0f} s; published after "
                    f"{self.stable_s:.0f} s without a refusal (lendable_stable_s)"
                ),
            )
        if not changed:
            return lender, None
        return replace(lender, upstreams={**lender.upstreams, **changed}), next_at
