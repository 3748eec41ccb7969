"""The power probe for the battery rule (``vacancyd.core.power``).

On Linux ``psutil.sensors_battery()`` answers None both on a host without a battery and where
the battery cannot be read, so the probe also asks the kernel whether a battery exists at all
(``/sys/class/power_supply/*/type`` = ``Battery``, the same source psutil reads). On macOS
and Windows psutil asks the OS's power API, whose "no battery" is taken as it is.
Blocking (sysfs reads): the owner-controls loop runs it in a thread under a deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

from vacancyd.core.power import PowerReading

POWER_SUPPLY = Path("/sys/class/power_supply")


def has_battery(root: Path = POWER_SUPPLY) -> bool | None:
    """Whether the kernel lists a battery; None when it cannot be told (not Linux, no sysfs)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        supplies = list(root.iterdir())
    except FileNotFoundError:
        return False if Path("/sys/class").is_dir() else None
    except OSError:
        return None
    for supply in supplies:
        try:
            if (supply / "type").read_text(encoding="ascii").strip() == "Battery":
                return True
        except (OSError, UnicodeDecodeError):
            continue
    return False


def read_power(root: Path = POWER_SUPPLY) -> PowerReading:
    """One reading of the host's power state; never raises (a failure is in ``error``)."""
    present = has_battery(root)
    try:
        battery = psutil.sensors_battery()
    except (OSError, RuntimeError, psutil.Error) as exc:
        return PowerReading(present, error=f"psutil.sensors_battery failed: {exc}")
    if battery is None:
        if present:
            return PowerReading(True, error="a battery is listed but psutil cannot read it")
        if present is None and not sys.platform.startswith("linux"):
            # macOS and Windows report a battery through the OS's own power API, which is
            # what psutil reads there: no answer means no battery.
            return PowerReading(False)
        return PowerReading(present)
    percent = float(battery.percent) if battery.percent is not None else None
    plugged = battery.power_plugged if isinstance(battery.power_plugged, bool) else None
    return PowerReading(True, plugged, percent)
