"""Build the status document from explicit inputs: the one picture ``/status``, ``/metrics``
and the Kubernetes publishers render.

:func:`build_status` is pure: everything it reads is in its :class:`StatusInputs`, which
the caller gathers from the live store in one synchronous step
(:func:`vacancyd.api.status.read_status`), so one set of inputs always gives the same
document. The decisions it shows are the core's own: what the gate would decide now
(:func:`vacancyd.core.gate.decide`), what fits (:func:`vacancyd.core.gate.headroom`), why a
resource does not lend, its card state (:mod:`vacancyd.core.sharing`), whether reach
evidence still counts. Times: ``now`` and every ``*_at`` are monotonic seconds; sizes MiB.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from vacancyd.core import gate, sharing
from vacancyd.core import presence as presence_rules
from vacancyd.core.exposure import Exposure, ListenerExposure
from vacancyd.core.ledger import Job
from vacancyd.core.lifecycle import Hold as JobHold
from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope, UpstreamPolicy
from vacancyd.core.pressure import PressureEdge
from vacancyd.core.reach import Reach
from vacancyd.core.reasons import Admit, Credit
from vacancyd.core.reclaim import Reclaim
from vacancyd.core.snapshot import RequestFacts, ResourceView, ServerState, Snapshot
from vacancyd.core.status import (
    CreditStatus,
    DurableStateStatus,
    HeadroomStatus,
    HolderStatus,
    HoldStatus,
    JobStatus,
    LearnedContextStatus,
    LearnedStatus,
    ListenerStatus,
    OwnerControlsStatus,
    OwnerHoldStatus,
    PoolStatus,
    PowerLimitStatus,
    PresenceStatus,
    PressureEdgeStatus,
    PressureStatus,
    PublisherStatus,
    ReachStatus,
    ReclaimStatus,
    RefusalStatus,
    ResidentModelStatus,
    ResourceStatus,
    ServerStatus,
    SharingStatus,
    StatusDocument,
    ThermalStatus,
    UpstreamStatus,
    VetoStatus,
)
from vacancyd.core.thermal import ThermalView
from vacancyd.core.usage import UNNAMED, borrower_label


@dataclass(frozen=True, slots=True)
class PressureReadout:
    """What one GPU's owner-pressure guard holds now, beside the gate's view of it
    (``ResourceView.pressure``): its learned threshold and newest loads (0–1 ratios), how
    long it has calibrated and needs to (seconds; None needed: a fixed threshold), seconds
    until its hysteresis releases, the GPU's UUID and its newest rising edge."""

    threshold_ratio: float | None
    owner_load_ratio: float | None
    borrower_load_ratio: float | None
    calibration_observed_s: float
    calibration_needed_s: float | None
    release_in_s: float | None
    gpu: str | None
    last_edge: PressureEdge | None


@dataclass(frozen=True, slots=True)
class StatusInputs:
    """Everything :func:`build_status` reads, gathered at one moment ``now`` (monotonic s).

    ``snapshot``: the gate's frozen view at ``now`` (its priors, learning and owner holds
    are shown too). The ledger's part: ``jobs`` (id order), ``holder`` (resource -> the
    oldest job holding it), ``holders`` (resource -> the upstream of each job holding it,
    oldest first), ``jobs_per_resource``, ``waiting`` (requests waiting per upstream) and
    ``busy`` (upstreams the ledger would refuse ``resource_busy`` now). ``listeners``: each
    proxy listener's address, bound flag and error (its exposure comes from ``exposure``).
    ``sleep``, ``owner_controls`` and ``kubernetes`` are already rendered by their owners.
    """

    now: float
    version: str
    snapshot: Snapshot
    upstreams: Mapping[str, UpstreamPolicy]
    not_ready: tuple[str, ...] = ()
    started_at: float | None = None
    presence_sessions: tuple[Mapping[str, object], ...] = ()
    owner_signal: bool | None = None
    veto_release_in_s: float | None = None
    jobs: tuple[Job, ...] = ()
    holder: Mapping[str, Job] = field(default_factory=dict)
    holders: Mapping[str, Sequence[str]] = field(default_factory=dict)
    jobs_per_resource: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, int] = field(default_factory=dict)
    busy: frozenset[str] = frozenset()
    pressure: Mapping[str, PressureReadout] = field(default_factory=dict)
    listeners: Mapping[str, ListenerStatus] = field(default_factory=dict)
    exposure: Mapping[str, Exposure] = field(default_factory=dict)
    unseen_gpu_work: Mapping[str, str] = field(default_factory=dict)
    job_holds: Mapping[int, JobHold] = field(default_factory=dict)
    #: Each running job's borrower by job id (``""``: the unnamed borrower).
    job_borrowers: Mapping[int, str] = field(default_factory=dict)
    reclaims: Mapping[str, Reclaim] = field(default_factory=dict)
    reach: Mapping[str, Reach] = field(default_factory=dict)
    #: Reach evidence older than this (seconds) is not shown (it no longer counts).
    reach_max_age_s: float = 30.0
    sleep: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    pools: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    write_errors: Mapping[str, str] = field(default_factory=dict)
    #: Per GPU with a lending power limit: the power limiter's report.
    power_limits: Mapping[str, PowerLimitStatus] = field(default_factory=dict)
    usage_error: str | None = None
    owner_controls: Mapping[str, object] | None = None
    kubernetes: PublisherStatus | None = None


