"""The Node conditions vacancyd publishes for a lender, as pure values.

Written like node-problem-detector's: only our types, merged by type into the Node's list:

* ``VacancyLendable``: True while at least one upstream would admit borrowed work now.
  False carries the gate's refusal code in CamelCase (``owner_active`` -> ``OwnerActive``).
* ``VacancyOwnerPresent``: True while the host policy veto is engaged.
* ``VacancyGPUPressure``: True while a GPU refuses borrowed work because of the owner's
  GPU load (``resource_pressured``).

Until the lender has taken its first full sample (presence sampled once, every resource's
capacity read once) all three are ``Unknown`` with the one reason ``AwaitingFirstSample``:
a refusal the gate answers meanwhile (``owner_active`` for unsampled presence) says nothing
about the owner yet, so it is not published as if it did.

Also here: the patches that keep them (the heartbeat write, marking stale conditions
Unknown, removing retired and, on uninstall, all of ours). ``now_wall`` (epoch seconds) is
an argument, used only for the conditions' timestamps; nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vacancyd.core.kubetime import as_rfc3339, parse_rfc3339, rfc3339
from vacancyd.core.lender import LenderState, Phase, UpstreamState
from vacancyd.core.reasons import PublishReason

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
            transition = as_rfc3339(previous["lastTransitionTime"])
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
            entry["lastHeartbeatTime"] = as_rfc3339(heartbeat)
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
