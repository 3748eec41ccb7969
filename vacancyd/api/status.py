"""The /status document: what vacancyd sees and why it decides what it decides.

Shape (all times seconds; ``*_age_s`` from the monotonic clock; sizes MiB)::

    {"version", "uptime_s", "ready", "not_ready": [str],
     "lending_enabled": bool,
     "presence": {"source", "sampled", "age_s", "evidence_complete", "refuses",
                  "veto": {"active", "release_in_s"}, "detail", "exempt_upstreams": [str],
                  "sessions": [{"id", "kind", "owner", "why", "type", "class", "seat",
                                "remote", "active", "locked", "idle", "idle_for_s",
                                "owner_processes"?}],
                  "session_counts": {KIND: int}},
     "resources": {NAME: {"kind", "enabled", "quality", "age_s", "free_mib", "total_mib",
                          "utilization_ratio", "used_mib", "lendable", "why_not", "error",
                          "held_by": {"job", "upstream", "phase"} | null,
                          "pressure": {"quality", "calibrated", "engaged", "threshold_ratio",
                                       "owner_load_ratio", "borrower_load_ratio",
                                       "calibration_observed_s", "calibration_needed_s",
                                       "release_in_s", "gpu", "detail", "last_edge"} | null}},
     "upstreams": {NAME: {"adapter", "resource", "also_requires", "owner_scope",
                          "listener": {"address", "bound", "error", "state",
                                       "state_detail"},
                          "lendable", "refusal": {"reason", "retry_after_s", "detail"} | null,
                          "busy",
                          "server": {"quality", "age_s", "idle", "error"} | null,
                          "unseen_gpu_work": str | null,
                          "active_work": [{"job", "phase", "model", "age_s"}],
                          "reclaim": {"phase", "policy", "trigger", "resource", "edges_age_s",
                                      "edge_triggers", "deadline_in_s", "outcome"} | null}}}

``reclaim`` is the upstream's latest reclaim (spec "Yield", Y5): phase waiting, stood_down,
proceeding or done; ``edges_at`` are the ages (s) of the edges it answers, first first.
"""

from __future__ import annotations

from typing import Any

from vacancyd import __version__
from vacancyd.core import gate
from vacancyd.core import presence as presence_rules
from vacancyd.core.exposure import ListenerExposure
from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope
from vacancyd.core.reasons import Admit
from vacancyd.core.reclaim import Reclaim
from vacancyd.core.snapshot import RequestFacts
from vacancyd.state import SharedState


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _pressure_doc(state: SharedState, name: str, now: float) -> dict[str, Any] | None:
    ps = state.pressure.get(name)
    view = state.pressure_view(name, now)
    if ps is None or view is None:
        return None
    value = ps.reading.value
    threshold = ps.learner.current()
    edge = ps.last_edge
    return {
        "quality": view.quality.value,
        "calibrated": view.calibrated,
        "engaged": view.engaged,
        "threshold_ratio": _round(threshold, 3),
        "owner_load_ratio": _round(value.owner_load, 3) if value else None,
        "borrower_load_ratio": _round(value.borrower_load, 3) if value else None,
        "calibration_observed_s": _round(ps.learner.observed_s),
        "calibration_needed_s": None
        if ps.learner.settings.fixed is not None
        else ps.learner.settings.calibration_s,
        "release_in_s": _round(ps.tracker.release_in_s(now)),
        "gpu": ps.gpu,
        "detail": view.detail,
        "last_edge": None
        if edge is None
        else {
            "cause": edge.cause.value,
            "age_s": _round(now - edge.at),
            "unknown_for_s": _round(edge.unknown_for_s),
        },
    }


