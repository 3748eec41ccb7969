"""Each named borrower's limits, executed (docs/borrowers.md): the upstreams it may use, its
jobs at once, and its busy seconds per local day, kept in memory and restored from the usage
ledger at start so a restart does not hand a borrower a fresh quota.

The rules are :mod:`vacancyd.core.quota`'s; this module keeps the counts they read. Busy
seconds are wall-clock seconds (a quota is per local day, which the ledger's wall times
measure); the local day is the C library's local time (``TZ``, ``/etc/localtime``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from vacancyd.core.quota import (
    UNLIMITED,
    BorrowerLimits,
    LocalDay,
    busy_in_day,
    decide_quota,
    may_use,
)
from vacancyd.core.reasons import Refuse


def local_day(now: float) -> LocalDay:
    """The lender's local day containing wall time ``now`` (s since the epoch): its two
    local midnights from the C library's local time, so a DST day is 23 or 25 hours long."""
    t = time.localtime(now)
    start = time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))
    end = time.mktime((t.tm_year, t.tm_mon, t.tm_mday + 1, 0, 0, 0, 0, 0, -1))
    if end <= now:  # never: but a day must end after now, whatever the zone data says
        end = now + 1.0
    return LocalDay(start, end, time.strftime("%H:%M", time.localtime(end)))


@dataclass(slots=True)
class _Running:
    borrower: str
    started_at: float  # wall s


class Borrowers:
    """The named borrowers' limits and what each used today; one per daemon, event loop only.

    ``limits``: per ``[[borrower]]`` name (a borrower not named, the unnamed ``""``
    included, has none). ``wall``: the wall clock (s since the epoch); ``day``: the local day
    of a wall time (:func:`local_day`).
    """

    def __init__(
        self,
        limits: Mapping[str, BorrowerLimits],
        *,
        wall: Callable[[], float] = time.time,
        day: Callable[[float], LocalDay] = local_day,
    ) -> None:
        self.limits = dict(limits)
        self._wall = wall
        self._day_of = day
        self._day = day(wall())
        #: Busy seconds of finished jobs in ``_day``, per borrower.
        self._used: dict[str, float] = {}
        self._running: dict[int, _Running] = {}

    def restore(self, used_today: Mapping[str, float], day: LocalDay) -> None:
        """Add the busy seconds the ledger holds for ``day`` (per borrower) to today's, once
        at start; ignored when the day has already turned."""
        self._roll()
        if day.start != self._day.start:
            return
        for name, seconds in used_today.items():
            self._used[name] = self._used.get(name, 0.0) + max(0.0, seconds)

    @property
    def day(self) -> LocalDay:
        """Today (the local day of the wall clock now)."""
        self._roll()
        return self._day

    def of(self, borrower: str) -> BorrowerLimits:
        """``borrower``'s limits (none for a borrower without a ``[[borrower]]`` table)."""
        return self.limits.get(borrower, UNLIMITED)

    def forbidden(self, borrower: str, names: Iterable[str]) -> str | None:
        """The 403's sentence when ``borrower`` may not use one of the upstreams or pools
        ``names``, else None."""
        limits = self.limits.get(borrower)
        return None if limits is None else may_use(borrower, limits, names)

    def refusal(self, borrower: str) -> Refuse | None:
        """``quota_exhausted`` or ``borrower_busy`` when ``borrower`` may not start a job
        now, else None (:func:`vacancyd.core.quota.decide_quota`)."""
        limits = self.limits.get(borrower)
        if limits is None or (limits.daily_busy_s is None and limits.max_concurrent is None):
            return None
        now = self._wall()
        return decide_quota(
            borrower,
            limits,
            used_s=self.used_today(borrower, now),
            running=self.running(borrower),
            now=now,
            day=self.day,
        )

    def used_today(self, borrower: str, now: float | None = None) -> float:
        """Busy seconds ``borrower`` used today: its finished jobs and its running ones so far."""
        now = self._wall() if now is None else now
        day = self.day
        used = self._used.get(borrower, 0.0)
        for job in self._running.values():
            if job.borrower == borrower:
                used += busy_in_day(job.started_at, now, day)
        return used

    def running(self, borrower: str) -> int:
        """``borrower``'s jobs started and not yet ended."""
        return sum(1 for job in self._running.values() if job.borrower == borrower)

    def started(self, job_id: int, borrower: str, at: float) -> None:
        """Job ``job_id`` of ``borrower`` was admitted at wall time ``at``."""
        self._running[job_id] = _Running(borrower, at)

    def ended(self, job_id: int, at: float) -> float:
        """Job ``job_id`` ended at wall time ``at``; returns its busy seconds (0 for a job
        never started here). Its part within today counts toward today's quota."""
        job = self._running.pop(job_id, None)
        if job is None:
            return 0.0
        day = self.day
        today = busy_in_day(job.started_at, at, day)
        if today > 0:
            self._used[job.borrower] = self._used.get(job.borrower, 0.0) + today
        return max(0.0, at - job.started_at)

    def _roll(self) -> None:
        now = self._wall()
        if now >= self._day.end or now < self._day.start:
            self._day = self._day_of(now)
            self._used.clear()


def limits_of(
    borrowers: Iterable[tuple[str, Iterable[str] | None, int | None, float | None]],
) -> dict[str, BorrowerLimits]:
    """``{name: BorrowerLimits}`` from (name, upstreams, max_concurrent, daily_busy_s)."""
    return {
        name: BorrowerLimits(
            upstreams=None if ups is None else frozenset(ups),
            max_concurrent=most,
            daily_busy_s=quota,
        )
        for name, ups, most, quota in borrowers
    }
