"""Lending windows: when the owner allows lending, by weekday and local hour (pure).

A schedule is a list of weekly windows (weekdays × a start and end time of day) plus dated
exceptions, read in one time zone. Outside every window the host is held as if its owner
were present. Times of day are whole minutes; a window covers ``[start, end)``.

* A window's ``end`` before its ``start`` is accepted only when the window says
  ``across_midnight``: it then starts on each listed weekday and ends on the next day.
  ``end`` equal to ``start`` with ``across_midnight`` is a full 24 hours from ``start``.
* An exception names a local date and a span of it (the whole day by default) and says
  whether lending is allowed then; inside that span it overrides the weekly windows.
* Local time is the wall clock of ``tz`` (a :class:`datetime.tzinfo`, normally a
  ``zoneinfo.ZoneInfo``), so DST is handled by the zone: on a spring-forward day a window
  from 02:30 opens at 03:00, when the clock jumps past it; on a fall-back day the repeated
  hour is inside a window twice.

Every time here is wall-clock seconds since the Unix epoch passed in by the caller; nothing
reads a clock or the time-zone database (the caller builds ``tz``).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

#: Weekday names as the configuration spells them; index 0 is Monday (``date.weekday()``).
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
MINUTES_PER_DAY = 24 * 60
#: How far ahead :func:`next_change` looks (seconds).
HORIZON_S = 8 * 86400.0
_EPOCH = dt.date(1970, 1, 1)


def parse_time_of_day(text: str) -> int:
    """``"HH:MM"`` (00:00–23:59) as minutes after midnight. Raises ValueError saying why."""
    hours, sep, minutes = text.partition(":")
    if (
        not sep
        or not (1 <= len(hours) <= 2)
        or len(minutes) != 2
        or not hours.isdigit()
        or not minutes.isdigit()
    ):
        raise ValueError(f"time {text!r} must be HH:MM (24-hour clock)")
    h, m = int(hours), int(minutes)
    if h > 23:
        raise ValueError(
            f"time {text!r}: hour {h} is out of range 0-23 (midnight is 00:00; a window "
            "that runs to midnight leaves end unset)"
        )
    if m > 59:
        raise ValueError(f"time {text!r}: minute {m} is out of range 0-59")
    return h * 60 + m


def parse_weekday(name: str) -> int:
    """A weekday name (``mon`` … ``sun`` or the full English name, any case) as 0–6 (Monday
    is 0). Raises ValueError naming the accepted spellings."""
    key = name.strip().lower()
    for i, (short, full) in enumerate(zip(WEEKDAYS, _FULL_NAMES, strict=True)):
        if key in (short, full):
            return i
    raise ValueError(
        f"unknown weekday {name!r}; use {', '.join(WEEKDAYS)} (or the full English names)"
    )


_FULL_NAMES = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def format_minutes(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


@dataclass(frozen=True, slots=True)
class Window:
    """A weekly window. ``days``: weekdays (0 = Monday) it starts on. ``start_min``/``end_min``:
    minutes after local midnight, ``end_min`` 1440 meaning midnight at the end of the day.
    """

    days: frozenset[int]
    start_min: int = 0
    end_min: int = MINUTES_PER_DAY
    across_midnight: bool = False

    def __post_init__(self) -> None:
        if not self.days or not self.days <= set(range(7)):
            raise ValueError("a window needs at least one weekday (0-6)")
        if not 0 <= self.start_min < MINUTES_PER_DAY or not 0 <= self.end_min <= MINUTES_PER_DAY:
            raise ValueError("window times must lie within the day")
        if self.across_midnight:
            if self.end_min == MINUTES_PER_DAY:
                raise ValueError("a window across midnight needs an end time on the next day")
        elif not self.start_min < self.end_min:
            raise ValueError(
                f"window end {format_minutes(self.end_min % MINUTES_PER_DAY)} is not after its "
                f"start {format_minutes(self.start_min)}; a window that runs past midnight "
                "must say across_midnight = true"
            )

    def covers(self, weekday: int, minute: int) -> bool:
        """Whether local ``minute`` (0–1439) of a day that is ``weekday`` is inside."""
        if not self.across_midnight:
            return weekday in self.days and self.start_min <= minute < self.end_min
        if weekday in self.days and minute >= self.start_min:
            return True
        return (weekday - 1) % 7 in self.days and minute < self.end_min

    def describe(self) -> str:
        days = ",".join(WEEKDAYS[d] for d in sorted(self.days))
        end = "24:00" if self.end_min == MINUTES_PER_DAY else format_minutes(self.end_min)
        tail = " (next day)" if self.across_midnight else ""
        return f"{days} {format_minutes(self.start_min)}-{end}{tail}"


@dataclass(frozen=True, slots=True)
class Exception_:
    """A dated exception: on local ``date`` within ``[start_min, end_min)`` lending is
    ``lend`` whatever the weekly windows say."""

    date: dt.date
    lend: bool = False
    start_min: int = 0
    end_min: int = MINUTES_PER_DAY

    def __post_init__(self) -> None:
        if not 0 <= self.start_min < self.end_min <= MINUTES_PER_DAY:
            raise ValueError(f"exception on {self.date}: end must be after start on the same day")

    def covers(self, date: dt.date, minute: int) -> bool:
        return date == self.date and self.start_min <= minute < self.end_min


@dataclass(frozen=True, slots=True)
class Schedule:
    """Weekly ``windows`` and dated ``exceptions`` read on the wall clock of ``tz``.

    ``zone`` is the time zone's name for display. Overlapping windows simply union;
    exceptions that overlap each other must agree (checked here).
    """

    windows: tuple[Window, ...]
    tz: dt.tzinfo
    zone: str = ""
    exceptions: tuple[Exception_, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.windows:
            raise ValueError("a schedule needs at least one window")
        for i, a in enumerate(self.exceptions):
            for b in self.exceptions[i + 1 :]:
                if (
                    a.date == b.date
                    and a.lend != b.lend
                    and a.start_min < b.end_min
                    and b.start_min < a.end_min
                ):
                    raise ValueError(
                        f"exceptions on {a.date} overlap and disagree on whether to lend"
                    )

    def local(self, at: float) -> tuple[dt.date, int]:
        """The local date and minute of the day at wall time ``at`` (epoch seconds)."""
        when = dt.datetime.fromtimestamp(at, self.tz)
        return when.date(), when.hour * 60 + when.minute

    def is_open(self, at: float) -> bool:
        """Whether lending is allowed at wall time ``at`` (epoch seconds)."""
        date, minute = self.local(at)
        for exc in self.exceptions:
            if exc.covers(date, minute):
                return exc.lend
        weekday = date.weekday()
        return any(w.covers(weekday, minute) for w in self.windows)

    def _boundaries(self) -> frozenset[int]:
        marks = {0}
        for w in self.windows:
            marks.update((w.start_min, w.end_min % MINUTES_PER_DAY))
        for e in self.exceptions:
            marks.update((e.start_min, e.end_min % MINUTES_PER_DAY))
        return frozenset(marks)

    def next_change(self, at: float, horizon_s: float = HORIZON_S) -> float | None:
        """The first wall time after ``at`` at which :meth:`is_open` changes, or None when
        it stays the same for ``horizon_s`` seconds. Exact to the second across DST changes.
        """
        current = self.is_open(at)
        for t in self._candidates(at, at + horizon_s):
            if self.is_open(t) != current:
                return t
        return None

    def _candidates(self, start: float, end: float) -> list[float]:
        """Every instant in (start, end] at which the answer could change: each local
        boundary minute in each stretch of constant UTC offset, and each offset change."""
        marks = self._boundaries()
        out: set[float] = set()
        for seg_start, seg_end, offset in _offset_segments(self.tz, start, end):
            if seg_start > start:
                out.add(seg_start)
            first = dt.datetime.fromtimestamp(seg_start, self.tz).date() - dt.timedelta(days=1)
            last = dt.datetime.fromtimestamp(seg_end, self.tz).date() + dt.timedelta(days=1)
            day = first
            while day <= last:
                base = (day - _EPOCH).days * 86400.0 - offset
                for minute in marks:
                    t = base + minute * 60
                    if seg_start <= t < seg_end and start < t <= end:
                        out.add(t)
                day += dt.timedelta(days=1)
        return sorted(out)

    def describe(self) -> list[str]:
        return [w.describe() for w in self.windows]


def _offset(tz: dt.tzinfo, at: float) -> float:
    delta = dt.datetime.fromtimestamp(at, tz).utcoffset()
    return 0.0 if delta is None else delta.total_seconds()


#: Offset changes are looked for at this step, then found to the second by bisection.
_OFFSET_STEP_S = 6 * 3600.0


def _offset_segments(tz: dt.tzinfo, start: float, end: float) -> list[tuple[float, float, float]]:
    """Split [start, end] into (from, to, utc_offset_s) stretches of constant UTC offset."""
    segments = []
    seg_start = start
    offset = _offset(tz, start)
    t = start
    while t < end:
        nxt = min(t + _OFFSET_STEP_S, end)
        if _offset(tz, nxt) != offset:
            lo, hi = t, nxt  # offset(lo) == offset, offset(hi) differs
            while hi - lo > 1.0:
                mid = (lo + hi) / 2
                if _offset(tz, mid) == offset:
                    lo = mid
                else:
                    hi = mid
            # Zones change offset on whole seconds: the change is the first second after lo.
            whole = float(math.floor(lo) + 1)
            hi = whole if _offset(tz, whole) != offset else hi
            segments.append((seg_start, hi, offset))
            seg_start, offset = hi, _offset(tz, hi)
            t = hi
            continue
        t = nxt
    segments.append((seg_start, end + 1.0, offset))
    return segments
