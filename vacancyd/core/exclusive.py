"""Exclusive applications: programs whose presence holds lending, with a grace period before
they engage and a resume delay after they exit (pure).

A short-lived helper that shares a name with an exclusive app must not flap the host, so a
name engages the hold only once it has been seen on every scan for ``grace_s`` seconds; and
the owner restarting their game should not hand the GPU to a borrower in between, so the
hold releases only ``resume_after_s`` seconds after the last scan that saw any of them. A scan
that failed counts as seeing every configured app (the safe reading): it keeps an engaged
hold engaged, and a run of failures longer than the grace engages it.

Times are monotonic seconds passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum


class ExclusiveScope(StrEnum):
    """What an exclusive app holds: only the GPU resources, or the whole host."""

    GPU = "gpu"
    HOST = "host"


@dataclass
class ExclusiveTracker:
    """Hysteresis for one scope's exclusive apps. ``names``: the program names it watches."""

    names: frozenset[str]
    grace_s: float = 0.0
    resume_after_s: float = 0.0
    engaged: bool = False
    #: name -> monotonic time it was first seen in the current unbroken run of sightings
    first_seen: dict[str, float] = field(default_factory=dict)
    last_seen_at: float | None = None
    #: the names that engaged (or keep) the hold, for /status and refusals
    holding: frozenset[str] = frozenset()

    def observe(self, running: Iterable[str] | None, now: float) -> bool:
        """Feed one scan (the configured names seen running, or None when the scan failed);
        returns True when ``engaged`` changed (an edge)."""
        seen = self.names if running is None else frozenset(running) & self.names
        for name in list(self.first_seen):
            if name not in seen:
                del self.first_seen[name]
        for name in seen:
            self.first_seen.setdefault(name, now)
        if seen:
            self.last_seen_at = now
        ripe = frozenset(n for n, t in self.first_seen.items() if now - t >= self.grace_s)
        if not self.engaged:
            if ripe:
                self.engaged = True
                self.holding = ripe
                return True
            return False
        if seen:
            self.holding = ripe or self.holding
            return False
        if self.last_seen_at is None or now - self.last_seen_at >= self.resume_after_s:
            self.engaged = False
            self.holding = frozenset()
            return True
        return False

    def engage_in_s(self, now: float) -> float | None:
        """Seconds until a name seen now would engage the hold (None: none pending)."""
        if self.engaged or not self.first_seen:
            return None
        return max(0.0, min(self.grace_s - (now - t) for t in self.first_seen.values()))

    def release_in_s(self, now: float) -> float | None:
        """Seconds until the hold releases if nothing is seen again (None: not engaged)."""
        if not self.engaged or self.last_seen_at is None:
            return None
        return max(0.0, self.resume_after_s - (now - self.last_seen_at))
