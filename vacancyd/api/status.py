"""The /status document: what vacancyd sees and why it decides what it decides.

Shape (all times seconds; ``*_age_s`` from the monotonic clock; sizes MiB)::

    {"version", "uptime_s", "ready", "not_ready": [str],
     "lending_enabled": bool, "stopping": bool,
     "owner_controls": {"holds": [{"kind", "detail", "resources", "until", "ends_in_s"}],
                        "schedule": {"timezone", "open", "windows", "next_change",
                                     "next_change_local", "next_change_in_s"} | null,
                        "pause": {"kind", "set_at", "until", "until_local", "ends_in_s",
                                  "seen_owner", "reason", "detail"} | null,
                        "pause_error", "pause_persist_error", "power": {...} | null,
                        "exclusive_apps": {SCOPE: {...}}} | null,
     "presence": {"source", "sampled", "age_s", "evidence_complete", "refuses",
                  "veto": {"active", "release_in_s"}, "detail", "exempt_upstreams": [str],
                  "sessions": [{"id", "kind", "owner", "why", "type", "class", "seat",
                                "remote", "active", "locked", "idle", "idle_for_s",
                                "owner_processes"?}],
                  "session_counts": {KIND: int}},
     "durable_state": {"write_errors": {PATH: str}},
     "resources": {NAME: {"kind", "enabled", "quality", "age_s", "free_mib", "total_mib",
                          "utilization_ratio", "used_mib", "lendable", "lendable_mib",
                          "why_not", "error", "jobs", "card": str | null,
                          "held_by": {"job", "upstream", "phase"} | null,
                          "state_error": str | null, "hold_write_error": str | null,
                          "pressure": {"quality", "calibrated", "engaged", "threshold_ratio",
                                       "owner_load_ratio", "borrower_load_ratio",
                                       "calibration_observed_s", "calibration_needed_s",
                                       "release_in_s", "gpu", "detail", "last_edge"} | null}},
     "upstreams": {NAME: {"adapter", "resource", "also_requires", "owner_scope",
                          "listener": {"address", "bound", "error", "state",
                                       "state_detail"},
                          "lendable", "refusal": {"reason", "retry_after_s", "detail"} | null,
                          "busy",
                          "sharing": {"max_concurrent", "jobs", "waiting", "exclusive_of",
                                      "excluded_by", "card"},
                          "headroom": {"lendable_mib", "largest_model", "largest_model_mib"},
                          "server": {"quality", "age_s", "idle", "error",
                                     "version"?, "models"?: [{"name", "digest",
                                     "context_length", "size_mib", "size_vram_mib",
                                     "expires_in_s", "expires_error"}],
                                     "allocator_mib"?, "devices"?} | null,
                          "unseen_gpu_work": str | null,
                          "active_work": [{"job", "phase", "model", "age_s", "charged_mib",
                                           "residency": {"applied", "why", "code",
                                                         "added_mib"} | null,
                                           "hold": {"reason", "release_by", "for_s",
                                                    "detail"} | null}],
                          "footprint_priors_mib": {MODEL: int},
                          "learned_contexts": {"contexts": [{"digest", "num_ctx",
                                               "dialect", "loads"}],
                                               "modelfile_num_ctx": {DIGEST: int|null}}
                                              | null,
                          "reclaim": {"phase", "policy", "trigger", "resource", "edges_age_s",
                                      "edge_triggers", "deadline_in_s", "outcome"} | null,
                          "sleep"?: {...}}},
     "kubernetes": {"lender", "namespace", "node", "address", "writes_ok",
                    "errors": {WRITE: str}} | null,
     "pools": {NAME: {"members": [str], "listener": {...} | null, "lendable"}}}

``busy``: the ledger would refuse a new job ``resource_busy`` now (every ``max_concurrent``
slot taken, or an exclusivity). ``sharing.card``: the primary resource's exclusivity state
(idle, shared, exclusive). A resource's ``jobs`` counts the borrowed jobs holding it; its
``card`` is the same exclusivity state, set only where upstreams with ``exclusive_of`` share
it. ``pools`` appears only when ``[[pool]]`` listeners are configured; ``sleep`` only for
upstreams whose controller reports one (vLLM); ``kubernetes`` is null unless host-side
publishing (``[kubernetes]``) is configured.

Everything here, every lender gauge on ``/metrics`` and what the Kubernetes publisher
writes come from one :class:`~vacancyd.core.status.StatusDocument` (:func:`build_status`).

``stopping`` is true from the moment the daemon starts shutting down. ``lendable_mib`` is
what the resource could lend now (free minus ``min_free_mib``; 0 while it is not lendable;
null without byte capacity or a reading). An upstream's ``headroom`` is the same for its
primary resource, 0 while the upstream refuses every borrowed request, plus the configured
model (``models.footprint_mib``) with the largest footprint that a request would be admitted
for now (null when none would be).

``reclaim`` is the upstream's latest reclaim (docs/reclaim.md): phase waiting, stood_down,
proceeding or done; ``edges_at`` are the ages (s) of the edges it answers, first first.
"""

