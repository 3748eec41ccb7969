"""The battery rule: lend on mains power only, and optionally above a charge level (pure).

A laptop lending its GPU on battery drains the owner's battery; by default that holds the
host. The collector (``vacancyd.control.owner``) reads ``psutil.sensors_battery()`` and the
kernel's list of power supplies and hands this module plain values.

Unknown power state counts as mains only where the host has no battery at all: a battery
whose plug state or charge cannot be read holds the host, since "could not tell" must never
read as "plugged in".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PowerReading:
    """What the power probe saw.

    ``has_battery``: the host has a battery (None: could not tell). ``plugged``: on mains
    power (None: unknown). ``percent``: charge 0–100 (None: unknown). ``error``: why the probe
    failed, when it did.
    """

    has_battery: bool | None
    plugged: bool | None = None
    percent: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PowerPolicy:
    """``lend_on_battery``: allow lending while on battery. ``min_battery_percent``: hold the
    host while a battery is below this charge (None: no charge rule)."""

    lend_on_battery: bool = False
    min_battery_percent: float | None = None

    @property
    def checks(self) -> bool:
        """Whether the rule can hold anything (otherwise there is nothing to probe)."""
        return not self.lend_on_battery or self.min_battery_percent is not None


def power_hold(reading: PowerReading, policy: PowerPolicy) -> str | None:
    """Why the power state holds the host, or None when lending may go on."""
    if not policy.checks or reading.has_battery is False:
        return None
    if reading.has_battery is None:
        return (
            "cannot tell whether this host has a battery"
            + (f" ({reading.error})" if reading.error else "")
            + "; power counts as battery"
        )
    if not policy.lend_on_battery:
        if reading.plugged is None:
            return "the battery's power source is unknown; it counts as battery"
        if not reading.plugged:
            charge = "" if reading.percent is None else f" ({reading.percent:.0f}% charged)"
            return f"running on battery{charge}; lending needs mains power (lend_on_battery)"
    if policy.min_battery_percent is not None:
        if reading.percent is None:
            return "the battery's charge is unknown; min_battery_percent cannot be checked"
        if reading.percent < policy.min_battery_percent:
            return (
                f"battery at {reading.percent:.0f}%, below min_battery_percent "
                f"{policy.min_battery_percent:g}%"
            )
    return None
