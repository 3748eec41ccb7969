"""A GPU's temperature guard: hysteresis between a maximum and a resume temperature, and the
time after which running borrowed work is yielded (docs/configuration.md,
``max_temperature_c``).

Pure: no clock, no I/O. Temperatures are °C as the collector reads them (NVML's GPU sensor);
times are monotonic seconds passed in by the caller.

The card turns *hot* on the first sample above ``max_c`` and stays hot until a sample below
``resume_c``: new borrowed work is refused ``gpu_too_hot`` meanwhile. Running work is left
alone unless the card stays above ``max_c`` for ``hot_yield_after_s`` seconds (every sample
since the first one above it, none at or below it): then one yield edge rises, which the
reclaim policy answers as it answers owner pressure. A sample at or below ``max_c`` re-arms
it. A missing reading changes nothing: it is no evidence that the card cooled.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

#: ``temperature_resume_c`` when unset: this many °C below ``max_temperature_c``.
DEFAULT_RESUME_MARGIN_C = 5.0


@dataclass(frozen=True, slots=True)
class ThermalPolicy:
    """One GPU's limits: ``max_c`` and ``resume_c`` in °C (``resume_c`` < ``max_c``), and
    ``hot_yield_after_s`` (seconds above ``max_c`` before running work is yielded; None:
    never yield, only refuse new work)."""

    max_c: float
    resume_c: float
    hot_yield_after_s: float | None = None

    def __post_init__(self) -> None:
        if not self.resume_c < self.max_c:
            raise ValueError(
                f"the resume temperature {self.resume_c:g} °C must be below the maximum "
                f"{self.max_c:g} °C"
            )


class ThermalChange(StrEnum):
    """What one sample changed."""

    HOT = "hot"  #: above ``max_c``: new borrowed work is refused from now on
    COOLED = "cooled"  #: below ``resume_c`` after being hot: lending may resume
    YIELD = "yield"  #: above ``max_c`` for ``hot_yield_after_s``: yield running work


@dataclass(frozen=True, slots=True)
class ThermalView:
    """The guard as the gate and /status see it. ``temperature_c``: the newest reading (°C,
    None when the card reports none); ``hot``: new work is refused; ``hot_since`` and
    ``above_since``: monotonic seconds when it turned hot and when the current run of
    samples above ``max_c`` began (None: not hot / not above)."""

    policy: ThermalPolicy
    temperature_c: float | None
    hot: bool
    hot_since: float | None = None
    above_since: float | None = None


class ThermalTracker:
    """The hysteresis of one GPU (see the module docstring). Not thread-safe."""

    def __init__(self, policy: ThermalPolicy) -> None:
        self.policy = policy
        self.hot = False
        self.hot_since: float | None = None
        self.above_since: float | None = None
        self.temperature_c: float | None = None
        self._yielded = False

    def observe(self, temperature_c: float | None, now: float) -> tuple[ThermalChange, ...]:
        """Take one reading (°C, or None when the card reported none) at ``now`` (monotonic
        s); returns what it changed, in order (HOT and YIELD together when
        ``hot_yield_after_s`` is 0)."""
        self.temperature_c = temperature_c
        if temperature_c is None:
            return ()
        policy = self.policy
        changes: list[ThermalChange] = []
        if temperature_c > policy.max_c:
            if not self.hot:
                self.hot = True
                self.hot_since = now
                changes.append(ThermalChange.HOT)
            if self.above_since is None:
                self.above_since = now
            if (
                policy.hot_yield_after_s is not None
                and not self._yielded
                and now - self.above_since >= policy.hot_yield_after_s
            ):
                self._yielded = True
                changes.append(ThermalChange.YIELD)
            return tuple(changes)
        self.above_since = None
        self._yielded = False
        if self.hot and temperature_c < policy.resume_c:
            self.hot = False
            self.hot_since = None
            changes.append(ThermalChange.COOLED)
        return tuple(changes)

    def view(self) -> ThermalView:
        return ThermalView(
            self.policy, self.temperature_c, self.hot, self.hot_since, self.above_since
        )
