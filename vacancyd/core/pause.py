"""The owner's pause: lending held until a time, for a while, until the owner is next idle,
or until resumed (pure).

Times are wall-clock seconds since the Unix epoch, passed in: a pause is about the owner's
calendar ("until 18:00"), and it survives a restart, so it cannot live on a monotonic clock.

``until_idle`` ends once the owner has been seen at the machine since the pause began (the
host policy veto engaged) and then left again (the veto released). Where the daemon has no
presence evidence at all (``presence`` unset or ``headless``) it cannot tell, and such a
pause is refused when it is asked for.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

#: A pause longer than this is almost certainly a typo; ``indefinite`` says it plainly.
MAX_PAUSE_S = 366 * 86400.0

# [0-9], not \d: \d and float() also take other scripts' digits ("٣h" would be 3 hours)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class PauseKind(StrEnum):
    INDEFINITE = "indefinite"
    UNTIL = "until"
    UNTIL_IDLE = "until_idle"


@dataclass(frozen=True, slots=True)
class Pause:
    """An active pause. ``until`` (epoch s) is set for ``UNTIL`` only. ``seen_owner``: for
    ``UNTIL_IDLE``, the owner has been seen present since it began."""

    kind: PauseKind
    set_at: float
    until: float | None = None
    seen_owner: bool = False
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "set_at": self.set_at,
            "until": self.until,
            "seen_owner": self.seen_owner,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Pause:
        """Rebuild a saved pause; raises ValueError when ``data`` is not one."""
        try:
            kind = PauseKind(str(data["kind"]))
            set_at = data["set_at"]
            until = data.get("until")
            seen = data.get("seen_owner", False)
            reason = data.get("reason", "")
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a saved pause: {exc}") from None
        if not isinstance(set_at, int | float) or isinstance(set_at, bool):
            raise ValueError("not a saved pause: set_at is not a number")
        if until is not None and (not isinstance(until, int | float) or isinstance(until, bool)):
            raise ValueError("not a saved pause: until is not a number")
        if (kind is PauseKind.UNTIL) != (until is not None):
            raise ValueError("not a saved pause: until goes with kind 'until' only")
        for name, value in (("set_at", set_at), ("until", until)):
            # what describe() and /status will format: NaN, an infinity or a year past
            # 9999 would raise there, at startup
            if value is not None and not 0 <= value <= MAX_WALL_S:
                raise ValueError(f"not a saved pause: {name} is not a time ({value!r})")
        if not isinstance(seen, bool) or not isinstance(reason, str):
            raise ValueError("not a saved pause: seen_owner or reason has the wrong type")
        return cls(kind, float(set_at), None if until is None else float(until), seen, reason)

    def describe(self, tz: dt.tzinfo | None = None) -> str:
        """A phrase for refusals and /status: ``paused until 2026-12-01 18:00 +0100``."""
        if self.kind is PauseKind.INDEFINITE:
            return "paused by the owner until resumed"
        if self.kind is PauseKind.UNTIL_IDLE:
            return "paused by the owner until they are next away from this machine"
        assert self.until is not None
        return f"paused by the owner until {format_wall(self.until, tz)}"


#: The latest wall-clock time (epoch seconds) a saved pause may name: the end of year 9999,
#: the last one ``datetime`` can show.
MAX_WALL_S = 253402300799.0


def format_wall(at: float, tz: dt.tzinfo | None = None) -> str:
    """``at`` (epoch s) as local ``YYYY-MM-DD HH:MM:SS +HHMM`` (UTC when ``tz`` is None)."""
    when = dt.datetime.fromtimestamp(at, tz or dt.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S %z")


def parse_duration(text: str) -> float:
    """``"90s"``, ``"5m"``, ``"2h"``, ``"1h30m"``, ``"1d"`` as seconds (> 0, at most a year).

    Raises ValueError saying what is wrong (a sign, a missing unit, zero, too long).
    """
    spec = text.strip().lower()
    if spec.startswith(("-", "+")):
        raise ValueError(f"duration {text!r} must be positive and unsigned (for example 30m)")
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(spec):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not spec or pos != len(spec):
        raise ValueError(
            f"duration {text!r} is not NUMBER+UNIT (ASCII digits 0-9; units s, m, h, d), "
            "for example 45m or 1h30m"
        )
    if total <= 0:
        raise ValueError(f"duration {text!r} is zero")
    if total > MAX_PAUSE_S:
        raise ValueError(f"duration {text!r} is longer than a year; pause indefinitely instead")
    return total


def parse_until(text: str, now: float, tz: dt.tzinfo) -> float:
    """When a pause ``--until TEXT`` ends, as epoch seconds.

    ``TEXT`` is an ISO 8601 date and time (``2026-12-01T18:00``, with or without a UTC
    offset; without one it is local time in ``tz``) or a time of day ``HH:MM``, meaning its
    next occurrence. Raises ValueError for anything else, or a time not after ``now``.
    """
    spec = text.strip()
    if re.fullmatch(r"[0-9]{1,2}:[0-9]{2}", spec):
        hours, minutes = (int(p) for p in spec.split(":"))
        if hours > 23 or minutes > 59:
            raise ValueError(f"time {text!r} is not a time of day (00:00-23:59)")
        today = dt.datetime.fromtimestamp(now, tz)
        target = today.replace(hour=hours, minute=minutes, second=0, microsecond=0)
        if target.timestamp() <= now:
            target = (today + dt.timedelta(days=1)).replace(
                hour=hours, minute=minutes, second=0, microsecond=0
            )
        return target.timestamp()
    try:
        when = dt.datetime.fromisoformat(spec)
    except ValueError:
        raise ValueError(
            f"time {text!r} is neither HH:MM nor an ISO 8601 date and time "
            "(for example 2026-12-01T18:00 or 2026-12-01T18:00+01:00)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=tz)
    at = when.timestamp()
    if at <= now:
        raise ValueError(f"time {text!r} is in the past ({format_wall(at, tz)})")
    if at - now > MAX_PAUSE_S:
        raise ValueError(f"time {text!r} is more than a year away; pause indefinitely instead")
    return at


def advance(pause: Pause | None, now: float, *, owner_present: bool) -> Pause | None:
    """The pause after one evaluation at wall time ``now``: None once it has ended.

    ``owner_present``: the host policy veto is engaged now (only ``UNTIL_IDLE`` reads it).
    """
    if pause is None:
        return None
    if pause.kind is PauseKind.UNTIL:
        assert pause.until is not None
        return None if now >= pause.until else pause
    if pause.kind is PauseKind.UNTIL_IDLE:
        if owner_present:
            return pause if pause.seen_owner else replace(pause, seen_owner=True)
        return None if pause.seen_owner else pause
    return pause
