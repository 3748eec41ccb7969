"""The event bus beside the store: each state transition as a typed event
(:mod:`vacancyd.core.events`), for observers (``GET /events``, the diagnostics bundle,
telemetry, the Kubernetes feeder). Event-loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vacancyd.core.events import StateEvent

log = logging.getLogger("vacancyd.state")

#: Called with each event.
Listener = Callable[[StateEvent], None]


class EventBus:
    """Calls every subscriber with each event, in the order they subscribed."""

    def __init__(self) -> None:
        self._subscribers: list[Listener] = []

    def __len__(self) -> int:
        """How many subscribers there are now."""
        return len(self._subscribers)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` on each event; returns an unsubscribe."""
        self._subscribers.append(listener)
        return lambda: self._subscribers.remove(listener) if listener in self._subscribers else None

    def emit(self, event: StateEvent) -> None:
        """Tell every subscriber; one that raises is logged and the others still hear it."""
        for listener in list(self._subscribers):
            try:
                listener(event)
            except Exception:  # a broken subscriber must not break a collector
                log.exception("state listener failed on %s", event.kind)