def render_status(state: SharedState, started_at: float) -> dict[str, Any]:
    now = state.clock()
    snap = state.snapshot(now)
    ready, not_ready = state.ready(now)
    presence = snap.presence
    reading = state.presence.reading.value
    doc: dict[str, Any] = {
        "version": __version__,
        "uptime_s": _round(now - started_at),
        "ready": ready,
        "not_ready": not_ready,
        "lending_enabled": snap.lending_enabled,
        "presence": {
            "source": presence.source,
            "sampled": presence.sampled,
            "age_s": _round(presence.age_s(now)),
            "evidence_complete": presence.evidence_complete,
            "refuses": presence.refuses,
            "veto": {
                "active": presence.veto_active,
                "release_in_s": _round(state.veto.release_in_s(now)),
            },
            "detail": presence.detail,
            "sessions": [dict(s) for s in reading.sessions] if reading else [],
            "session_counts": presence_rules.count_kinds(reading.sessions if reading else ()),
            "exempt_upstreams": sorted(
                n for n, u in state.upstreams.items() if u.owner_scope is OwnerScope.RESOURCE
            ),
        },
        "resources": {},
        "upstreams": {},
    }
    for name, view in snap.resources.items():
        q = view.quality(now)
        value = view.capacity.value
        why_not = None
        if not view.switch_on:
            why_not = "switched off"
        elif q is not Quality.READY:
            why_not = f"capacity {q}"
        elif value is not None:
            why_not = view.policy.evaluate(value)
        holder = state.ledger.holder(name)
        doc["resources"][name] = {
            "kind": view.policy.kind.value,
            "enabled": view.switch_on,
            "quality": q.value,
            "age_s": _round(view.capacity.age_s(now)),
            "free_mib": _round(value.free_mib) if value else None,
            "total_mib": _round(value.total_mib) if value else None,
            "utilization_ratio": _round(value.utilization, 3) if value else None,
            "lendable": why_not is None,
            "why_not": why_not,
            "error": view.capacity.error if q is Quality.UNKNOWN else None,
            "used_mib": _round(value.used_mib) if value else None,
            "held_by": None
            if holder is None
            else {"job": holder.id, "upstream": holder.upstream, "phase": holder.phase.value},
            "pressure": _pressure_doc(state, name, now),
        }
    for name, policy in state.upstreams.items():
        decision = gate.decide(RequestFacts(), snap, policy)
        refusal = None
        if not isinstance(decision, Admit):
            refusal = {
                "reason": decision.reason.value,
                "retry_after_s": decision.retry_after_s,
                "detail": decision.detail,
            }
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
            server_doc = {
                "quality": sq.value,
                "age_s": _round(server.age_s(now)) if server else None,
                "idle": server.value.idle if server and server.value else None,
                "error": server.error if server and sq is Quality.UNKNOWN else None,
            }
        doc["upstreams"][name] = {
            "adapter": policy.adapter,
            "resource": policy.resource,
            "also_requires": list(policy.also_requires),
            "owner_scope": policy.owner_scope.value,
            "listener": None
            if listener is None
            else {
                "address": listener.address,
                "bound": listener.bound,
                "error": listener.error,
                # what serves the upstream's own target (vacancyd.core.exposure)
                "state": exposure.state.value if exposure else ListenerExposure.UNKNOWN.value,
                "state_detail": exposure.detail if exposure else "not observed yet",
            },
            "lendable": refusal is None,
            # Lendable says what the gate would decide; busy says whether a borrowed job
            # holds one of its resources right now (the ledger refuses resource_busy).
            "busy": any(state.ledger.holder(r) is not None for r in policy.resources),
            "refusal": refusal,
            "server": server_doc,
            "unseen_gpu_work": state.unseen_gpu_work.get(name),
            "active_work": [
                {
                    "job": job.id,
                    "phase": job.phase.value,
                    "model": job.model,
                    "age_s": _round(now - job.admitted_at),
                }
                for job in state.ledger.jobs()
                if job.upstream == name
            ],
            "reclaim": _reclaim_doc(state.reclaims.get(name), now),
        }
    return doc


def _reclaim_doc(r: Reclaim | None, now: float) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "phase": r.phase.value,
        "policy": r.policy.on_owner_return.value,
        "trigger": r.first.trigger.value,
        "resource": r.first.resource,
        "edges_age_s": [_round(now - e.at) for e in r.edges],
        "edge_triggers": [e.trigger.value for e in r.edges],
        "deadline_in_s": None if r.deadline is None else _round(r.deadline - now),
        "outcome": r.outcome,
    }