def build_status(inputs: StatusInputs) -> StatusDocument:
    """The status document for ``inputs``; raises nothing for any consistent inputs."""
    now, snap = inputs.now, inputs.snapshot
    resources = {name: _resource(inputs, name, view) for name, view in snap.resources.items()}
    upstreams = {name: _upstream(inputs, name, policy) for name, policy in inputs.upstreams.items()}
    return StatusDocument(
        version=inputs.version,
        uptime_s=None if inputs.started_at is None else now - inputs.started_at,
        ready=not inputs.not_ready,
        not_ready=tuple(inputs.not_ready),
        lending_enabled=snap.lending_enabled,
        presence=_presence(inputs),
        resources=resources,
        upstreams=upstreams,
        pools={
            name: PoolStatus(
                members=members,
                listener=inputs.listeners.get(name),
                lendable=any(upstreams[m].lendable for m in members if m in upstreams),
            )
            for name, members in inputs.pools.items()
        },
        stopping=snap.stopping,
        durable_state=DurableStateStatus(
            dict(inputs.write_errors), usage_ledger_error=inputs.usage_error
        ),
        owner_controls=_owner_controls(inputs),
        kubernetes=inputs.kubernetes,
    )


def _owner_controls(inputs: StatusInputs) -> OwnerControlsStatus | None:
    """The owner's holds in force and the rest of the owner's controls, which render their
    own part in wall time; None when there are neither."""
    holds = tuple(
        OwnerHoldStatus(
            kind=h.kind.value,
            detail=h.detail,
            resources=None if h.resources is None else tuple(sorted(h.resources)),
            until=h.until,
            ends_in_s=h.ends_in_s,
        )
        for h in inputs.snapshot.holds
    )
    if inputs.owner_controls is None and not holds:
        return None
    return OwnerControlsStatus(dict(inputs.owner_controls or {}), holds)


def _presence(inputs: StatusInputs) -> PresenceStatus:
    now, presence = inputs.now, inputs.snapshot.presence
    sessions = inputs.presence_sessions
    return PresenceStatus(
        source=presence.source,
        sampled=presence.sampled,
        age_s=presence.age_s(now),
        evidence_complete=presence.evidence_complete,
        refuses=presence.refuses,
        veto=VetoStatus(presence.veto_active, inputs.veto_release_in_s),
        detail=presence.detail,
        sessions=tuple(sessions),
        session_counts=presence_rules.count_kinds(sessions),
        exempt_upstreams=tuple(
            sorted(n for n, u in inputs.upstreams.items() if u.owner_scope is OwnerScope.RESOURCE)
        ),
        owner_signal=inputs.owner_signal,
    )


def _why_not(view: ResourceView, quality: Quality) -> str | None:
    """Why the resource does not lend now (None: it does)."""
    value = view.capacity.value
    if not view.switch_on:
        return "switched off"
    if view.state_error is not None:
        return f"durable state unusable: {view.state_error}"
    if view.hold_write_error is not None:
        return f"a held job cannot be written to the state directory: {view.hold_write_error}"
    if view.hold_unsaved:
        return "a held job is being written to the state directory"
    if quality is not Quality.READY:
        return f"capacity {quality}"
    if value is not None:
        why = view.policy.evaluate(value)
        if why is None:
            refusal = gate.decide_thermal(view.thermal, value.temperature_c, view.name)
            why = None if refusal is None else refusal.detail
        return why
    return None


