"""Time zones for the lending schedule and pauses: an IANA name, or the host's local zone.

The zone comes from the system's time-zone database through :mod:`zoneinfo`, so DST rules
are the host's own. The host's zone is found the way the C library finds it: ``$TZ`` when it
names a zone, else the ``/etc/localtime`` link (or the file itself).
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

LOCALTIME = Path("/etc/localtime")


def zone_by_name(name: str) -> ZoneInfo:
    """The zone called ``name`` (``Europe/Berlin``). Raises ValueError when none exists."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"time zone {name!r} does not exist in this host's time-zone database "
            "(use an IANA name such as Europe/Berlin, or leave timezone unset for the host's)"
        ) from None


def local_zone(localtime: Path = LOCALTIME) -> tuple[dt.tzinfo, str]:
    """The host's zone and a name for it; UTC (named so) when it cannot be determined."""
    tz_env = os.environ.get("TZ", "").removeprefix(":")
    if tz_env:
        try:
            return ZoneInfo(tz_env), tz_env
        except (ZoneInfoNotFoundError, ValueError, OSError):
            pass
    try:
        target = os.readlink(localtime)
    except OSError:
        target = ""
    if "zoneinfo/" in target:
        name = target.split("zoneinfo/", 1)[1]
        try:
            return ZoneInfo(name), name
        except (ZoneInfoNotFoundError, ValueError, OSError):
            pass
    try:
        with localtime.open("rb") as f:
            return ZoneInfo.from_file(f, key="localtime"), "localtime"
    except (OSError, ValueError):
        return dt.UTC, "UTC"


def resolve_zone(name: str | None) -> tuple[dt.tzinfo, str]:
    """``name``'s zone, or the host's when None. Raises ValueError for an unknown name."""
    if name is None:
        return local_zone()
    return zone_by_name(name), name
