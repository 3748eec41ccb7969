"""The typed status document: one picture of the lender that ``/status``, ``/metrics`` and
the Kubernetes publisher all render from.

Built once per read by :func:`vacancyd.core.statusbuild.build_status` from inputs that
:func:`vacancyd.api.status.read_status` gathers. Values are raw (seconds,
MiB, 0–1 ratios; ages are monotonic-clock differences); :meth:`StatusDocument.to_json` rounds
them for the JSON document whose shape is described in :mod:`vacancyd.api.status`. A few
fields exist for metrics only and are not in the JSON (marked below).

Every reader renders the same document: ``GET /status`` is :meth:`StatusDocument.to_json`,
each ``/metrics`` gauge of the lender is read from its fields
(:func:`vacancyd.api.metrics.render_gauges`), and the host-side Kubernetes publisher reads
it into the lender state its Node conditions and EndpointSlices come from
(``vacancyd.core.lender.lender_from_document``; the in-cluster companion reads the same
state from the JSON over HTTP, ``lender_from_status``). Nothing any of them shows is read
from the live state beside it, so for one document they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vacancyd.core.observations import Quality


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True, slots=True)
class VetoStatus:
    active: bool
    release_in_s: float | None


@dataclass(frozen=True, slots=True)
class PresenceStatus:
    """Owner presence. ``sessions``: redacted per-session descriptions from the reading.

    ``owner_signal`` (metrics only): the newest reading matched the owner policy; None when
    there is no reading.
    """

    source: str
    sampled: bool
    age_s: float | None
    evidence_complete: bool
    refuses: bool
    veto: VetoStatus
    detail: str
    sessions: tuple[Mapping[str, object], ...]
    session_counts: Mapping[str, int]
    exempt_upstreams: tuple[str, ...]
    owner_signal: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sampled": self.sampled,
            "age_s": _round(self.age_s),
            "evidence_complete": self.evidence_complete,
            "refuses": self.refuses,
            "veto": {"active": self.veto.active, "release_in_s": _round(self.veto.release_in_s)},
            "detail": self.detail,
            "sessions": [dict(s) for s in self.sessions],
            "session_counts": dict(self.session_counts),
            "exempt_upstreams": list(self.exempt_upstreams),
        }


@dataclass(frozen=True, slots=True)
class PressureEdgeStatus:
    cause: str
    age_s: float
    unknown_for_s: float


@dataclass(frozen=True, slots=True)
class PressureStatus:
    """One GPU's owner-pressure guard; ratios 0–1, times in seconds."""

    quality: Quality
    calibrated: bool
    engaged: bool
    threshold_ratio: float | None
    owner_load_ratio: float | None
    borrower_load_ratio: float | None
    calibration_observed_s: float
    calibration_needed_s: float | None
    release_in_s: float | None
    gpu: str | None
    detail: str
    last_edge: PressureEdgeStatus | None

    def to_json(self) -> dict[str, Any]:
        edge = self.last_edge
        return {
            "quality": self.quality.value,
            "calibrated": self.calibrated,
            "engaged": self.engaged,
            "threshold_ratio": _round(self.threshold_ratio, 3),
            "owner_load_ratio": _round(self.owner_load_ratio, 3),
            "borrower_load_ratio": _round(self.borrower_load_ratio, 3),
            "calibration_observed_s": _round(self.calibration_observed_s),
            "calibration_needed_s": self.calibration_needed_s,
            "release_in_s": _round(self.release_in_s),
            "gpu": self.gpu,
            "detail": self.detail,
            "last_edge": None
            if edge is None
            else {
                "cause": edge.cause,
                "age_s": _round(edge.age_s),
                "unknown_for_s": _round(edge.unknown_for_s),
            },
        }


