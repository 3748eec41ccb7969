"""What vacancyd publishes to Kubernetes, as pure values.

The publisher (``vacancyd.k8s``) reads a lender's state, turns it into desired objects here and
writes them. Nothing in this module does I/O or reads a clock: ``now_wall`` (epoch seconds) is
an argument, used only for the Node conditions' timestamps (style.md: ``*_wall`` for display
and Kubernetes times).

The lender's state is read from its /status document (``vacancyd.api.status``), so the
in-cluster companion, which reads it over HTTP, and the host-side publisher, which renders it
in-process, feed the same code.

Node conditions — written like node-problem-detector's: only our types, merged by type:

* ``VacancyLendable``: True while at least one upstream would admit borrowed work now.
  False carries the gate's refusal code in CamelCase (``owner_active`` -> ``OwnerActive``).
* ``VacancyOwnerPresent``: True while the host policy veto is engaged.
* ``VacancyGPUPressure``: True while a GPU refuses borrowed work because of the owner's
  GPU load (``resource_pressured``).

Until the lender has taken its first full sample (presence sampled once, every resource's
capacity read once) all three are ``Unknown`` with the one reason ``AwaitingFirstSample``:
a refusal the gate answers meanwhile (``owner_active`` for unsampled presence) says nothing
about the owner yet, so it is not published as if it did.

EndpointSlices: one per lender, upstream and Service. The gated Service's endpoint is
``ready`` while the upstream is lendable; the ``-direct`` Service's endpoint is ready while
the lender is alive and its listener bound, so a borrower that goes through it gets a 503
with a reason instead of a refused connection. ``serving`` is "the lender answers".
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from vacancyd.core.reasons import PublishReason, Reason

#: ``endpointslice.kubernetes.io/managed-by`` value on every EndpointSlice we write (a label
#: value: no ``/``), named like the endpointslice controller's ``endpointslice-controller.k8s.io``.
MANAGED_BY = "companion.vacancyd.io"
#: Labels that name what an EndpointSlice belongs to, so a resync finds and repairs it.
LENDER_LABEL = "vacancyd.io/lender"
UPSTREAM_LABEL = "vacancyd.io/upstream"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"

#: Annotations on a gated endpoint's EndpointSlice: what fits on the lender now.
LARGEST_MODEL_ANNOTATION = "vacancyd.io/largest-model"
LARGEST_MODEL_MIB_ANNOTATION = "vacancyd.io/largest-model-mib"
HEADROOM_ANNOTATION = "vacancyd.io/headroom-mib"

LENDABLE = "VacancyLendable"
OWNER_PRESENT = "VacancyOwnerPresent"
GPU_PRESSURE = "VacancyGPUPressure"
CONDITION_TYPES = (LENDABLE, OWNER_PRESENT, GPU_PRESSURE)
#: The one reason of every condition before the lender's first full sample.
AWAITING_FIRST_SAMPLE = "AwaitingFirstSample"


class Status(StrEnum):
    """A Node condition's status: the exact strings the API stores."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


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