def _resource(inputs: StatusInputs, name: str, view: ResourceView) -> ResourceStatus:
    now = inputs.now
    q = view.quality(now)
    value = view.capacity.value
    why_not = _why_not(view, q)
    holder = inputs.holder.get(name)
    lendable_mib: float | None = None
    if value is not None and value.free_mib is not None and view.policy.has_bytes:
        lendable_mib = (
            max(0.0, value.free_mib - view.policy.min_free_mib) if why_not is None else 0.0
        )
    #: Resources that upstreams with ``exclusive_of`` share: their card state is shown.
    exclusive = any(p.resource == name and p.exclusive_of for p in inputs.upstreams.values())
    return ResourceStatus(
        kind=view.policy.kind.value,
        enabled=view.switch_on,
        quality=q,
        age_s=view.capacity.age_s(now),
        free_mib=value.free_mib if value else None,
        total_mib=value.total_mib if value else None,
        utilization_ratio=value.utilization if value else None,
        used_mib=value.used_mib if value else None,
        why_not=why_not,
        error=view.capacity.error if q is Quality.UNKNOWN else None,
        held_by=None
        if holder is None
        else HolderStatus(holder.id, holder.upstream, holder.phase.value),
        pressure=_pressure(inputs.pressure.get(name), view, now),
        has_bytes=view.policy.has_bytes,
        lendable_mib=lendable_mib,
        state_error=view.state_error,
        hold_write_error=view.hold_write_error,
        jobs=inputs.jobs_per_resource.get(name, 0),
        card=sharing.card_state(name, inputs.holders, inputs.upstreams).value
        if exclusive
        else None,
        temperature_c=value.temperature_c if value else None,
        energy_j=value.energy_j if value else None,
        thermal=_thermal(view.thermal, now),
        power_limit=inputs.power_limits.get(name),
    )


def _thermal(view: ThermalView | None, now: float) -> ThermalStatus | None:
    if view is None:
        return None
    return ThermalStatus(
        max_c=view.policy.max_c,
        resume_c=view.policy.resume_c,
        hot_yield_after_s=view.policy.hot_yield_after_s,
        hot=view.hot,
        hot_for_s=None if view.hot_since is None else max(0.0, now - view.hot_since),
        above_for_s=None if view.above_since is None else max(0.0, now - view.above_since),
    )


def _pressure(
    readout: PressureReadout | None, view: ResourceView, now: float
) -> PressureStatus | None:
    pressure = view.pressure
    if readout is None or pressure is None:
        return None
    edge = readout.last_edge
    return PressureStatus(
        quality=pressure.quality,
        calibrated=pressure.calibrated,
        engaged=pressure.engaged,
        threshold_ratio=readout.threshold_ratio,
        owner_load_ratio=readout.owner_load_ratio,
        borrower_load_ratio=readout.borrower_load_ratio,
        calibration_observed_s=readout.calibration_observed_s,
        calibration_needed_s=readout.calibration_needed_s,
        release_in_s=readout.release_in_s,
        gpu=readout.gpu,
        detail=pressure.detail,
        last_edge=None
        if edge is None
        else PressureEdgeStatus(edge.cause.value, now - edge.at, edge.unknown_for_s),
    )


def _server(inputs: StatusInputs, name: str, policy: UpstreamPolicy) -> ServerStatus | None:
    now = inputs.now
    server = inputs.snapshot.servers.get(name)
    if not policy.needs_model_observation and server is None:
        return None
    sq = (
        server.quality(now, policy.model_observation_max_age_s)
        if server is not None
        else Quality.UNKNOWN
    )
    sv: ServerState | None = server.value if server else None
    age = server.age_s(now) if server else None
    return ServerStatus(
        quality=sq,
        age_s=age,
        idle=sv.idle if sv else None,
        error=server.error if server and sq is Quality.UNKNOWN else None,
        version=sv.version if sv else None,
        models=None
        if sv is None or sv.models is None
        else tuple(
            ResidentModelStatus(
                m.name,
                m.digest,
                m.context_length,
                m.size_mib,
                m.size_vram_mib,
                None if m.expires_in_s is None or age is None else m.expires_in_s - age,
                m.expires_error,
            )
            for m in sv.models
        ),
        allocator_mib=sv.allocator_mib if sv else None,
        devices=sv.devices if sv else None,
    )


