"""``vacancyd status`` for a person: a status document rendered as lines of text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vacancyd.core.status import (
    OwnerControlsStatus,
    ResourceStatus,
    StatusDocument,
    UpstreamStatus,
)


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def format_sessions(
    sessions: Sequence[Mapping[str, Any]], exempt_upstreams: Sequence[str] = ()
) -> list[str]:
    """Lines for the sessions presence saw (see vacancyd.core.presence for the fields) and
    the upstreams exempt from owner presence."""
    lines = []
    for s in sessions:
        if s.get("kind") == "unknown":
            lines.append(f"  session {s.get('id')} [unknown]: {s.get('why')}")
            continue
        state = ", ".join(
            word
            for word, on in (
                ("remote" if s.get("remote") else "local", True),
                ("locked" if s.get("locked") else "unlocked", True),
                ("active", s.get("active")),
                (
                    f"idle {s['idle_for_s']:.0f}s" if s.get("idle_for_s") is not None else "idle",
                    s.get("idle"),
                ),
            )
            if on
        )
        lines.append(
            f"  session {s.get('id')} [{s.get('kind')} {s.get('type') or '-'}] {state}: "
            f"{'OWNER' if s.get('owner') else 'not the owner'} ({s.get('why')})"
        )
    if exempt_upstreams:
        lines.append(f"  exempt from owner presence: {', '.join(exempt_upstreams)}")
    return lines


def format_owner_controls(oc: OwnerControlsStatus | None) -> list[str]:
    """Lines for the owner's controls (see vacancyd.control.owner for the fields)."""
    if oc is None:
        return []
    lines = [f"HELD ({hold.kind}): {hold.detail}" for hold in oc.holds]
    sched: Any = oc.controls.get("schedule")
    if sched:
        change = sched.get("next_change_local")
        lines.append(
            f"schedule ({sched.get('timezone')}): {'open' if sched.get('open') else 'closed'}"
            + (f", {'closes' if sched.get('open') else 'opens'} at {change}" if change else "")
        )
    if oc.controls.get("pause_persist_error"):
        lines.append(f"  pause not saved: {oc.controls['pause_persist_error']}")
    return lines


def format_status(doc: StatusDocument) -> str:
    """Render a status document for a person (``StatusDocument.from_json`` reads one from
    ``/status``)."""
    lines = [
        f"vacancyd {doc.version}, up {doc.uptime_s or 0:.0f} s, "
        f"{'ready' if doc.ready else 'NOT READY: ' + '; '.join(doc.not_ready)}",
        f"lending: {'on' if doc.lending_enabled else 'OFF'}",
    ]
    lines.extend(format_owner_controls(doc.owner_controls))
    p = doc.presence
    lines.append(
        f"presence: source={p.source} sampled={_yes(p.sampled)} "
        f"age={'-' if p.age_s is None else f'{p.age_s:.1f}s'} "
        f"evidence_complete={_yes(p.evidence_complete)} "
        f"veto={'ACTIVE' if p.veto.active else 'released'}"
        + (f" (releases in {p.veto.release_in_s:.0f}s)" if p.veto.release_in_s else "")
    )
    if p.detail:
        lines.append(f"  {p.detail}")
    lines.extend(format_sessions(p.sessions, p.exempt_upstreams))
    lines.append("resources:")
    for name, r in doc.resources.items():
        lines.extend(_format_resource(name, r))
    lines.append("upstreams:")
    for name, u in doc.upstreams.items():
        lines.extend(_format_upstream(name, u))
    if doc.pools:
        lines.append("pools:")
    for name, pool in doc.pools.items():
        ls = pool.listener
        lines.append(
            f"  {name} on {'?' if ls is None else ls.address} "
            f"{'bound' if ls is not None and ls.bound else 'NOT BOUND'} -> "
            f"{', '.join(pool.members)}: "
            f"{'lendable' if pool.lendable else 'no member lendable'}"
        )
    if doc.durable_state.usage_ledger_error:
        lines.append(f"usage ledger: {doc.durable_state.usage_ledger_error}")
    return "\n".join(lines)


def _format_resource(name: str, r: ResourceStatus) -> list[str]:
    cap = ""
    if r.free_mib is not None:
        cap = f" free={r.free_mib:.0f}/{r.total_mib or 0:.0f} MiB"
    if r.utilization_ratio is not None:
        cap += f" util={r.utilization_ratio:.0%}"
    state = "lendable" if r.lendable else f"not lendable ({r.why_not})"
    lines = [
        f"  {name} [{r.kind}] {'on' if r.enabled else 'OFF'} "
        f"{r.quality.value}{'' if r.age_s is None else f' {r.age_s:.1f}s old'}{cap}: {state}"
    ]
    if r.error:
        lines.append(f"    error: {r.error}")
    pr = r.pressure
    if pr is not None:
        thr, load = pr.threshold_ratio, pr.owner_load_ratio
        lines.append(
            f"    GPU pressure: {pr.quality.value} "
            f"{'ENGAGED' if pr.engaged else 'clear'} "
            f"owner={'-' if load is None else f'{load:.0%}'} "
            f"threshold={'-' if thr is None else f'{thr:.0%}'} "
            + (
                "calibrated"
                if pr.calibrated
                else f"calibrating ({pr.calibration_observed_s or 0:.0f}"
                f"/{pr.calibration_needed_s or 0:.0f} s)"
            )
            + (f": {pr.detail}" if pr.detail else "")
        )
    if r.held_by is not None:
        h = r.held_by
        lines.append(f"    held by job {h.job} ({h.upstream}, {h.phase})")
    return lines


def _format_upstream(name: str, u: UpstreamStatus) -> list[str]:
    ls = u.listener
    verdict = (
        "lendable"
        if u.lendable
        else (f"refusing {u.refusal.reason} ({u.refusal.detail})" if u.refusal else "?")
    )
    lines = [
        f"  {name} [{u.adapter}] on {'?' if ls is None else ls.address} "
        f"{'bound' if ls is not None and ls.bound else 'NOT BOUND'} -> resource {u.resource}"
        f"{' + ' + ', '.join(u.also_requires) if u.also_requires else ''}: {verdict}"
    ]
    if ls is not None and ls.state == "listens_on_network":
        lines.append(f"    WARNING: its server can be reached without the gate: {ls.state_detail}")
    server = u.server
    if server is not None:
        lines.append(
            f"    server: {server.quality.value} idle={_yes(server.idle)}"
            + (f" error: {server.error}" if server.error else "")
        )
    work = u.active_work
    sharing = u.sharing
    slots = ""
    if sharing is not None:
        slots = f" of {sharing.max_concurrent} slot(s), {sharing.waiting} waiting"
        if sharing.exclusive_of or sharing.excluded_by:
            slots += f", card {sharing.card}"
    lines.append(
        f"    active work: {len(work)}{slots}"
        + "".join(f"\n      job {w.job} {w.phase} model={w.model} {w.age_s:.0f}s" for w in work)
    )
    rec = u.reclaim
    if rec is not None:
        lines.append(
            f"    reclaim: {rec.phase} ({rec.trigger}, policy "
            f"{rec.policy}, {len(rec.edge_triggers)} edge(s)"
            + (f", outcome {rec.outcome}" if rec.outcome else "")
            + ")"
        )
    if u.unseen_gpu_work:
        lines.append(f"    unseen GPU work: {u.unseen_gpu_work}")
    return lines
