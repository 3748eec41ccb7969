"""Whether an upstream's server answers at all, as the daemon last learned it.

The gate decides whether a borrowed request *may* run; this says whether the server behind
the proxy listener is there to run it. The lendability probe answers 503
``upstream_unreachable`` while it is not, so a balancer takes a lender whose inference
server has stopped out of rotation instead of sending it work that ends in a 502.

Evidence comes from two places, and the newest wins: a TCP connection the daemon opens (and
closes at once) to the upstream's ``target`` on the collectors' cadence while the probe is
being asked, and a borrowed request whose connection to the upstream failed. Nothing here
reads a clock: times are monotonic seconds, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from vacancyd.core.reasons import ErrorCode

#: The probe's reason code while the upstream server does not answer (the same code a
#: borrowed request that cannot connect gets with its 502).
UPSTREAM_UNREACHABLE = ErrorCode.UPSTREAM_UNREACHABLE.value
#: Retry-After (seconds) the probe sends with it: about two connection checks.
UNREACHABLE_RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class Reach:
    """The latest evidence of whether one upstream's server accepts connections.

    ``ok``: True (it answered), False (it did not), None (nothing learned yet). ``at``:
    monotonic seconds of that evidence. ``since``: when ``ok`` last changed. ``error``: why
    the last failure failed ("" while ``ok``).
    """

    ok: bool | None = None
    at: float | None = None
    since: float | None = None
    error: str = ""

    def learned(self, ok: bool, now: float, error: str = "") -> Reach:
        """This record after evidence ``ok`` taken at ``now``. Evidence older than what is
        already known changes nothing (a slow check must not undo a newer failure)."""
        if self.at is not None and now < self.at:
            return self
        since = self.since if self.ok is ok else now
        return Reach(ok, now, since, "" if ok else error)

    def unreachable(self, now: float, max_age_s: float) -> bool:
        """True when the newest evidence, at most ``max_age_s`` old at ``now``, is a
        failure. No evidence, or only old evidence, is not a failure: the probe then says
        what the gate says."""
        return self.ok is False and self.at is not None and now - self.at <= max_age_s