def camel(reason: str) -> str:
    """``owner_active`` -> ``OwnerActive``: a wire code as a Kubernetes condition reason."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", reason) if part)


@dataclass(frozen=True, slots=True)
class Condition:
    """A desired Node condition, before timestamps."""

    type: str
    status: Status
    reason: str
    message: str


def node_conditions(lender: LenderState) -> tuple[Condition, ...]:
    """The three Node conditions for ``lender``.

    Before the first reading, and before the lender's first full sample, every condition is
    Unknown with one reason; an unreachable lender makes every condition Unknown and, on
    clean shutdown, ``VacancyLendable`` is False (``Stopped``).
    """
    if lender.alive and not lender.terminating and lender.unsampled is not None:
        message = _message(f"vacancyd has not taken its first full sample ({lender.unsampled})")
        return tuple(
            Condition(kind, Status.UNKNOWN, AWAITING_FIRST_SAMPLE, message)
            for kind in CONDITION_TYPES
        )
    if lender.phase is not Phase.ALIVE:
        reason = {
            Phase.STARTING: "Starting",
            Phase.UNREACHABLE: "LenderUnreachable",
            Phase.STOPPED: "Stopped",
        }[lender.phase]
        lendable_status = Status.FALSE if lender.phase is Phase.STOPPED else Status.UNKNOWN
        return (
            Condition(LENDABLE, lendable_status, reason, _message(lender.detail)),
            Condition(OWNER_PRESENT, Status.UNKNOWN, reason, _message(lender.detail)),
            Condition(GPU_PRESSURE, Status.UNKNOWN, reason, _message(lender.detail)),
        )

    lendable = sorted(n for n, u in lender.upstreams.items() if u.lendable)
    if lender.terminating:
        lend = Condition(
            LENDABLE,
            Status.FALSE,
            "Terminating",
            _message(lender.detail or "vacancyd on this host is shutting down"),
        )
    elif lendable:
        lend = Condition(
            LENDABLE,
            Status.TRUE,
            "Lendable",
            _message("lending " + ", ".join(_headroom_text(lender.upstreams[n]) for n in lendable)),
        )
    elif not lender.upstreams:
        lend = Condition(
            LENDABLE, Status.FALSE, "NoUpstreams", "this lender declares no [[upstream]]"
        )
    else:
        first = lender.upstreams[sorted(lender.upstreams)[0]]
        lend = Condition(
            LENDABLE,
            Status.FALSE,
            camel(first.reason or PublishReason.UNKNOWN),
            _message(
                "; ".join(
                    f"{u.name}: {u.reason}: {u.detail}" for _, u in sorted(lender.upstreams.items())
                )
            ),
        )

    if lender.owner_present is None:
        owner = Condition(
            OWNER_PRESENT, Status.UNKNOWN, "PresenceUnknown", _message(lender.owner_detail)
        )
    elif lender.owner_present:
        owner = Condition(
            OWNER_PRESENT,
            Status.TRUE,
            "OwnerActive",
            _message("the owner is using this machine" + _suffix(lender.owner_detail)),
        )
    else:
        owner = Condition(
            OWNER_PRESENT, Status.FALSE, "OwnerAway", "the host policy veto is released"
        )

    if lender.gpu_pressure is None:
        gpu = Condition(
            GPU_PRESSURE, Status.UNKNOWN, "ResourceUnmeasured", _message(lender.gpu_detail)
        )
    elif lender.gpu_pressure:
        gpu = Condition(GPU_PRESSURE, Status.TRUE, "ResourcePressured", _message(lender.gpu_detail))
    else:
        gpu = Condition(GPU_PRESSURE, Status.FALSE, "NoPressure", _message(lender.gpu_detail))
    return (lend, owner, gpu)


def _headroom_text(up: UpstreamState) -> str:
    """``chat (largest model llama3:70b, 40960 MiB; 41216 MiB to lend)`` for a message."""
    parts = []
    if up.largest_model is not None:
        parts.append(f"largest model {up.largest_model}, {up.largest_model_mib} MiB")
    if up.headroom_mib is not None:
        parts.append(f"{up.headroom_mib} MiB to lend")
    return f"{up.name} ({'; '.join(parts)})" if parts else up.name


#: Kubernetes caps a condition message at 32 KiB; keep ours short enough to read.
MESSAGE_MAX_CHARS = 1024


def _message(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_MAX_CHARS else text[: MESSAGE_MAX_CHARS - 1] + "…"


def _suffix(detail: str) -> str:
    return f": {detail}" if detail else ""


def rfc3339(now_wall: float) -> str:
    """Epoch seconds as the second-precision UTC time Kubernetes stores."""
    return datetime.fromtimestamp(now_wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_patch(
    desired: Sequence[Condition], current: Sequence[Mapping[str, Any]], now_wall: float
) -> dict[str, Any]:
    """The strategic-merge patch body for ``nodes/NAME/status``.

    It carries only our condition types, so the server merges them by ``type`` into the
    Node's list and never touches kubelet's. ``lastHeartbeatTime`` is ``now_wall``;
    ``lastTransitionTime`` keeps the value in ``current`` (the Node as last read) unless the
    status changed.
    """
    by_type = {c.get("type"): c for c in current if isinstance(c, Mapping)}
    stamp = rfc3339(now_wall)
    conditions = []
    for cond in desired:
        previous = by_type.get(cond.type)
        transition = stamp
        if (
            previous is not None
            and previous.get("status") == cond.status.value
            and previous.get("lastTransitionTime")
        ):
            transition = _as_rfc3339(previous["lastTransitionTime"])
        conditions.append(
            {
                "type": cond.type,
                "status": cond.status.value,
                "reason": cond.reason,
                "message": cond.message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": transition,
            }
        )
    return {"status": {"conditions": conditions}}


#: Every Node condition type vacancyd has ever set starts with this; one that is not in
#: ``CONDITION_TYPES`` (a renamed or retired type) is removed on the next write.
CONDITION_PREFIX = "Vacancy"


def retired_conditions(current: Sequence[Mapping[str, Any]]) -> list[str]:
    """Types on the Node that vacancyd once set but no longer publishes.

    Only types with our prefix count: conditions of kubelet, node-problem-detector or any
    other writer are never touched.
    """
    return sorted(
        {
            str(c.get("type"))
            for c in current
            if isinstance(c, Mapping)
            and str(c.get("type", "")).startswith(CONDITION_PREFIX)
            and c.get("type") not in CONDITION_TYPES
        }
    )


#: The reason of a condition the stale-condition check marked Unknown: nobody has refreshed
#: it within the staleness limit (its publisher stopped, or cannot reach the API server).
PUBLISHER_STALE = "PublisherStale"


def parse_rfc3339(value: Any) -> float | None:
    """A Kubernetes timestamp (``2026-11-29T14:02:30Z``, or a datetime) as epoch seconds;
    None when it is missing or not a timestamp."""
    if isinstance(value, datetime):
        stamp = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return stamp.timestamp()
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def stale_patch(
    current: Sequence[Mapping[str, Any]], now_wall: float, stale_after_s: float
) -> dict[str, Any] | None:
    """The strategic-merge patch that marks our stale conditions Unknown, or None.

    A condition of ours (``CONDITION_TYPES``) is stale when its ``lastHeartbeatTime`` (or,
    without one, its ``lastTransitionTime``) is more than ``stale_after_s`` seconds before
    ``now_wall`` (epoch seconds), or when it carries neither. One already ``Unknown`` is
    left alone. The patch keeps ``lastHeartbeatTime`` (it says when the publisher last
    vouched for the condition, as the node lifecycle controller keeps kubelet's), sets
    ``lastTransitionTime`` to now and the reason to ``PublisherStale``.
    """
    stamp = rfc3339(now_wall)
    out = []
    for cond in current:
        if not isinstance(cond, Mapping) or cond.get("type") not in CONDITION_TYPES:
            continue
        if cond.get("status") == Status.UNKNOWN.value:
            continue
        heartbeat = cond.get("lastHeartbeatTime") or cond.get("lastTransitionTime")
        seen = parse_rfc3339(heartbeat)
        if seen is not None and now_wall - seen <= stale_after_s:
            continue
        since = "ever" if seen is None else f"{max(0.0, now_wall - seen):.0f} s"
        message = (
            f"no heartbeat from the publisher for {since} (stale after {stale_after_s:.0f} s); "
            f"it last said {cond.get('status')} ({cond.get('reason') or 'no reason'})"
        )
        entry: dict[str, Any] = {
            "type": cond["type"],
            "status": Status.UNKNOWN.value,
            "reason": PUBLISHER_STALE,
            "message": _message(message),
            "lastTransitionTime": stamp,
        }
        if heartbeat:
            entry["lastHeartbeatTime"] = _as_rfc3339(heartbeat)
        out.append(entry)
    return {"status": {"conditions": out}} if out else None


def cleanup_patch(current: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The strategic-merge patch that removes every condition vacancyd set on a Node (any
    type with the ``Vacancy`` prefix, current or retired), or None when there is none.
    Conditions of every other type are never in it."""
    ours = sorted(
        {
            str(c.get("type"))
            for c in current
            if isinstance(c, Mapping) and str(c.get("type", "")).startswith(CONDITION_PREFIX)
        }
    )
    if not ours:
        return None
    return {"status": {"conditions": [{"type": kind, "$patch": "delete"} for kind in ours]}}


#: The uninstall marker: an EndpointSlice with this label (no endpoints, no Service) that
#: ``vacancyd k8s cleanup`` writes before it removes anything. Every publisher that sees it
#: stops writing, so nothing it removes is written back.
UNINSTALL_LABEL = "vacancyd.io/uninstall"
UNINSTALL_MARKER = "vacancyd-uninstall"
#: A marker older than this (seconds) is a leftover of a cleanup that did not finish, not
#: an uninstall in progress: it silences nobody (a reinstall publishes again).
UNINSTALL_MARKER_MAX_AGE_S = 600.0


def uninstall_marker(namespace: str) -> dict[str, Any]:
    """The uninstall marker EndpointSlice for ``namespace``. It carries our managed-by label
    (so a cleanup removes it with the rest) but no lender or Service label (so no publisher
    or kube-proxy mistakes it for a lender's endpoints)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": UNINSTALL_MARKER,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, UNINSTALL_LABEL: "true"},
        },
        "addressType": "IPv4",
        "endpoints": [],
    }


def uninstall_in_progress(markers: Mapping[str, Mapping[str, Any]], now_wall: float) -> bool:
    """True when one of ``markers`` (EndpointSlices labelled ``UNINSTALL_LABEL``, by name,
    as the server holds them) was created within ``UNINSTALL_MARKER_MAX_AGE_S`` of
    ``now_wall`` (epoch seconds). A marker without a creation time counts."""
    for body in markers.values():
        created = parse_rfc3339((body.get("metadata") or {}).get("creationTimestamp"))
        if created is None or now_wall - created <= UNINSTALL_MARKER_MAX_AGE_S:
            return True
    return False


def _as_rfc3339(value: Any) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        stamp: str = value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return stamp
    return str(value)


# -- EndpointSlices ----------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


def dns_name(*parts: str, limit: int = 63) -> str:
    """Join ``parts`` into a DNS-1123 label (lower case, ``-``, at most ``limit`` chars)."""
    raw = "-".join(_DNS_LABEL.sub("-", p.lower()).strip("-") for p in parts if p)
    raw = re.sub(r"-{2,}", "-", raw).strip("-") or "x"
    if len(raw) <= limit:
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return raw[: limit - 9].rstrip("-") + "-" + digest


def address_problem(address: str) -> str | None:
    """Why the API server would reject ``address`` as an endpoint, or None.

    EndpointSlice validation refuses loopback, link-local and unspecified addresses (they
    would route to the node the client runs on, not to the lender).
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if ip.is_loopback:
        return f"{address} is a loopback address"
    if ip.is_link_local:
        return f"{address} is a link-local address"
    if ip.is_unspecified:
        return f"{address} is the unspecified address"
    if ip.is_multicast:
        return f"{address} is a multicast address"
    return None


@dataclass(frozen=True, slots=True)
class SliceTarget:
    """Which Service an upstream's endpoint joins, and how.

    ``direct``: the endpoint is ready while the lender is alive and listening (the
    ``-direct`` Service), instead of while the upstream is lendable.
    """

    service: str
    port_name: str = "http"
    direct: bool = False


def endpoint_flags(lender: LenderState, upstream: str, *, direct: bool) -> tuple[bool, bool]:
    """(would be ready, answers) for ``upstream``'s endpoint, ignoring termination.

    ``answers`` is "the lender answers and this listener is bound"; the first value is that
    plus, for the gated Service, "lendable now". :func:`endpoint_conditions` turns them into
    the published conditions.
    """
    up = lender.upstreams.get(upstream)
    answers = lender.alive and up is not None and up.bound
    ready = answers and (direct or (up is not None and up.lendable))
    return ready, answers


@dataclass(frozen=True, slots=True)
class EndpointConditions:
    """An endpoint's ``conditions`` as discovery.k8s.io/v1 defines them.

    ``serving`` equals ``ready`` except while ``terminating``: then ``ready`` is False and
    ``serving`` still says whether the endpoint would take traffic (kube-proxy falls back to
    serving, terminating endpoints only when a Service has no ready one).
    """

    ready: bool
    serving: bool
    terminating: bool

    def as_dict(self) -> dict[str, bool]:
        return {"ready": self.ready, "serving": self.serving, "terminating": self.terminating}


def endpoint_conditions(lender: LenderState, upstream: str, *, direct: bool) -> EndpointConditions:
    """The published conditions of ``upstream``'s endpoint in a gated or ``-direct`` Service.

    Every field is always set (an absent ``ready`` would count as ready).
    """
    would, _answers = endpoint_flags(lender, upstream, direct=direct)
    if lender.terminating:
        return EndpointConditions(ready=False, serving=would, terminating=True)
    return EndpointConditions(ready=would, serving=would, terminating=False)


def endpoint_slice(
    *,
    lender: str,
    upstream: str,
    namespace: str,
    target: SliceTarget,
    address: str,
    port: int,
    ready: bool,
    serving: bool,
    node_name: str | None = None,
    terminating: bool = False,
    headroom: UpstreamState | None = None,
) -> dict[str, Any]:
    """The EndpointSlice for one lender's upstream in one Service.

    Its name is unique per (Service, lender, upstream), so many lenders can join one
    Service. Applied with server-side apply, every field here is ours; anything an outside
    edit changed is put back on the next write. ``headroom``, when given, adds the
    ``vacancyd.io/largest-model``, ``vacancyd.io/largest-model-mib`` and
    ``vacancyd.io/headroom-mib`` annotations (absent values are left out, so server-side
    apply removes them).
    """
    family = "IPv6" if ":" in address else "IPv4"
    endpoint: dict[str, Any] = {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
    }
    if node_name:
        endpoint["nodeName"] = node_name
    annotations: dict[str, str] = {}
    if headroom is not None:
        if headroom.largest_model is not None:
            annotations[LARGEST_MODEL_ANNOTATION] = headroom.largest_model
            annotations[LARGEST_MODEL_MIB_ANNOTATION] = str(headroom.largest_model_mib)
        if headroom.headroom_mib is not None:
            annotations[HEADROOM_ANNOTATION] = str(headroom.headroom_mib)
    metadata: dict[str, Any] = {
        "name": dns_name(target.service, lender, upstream),
        "namespace": namespace,
    }
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            **metadata,
            "labels": {
                SERVICE_NAME_LABEL: target.service,
                MANAGED_BY_LABEL: MANAGED_BY,
                LENDER_LABEL: dns_name(lender),
                UPSTREAM_LABEL: dns_name(upstream),
            },
        },
        "addressType": family,
        "endpoints": [endpoint],
        "ports": [{"name": target.port_name, "port": port, "protocol": "TCP"}],
    }