@dataclass(frozen=True, slots=True)
class HolderStatus:
    job: int
    upstream: str
    phase: str


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """One declared resource. Sizes MiB, ``utilization_ratio`` 0–1, ``age_s`` seconds.

    ``has_bytes`` (metrics only): the resource has a byte capacity (not CPU).
    """

    kind: str
    enabled: bool
    quality: Quality
    age_s: float | None
    free_mib: float | None
    total_mib: float | None
    utilization_ratio: float | None
    used_mib: float | None
    why_not: str | None
    error: str | None
    held_by: HolderStatus | None
    pressure: PressureStatus | None
    has_bytes: bool = True
    #: MiB it could lend now: free minus ``min_free_mib``, 0 while not lendable, None
    #: without byte capacity or a reading.
    lendable_mib: float | None = None
    #: Why a durable state file it depends on is unusable (it refuses until repaired).
    state_error: str | None = None
    #: Why a job held on it cannot be written to the state directory (it refuses
    #: ``state_write_failed`` until the retried write succeeds).
    hold_write_error: str | None = None
    #: Borrowed jobs holding it now (more than one with ``max_concurrent``).
    jobs: int = 0
    #: What it is doing when upstreams with ``exclusive_of`` share it (idle, shared,
    #: exclusive: ``vacancyd.core.sharing.CardState``); None when no such upstream uses it.
    card: str | None = None

    @property
    def lendable(self) -> bool:
        return self.why_not is None

    def to_json(self) -> dict[str, Any]:
        held = self.held_by
        return {
            "kind": self.kind,
            "enabled": self.enabled,
            "quality": self.quality.value,
            "age_s": _round(self.age_s),
            "free_mib": _round(self.free_mib),
            "total_mib": _round(self.total_mib),
            "utilization_ratio": _round(self.utilization_ratio, 3),
            "lendable": self.lendable,
            "lendable_mib": _round(self.lendable_mib),
            "why_not": self.why_not,
            "error": self.error,
            "used_mib": _round(self.used_mib),
            "held_by": None
            if held is None
            else {"job": held.job, "upstream": held.upstream, "phase": held.phase},
            "pressure": None if self.pressure is None else self.pressure.to_json(),
            "state_error": self.state_error,
            "hold_write_error": self.hold_write_error,
            "jobs": self.jobs,
            "card": self.card,
        }


@dataclass(frozen=True, slots=True)
class ListenerStatus:
    """The upstream's proxy listener, and (``state``) what serves its own target:
    ``loopback_only``, ``listens_on_network``, ``unknown`` or ``not_observable``."""

    address: str
    bound: bool
    error: str | None
    state: str = "unknown"
    state_detail: str = "not observed yet"


@dataclass(frozen=True, slots=True)
class RefusalStatus:
    reason: str
    retry_after_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class ResidentModelStatus:
    """A model the server reports loaded (Ollama ``/api/ps``); sizes MiB, seconds."""

    name: str
    digest: str | None
    context_length: int | None
    size_mib: float | None
    size_vram_mib: float | None
    expires_in_s: float | None
    expires_error: str | None


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """The adapter's observation of its server. ``models``: what Ollama reports loaded;
    ``allocator_mib`` / ``devices``: ComfyUI's reusable allocator memory and GPU count."""

    quality: Quality
    age_s: float | None
    idle: bool | None
    error: str | None
    version: str | None = None
    models: tuple[ResidentModelStatus, ...] | None = None
    allocator_mib: float | None = None
    devices: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "quality": self.quality.value,
            "age_s": _round(self.age_s),
            "idle": self.idle,
            "error": self.error,
        }
        if self.models is not None:
            out["version"] = self.version
            out["models"] = [
                {
                    "name": m.name,
                    "digest": m.digest,
                    "context_length": m.context_length,
                    "size_mib": _round(m.size_mib),
                    "size_vram_mib": _round(m.size_vram_mib),
                    "expires_in_s": _round(m.expires_in_s),
                    "expires_error": m.expires_error,
                }
                for m in self.models
            ]
        if self.allocator_mib is not None:
            out["allocator_mib"] = _round(self.allocator_mib)
            out["devices"] = self.devices
        return out


