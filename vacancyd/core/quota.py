"""A named borrower's own limits (pure): the upstreams it may use, its jobs at once and its
busy seconds per local day (docs/borrowers.md).

Nothing here reads a clock or the time zone: the caller passes the wall time now and the
bounds of the lender's local day (:class:`LocalDay`), which it computes with the C library's
local time so a day that is 23 or 25 hours long (a DST change) is measured as it is.
Times are wall-clock seconds since the epoch; busy time is in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vacancyd.core.reasons import Reason, Refuse
from vacancyd.core.usage import borrower_label


@dataclass(frozen=True, slots=True)
class BorrowerLimits:
    """One borrower's limits (a ``[[borrower]]`` table): ``upstreams`` it may use (None:
    every one), ``max_concurrent`` jobs at once over every upstream (None: no cap of its
    own), ``daily_busy_s`` busy seconds per local day (None: no quota)."""

    upstreams: frozenset[str] | None = None
    max_concurrent: int | None = None
    daily_busy_s: float | None = None


#: No limits at all: the unnamed borrower, and any borrower without a ``[[borrower]]`` table.
UNLIMITED = BorrowerLimits()


@dataclass(frozen=True, slots=True)
class LocalDay:
    """The lender's local day that contains now: ``start`` and ``end`` (its local midnights,
    wall s; ``end`` is when a daily quota resets) and ``end_clock``, the local clock time
    ``end`` shows (``"00:00"``, or ``"01:00"`` where a DST change skips midnight)."""

    start: float
    end: float
    end_clock: str = "00:00"


def may_use(borrower: str, limits: BorrowerLimits, names: Iterable[str]) -> str | None:
    """None when ``borrower`` may use every upstream or pool in ``names`` (a request on a
    pool's listener names the pool and the member it would reach), else a sentence for the
    403 naming the borrower and the first upstream it may not use."""
    if limits.upstreams is None:
        return None
    for name in names:
        if name not in limits.upstreams:
            allowed = ", ".join(sorted(limits.upstreams)) or "none"
            return (
                f"borrower {borrower_label(borrower)!r} may not use upstream {name!r} "
                f"(its upstreams: {allowed})"
            )
    return None


def busy_in_day(started_at: float, ended_at: float, day: LocalDay) -> float:
    """Seconds of the interval [``started_at``, ``ended_at``] that fall in ``day`` (a job
    that began before midnight counts only its part after it), never negative."""
    return max(0.0, min(ended_at, day.end) - max(started_at, day.start))


def decide_quota(
    borrower: str,
    limits: BorrowerLimits,
    *,
    used_s: float,
    running: int,
    now: float,
    day: LocalDay,
) -> Refuse | None:
    """None when ``borrower`` may start one more job now, else the refusal.

    ``used_s``: its busy seconds today (finished jobs, and the running ones so far);
    ``running``: its jobs admitted and not yet ended; ``now``: wall s, within ``day``.

    * ``daily_busy_s`` used up: ``quota_exhausted``, Retry-After the whole seconds until
      ``day.end`` (at least 1), the message saying when in local time;
    * ``max_concurrent`` jobs running: ``borrower_busy``, its short default Retry-After.

    The quota comes first: a borrower over it would be refused after a slot frees anyway.
    """
    label = borrower_label(borrower)
    if limits.daily_busy_s is not None and used_s >= limits.daily_busy_s:
        left = max(1, math.ceil(day.end - now))
        return Refuse.of(
            Reason.QUOTA_EXHAUSTED,
            f"borrower {label!r} used its {_seconds(limits.daily_busy_s)} of busy time for "
            f"today; the quota resets at {day.end_clock} local time (in {_duration(left)})",
            retry_after_s=left,
        )
    if limits.max_concurrent is not None and running >= limits.max_concurrent:
        return Refuse.of(
            Reason.BORROWER_BUSY,
            f"borrower {label!r} already runs {running} job(s), its max_concurrent",
        )
    return None


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _duration(seconds: int) -> str:
    """``3 h 12 min``, ``12 min``, ``45 s``: whole minutes once it is a minute or more."""
    if seconds < 60:
        return f"{seconds} s"
    minutes = math.ceil(seconds / 60)
    hours, minutes = divmod(minutes, 60)
    if hours and minutes:
        return f"{hours} h {minutes} min"
    if hours:
        return f"{hours} h"
    return f"{minutes} min"
