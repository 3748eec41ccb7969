"""Timestamped observations with explicit quality (docs/architecture.md).

Every measured input carries the monotonic time (seconds, event-loop clock) of its last good
sample and of its last failed attempt. Quality is derived, never stored, so it cannot go stale
itself: a reading older than its bound is ``stale``; a reading that never arrived, or whose
newest attempt failed, is ``unknown``. There is no plausible default anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class ProbeError(Exception):
    """A probe (a collector's sample, an adapter's server observation) could not measure;
    the message says what failed, for /status and logs."""


class ProbeFailure(StrEnum):
    """Why one sample failed, the ``error`` label of ``vacancyd_collector_errors_total``:
    a closed set, so a dashboard can count every kind (the message, for /status, says more).
    """

    #: the probe did not answer within ``[collectors] probe_timeout_s``
    TIMEOUT = "timeout"
    #: the previous probe is still running past its deadline, so none was started
    STUCK = "stuck"
    #: the probe answered that it could not measure (a :class:`ProbeError`: a lost GPU, an
    #: upstream that refused or answered something unreadable, D-Bus unreachable)
    FAILED = "failed"
    #: the probe raised something it should not have (a bug; the log has the traceback)
    UNEXPECTED = "unexpected"


class Quality(StrEnum):
    UNKNOWN = "unknown"
    READY = "ready"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Observation(Generic[T]):
    """One input's latest reading.

    ``observed_at`` / ``failed_at`` are monotonic seconds (None when never). ``error`` is the
    last failure's message, kept for /status even after a later success.
    """

    value: T | None = None
    observed_at: float | None = None
    failed_at: float | None = None
    error: str | None = None

    def succeeded(self, value: T, now: float) -> Observation[T]:
        return Observation(value=value, observed_at=now, failed_at=self.failed_at, error=self.error)

    def failed(self, error: str, now: float) -> Observation[T]:
        return Observation(
            value=self.value, observed_at=self.observed_at, failed_at=now, error=error
        )

    def age_s(self, now: float) -> float | None:
        """Seconds since the last good sample, or None if there never was one."""
        return None if self.observed_at is None else max(0.0, now - self.observed_at)

    def quality(self, now: float, max_age_s: float) -> Quality:
        """``ready``: a good sample exists, is the newest attempt, and is <= ``max_age_s`` old."""
        if self.value is None or self.observed_at is None:
            return Quality.UNKNOWN
        if self.failed_at is not None and self.failed_at >= self.observed_at:
            return Quality.UNKNOWN
        if now - self.observed_at > max_age_s:
            return Quality.STALE
        return Quality.READY


@dataclass(frozen=True, slots=True)
class CapacityReading:
    """What a capacity probe measured for one resource.

    ``free_mib``/``total_mib`` are MiB (None for CPU, which has no byte capacity);
    ``utilization`` is a 0–1 ratio (None when the probe cannot read it); ``used_mib`` is MiB
    in use as the device reports it (None where the probe has no such figure).
    ``temperature_c``: a GPU's temperature in °C; ``energy_j``: its cumulative energy counter
    in joules since the driver loaded (both None where the card or the probe has none).
    """

    free_mib: float | None
    total_mib: float | None
    utilization: float | None = None
    used_mib: float | None = None
    temperature_c: float | None = None
    energy_j: float | None = None


class SampleKind(StrEnum):
    """What a collector samples: a resource's capacity, a GPU's pressure, an upstream's
    server (its own state) or whether it accepts connections, the owner's presence."""

    CAPACITY = "capacity"
    PRESSURE = "pressure"
    SERVER = "server"
    REACH = "reach"
    PRESENCE = "presence"


@dataclass(frozen=True, slots=True)
class SampleKey:
    """Which sample is meant: ``kind`` of the resource or upstream ``name`` (empty for the
    owner's presence). The key of on-demand samples (``SharedState.samples``)."""

    kind: SampleKind
    name: str = ""

    @classmethod
    def capacity(cls, resource: str) -> SampleKey:
        return cls(SampleKind.CAPACITY, resource)

    @classmethod
    def pressure(cls, resource: str) -> SampleKey:
        return cls(SampleKind.PRESSURE, resource)

    @classmethod
    def server(cls, upstream: str) -> SampleKey:
        return cls(SampleKind.SERVER, upstream)

    @classmethod
    def reach(cls, upstream: str) -> SampleKey:
        return cls(SampleKind.REACH, upstream)

    @classmethod
    def presence(cls) -> SampleKey:
        return cls(SampleKind.PRESENCE)

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.name}" if self.name else self.kind.value
