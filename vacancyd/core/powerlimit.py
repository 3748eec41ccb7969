"""A GPU's lending power limit (``lend_power_limit_w``, docs/hardware-limits.md): when it is
in force, and whether the driver can take it.

Pure: no clock, no I/O. Power is in milliwatts, as NVML's power-management calls take it.
The limit is in force exactly while borrowed work holds the GPU and the owner is not back:
the first job that reserves it applies the limit, the last one to release it restores the
card's original limit, and the owner's return (the host veto, or one of the owner's holds)
restores it at once even while borrowed work still runs. A stopping daemon restores it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from vacancyd.core.reasons import PowerLimitProblem

__all__ = ["PowerLimitProblem", "PowerLimits", "check_lend_limit", "to_mw", "wants_lend_limit"]


@dataclass(frozen=True, slots=True)
class PowerLimits:
    """What the driver reports of one GPU, in mW: the limit in force, the default, and the
    range a limit may be set within."""

    current_mw: int
    default_mw: int
    min_mw: int
    max_mw: int


def to_mw(watts: float) -> int:
    """Watts as NVML's milliwatts."""
    return round(watts * 1000)


def check_lend_limit(lend_mw: int, limits: PowerLimits) -> str | None:
    """None when ``lend_mw`` is within the card's range, else a sentence saying why not."""
    if limits.min_mw <= lend_mw <= limits.max_mw:
        return None
    return (
        f"lend_power_limit_w {lend_mw / 1000:g} W is outside this card's range "
        f"{limits.min_mw / 1000:g}-{limits.max_mw / 1000:g} W"
    )


def wants_lend_limit(*, jobs: int, owner_back: bool, stopping: bool) -> bool:
    """Whether the lending limit should be in force on a GPU that ``jobs`` borrowed jobs
    hold, with the owner back (veto engaged or a hold in force) or not, the daemon stopping
    or not."""
    return jobs > 0 and not owner_back and not stopping
