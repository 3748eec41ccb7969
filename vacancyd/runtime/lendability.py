"""The lendability watcher: turns every change of what a borrowed request would get into an
event (``lendable``), so followers of ``/events`` and the host-side publisher learn it at once.

Transitions (a veto, a switch) already emit events, but lendability also changes without
one: a capacity reading goes stale, free memory crosses a policy limit, a calibration
completes, a larger model starts to fit. The watcher re-decides every upstream from one
snapshot every ``period_s`` seconds (pure computation, no I/O, no upstream call) and emits
only when the summary changed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vacancyd.core import gate
from vacancyd.core.events import LendabilityChanged
from vacancyd.core.lender import quantize_mib
from vacancyd.core.reasons import Refuse
from vacancyd.core.snapshot import RequestFacts
from vacancyd.state import SharedState

#: Seconds between re-decisions; a change is announced at most this late.
PERIOD_S = 0.25


def summary(state: SharedState) -> dict[str, dict[str, Any]]:
    """Per upstream: lendable, the refusal reason, and the headroom as it is published
    (MiB rounded down to ``HEADROOM_STEP_MIB``, the largest model that fits)."""
    snap = state.snapshot()
    out: dict[str, dict[str, Any]] = {}
    for name, policy in sorted(state.upstreams.items()):
        decision = gate.decide(RequestFacts(), snap, policy)
        room = gate.headroom(snap, policy)
        out[name] = {
            "lendable": not isinstance(decision, Refuse),
            "reason": decision.reason.value if isinstance(decision, Refuse) else None,
            "headroom_mib": quantize_mib(room.lendable_mib),
            "largest_model": room.largest_model,
        }
    return out


async def watch(state: SharedState, period_s: float = PERIOD_S) -> None:
    """Run until cancelled: emit ``lendable`` on each change of :func:`summary`."""
    last = summary(state)
    while True:
        await asyncio.sleep(period_s)
        now = summary(state)
        if now != last:
            last = now
            # not every such change is another transition: the summary moved
            state.events.emit(LendabilityChanged(dict(now)))
