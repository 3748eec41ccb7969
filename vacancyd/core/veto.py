"""The host policy veto's hysteresis (docs/architecture.md).

It engages on one matching sample and releases only once ``release_after_s`` seconds have
passed since the last matching sample, with every sample in between clear. Times are
monotonic seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VetoTracker:
    release_after_s: float
    engaged: bool = False
    last_match_at: float | None = None
    engaged_at: float | None = None

    def observe(self, match: bool, now: float) -> bool:
        """Feed one sample; return True when the veto's state changed (an edge)."""
        if match:
            self.last_match_at = now
            if not self.engaged:
                self.engaged = True
                self.engaged_at = now
                return True
            return False
        if self.engaged and (
            self.last_match_at is None or now - self.last_match_at >= self.release_after_s
        ):
            self.engaged = False
            self.engaged_at = None
            return True
        return False

    def release_in_s(self, now: float) -> float | None:
        """Seconds until a run of clear samples would release the veto, or None if released."""
        if not self.engaged or self.last_match_at is None:
            return None
        return max(0.0, self.release_after_s - (now - self.last_match_at))