def _upstream(inputs: StatusInputs, name: str, policy: UpstreamPolicy) -> UpstreamStatus:
    now, snap = inputs.now, inputs.snapshot
    decision = gate.decide(RequestFacts(), snap, policy)
    refusal = None
    if not isinstance(decision, Admit):
        refusal = RefusalStatus(decision.reason.value, decision.retry_after_s, decision.detail)
    room = gate.headroom(snap, policy)
    listener = inputs.listeners.get(name)
    exposure = inputs.exposure.get(name)
    learned = snap.learning.get(name)
    return UpstreamStatus(
        adapter=policy.adapter,
        resource=policy.resource,
        also_requires=tuple(policy.also_requires),
        owner_scope=policy.owner_scope.value,
        listener=None
        if listener is None
        else replace(
            listener,
            # what serves the upstream's own target (vacancyd.core.exposure)
            state=exposure.state.value if exposure else ListenerExposure.UNKNOWN.value,
            state_detail=exposure.detail if exposure else "not observed yet",
        ),
        refusal=refusal,
        busy=name in inputs.busy,
        sharing=SharingStatus(
            max_concurrent=policy.max_concurrent,
            jobs=sum(1 for job in inputs.jobs if job.upstream == name),
            waiting=inputs.waiting.get(name, 0),
            exclusive_of=tuple(sorted(policy.exclusive_of)),
            excluded_by=tuple(sorted(policy.excluded_by)),
            card=sharing.card_state(policy.resource, inputs.holders, inputs.upstreams).value,
        ),
        server=_server(inputs, name, policy),
        unseen_gpu_work=inputs.unseen_gpu_work.get(name),
        active_work=tuple(
            JobStatus(
                job.id,
                job.phase.value,
                job.model,
                now - job.admitted_at,
                charged_mib=job.charged_mib,
                residency=_credit(job.credit),
                hold=None
                if (held := inputs.job_holds.get(job.id)) is None
                else HoldStatus(
                    held.reason.value, held.release_by.value, now - held.since, held.detail
                ),
                borrower=borrower_label(inputs.job_borrowers.get(job.id, UNNAMED)),
            )
            for job in inputs.jobs
            if job.upstream == name
        ),
        reclaim=_reclaim(inputs.reclaims.get(name), now),
        headroom=HeadroomStatus(room.lendable_mib, room.largest_model, room.largest_model_mib),
        reachable=_reach(inputs.reach.get(name), now, inputs.reach_max_age_s),
        footprint_priors_mib=dict(sorted(snap.priors.get(name, {}).items())),
        learned_contexts=None
        if learned is None
        else LearnedStatus(
            tuple(
                LearnedContextStatus(k.digest, k.num_ctx, k.dialect, v)
                for k, v in sorted(
                    learned.contexts.items(),
                    key=lambda kv: (kv[0].digest, kv[0].num_ctx or 0, kv[0].dialect),
                )
            ),
            dict(sorted(learned.modelfile_num_ctx.items())),
        ),
        sleep=inputs.sleep.get(name),
    )


def _reclaim(r: Reclaim | None, now: float) -> ReclaimStatus | None:
    if r is None:
        return None
    return ReclaimStatus(
        phase=r.phase.value,
        policy=r.policy.on_owner_return.value,
        trigger=r.first.trigger.value,
        resource=r.first.resource,
        edges_age_s=tuple(now - e.at for e in r.edges),
        edge_triggers=tuple(e.trigger.value for e in r.edges),
        deadline_in_s=None if r.deadline is None else r.deadline - now,
        outcome=r.outcome,
    )


def _credit(credit: Credit | None) -> CreditStatus | None:
    if credit is None:
        return None
    return CreditStatus(credit.applied, credit.why, credit.code, credit.added_mib or None)


def _reach(reach: Reach | None, now: float, max_age_s: float) -> ReachStatus | None:
    """The upstream's latest reachability evidence; None when there is none or it is older
    than ``max_age_s`` (it no longer counts for the probe either)."""
    if reach is None or reach.ok is None or reach.at is None or now - reach.at > max_age_s:
        return None
    return ReachStatus(reach.ok, max(0.0, now - reach.at), reach.error or None)
