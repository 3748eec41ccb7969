"""The admission ledger (docs/architecture.md, last paragraph).

A job reserves every resource its upstream depends on. How many jobs a resource holds at
once is the sharing rule of :mod:`vacancyd.core.sharing`: by default one, so a second
request that needs any of them is refused with ``resource_busy`` (Retry-After 2 s) until the
first is released; ``max_concurrent`` allows more, and exclusivity keeps some upstreams'
jobs apart. Each job keeps the MiB the gate charged it, so the next admission is charged
beside the jobs still running. Release time per resource is kept so the gate can demand a
capacity sample taken after it. Pure: callers pass monotonic ``now`` in seconds, and
the asyncio proxy calls it without awaiting in between, so no lock is needed.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Credit, Refuse
from vacancyd.core.sharing import slot_refusal
from vacancyd.core.snapshot import RequestFacts


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
class Admitted:
    """What admission fixed about one borrowed job, never changed after: the one record of
    it that its ledger entry (:class:`Job`) and its lifecycle record
    (:class:`vacancyd.core.lifecycle.JobState`) share, each living as long as it must.

    ``id``: the ledger's job id; ``resources``: every resource it reserves, the primary
    first; ``admitted_at``: monotonic seconds; ``model``: the model asked for (None: none
    named); ``borrower``: who borrows it ("": the unnamed borrower of the single token).
    """

    id: int
    upstream: str
    resources: tuple[str, ...]
    admitted_at: float
    model: str | None = None
    borrower: str = ""


class AdmittedFields:
    """The :class:`Admitted` record's fields, read through ``admitted``."""

    __slots__ = ()
    admitted: Admitted

    @property
    def id(self) -> int:
        return self.admitted.id

    @property
    def upstream(self) -> str:
        return self.admitted.upstream

    @property
    def resources(self) -> tuple[str, ...]:
        return self.admitted.resources

    @property
    def admitted_at(self) -> float:
        """Monotonic seconds."""
        return self.admitted.admitted_at

    @property
    def model(self) -> str | None:
        return self.admitted.model

    @property
    def borrower(self) -> str:
        return self.admitted.borrower


@dataclass(frozen=True, slots=True)
class Job(AdmittedFields):
    """One admitted borrowed request's ledger entry: its :class:`Admitted` record (``id``,
    ``upstream``, ``resources``, ``admitted_at``, ``model``, ``borrower`` read through) and
    what the ledger changes of it.

    ``phase``: as exported (:class:`Phase`). ``charged_mib``: MiB the gate's per-model step
    charged against the primary resource (None without byte capacity). ``facts``: what the
    gate decided on; ``credit``: the residency proof's outcome, for /status.
    """

    admitted: Admitted
    phase: Phase
    charged_mib: int | None = None
    facts: RequestFacts | None = None
    credit: Credit | None = None
    #: Free MiB of the primary resource when it was admitted (for the learned prior).
    free_before_mib: float | None = None


