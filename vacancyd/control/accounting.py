"""What each borrowed job used, counted when it ends (docs/borrowers.md): its busy time, the
tokens its server reported, the GPU energy it is attributed, the bytes it moved; one row in
the usage ledger per job and the per-borrower metrics.

:class:`Accounting` is told when a job is admitted (:meth:`Accounting.started`), what its
exchange carried (:meth:`Accounting.exchanged`, from the proxy, before the exchange's end is
reported) and when the job ended (:meth:`Accounting.ended`, from
:class:`~vacancyd.control.work.Work`, which ends every job exactly once). Energy comes from
each GPU's cumulative energy counter in the capacity samples (:meth:`Accounting.sampled`),
shared between the jobs that ran at once by time (:func:`vacancyd.core.energy.split_energy`).
A job on a GPU with a counter is written once the first sample after its end has been read
(the release asks for one at once), or after :data:`ENERGY_WAIT_S` at the latest, so its
last seconds are counted; on any other resource it is written when it ends.

Times: ``clock`` is the monotonic clock the jobs and samples are stamped with, ``wall`` the
wall clock (s since the epoch) the ledger keeps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from vacancyd.control.borrowers import Borrowers
from vacancyd.core.energy import split_energy
from vacancyd.core.usage import UsageRow
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)

#: Seconds an ended job on a GPU with an energy counter waits for the sample after its end.
ENERGY_WAIT_S = 10.0


@dataclass(slots=True)
class _Job:
    id: int
    borrower: str
    upstream: str
    model: str | None
    resources: tuple[str, ...]
    wall_start: float
    start: float  # monotonic
    end: float | None = None  # monotonic
    wall_end: float | None = None
    outcome: str = ""
    prompt: int | None = None
    completion: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    written: bool = False


class Accounting:
    """Per-job usage on this daemon; one per daemon, event loop only.

    ``borrowers``: the quota counts (told of every start and end); ``metrics``: the
    per-borrower counters; ``record``: writes one ledger row and returns at once (None: no
    ledger, the metrics are still counted); ``energy_of``: the newest (monotonic s, joules)
    of a resource's energy counter, None where it has none; ``energy_wait_s``: see
    :data:`ENERGY_WAIT_S`.
    """

    def __init__(
        self,
        borrowers: Borrowers,
        metrics: Metrics,
        *,
        record: Callable[[UsageRow], object] | None = None,
        energy_of: Callable[[str], tuple[float, float] | None] = lambda _r: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        energy_wait_s: float = ENERGY_WAIT_S,
    ) -> None:
        self.borrowers = borrowers
        self.metrics = metrics
        self.record = record
        self.energy_of = energy_of
        self.clock = clock
        self.wall = wall
        self.energy_wait_s = energy_wait_s
        self._jobs: dict[int, _Job] = {}
        #: Per resource with an energy counter: its readings (monotonic s, J), oldest first,
        #: as far back as a job not yet written needs them.
        self._readings: dict[str, list[tuple[float, float]]] = {}
        #: Jobs that ended and wait for the sample after their end, with their timers.
        self._pending: dict[int, asyncio.TimerHandle | None] = {}

    # -- what the daemon reports ----------------------------------------------------------

    def started(
        self,
        job_id: int,
        borrower: str,
        upstream: str,
        model: str | None,
        resources: tuple[str, ...],
        at: float,
    ) -> None:
        """Job ``job_id`` of ``borrower`` was admitted at monotonic ``at`` on ``resources``
        (primary first)."""
        wall = self.wall() - max(0.0, self.clock() - at)
        self._jobs[job_id] = _Job(job_id, borrower, upstream, model, resources, wall, at)
        self.borrowers.started(job_id, borrower, wall)
        for name in resources:
            reading = self.energy_of(name)
            if reading is not None:
                self._add_reading(name, reading)

    def exchanged(
        self,
        job_id: int,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        bytes_in: int,
        bytes_out: int,
    ) -> None:
        """What job ``job_id``'s exchange carried: the tokens its server reported (None: not
        reported) and the body bytes read from the borrower and sent to it."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.prompt, job.completion = prompt_tokens, completion_tokens
        job.bytes_in, job.bytes_out = bytes_in, bytes_out

    def ended(self, job_id: int, outcome: str) -> None:
        """Job ``job_id`` ended with ``outcome`` (a ``JobOutcome`` value): its busy time
        counts toward its borrower's quota now; its row is written now, or after the sample
        that closes its energy."""
        job = self._jobs.get(job_id)
        if job is None or job.end is not None:
            return
        job.end = self.clock()
        job.wall_end = self.wall()
        job.outcome = outcome
        self.borrowers.ended(job_id, job.wall_end)
        if not any(name in self._readings for name in job.resources):
            self._write(job)
            return
        timer: asyncio.TimerHandle | None = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            timer = loop.call_later(self.energy_wait_s, self._write_pending, job_id)
        self._pending[job_id] = timer
        if loop is None:
            self._write_pending(job_id)

    def sampled(self, resources: Iterable[str]) -> None:
        """Capacity samples were taken: read the energy counter of each of ``resources``
        that has one, and write the ended jobs whose energy is now closed."""
        for name in resources:
            reading = self.energy_of(name)
            if reading is not None:
                self._add_reading(name, reading)
        for job_id in list(self._pending):
            job = self._jobs[job_id]
            assert job.end is not None
            if all(
                (readings := self._readings.get(name)) is None or readings[-1][0] >= job.end
                for name in job.resources
            ):
                self._write_pending(job_id)

    def flush(self) -> None:
        """Write every ended job's row now (the daemon stops)."""
        for job_id in list(self._pending):
            self._write_pending(job_id)

    # -- the rows ------------------------------------------------------------------------

    def _add_reading(self, name: str, reading: tuple[float, float]) -> None:
        readings = self._readings.setdefault(name, [])
        if not readings or reading[0] > readings[-1][0]:
            readings.append(reading)
        if len(readings) > 2:
            self._trim(name)

    def _trim(self, name: str) -> None:
        """Drop the readings older than the newest one at or before the start of every job
        on ``name`` not yet written (one reading stays when there is none)."""
        readings = self._readings[name]
        open_starts = [
            j.start for j in self._jobs.values() if not j.written and name in j.resources
        ]
        horizon = min(open_starts, default=math.inf)
        keep = 0
        for i, (t, _e) in enumerate(readings):
            if t <= horizon:
                keep = i
        if keep:
            del readings[:keep]

    def _write_pending(self, job_id: int) -> None:
        timer = self._pending.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        job = self._jobs.get(job_id)
        if job is not None:
            self._write(job)

    def _energy(self, job: _Job) -> dict[str, float]:
        """Joules per resource of ``job`` with an energy counter, where some reading pair
        covered part of its life."""
        out: dict[str, float] = {}
        assert job.end is not None
        for name in job.resources:
            readings = self._readings.get(name)
            if not readings:
                continue
            others = {
                j.id: (j.start, j.end if j.end is not None else math.inf)
                for j in self._jobs.values()
                if name in j.resources
            }
            share = split_energy(readings, others).shares[job.id]
            if share.covered_s > 0 or job.end <= job.start:
                out[name] = share.joules
        return out

    def _write(self, job: _Job) -> None:
        assert job.end is not None and job.wall_end is not None
        energy = self._energy(job)
        job.written = True
        row = UsageRow(
            job_id=job.id,
            borrower=job.borrower,
            upstream=job.upstream,
            model=job.model,
            resource=job.resources[0] if job.resources else "",
            started_at=job.wall_start,
            ended_at=job.wall_end,
            outcome=job.outcome,
            prompt_tokens=job.prompt,
            completion_tokens=job.completion,
            energy_j=sum(energy.values()) if energy else None,
            bytes_in=job.bytes_in,
            bytes_out=job.bytes_out,
        )
        self.metrics.borrower_job(row, energy)
        if self.record is not None:
            try:
                self.record(row)
            except Exception:  # the ledger never stops lending
                log.exception("could not record job %d in the usage ledger", job.id)
        self._forget_written()

    def _forget_written(self) -> None:
        """Forget written jobs no job still to be written overlaps (their intervals no
        longer change any share)."""
        open_jobs = [j for j in self._jobs.values() if not j.written]
        for job_id, job in list(self._jobs.items()):
            if not job.written:
                continue
            assert job.end is not None
            if not any(
                o.start < job.end and set(o.resources) & set(job.resources) for o in open_jobs
            ):
                del self._jobs[job_id]
        for name in list(self._readings):
            if len(self._readings[name]) > 1:
                self._trim(name)

    def running(self) -> Mapping[int, str]:
        """The borrower of each job started and not yet ended, by job id."""
        return {j.id: j.borrower for j in self._jobs.values() if j.end is None}