@dataclass(frozen=True, slots=True)
class HoldStatus:
    """Why a job is held (``cut_uncertain``, ``tracking_lost``, ``upstream_silent``), since
    when (seconds ago), and what releases it (``server_idle`` or ``admin``)."""

    reason: str
    release_by: str
    for_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class CreditStatus:
    """A residency proof's outcome for one admission; ``added_mib``: memory added back."""

    applied: bool
    why: str
    code: str
    added_mib: float | None = None


@dataclass(frozen=True, slots=True)
class LearnedContextStatus:
    digest: str
    num_ctx: int | None
    dialect: str
    loads: int


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One borrowed job; ``phase`` is the ledger phase (forwarding, tracking, held)."""

    job: int
    phase: str
    model: str | None
    age_s: float
    #: MiB the per-model step charged (None without byte capacity).
    charged_mib: int | None = None
    residency: CreditStatus | None = None
    #: Why a held job is held and what releases it (``held`` phase only).
    hold: HoldStatus | None = None


@dataclass(frozen=True, slots=True)
class ReclaimStatus:
    """An upstream's latest reclaim; ``edges_age_s`` first edge first, seconds."""

    phase: str
    policy: str
    trigger: str
    resource: str | None
    edges_age_s: tuple[float, ...]
    edge_triggers: tuple[str, ...]
    deadline_in_s: float | None
    outcome: str | None


@dataclass(frozen=True, slots=True)
class SharingStatus:
    """An upstream's slots and wait queue (``max_concurrent``, ``busy = "wait"``) and its
    side of an exclusivity; ``card`` is its primary resource's state (idle, shared,
    exclusive)."""

    max_concurrent: int
    jobs: int
    waiting: int
    exclusive_of: tuple[str, ...]
    excluded_by: tuple[str, ...]
    card: str

    def to_json(self) -> dict[str, Any]:
        return {
            "max_concurrent": self.max_concurrent,
            "jobs": self.jobs,
            "waiting": self.waiting,
            "exclusive_of": list(self.exclusive_of),
            "excluded_by": list(self.excluded_by),
            "card": self.card,
        }


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """A ``[[pool]]`` listener: its members (first member first) and whether any lends."""

    members: tuple[str, ...]
    listener: ListenerStatus | None
    lendable: bool

    def to_json(self) -> dict[str, Any]:
        ls = self.listener
        return {
            "members": list(self.members),
            "listener": None
            if ls is None
            else {"address": ls.address, "bound": ls.bound, "error": ls.error},
            "lendable": self.lendable,
        }


@dataclass(frozen=True, slots=True)
class HeadroomStatus:
    """What fits on an upstream now (see ``vacancyd.core.gate.Headroom``); MiB."""

    lendable_mib: float | None
    largest_model: str | None
    largest_model_mib: int | None


@dataclass(frozen=True, slots=True)
class ReachStatus:
    """Whether the upstream's server accepted connections when last checked (see
    ``vacancyd.core.reach``): ``ok``, seconds since that evidence, and why it failed."""

    ok: bool
    age_s: float
    error: str | None