@dataclass
class Ledger:
    """Active jobs and per-resource release times.

    ``policies``: the upstreams' policies, for their slots and exclusivity; an upstream not
    listed gets one slot and no exclusivity. ``waiting``: requests waiting per upstream, kept
    current by the wait queues (an exclusive upstream's waiting request goes first).
    """

    policies: Mapping[str, UpstreamPolicy] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    _jobs: dict[int, Job] = field(default_factory=dict)
    _holders: dict[str, list[int]] = field(default_factory=dict)
    _released_at: dict[str, float] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def fits(
        self, upstream: str, resources: tuple[str, ...], waiting: Mapping[str, int] | None = None
    ) -> Refuse | None:
        """Whether a new job of ``upstream`` on ``resources`` would fit now (None) or the
        ``resource_busy`` refusal it would get. ``waiting``: waiting requests per upstream."""
        policy = self.policies.get(upstream) or UpstreamPolicy(
            upstream, "", resources[0], resources[1:]
        )
        if policy.resources != resources:
            policy = replace(policy, resource=resources[0], also_requires=resources[1:])
        return slot_refusal(
            policy,
            self.holders_by_upstream(),
            self.policies,
            self.waiting if waiting is None else waiting,
        )

    def reserve(
        self,
        upstream: str,
        resources: tuple[str, ...],
        now: float,
        model: str | None = None,
        *,
        charged_mib: int | None = None,
        waiting: Mapping[str, int] | None = None,
        facts: RequestFacts | None = None,
        credit: Credit | None = None,
        free_before_mib: float | None = None,
        borrower: str = "",
    ) -> Job | Refuse:
        """Reserve every resource in ``resources`` for a new job of ``borrower``, or refuse
        ``resource_busy`` when the sharing rule says it does not fit (see :meth:`fits`)."""
        refusal = self.fits(upstream, resources, waiting)
        if refusal is not None:
            return refusal
        job = Job(
            Admitted(next(self._ids), upstream, resources, now, model, borrower),
            Phase.FORWARDING,
            charged_mib,
            facts=facts,
            credit=credit,
            free_before_mib=free_before_mib,
        )
        self._jobs[job.id] = job
        for name in resources:
            self._holders.setdefault(name, []).append(job.id)
        return job

    def restore_held(
        self,
        upstream: str,
        resources: tuple[str, ...],
        now: float,
        model: str | None = None,
        charged_mib: int | None = None,
        borrower: str = "",
    ) -> Job:
        """Re-create ``borrower``'s job held before a restart, in the ``held`` phase,
        whatever else holds its resources (it was reserved before anything admitted since)."""
        admitted = Admitted(next(self._ids), upstream, resources, now, model, borrower)
        job = Job(admitted, Phase.HELD, charged_mib)
        self._jobs[job.id] = job
        for name in resources:
            self._holders.setdefault(name, []).append(job.id)
        return job

    def set_charge(self, job_id: int, charged_mib: int | None) -> None:
        """Replace a job's charge (an exclusive job is charged again after the unload)."""
        job = self._jobs.get(job_id)
        if job is not None:
            self._jobs[job_id] = replace(job, charged_mib=charged_mib)

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
            holders = self._holders.get(name, [])
            if job_id in holders:
                holders.remove(job_id)
            if not holders:
                self._holders.pop(name, None)
            self._released_at[name] = now
        return job

    def released_at(self, resource: str) -> float | None:
        """Monotonic time of the last release on ``resource``, or None."""
        return self._released_at.get(resource)

    def jobs(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.id)

    def holder(self, resource: str) -> Job | None:
        """The oldest job holding ``resource``, or None."""
        holders = self._holders.get(resource)
        return self._jobs.get(holders[0]) if holders else None

    def holders_by_upstream(self) -> dict[str, list[str]]:
        """Resource -> the upstream name of each job holding it, oldest first."""
        return {
            name: [self._jobs[i].upstream for i in ids]
            for name, ids in self._holders.items()
            if ids
        }

    def charged_mib(self, resource: str) -> int:
        """MiB charged to the jobs holding ``resource`` as their primary resource."""
        return sum(
            job.charged_mib or 0
            for i in self._holders.get(resource, ())
            if (job := self._jobs[i]).resources[0] == resource
        )

    def jobs_per_resource(self) -> dict[str, int]:
        """Resource -> number of jobs holding it."""
        return {name: len(ids) for name, ids in self._holders.items() if ids}

    def jobs_per_upstream(self) -> Counter[str]:
        return Counter(j.upstream for j in self._jobs.values())

    def active_per_upstream(self) -> dict[str, int]:
        """Upstream -> number of its jobs in the ledger (only upstreams that have one).

        A plain dict built in one pass: every snapshot takes it, and a Counter costs more
        than the rest of the count.
        """
        counts: dict[str, int] = {}
        for job in self._jobs.values():
            counts[job.upstream] = counts.get(job.upstream, 0) + 1
        return counts

    def counts(self) -> Counter[tuple[str, Phase]]:
        """Active jobs per (upstream, phase)."""
        return Counter((j.upstream, j.phase) for j in self._jobs.values())
