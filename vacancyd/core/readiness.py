"""Readiness (``/readyz``): whether this lender can decide on fresh evidence right now.

Pure: the caller passes a :class:`~vacancyd.core.snapshot.Snapshot` and which listeners are
bound; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vacancyd.core.observations import Quality
from vacancyd.core.snapshot import Snapshot


def not_ready(
    snap: Snapshot, *, listeners: Mapping[str, bool], required: Iterable[str]
) -> list[str]:
    """Why the lender is not ready at ``snap.now`` ([] when it is), for ``/status``.

    Not ready while stopping, while any proxy listener (``listeners``: upstream name ->
    bound) is unbound, while a presence source that refuses has no fresh reading, and while
    any switched-on resource in ``required`` (those some upstream depends on) lacks a fresh
    capacity sample or, on a GPU with pressure, a fresh pressure reading.
    """
    now = snap.now
    why: list[str] = ["stopping"] if snap.stopping else []
    for name, bound in sorted(listeners.items()):
        if not bound:
            why.append(f"listener {name} not bound")
    presence = snap.presence
    if presence.refuses:
        if not presence.sampled:
            why.append("presence not sampled")
        elif not presence.fresh(now):
            why.append("presence stale")
    for name in sorted(set(required)):
        view = snap.resources.get(name)
        if view is None or not view.switch_on:
            continue
        quality = view.quality(now)
        if quality is not Quality.READY:
            why.append(f"resource {name} {quality}")
        if view.pressure is not None and view.pressure.quality is not Quality.READY:
            why.append(f"resource {name} pressure {view.pressure.quality}")
    return why