def slice_matches(desired: Any, current: Any) -> bool:
    """True when ``current`` (an object as the server holds it) already carries every field
    of ``desired`` with the same value; fields the server added (defaults, managedFields,
    resourceVersion) do not matter. Lists must match element by element."""
    if isinstance(desired, Mapping):
        if not isinstance(current, Mapping):
            return False
        return all(k in current and slice_matches(v, current[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(current, list) or len(current) != len(desired):
            return False
        return all(slice_matches(d, c) for d, c in zip(desired, current, strict=True))
    return bool(desired == current)


OUR_ANNOTATIONS = (LARGEST_MODEL_ANNOTATION, LARGEST_MODEL_MIB_ANNOTATION, HEADROOM_ANNOTATION)


def slice_up_to_date(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    """True when the server's copy ``current`` needs no write to become ``desired``: every
    field we set matches, and none of our annotations lingers that ``desired`` dropped."""
    if current is None:
        return False
    # Items of a list carry no apiVersion/kind: compare everything else.
    fields = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    if not slice_matches(fields, current):
        return False
    want = desired.get("metadata", {}).get("annotations") or {}
    have = (current.get("metadata") or {}).get("annotations") or {}
    return all(want.get(k) == have.get(k) for k in OUR_ANNOTATIONS)


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
