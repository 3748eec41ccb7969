"""Held jobs: which are on disk, which are shown, and the log lines that announce them.

A job whose completion is uncertain is *held* (:mod:`vacancyd.core.lifecycle`): its
reservation stays until its server is seen idle or an administrator releases it. With a
:class:`HoldsWriter` (the daemon's durable-state saver), a hold survives a restart; a new
hold is shown (``/status``, the ``job_hold`` event, the ledger's ``held`` phase, its log
line) only once the writer says it is on disk, and until then the resources it holds lend
nothing (``state_write_failed`` once a write failed). :class:`HoldBook` keeps that
bookkeeping for :class:`vacancyd.control.work.Work`, which owns the jobs themselves (the
tasks that watch a held job are :mod:`vacancyd.control.jobwatch`'s).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from vacancyd.control import jobwatch
from vacancyd.core.ledger import Phase
from vacancyd.core.lifecycle import Hold, JobPhase, JobState
from vacancyd.core.reasons import Reason
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.control.work")


class HeldJobs(Protocol):
    """What a :class:`HoldsWriter` reads and tells: the held jobs, and whether they are on
    disk (:class:`HoldBook`)."""

    def held(self) -> list[JobState]: ...

    def holds_saved(self, job_ids: frozenset[int]) -> None: ...

    def holds_unsaved(self, error: str) -> None: ...


class HoldsWriter(Protocol):
    """Writes the held jobs to the state directory (the daemon's durable-state saver), so
    a hold survives a restart."""

    def write_holds(self, source: HeldJobs) -> None:
        """Write ``source.held()`` soon (off the loop), then tell ``source`` which job ids
        are on disk (``holds_saved``) or why the write failed (``holds_unsaved``)."""
        ...


class HoldBook:
    """The held jobs among ``jobs`` (the live jobs by id, kept by ``Work``; read only here).

    ``writer``: asked to write the held jobs whenever their set changes; None: holds are
    shown at once and never written. What is shown is read from here (:meth:`shown`, for
    /status); publishes to ``state`` the ``unsaved_holds``, ``job_hold`` events and the
    ledger's ``held`` phase.
    """

    def __init__(
        self, state: SharedState, jobs: Mapping[int, JobState], writer: HoldsWriter | None
    ) -> None:
        self._state = state
        self._jobs = jobs
        self._writer = writer
        self._held_ids: set[int] = set()
        #: Held jobs not yet known to be on disk (only with a ``writer``).
        self._unsaved: set[int] = set()
        #: Held jobs shown in /status and announced as ``job_hold`` events, by id (each
        #: job's record as it was last shown).
        self._shown: dict[int, JobState] = {}
        #: Why the newest write of the held jobs failed; None when it did not.
        self._write_error: str | None = None
        #: The failure last logged: (error, unsaved job ids), so each is logged once.
        self._logged_failure: tuple[str, frozenset[int]] | None = None

    # -- what a HoldsWriter reads and tells -------------------------------------------------

    def held(self) -> list[JobState]:
        """Jobs held for uncertain completion, oldest first."""
        return sorted(
            (j for j in self._jobs.values() if j.phase is JobPhase.HELD), key=lambda j: j.id
        )

    def shown(self) -> dict[int, Hold]:
        """The holds shown in /status, by job id: held jobs whose hold is on disk (all held
        jobs without a writer)."""
        return {i: j.hold for i, j in self._shown.items() if j.hold is not None}

    def unsaved(self) -> list[int]:
        """Ids of held jobs not yet known to be on disk, oldest first."""
        return sorted(self._unsaved)

    def holds_saved(self, job_ids: frozenset[int]) -> None:
        """The held jobs ``job_ids`` are on disk now (the durable writer calls this after
        each successful write): show them, and let their resources lend again."""
        saved = self._unsaved & job_ids
        self._unsaved -= saved
        if self._write_error is not None:
            log.info("held jobs written to the state directory again")
            self._write_error = None
            self._logged_failure = None
        for job_id in sorted(saved):
            job = self._jobs.get(job_id)
            if job is not None and job.phase is JobPhase.HELD:
                self._state.ledger.set_phase(job_id, Phase.HELD)
                log.warning("%s", jobwatch.hold_line(job))
        self._show()

    def holds_unsaved(self, error: str) -> None:
        """The newest write of the held jobs failed with ``error`` (it is retried): the
        resources of every hold not yet on disk refuse ``state_write_failed``."""
        failure = (error, frozenset(self._unsaved))
        if self._unsaved and failure != self._logged_failure:
            self._logged_failure = failure
            resources = sorted(
                {r for i in self._unsaved if (j := self._jobs.get(i)) for r in j.resources}
            )
            log.error(
                "held job(s) %s cannot be written to the state directory (%s); borrowed work "
                "on %s is refused (%s) until the write, retried, succeeds",
                ", ".join(str(i) for i in sorted(self._unsaved)),
                error,
                ", ".join(resources),
                Reason.STATE_WRITE_FAILED,
            )
        self._write_error = error
        self._show()

    # -- what Work tells ---------------------------------------------------------------------

    def defer(self, job: JobState) -> bool:
        """``job`` was just held: True when its showing waits until it is on disk
        (:meth:`holds_saved`); False when there is no writer (the caller shows it now)."""
        if self._writer is None:
            return False
        self._unsaved.add(job.id)
        return True

    def changed(self) -> None:
        """After a transition: when the set of held jobs changed, ask for it to be written
        (``writer``) and show what is on disk."""
        held = {j.id for j in self._jobs.values() if j.phase is JobPhase.HELD}
        if held != self._held_ids:
            self._held_ids = held
            self._unsaved &= held  # a hold that ended before it was written is just gone
            if self._writer is not None:
                self._writer.write_holds(self)
            self._show()

    def restored(self, job: JobState) -> None:
        """``job`` was held again from the state directory: it is on disk already, so it
        is shown at once."""
        assert job.hold is not None
        self._held_ids.add(job.id)
        self._shown[job.id] = job

    def rehold(self, job: JobState) -> None:
        """Restored ``job``'s hold changed how it is released (its server's observations
        cannot release it): show its new hold."""
        assert job.hold is not None
        if job.id in self._shown:
            self._shown[job.id] = job

    def _show(self) -> None:
        """Publish the held jobs that are on disk (``/status``, ``job_hold`` events) and
        mark the resources of those that are not (the gate refuses them)."""
        shown = {
            j.id: j
            for j in self._jobs.values()
            if j.phase is JobPhase.HELD and j.id not in self._unsaved
        }
        before, self._shown = self._shown, shown
        for job_id in sorted(shown.keys() - before.keys()):
            job = shown[job_id]
            assert job.hold is not None
            self._state.note_job_hold(
                job_id, job.upstream, job.hold, held=True, borrower=job.borrower
            )
        for job_id in sorted(before.keys() - shown.keys()):
            job = before[job_id]
            assert job.hold is not None
            self._state.note_job_hold(
                job_id, job.upstream, job.hold, held=False, borrower=job.borrower
            )
        unsaved: dict[str, str | None] = {}
        for job_id in self._unsaved:
            pending = self._jobs.get(job_id)
            for name in pending.resources if pending is not None else ():
                unsaved[name] = self._write_error
        if unsaved != self._state.unsaved_holds:
            self._state.unsaved_holds = unsaved