@dataclass(frozen=True, slots=True)
class UpstreamStatus:
    """One ``[[upstream]]``: what the gate would decide now and the work it has."""

    adapter: str
    resource: str
    also_requires: tuple[str, ...]
    owner_scope: str
    listener: ListenerStatus | None
    refusal: RefusalStatus | None
    busy: bool
    server: ServerStatus | None
    unseen_gpu_work: str | None
    active_work: tuple[JobStatus, ...]
    reclaim: ReclaimStatus | None
    sharing: SharingStatus | None = None
    headroom: HeadroomStatus | None = None
    #: Learned footprint priors per model, MiB.
    footprint_priors_mib: Mapping[str, int] | None = None
    #: The learned context map (Ollama) and the Modelfile contexts read per digest.
    learned_contexts: tuple[LearnedContextStatus, ...] | None = None
    modelfile_num_ctx: Mapping[str, int | None] | None = None
    #: What the upstream's controller reports of its server beside the observation (a vLLM
    #: server's sleep mode), as the controller renders it; None when it has no such view.
    sleep: Mapping[str, object] | None = None
    #: The latest reachability evidence (None: none, or too old to count).
    reachable: ReachStatus | None = None

    @property
    def lendable(self) -> bool:
        return self.refusal is None

    def to_json(self) -> dict[str, Any]:
        ls, refusal, server, r = self.listener, self.refusal, self.server, self.reclaim
        doc = {
            "adapter": self.adapter,
            "resource": self.resource,
            "also_requires": list(self.also_requires),
            "owner_scope": self.owner_scope,
            "listener": None
            if ls is None
            else {
                "address": ls.address,
                "bound": ls.bound,
                "error": ls.error,
                "state": ls.state,
                "state_detail": ls.state_detail,
            },
            "lendable": self.lendable,
            # Lendable says what the gate would decide; busy says whether the ledger would
            # refuse a new job resource_busy right now (every slot taken, or an exclusivity).
            "busy": self.busy,
            "sharing": None if self.sharing is None else self.sharing.to_json(),
            "refusal": None
            if refusal is None
            else {
                "reason": refusal.reason,
                "retry_after_s": refusal.retry_after_s,
                "detail": refusal.detail,
            },
            "server": None if server is None else server.to_json(),
            "reachable": None
            if self.reachable is None
            else {
                "ok": self.reachable.ok,
                "age_s": _round(self.reachable.age_s),
                "error": self.reachable.error,
            },
            "headroom": None
            if self.headroom is None
            else {
                "lendable_mib": _round(self.headroom.lendable_mib),
                "largest_model": self.headroom.largest_model,
                "largest_model_mib": self.headroom.largest_model_mib,
            },
            "unseen_gpu_work": self.unseen_gpu_work,
            "active_work": [
                {
                    "job": j.job,
                    "phase": j.phase,
                    "model": j.model,
                    "age_s": _round(j.age_s),
                    "charged_mib": j.charged_mib,
                    "residency": None
                    if j.residency is None
                    else {
                        "applied": j.residency.applied,
                        "why": j.residency.why,
                        "code": j.residency.code,
                        "added_mib": _round(j.residency.added_mib),
                    },
                    "hold": None
                    if j.hold is None
                    else {
                        "reason": j.hold.reason,
                        "release_by": j.hold.release_by,
                        "for_s": _round(j.hold.for_s),
                        "detail": j.hold.detail,
                    },
                }
                for j in self.active_work
            ],
            "footprint_priors_mib": dict(self.footprint_priors_mib or {}),
            "learned_contexts": None
            if self.learned_contexts is None
            else {
                "contexts": [
                    {
                        "digest": c.digest,
                        "num_ctx": c.num_ctx,
                        "dialect": c.dialect,
                        "loads": c.loads,
                    }
                    for c in self.learned_contexts
                ],
                "modelfile_num_ctx": dict(self.modelfile_num_ctx or {}),
            },
            "reclaim": None
            if r is None
            else {
                "phase": r.phase,
                "policy": r.policy,
                "trigger": r.trigger,
                "resource": r.resource,
                "edges_age_s": [_round(a) for a in r.edges_age_s],
                "edge_triggers": list(r.edge_triggers),
                "deadline_in_s": _round(r.deadline_in_s),
                "outcome": r.outcome,
            },
        }
        if self.sleep is not None:
            doc["sleep"] = dict(self.sleep)
        return doc


@dataclass(frozen=True, slots=True)
class OwnerHoldStatus:
    """One of the owner's holds in force (``vacancyd.core.holds.Hold``): its kind
    (schedule, pause, battery, exclusive_app), the resources it covers (None: the whole
    host), when it ends by itself (``until``: wall-clock epoch seconds; ``ends_in_s``:
    seconds from now), both None when it does not."""

    kind: str
    detail: str
    resources: tuple[str, ...] | None
    until: float | None
    ends_in_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "detail": self.detail,
            "resources": None if self.resources is None else list(self.resources),
            "until": self.until,
            "ends_in_s": _round(self.ends_in_s),
        }


