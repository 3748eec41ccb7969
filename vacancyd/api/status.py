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
     "durable_state": {"write_errors": {PATH: str}, "usage_ledger_error": str | null},
     "resources": {NAME: {"kind", "enabled", "quality", "age_s", "free_mib", "total_mib",
                          "utilization_ratio", "used_mib", "lendable", "lendable_mib",
                          "why_not", "error", "jobs", "card": str | null,
                          "held_by": {"job", "upstream", "phase"} | null,
                          "state_error": str | null, "hold_write_error": str | null,
                          "temperature_c": °C | null, "energy_j": J | null,
                          "thermal": {"max_c", "resume_c", "hot_yield_after_s", "hot",
                                      "hot_for_s", "above_for_s"} | null,
                          "power_limit": {"lend_w", "original_w", "applied", "problem",
                                          "error"} | null,
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
                                                    "detail"} | null,
                                           "borrower"}],
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
writes come from one :class:`~vacancyd.core.status.StatusDocument`: :func:`read_status`
gathers the inputs from the live store and the pure
:func:`vacancyd.core.statusbuild.build_status` builds the document from them.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vacancyd import __version__
from vacancyd.core.lifecycle import Hold as JobHold
from vacancyd.core.status import ListenerStatus, PublisherStatus, StatusDocument
from vacancyd.core.statusbuild import PressureReadout, StatusInputs, build_status
from vacancyd.state import SharedState

#: Per upstream, a controller's own view for /status (a vLLM controller's sleep mode).
SleepViews = Mapping[str, Callable[[], Mapping[str, object]]]


@dataclass(frozen=True)
class StatusViews:
    """What their owners render for the status document, read at each status read (each
    optional): ``sleep``, each controller's view per upstream; ``owner``, the owner
    controls; ``kubernetes``, the host-side publisher's state (None when there is none);
    ``usage_error``, why the usage ledger cannot be used (None: it can); ``job_holds``, the
    held jobs shown (job id -> hold; :meth:`vacancyd.control.holds.HoldBook.shown`);
    ``job_borrowers``, each live job's borrower by job id ("": unnamed;
    :meth:`vacancyd.control.work.Work.borrowers`). Without the last two no job is shown
    held and every job is the unnamed borrower's."""

    sleep: SleepViews = field(default_factory=dict)
    owner: Callable[[], Mapping[str, object]] | None = None
    kubernetes: Callable[[], PublisherStatus | None] | None = None
    usage_error: Callable[[], str | None] | None = None
    job_holds: Callable[[], Mapping[int, JobHold]] | None = None
    job_borrowers: Callable[[], Mapping[int, str]] | None = None


def gather_status_inputs(
    state: SharedState, started_at: float | None = None, views: StatusViews | None = None
) -> StatusInputs:
    """Read everything :func:`~vacancyd.core.statusbuild.build_status` needs from ``state``
    at its clock, in one synchronous step (nothing can change in between); the owners'
    ``views`` are rendered here. ``started_at``: monotonic start time (for uptime)."""
    views = views or StatusViews()
    now = state.clock()
    snap = state.snapshot(now)
    _ready, not_ready = state.ready(now)
    reading = state.presence.reading.value
    ledger = state.ledger
    return StatusInputs(
        now=now,
        version=__version__,
        snapshot=snap,
        upstreams=dict(state.upstreams),
        not_ready=tuple(not_ready),
        started_at=started_at,
        presence_sessions=tuple(reading.sessions) if reading else (),
        owner_signal=None if reading is None else reading.owner_signal,
        veto_release_in_s=state.veto.release_in_s(now),
        jobs=tuple(ledger.jobs()),
        holder={name: job for name in snap.resources if (job := ledger.holder(name)) is not None},
        holders=ledger.holders_by_upstream(),
        jobs_per_resource=ledger.jobs_per_resource(),
        waiting=dict(ledger.waiting),
        busy=frozenset(
            name
            for name, policy in state.upstreams.items()
            if ledger.fits(name, policy.resources) is not None
        ),
        pressure={
            name: PressureReadout(
                threshold_ratio=ps.learner.current(),
                owner_load_ratio=ps.reading.value.owner_load if ps.reading.value else None,
                borrower_load_ratio=ps.reading.value.borrower_load if ps.reading.value else None,
                calibration_observed_s=ps.learner.observed_s,
                calibration_needed_s=None
                if ps.learner.settings.fixed is not None
                else ps.learner.settings.calibration_s,
                release_in_s=ps.tracker.release_in_s(now),
                gpu=ps.gpu,
                last_edge=ps.last_edge,
            )
            for name, ps in state.pressure.items()
        },
        listeners={
            name: ListenerStatus(ls.address, ls.bound, ls.error)
            for name, ls in state.listeners.items()
        },
        exposure=dict(state.target_exposure),
        unseen_gpu_work=dict(state.unseen_gpu_work),
        job_holds={} if views.job_holds is None else dict(views.job_holds()),
        job_borrowers={} if views.job_borrowers is None else dict(views.job_borrowers()),
        reclaims=dict(state.reclaims),
        reach=dict(state.reach),
        reach_max_age_s=state.reach_max_age_s,
        sleep={name: view() for name, view in views.sleep.items() if name in state.upstreams},
        pools=dict(state.pools),
        write_errors=dict(state.write_errors),
        power_limits=dict(state.power_limits),
        usage_error=None if views.usage_error is None else views.usage_error(),
        owner_controls=None if views.owner is None else views.owner(),
        kubernetes=None if views.kubernetes is None else views.kubernetes(),
    )


def read_status(
    state: SharedState, started_at: float | None = None, views: StatusViews | None = None
) -> StatusDocument:
    """Everything ``/status``, ``/metrics`` and the Kubernetes publisher show, from one
    snapshot at the state's clock. ``started_at``: monotonic start time (for uptime);
    ``views``: see :func:`gather_status_inputs`."""
    return build_status(gather_status_inputs(state, started_at, views))


def render_status(
    state: SharedState, started_at: float, views: StatusViews | None = None
) -> dict[str, Any]:
    """The ``/status`` JSON object (see the module docstring for its shape): one
    :func:`read_status` document as JSON."""
    return read_status(state, started_at, views).to_json()
