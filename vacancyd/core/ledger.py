"""The admission ledger (spec "Gate", last paragraph; product map L1–L3).

One job at a time per resource: a job reserves every resource its upstream depends on, and
a second request that needs any of them is refused with ``resource_busy`` (Retry-After 2 s)
until the first is released. Release time per resource is kept so the gate can demand a
capacity sample taken after it (L3). Pure: callers pass monotonic ``now`` in seconds, and
the asyncio proxy calls it without awaiting in between, so no lock is needed.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vacancyd.core.reasons import Reason, Refuse


class Phase(StrEnum):
    """Ledger phases, exported as ``vacancyd_active_work{upstream,phase}``.

    ``forwarding``: the HTTP exchange with the upstream is in progress.
    ``tracking``: the exchange ended but the adapter tracks work the server still runs.
    ``held``: completion is uncertain; the reservation stays until evidence or an admin frees it.
    """

    FORWARDING = "forwarding"
    TRACKING = "tracking"
    HELD = "held"


@dataclass(frozen=True, slots=True)
class Job:
    """One admitted borrowed request. ``admitted_at`` is monotonic seconds."""

    id: int
    upstream: str
    resources: tuple[str, ...]
    phase: Phase
    admitted_at: float
    model: str | None = None


@dataclass
class Ledger:
    _jobs: dict[int, Job] = field(default_factory=dict)
    _holders: dict[str, int] = field(default_factory=dict)
    _released_at: dict[str, float] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def reserve(
        self, upstream: str, resources: tuple[str, ...], now: float, model: str | None = None
    ) -> Job | Refuse:
        """Reserve every resource in ``resources`` for a new job, or refuse ``resource_busy``."""
        busy = self.busy(resources)
        if busy is not None:
            return busy
        job = Job(next(self._ids), upstream, resources, Phase.FORWARDING, now, model)
        self._jobs[job.id] = job
        for name in resources:
            self._holders[name] = job.id
        return job

    def busy(self, resources: tuple[str, ...]) -> Refuse | None:
        """The ``resource_busy`` refusal :meth:`reserve` would give now, or None; reserves
        nothing (the lendability probe asks this)."""
        for name in resources:
            holder = self._holders.get(name)
            if holder is not None:
                other = self._jobs[holder]
                return Refuse.of(
                    Reason.RESOURCE_BUSY,
                    f"{name!r} is lent to another borrowed job (upstream {other.upstream!r}, "
                    f"{other.phase})",
                    resource=name,
                )
        return None

    def set_phase(self, job_id: int, phase: Phase) -> None:
        job = self._jobs.get(job_id)
        if job is not None:
            self._jobs[job_id] = replace(job, phase=phase)

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def release(self, job_id: int, now: float) -> Job | None:
        """Release a job's reservations; idempotent. Returns the job, or None if unknown."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        for name in job.resources:
            if self._holders.get(name) == job_id:
                del self._holders[name]
            self._released_at[name] = now
        return job

    def released_at(self, resource: str) -> float | None:
        """Monotonic time of the last release on ``resource``, or None."""
        return self._released_at.get(resource)

    def jobs(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.id)

    def holder(self, resource: str) -> Job | None:
        job_id = self._holders.get(resource)
        return None if job_id is None else self._jobs.get(job_id)

    def counts(self) -> Counter[tuple[str, Phase]]:
        """Active jobs per (upstream, phase)."""
        return Counter((j.upstream, j.phase) for j in self._jobs.values())