@dataclass(frozen=True, slots=True)
class PublisherStatus:
    """Host-side Kubernetes publishing (``[kubernetes]``): where this lender is published
    and whether the last attempt of every write went through (``writes_ok``); ``errors``
    maps each failing write (the client, the Node conditions, the EndpointSlices) to its
    newest error."""

    lender: str
    namespace: str
    node: str | None
    address: str | None
    writes_ok: bool
    errors: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "lender": self.lender,
            "namespace": self.namespace,
            "node": self.node,
            "address": self.address,
            "writes_ok": self.writes_ok,
            "errors": dict(sorted(self.errors.items())),
        }


@dataclass(frozen=True, slots=True)
class StatusDocument:
    """The whole lender. ``uptime_s``: seconds since start (None where not known)."""

    version: str
    uptime_s: float | None
    ready: bool
    not_ready: tuple[str, ...]
    lending_enabled: bool
    presence: PresenceStatus
    resources: Mapping[str, ResourceStatus]
    upstreams: Mapping[str, UpstreamStatus]
    pools: Mapping[str, PoolStatus] = field(default_factory=dict)
    #: True from the moment the daemon starts shutting down.
    stopping: bool = False
    #: Durable state files (or the directory) whose newest write failed -> why.
    write_errors: Mapping[str, str] | None = None
    #: The owner's holds in force, in the order the owner controls list them.
    holds: tuple[OwnerHoldStatus, ...] = ()
    #: The rest of the owner's controls (schedule, pause, power, exclusive apps) as
    #: ``vacancyd.control.owner`` renders them in wall time; None without owner controls.
    owner_controls: Mapping[str, object] | None = None
    #: Host-side Kubernetes publishing; None when ``[kubernetes]`` is not configured.
    kubernetes: PublisherStatus | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``/status`` JSON object (rounded); ``pools`` only where pools are configured.
        ``owner_controls.holds`` is rendered from :attr:`holds`."""
        doc = {
            "version": self.version,
            "uptime_s": _round(self.uptime_s),
            "ready": self.ready,
            "not_ready": list(self.not_ready),
            "lending_enabled": self.lending_enabled,
            "stopping": self.stopping,
            "presence": self.presence.to_json(),
            "resources": {name: r.to_json() for name, r in self.resources.items()},
            "upstreams": {name: u.to_json() for name, u in self.upstreams.items()},
            "durable_state": {"write_errors": dict(sorted((self.write_errors or {}).items()))},
            "owner_controls": None
            if self.owner_controls is None and not self.holds
            else {**(self.owner_controls or {}), "holds": [h.to_json() for h in self.holds]},
            "kubernetes": None if self.kubernetes is None else self.kubernetes.to_json(),
        }
        if self.pools:
            doc["pools"] = {name: p.to_json() for name, p in self.pools.items()}
        return doc


def service_status_line(
    upstreams: Mapping[str, Mapping[str, object]],
    *,
    running: int,
    held: int,
    not_ready: Sequence[str],
) -> str:
    """The one line the service manager shows (sd_notify ``STATUS=``, ``systemctl status``).

    ``upstreams``: per upstream name, ``{"lendable": bool, "reason": str | None}`` (the
    lendability summary); ``running``: borrowed jobs admitted, forwarding or tracked;
    ``held``: jobs held for an uncertain outcome; ``not_ready``: why ``/readyz`` fails
    ([] when ready). For example ``lendable: ollama; not lending: comfyui (owner_active);
    1 job running``.
    """
    parts: list[str] = []
    if not_ready:
        parts.append("not ready: " + ", ".join(not_ready))
    lendable = [name for name, up in upstreams.items() if up.get("lendable")]
    if lendable:
        parts.append("lendable: " + ", ".join(lendable))
    refused = [
        f"{name} ({up.get('reason') or 'refused'})"
        for name, up in upstreams.items()
        if not up.get("lendable")
    ]
    if refused:
        parts.append("not lending: " + ", ".join(refused))
    jobs = f"{running} job{'' if running == 1 else 's'} running"
    if held:
        jobs += f", {held} held"
    parts.append(jobs)
    return "; ".join(parts)