from __future__ import annotations

from typing import Any

from vacancyd import __version__
from vacancyd.core import gate, sharing
from vacancyd.core import presence as presence_rules
from vacancyd.core.exposure import ListenerExposure
from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope
from vacancyd.core.reach import Reach
from vacancyd.core.reasons import Admit, Credit
from vacancyd.core.reclaim import Reclaim
from vacancyd.core.snapshot import RequestFacts
from vacancyd.core.status import (
    CreditStatus,
    HeadroomStatus,
    HolderStatus,
    HoldStatus,
    JobStatus,
    LearnedContextStatus,
    ListenerStatus,
    OwnerHoldStatus,
    PoolStatus,
    PresenceStatus,
    PressureEdgeStatus,
    PressureStatus,
    ReachStatus,
    ReclaimStatus,
    RefusalStatus,
    ResidentModelStatus,
    ResourceStatus,
    ServerStatus,
    SharingStatus,
    StatusDocument,
    UpstreamStatus,
    VetoStatus,
)
from vacancyd.state import SharedState


def _pressure(state: SharedState, name: str, now: float) -> PressureStatus | None:
    ps = state.pressure.get(name)
    view = state.pressure_view(name, now)
    if ps is None or view is None:
        return None
    value = ps.reading.value
    edge = ps.last_edge
    return PressureStatus(
        quality=view.quality,
        calibrated=view.calibrated,
        engaged=view.engaged,
        threshold_ratio=ps.learner.current(),
        owner_load_ratio=value.owner_load if value else None,
        borrower_load_ratio=value.borrower_load if value else None,
        calibration_observed_s=ps.learner.observed_s,
        calibration_needed_s=None
        if ps.learner.settings.fixed is not None
        else ps.learner.settings.calibration_s,
        release_in_s=ps.tracker.release_in_s(now),
        gpu=ps.gpu,
        detail=view.detail,
        last_edge=None
        if edge is None
        else PressureEdgeStatus(edge.cause.value, now - edge.at, edge.unknown_for_s),
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


def build_status(state: SharedState, started_at: float | None = None) -> StatusDocument:
    """Everything ``/status``, ``/metrics`` and the Kubernetes publisher show, from one
    snapshot at the state's clock. ``started_at``: monotonic start time (for uptime)."""
    now = state.clock()
    snap = state.snapshot(now)
    _ready, not_ready = state.ready(now)
    presence = snap.presence
    reading = state.presence.reading.value
    sessions = reading.sessions if reading else ()
    presence_doc = PresenceStatus(
        source=presence.source,
        sampled=presence.sampled,
        age_s=presence.age_s(now),
        evidence_complete=presence.evidence_complete,
        refuses=presence.refuses,
        veto=VetoStatus(presence.veto_active, state.veto.release_in_s(now)),
        detail=presence.detail,
        sessions=tuple(sessions),
        session_counts=presence_rules.count_kinds(sessions),
        exempt_upstreams=tuple(
            sorted(n for n, u in state.upstreams.items() if u.owner_scope is OwnerScope.RESOURCE)
        ),
        owner_signal=None if reading is None else reading.owner_signal,
    )
    jobs = state.ledger.jobs()
    holders = state.ledger.holders_by_upstream()
    per_resource = state.ledger.jobs_per_resource()
    #: Resources that upstreams with ``exclusive_of`` share: their card state is shown.
    exclusive = {p.resource for p in state.upstreams.values() if p.exclusive_of}
    resources: dict[str, ResourceStatus] = {}
    for name, view in snap.resources.items():
        q = view.quality(now)
        value = view.capacity.value
        why_not = None
        if not view.switch_on:
            why_not = "switched off"
        elif view.state_error is not None:
            why_not = f"durable state unusable: {view.state_error}"
        elif view.hold_write_error is not None:
            why_not = (
                f"a held job cannot be written to the state directory: {view.hold_write_error}"
            )
        elif view.hold_unsaved:
            why_not = "a held job is being written to the state directory"
        elif q is not Quality.READY:
            why_not = f"capacity {q}"
        elif value is not None:
            why_not = view.policy.evaluate(value)
        holder = state.ledger.holder(name)
        lendable_mib: float | None = None
        if value is not None and value.free_mib is not None and view.policy.has_bytes:
            lendable_mib = (
                max(0.0, value.free_mib - view.policy.min_free_mib) if why_not is None else 0.0
            )
        resources[name] = ResourceStatus(
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
            pressure=_pressure(state, name, now),
            has_bytes=view.policy.has_bytes,
            lendable_mib=lendable_mib,
            state_error=view.state_error,
            hold_write_error=view.hold_write_error,
            jobs=per_resource.get(name, 0),
            card=sharing.card_state(name, holders, state.upstreams).value
            if name in exclusive
            else None,
        )
    upstreams: dict[str, UpstreamStatus] = {}
    for name, policy in state.upstreams.items():
        decision = gate.decide(RequestFacts(), snap, policy)
        refusal = None
        if not isinstance(decision, Admit):
            refusal = RefusalStatus(decision.reason.value, decision.retry_after_s, decision.detail)
        room = gate.headroom(snap, policy)
        listener = state.listeners.get(name)
        exposure = state.target_exposure.get(name)
        server = snap.servers.get(name)
        server_doc = None
        if policy.needs_model_observation or server is not None:
            sq = (
                server.quality(now, policy.model_observation_max_age_s)
                if server is not None
                else Quality.UNKNOWN
            )
            sv = server.value if server else None
            age = server.age_s(now) if server else None
            server_doc = ServerStatus(
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
        learned = state.learning.get(name)
        upstreams[name] = UpstreamStatus(
            adapter=policy.adapter,
            resource=policy.resource,
            also_requires=tuple(policy.also_requires),
            owner_scope=policy.owner_scope.value,
            listener=None
            if listener is None
            else ListenerStatus(
                listener.address,
                listener.bound,
                listener.error,
                # what serves the upstream's own target (vacancyd.core.exposure)
                state=exposure.state.value if exposure else ListenerExposure.UNKNOWN.value,
                state_detail=exposure.detail if exposure else "not observed yet",
            ),
            refusal=refusal,
            busy=state.ledger.fits(name, policy.resources) is not None,
            sharing=SharingStatus(
                max_concurrent=policy.max_concurrent,
                jobs=sum(1 for job in jobs if job.upstream == name),
                waiting=state.ledger.waiting.get(name, 0),
                exclusive_of=tuple(sorted(policy.exclusive_of)),
                excluded_by=tuple(sorted(policy.excluded_by)),
                card=sharing.card_state(policy.resource, holders, state.upstreams).value,
            ),
            server=server_doc,
            unseen_gpu_work=state.unseen_gpu_work.get(name),
            active_work=tuple(
                JobStatus(
                    job.id,
                    job.phase.value,
                    job.model,
                    now - job.admitted_at,
                    charged_mib=job.charged_mib,
                    residency=_credit(job.credit),
                    hold=None
                    if (held := state.job_holds.get(job.id)) is None
                    else HoldStatus(
                        held.reason.value, held.release_by.value, now - held.since, held.detail
                    ),
                )
                for job in jobs
                if job.upstream == name
            ),
            reclaim=_reclaim(state.reclaims.get(name), now),
            headroom=HeadroomStatus(room.lendable_mib, room.largest_model, room.largest_model_mib),
            reachable=_reach(state.reach.get(name), now, state.reach_max_age_s),
            footprint_priors_mib=dict(sorted(state.priors.get(name, {}).items())),
            learned_contexts=None
            if learned is None
            else tuple(
                LearnedContextStatus(k.digest, k.num_ctx, k.dialect, v)
                for k, v in sorted(
                    learned.contexts.items(),
                    key=lambda kv: (kv[0].digest, kv[0].num_ctx or 0, kv[0].dialect),
                )
            ),
            modelfile_num_ctx=None
            if learned is None
            else dict(sorted(learned.modelfile_num_ctx.items())),
            sleep=None if (view_of := state.upstream_views.get(name)) is None else view_of(),
        )
    return StatusDocument(
        version=__version__,
        uptime_s=None if started_at is None else now - started_at,
        ready=not not_ready,
        not_ready=tuple(not_ready),
        lending_enabled=snap.lending_enabled,
        presence=presence_doc,
        resources=resources,
        upstreams=upstreams,
        pools={
            name: PoolStatus(
                members=members,
                listener=None
                if (ls := state.listeners.get(name)) is None
                else ListenerStatus(ls.address, ls.bound, ls.error),
                lendable=any(upstreams[m].lendable for m in members if m in upstreams),
            )
            for name, members in state.pools.items()
        },
        stopping=snap.stopping,
        write_errors=dict(state.write_errors),
        holds=tuple(
            OwnerHoldStatus(
                kind=h.kind.value,
                detail=h.detail,
                resources=None if h.resources is None else tuple(sorted(h.resources)),
                until=h.until,
                ends_in_s=h.ends_in_s,
            )
            for h in state.holds
        ),
        # The owner's controls render their own part, in wall time.
        owner_controls=None if state.owner_view is None else state.owner_view(),
        kubernetes=None if state.publisher_status is None else state.publisher_status(),
    )


def _credit(credit: Credit | None) -> CreditStatus | None:
    if credit is None:
        return None
    return CreditStatus(credit.applied, credit.why, credit.code, credit.added_mib or None)


def render_status(state: SharedState, started_at: float) -> dict[str, Any]:
    """The ``/status`` JSON object (see the module docstring for its shape): one
    :func:`build_status` document as JSON."""
    return build_status(state, started_at).to_json()


def _reach(reach: Reach | None, now: float, max_age_s: float) -> ReachStatus | None:
    """The upstream's latest reachability evidence for /status; None when there is none or
    it is older than ``max_age_s`` (it no longer counts for the probe either)."""
    if reach is None or reach.ok is None or reach.at is None or now - reach.at > max_age_s:
        return None
    return ReachStatus(reach.ok, max(0.0, now - reach.at), reach.error or None)
