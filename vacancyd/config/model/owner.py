"""``[owner]`` (presence, exclusive apps) and ``[schedule]`` (lending windows)."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from vacancyd.config.model.base import FrozenModel
from vacancyd.config.zone import zone_by_name
from vacancyd.core import presence as presence_rules
from vacancyd.core import schedule as schedule_rules


class ExclusiveAppSettings(FrozenModel):
    """A program that holds lending while it runs (docs/presence.md "Exclusive apps").

    ``name``: the program's name, matched like ``[owner] processes``. ``scope``: ``host``
    holds every upstream; ``gpu`` holds only upstreams that depend on a GPU resource.
    """

    name: str
    scope: Literal["host", "gpu"] = "host"

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        why = presence_rules.validate_process_name(name)
        if why is not None:
            raise ValueError(f"exclusive app name must be a program name: {why}")
        return name


class OwnerSettings(FrozenModel):
    """Owner presence (docs/architecture.md). ``presence`` unset: an unknown reading that refuses.

    ``release_after_s``: consecutive clear seconds before the host policy veto releases.
    ``presence``: "logind" reads systemd-logind over D-Bus; "auto" is logind on Linux and an
    unknown, non-refusing reading elsewhere; "headless" is a fixed logged-out reading.
    ``bus_address``: D-Bus address of the bus logind is on (default: the system bus).
    ``processes``: owner-process names that hold the machine while their user's desktop is
    unlocked, even when it is idle. ``idle_after_s``: seconds a session's idle hint must have
    held before it counts as away. ``remote_graphical``: "count" (the default) treats remote
    x11/wayland sessions (remote desktop, VNC) like local ones; "ignore" does not count them.
    ``signals``: subscribe to logind's change signals (false: polling only).
    ``lend_on_battery``: lend while running on battery; ``min_battery_percent``: hold while a
    battery is below this charge. ``exclusive_apps`` hold lending while they run, once seen
    for ``exclusive_grace_s`` and until ``exclusive_resume_after_s`` after the last one
    exits. ``present_max_model_mib``: while the owner is present, resource-scoped upstreams
    lend only requests whose footprint is at most this many MiB (unset: no limit).
    """

    presence: Literal["headless", "logind", "auto"] | None = None
    release_after_s: float = Field(60.0, ge=0, le=86400)
    bus_address: str | None = Field(None, min_length=1)
    processes: list[str] = []
    idle_after_s: float = Field(0.0, ge=0, le=86400)
    remote_graphical: Literal["ignore", "count"] = "count"
    signals: StrictBool = True
    lend_on_battery: StrictBool = False
    min_battery_percent: float | None = Field(None, gt=0, le=100)
    exclusive_apps: list[ExclusiveAppSettings] = []
    exclusive_grace_s: float = Field(5.0, ge=0, le=3600)
    exclusive_resume_after_s: float = Field(60.0, ge=0, le=86400)
    present_max_model_mib: int | None = Field(None, ge=0)

    @field_validator("processes")
    @classmethod
    def _process_names(cls, names: list[str]) -> list[str]:
        problems = [
            f"[{i}] {why}"
            for i, name in enumerate(names)
            if (why := presence_rules.validate_process_name(name)) is not None
        ]
        if problems:
            raise ValueError("owner process names must be program names: " + "; ".join(problems))
        return names


def _minutes(value: str | None, key: str, default: int) -> int:
    if value is None:
        return default
    try:
        return schedule_rules.parse_time_of_day(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


class WindowSettings(FrozenModel):
    """A weekly lending window. ``days``: weekday names (``mon`` … ``sun``). ``start``/``end``:
    ``HH:MM`` local time; ``end`` unset means midnight at the end of the day. An ``end`` before
    ``start`` is accepted only with ``across_midnight = true``."""

    days: list[str] = Field(min_length=1)
    start: str = "00:00"
    end: str | None = None
    across_midnight: StrictBool = False

    def to_window(self) -> schedule_rules.Window:
        """The core's window; raises ValueError naming the bad value."""
        days = frozenset(schedule_rules.parse_weekday(d) for d in self.days)
        start = _minutes(self.start, "start", 0)
        end = _minutes(self.end, "end", schedule_rules.MINUTES_PER_DAY)
        return schedule_rules.Window(days, start, end, self.across_midnight)

    @model_validator(mode="after")
    def _valid(self) -> WindowSettings:
        self.to_window()
        return self


class ScheduleExceptionSettings(FrozenModel):
    """A dated exception: on ``date`` (a TOML date), from ``start`` to ``end`` (the whole day
    by default), lending is ``lend`` (default false: a holiday) whatever the windows say."""

    date: dt.date
    lend: StrictBool = False
    start: str = "00:00"
    end: str | None = None

    def to_exception(self) -> schedule_rules.Exception_:
        start = _minutes(self.start, "start", 0)
        end = _minutes(self.end, "end", schedule_rules.MINUTES_PER_DAY)
        return schedule_rules.Exception_(self.date, self.lend, start, end)

    @model_validator(mode="after")
    def _valid(self) -> ScheduleExceptionSettings:
        self.to_exception()
        return self


class ScheduleSettings(FrozenModel):
    """When lending is allowed (docs/presence.md "Lending schedule"). ``timezone``: an IANA
    zone name; unset means the host's local zone."""

    timezone: str | None = None
    window: list[WindowSettings] = Field(min_length=1)
    exception: list[ScheduleExceptionSettings] = []

    @field_validator("timezone")
    @classmethod
    def _zone(cls, name: str | None) -> str | None:
        if name is not None:
            zone_by_name(name)
        return name

    @model_validator(mode="after")
    def _valid(self) -> ScheduleSettings:
        self.build(dt.UTC, "UTC")
        return self

    def build(self, tz: dt.tzinfo, zone: str) -> schedule_rules.Schedule:
        """The core's schedule in ``tz``; raises ValueError."""
        return schedule_rules.Schedule(
            tuple(w.to_window() for w in self.window),
            tz,
            zone,
            tuple(e.to_exception() for e in self.exception),
        )
