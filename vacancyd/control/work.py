"""Borrowed work: every admitted job's life until its reservation is released.

The phases and their rules are the pure state machine in :mod:`vacancyd.core.lifecycle`;
this module is its only executor and the only writer of the admission ledger. The decisions
that admit or refuse a request are :mod:`vacancyd.control.admission`'s; this module:

* records what admission decided: the ledger reservation and the job's record
  (:meth:`Work.reserve`), an exclusive job's charge, a job dropped before it was forwarded;
* records what the proxy reports about the exchange through the job's handle
  (:mod:`vacancyd.control.job`: started, reply arrived, ended, upstream silent) and
  carries out the resulting transitions: tracking a job the server still runs (its own
  task, ``track NAME job N``), tracking the abandoned request of a borrower who disconnected
  from a server that goes on generating, and holding a cut job whose outcome is uncertain
  (both watched by ``hold NAME job N`` where the server's idleness can be observed),
  releasing;
* counts and logs how every job ended (``vacancyd_jobs_total{upstream,outcome}``, the
  ``outcome`` field of the ``job N ended`` log line);
* cuts jobs for a reclaim: cuts the exchange the proxy handed over
  (:class:`~vacancyd.core.lifecycle.Cuttable`), or cancels tracked work through the
  server's API with a deadline;
* on every release, asks the collectors for a fresh sample of each released resource, so
  the next admission's "sample after the last release" rule is usually met by the time the
  next request arrives, and serves the wait queues of upstreams with ``busy = "wait"``
  (:mod:`vacancyd.control.waiting`, kept here as :attr:`Work.rooms`);
* sharing (docs/architecture.md "Sharing the card"): an exclusive upstream's server frees
  its memory before its job's reservation is released (:mod:`vacancyd.control.sharing`).

A reclaim reads jobs and asks for cuts here. Times are monotonic seconds from
``SharedState.clock``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from vacancyd.adapters.base import Controller
from vacancyd.control import jobwatch
from vacancyd.control.accounting import Accounting
from vacancyd.control.holds import HoldBook, HoldsWriter
from vacancyd.control.observe import JobObserver
from vacancyd.control.sharing import CardSharing
from vacancyd.control.spawn import Spawner
from vacancyd.control.upstreamcalls import Outcome, UpstreamCalls
from vacancyd.control.waiting import WaitRooms
from vacancyd.core.ledger import Job
from vacancyd.core.lifecycle import (
    CancelExchange,
    CancelOnServer,
    Cuttable,
    Ending,
    Follow,
    Hold,
    HoldReason,
    JobOutcome,
    JobPhase,
    JobRules,
    JobState,
    Release,
    ReleaseBy,
    SetPhase,
    Transition,
    WatchIdle,
)
from vacancyd.core.observations import SampleKey
from vacancyd.core.reasons import Admit, Refuse
from vacancyd.core.reclaim import Edge
from vacancyd.core.reclaim import refusal as reclaim_refusal
from vacancyd.core.sharing import serve_order
from vacancyd.core.snapshot import RequestFacts
from vacancyd.state import SharedState
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CutResult:
    """What :meth:`Work.cut` did: ``streams``, the exchanges it cut while they ran (their
    upstream connections closed); ``cancels``, each server's cancel of tracked jobs in its
    queue, as :class:`~vacancyd.control.upstreamcalls.UpstreamCalls` ended it."""

    streams: int = 0
    cancels: tuple[Outcome[None], ...] = ()


@dataclass
class _Upstream:
    rules: JobRules
    controller: Controller | None = None
    #: The running exchanges of this upstream's jobs, by job id (a reclaim cuts them).
    exchanges: dict[int, Cuttable] = field(default_factory=dict)


class Work:
    """Every borrowed job on this daemon; one per daemon, touched only from the event loop.

    ``holds_writer``: asked to write the held jobs whenever their set changes; with one, a
    new hold is shown (``/status``, the ``job_hold`` event, the log) only once
    :meth:`holds_saved` says it is on disk, and until then its resources lend nothing.
    None: holds are shown at once and never written. ``after_release(job, now)``: told of
    every released reservation (monotonic ``now``), to learn from it.
    """

    def __init__(
        self,
        state: SharedState,
        *,
        supervisor: Spawner,
        metrics: Metrics,
        calls: UpstreamCalls,
        holds_writer: HoldsWriter | None = None,
        after_release: Callable[[Job, float], None] | None = None,
        observers: Sequence[JobObserver] = (),
        accounting: Accounting | None = None,
    ) -> None:
        self.state = state
        #: Told when each job starts and stops holding its resources (the power limiter).
        self._observers = tuple(observers)
        #: Every call to the servers (here: cancelling tracked work in a server's queue).
        self.calls = calls
        self.supervisor = supervisor
        self.metrics = metrics
        #: What each job used (busy time, tokens, energy; the borrowers' quota counts and the
        #: usage ledger), told of every job's start and end; None: nothing is counted.
        self.accounting = accounting
        self._after_release = after_release
        self._watched: set[int] = set()
        self._upstreams: dict[str, _Upstream] = {}
        self._jobs: dict[int, JobState] = {}
        #: The held jobs: which are on disk and shown (the ``holds_writer``'s source).
        self.holds = HoldBook(state, self._jobs, holds_writer)
        #: Per upstream: set whenever one of its jobs changes phase (see :meth:`changes`).
        self._changes: dict[str, asyncio.Event] = {}
        #: Wait queues of upstreams with ``busy = "wait"`` (see :meth:`enable_wait`).
        self.rooms: WaitRooms[JobState] = WaitRooms(
            state.clock,
            request_sample=state.samples.request,
            counts=state.ledger.waiting,
            observe=lambda up, outcome, s: metrics.wait_seconds.labels(up, outcome).observe(s),
        )
        self.rooms.set_order(serve_order(state.upstreams))
        # Anything that may change a waiting request's answer serves the queues again: a
        # state transition here, each new sample through the daemon's collectors.
        state.subscribe(lambda _event: self.rooms.serve())
        #: Exclusivity effects; None until :meth:`share_cards` (no upstream is exclusive).
        self.card: CardSharing | None = None

    # -- wiring --------------------------------------------------------------------------

    def add_upstream(
        self, name: str, rules: JobRules, controller: Controller | None = None
    ) -> None:
        """Declare one upstream's lifecycle rules (and its controller, for tracked work)."""
        self._upstreams[name] = _Upstream(rules, controller)

    def enable_wait(self, name: str, *, max_waiting: int, timeout_s: float) -> None:
        """Let busy requests on ``name`` wait: at most ``max_waiting`` at once, each for at
        most ``timeout_s`` seconds (``busy = "wait"``)."""
        self.rooms.add(name, max_waiting=max_waiting, timeout_s=timeout_s)

    def share_cards(self, card: CardSharing) -> None:
        """Carry out exclusivity for upstreams with ``exclusive_of`` (set once)."""
        self.card = card

    # -- admission's records (the decisions are vacancyd.control.admission's) -------------

    def refusal(self, upstream: str) -> Refuse | None:
        """The reclaim refusal new work on ``upstream`` gets now (while the reclaim the
        reclaimer published for it is open: :func:`vacancyd.core.reclaim.refusal`), or None."""
        return reclaim_refusal(self.state.reclaims.get(upstream))

    def reserve(
        self, upstream: str, admit: Admit, now: float, facts: RequestFacts, borrower: str = ""
    ) -> JobState | Refuse:
        """Reserve what the gate admitted on a snapshot taken at ``now`` (monotonic s): the
        new job's record, or the ledger's refusal when no slot is left. ``borrower``: who
        borrows it ("": the unnamed borrower of the single borrow token)."""
        policy = self.state.upstreams[upstream]
        reserved = self.state.ledger.reserve(
            upstream,
            admit.resources,
            now,
            facts.model,
            facts=facts,
            charged_mib=admit.charged_mib,
            credit=admit.credit,
            free_before_mib=self.state.free_mib(policy.resource),
            borrower=borrower,
        )
        if isinstance(reserved, Refuse):
            return reserved
        credit = admit.credit
        if credit is not None:
            self.metrics.residency(upstream, credit)
            if credit.applied:
                log.info(
                    "residency credit on %s for model %r (job %d, charged %s MiB): %s",
                    upstream,
                    facts.model,
                    reserved.id,
                    admit.charged_mib,
                    credit.why,
                )
        job = JobState(reserved.admitted)
        self._jobs[job.id] = job
        self._tell(reserved, started=True)
        self._account(job, None, now)
        return job

    def _account(self, job: JobState, outcome: str | None, now: float) -> None:
        """Tell /status, /events and the accounting that ``job`` started (``outcome``
        None) or ended with ``outcome``; a failure there is logged, never raised into the
        job's life."""
        try:
            self.state.note_job(job.id, job.upstream, job.borrower, job.model, outcome=outcome)
            accounting = self.accounting
            if accounting is None:
                return
            if outcome is None:
                accounting.started(
                    job.id, job.borrower, job.upstream, job.model, job.resources, now
                )
            else:
                accounting.ended(job.id, outcome)
        except Exception:
            log.exception("accounting failed on job %d", job.id)

    # -- a borrower's own limits (docs/borrowers.md) --------------------------------------

    def forbidden(self, borrower: str, upstream: str) -> str | None:
        """Why ``borrower`` may not use ``upstream`` (an upstream's or a pool's name) at all:
        the 403's sentence; None when it may (or nothing is counted)."""
        if self.accounting is None:
            return None
        return self.accounting.borrowers.forbidden(borrower, (upstream,))

    def borrower_refusal(self, borrower: str) -> Refuse | None:
        """``quota_exhausted`` or ``borrower_busy`` when ``borrower`` may not start another
        job now, else None."""
        if self.accounting is None:
            return None
        return self.accounting.borrowers.refusal(borrower)

    def exchanged(
        self,
        job_id: int,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        bytes_in: int,
        bytes_out: int,
    ) -> None:
        """What job ``job_id``'s exchange carried (told before its end is reported): the
        tokens the server reported (None: not reported) and the body bytes in and out."""
        if self.accounting is None:
            return
        try:
            self.accounting.exchanged(
                job_id,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                bytes_in=bytes_in,
                bytes_out=bytes_out,
            )
        except Exception:  # counting never breaks the job's life
            log.exception("accounting failed on job %d", job_id)

    def charge(self, job_id: int, charged_mib: int | None) -> None:
        """Charge job ``job_id`` ``charged_mib`` MiB again (an exclusive job, on the fresh
        sample after the other servers were unloaded)."""
        self.state.ledger.set_charge(job_id, charged_mib)

    def drop(self, job: JobState) -> None:
        """Release a job admitted for a request that will not run it (gone, or refused after
        its unload): nothing was forwarded, so nothing needs freeing."""
        if self._jobs.pop(job.id, None) is not None:
            self._release_now(job.id)
            self._ended(replace(job, phase=JobPhase.RELEASED, outcome=JobOutcome.NOT_FORWARDED))

    def _tell(self, job: Job, *, started: bool) -> None:
        for observer in self._observers:
            try:
                if started:
                    observer.job_started(job)
                else:
                    observer.job_ended(job)
            except Exception:  # an observer's bug must not break a job's life
                log.exception("job observer %r failed on job %d", observer, job.id)

    # -- what the proxy reports ------------------------------------------------------------

    def forwarding(self, job_id: int, key: str | None, exchange: Cuttable) -> None:
        """The exchange of job ``job_id`` starts; a reclaim cuts ``exchange``, ``key`` is the
        job key the upstream's controller tracks (None when untracked). A job a reclaim cut
        before its exchange started has it cut at once (nothing had it to cut before)."""
        job = self._jobs[job_id]
        self._upstreams[job.upstream].exchanges[job_id] = exchange
        started = self._apply(job.forwarding(key))
        if started.cut_by is not None and started.key is None:
            self._cancel_exchange(started)
        self._changed(job.upstream)

    def reply_arrived(self, job_id: int, status: int) -> Edge | None:
        """The upstream's response headers arrived; returns the edge that cut the job, if a
        reclaim already did (the proxy then answers as for a cut)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        return self._apply(job.reply_arrived(status)).cut_by

    def exchange_ended(self, job_id: int, ending: Ending) -> None:
        """The proxy is done with job ``job_id``'s exchange; ``ending`` says how."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        up = self._upstreams[job.upstream]
        up.exchanges.pop(job_id, None)
        self._apply(job.exchange_ended(ending, up.rules, self.state.clock()))
        self._changed(job.upstream)

    def upstream_silent(self, job_id: int) -> None:
        """The proxy gave up on job ``job_id``'s exchange: its upstream sent no byte for the
        upstream's ``upstream_silence_s``. The exchange is over; the job is held."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        up = self._upstreams[job.upstream]
        up.exchanges.pop(job_id, None)
        self._apply(job.went_silent(up.rules, self.state.clock()))
        self._changed(job.upstream)

    # -- what an administrator does --------------------------------------------------------

    def admin_release(self, job_id: int) -> Job | None:
        """``POST /admin/jobs/{id}/release``: free job ``job_id``'s reservation now.

        Returns the ledger's record as it was (None for an unknown job).
        """
        entry = self.state.ledger.get(job_id)
        job = self._jobs.get(job_id)
        if job is not None:
            self._apply(job.admin_release())
            self._changed(job.upstream)
        elif entry is not None:
            self._release(entry.id)
        return entry

    # -- what a reclaim reads and does -------------------------------------------------------

    def active(self, upstream: str, admitted_by: float) -> list[JobState]:
        """Jobs on ``upstream`` admitted no later than ``admitted_by`` (monotonic s) that
        defer a reclaim: not held, not ended."""
        return [
            j
            for j in self._jobs.values()
            if j.upstream == upstream and j.admitted_at <= admitted_by and j.phase.defers_reclaim
        ]

    def keys(self, upstream: str) -> frozenset[str]:
        """Tracked job keys of ``upstream``'s jobs that still defer a reclaim."""
        return frozenset(
            j.key
            for j in self._jobs.values()
            if j.upstream == upstream and j.key is not None and j.phase.defers_reclaim
        )

    async def cut(
        self, jobs: list[JobState], edge: Edge, *, cancel_queued: bool = True
    ) -> CutResult:
        """Cut ``jobs`` for the reclaim that ``edge`` opened (those that ended meanwhile are
        skipped); a tracked job's cancel on the server is bounded by
        ``upstreamcalls.CANCEL_DEADLINE_S``. Returns what was done."""
        streams = 0
        cancels: list[Outcome[None]] = []
        queued: dict[str, list[JobState]] = {}
        for job in jobs:
            current = self._jobs.get(job.id)
            if current is None:
                continue
            transition = current.cut(edge, cancel_queued=cancel_queued)
            self._jobs[current.id] = transition.state
            for effect in transition.effects:
                if isinstance(effect, CancelExchange):
                    streams += self._cancel_exchange(transition.state)
                elif isinstance(effect, CancelOnServer):
                    queued.setdefault(current.upstream, []).append(transition.state)
        for upstream, tracked in queued.items():
            keys = [j.key for j in tracked if j.key is not None]
            outcome = await self._cancel_on_server(upstream, keys)
            if outcome is not None:
                cancels.append(outcome)
        return CutResult(streams, tuple(cancels))

    # -- what the daemon's stop does ----------------------------------------------------------

    def cut_for_stop(self) -> None:
        """The daemon is about to reset the borrower connections still in flight: the end of
        each exchange still running counts as a cut (held where a cut's outcome is
        uncertain), not as its borrower's disconnect."""
        for job in list(self._jobs.values()):
            self._apply(job.cut_for_stop())

    def stop_watching(self) -> list[JobState]:
        """The daemon stops watching its jobs (after its listeners closed): hold each one
        whose completion is uncertain (:meth:`JobState.stop_watching`), so ``holds_writer`` writes
        it out and the restarted daemon holds its resources again. Returns the jobs newly
        held."""
        now = self.state.clock()
        held: list[JobState] = []
        for job in list(self._jobs.values()):
            up = self._upstreams.get(job.upstream)
            if up is None:
                continue
            after = self._apply(job.stop_watching(up.rules, now))
            if after.phase is JobPhase.HELD and job.phase is not JobPhase.HELD:
                held.append(after)
                self._changed(job.upstream)
        return held

    # -- readers ---------------------------------------------------------------------------

    def get(self, job_id: int) -> JobState | None:
        return self._jobs.get(job_id)

    def __iter__(self) -> Iterator[JobState]:
        return iter(sorted(self._jobs.values(), key=lambda j: j.id))

    def borrowers(self) -> dict[int, str]:
        """Each live job's borrower by job id ("": the unnamed one), from its record: a job
        is here from its admission (or restored hold) until it ends, also when an
        administrator released its reservation while it still runs."""
        return {i: j.borrower for i, j in self._jobs.items()}

    # -- carrying out transitions ------------------------------------------------------------

    def restore_hold(
        self,
        upstream: str,
        resources: tuple[str, ...],
        *,
        model: str | None,
        charged_mib: int | None,
        reason: HoldReason,
        release_by: ReleaseBy,
        detail: str,
        borrower: str = "",
    ) -> JobState:
        """Hold ``resources`` again for a job that was held when vacancyd last stopped.

        Call before any listener accepts work. The hold starts now: only a server
        observation taken after the restart (see :meth:`watch_restored`) or an administrator
        releases it. ``borrower``: whose job it was; it is that borrower's again (shown, and
        counted from now: its busy time before the restart was not written anywhere).
        """
        now = self.state.clock()
        entry = self.state.ledger.restore_held(
            upstream, resources, now, model, charged_mib, borrower
        )
        job = JobState(
            entry.admitted, phase=JobPhase.HELD, hold=Hold(reason, now, release_by, detail)
        )
        self._jobs[job.id] = job
        self._account(job, None, now)
        self.holds.restored(job)  # it was on disk already: that is where it came from
        return job

    def watch_restored(self) -> None:
        """Once every upstream is declared: watch each restored hold that its server's
        observations can release, and turn the others into admin-only holds."""
        for job in self.holds.held():
            hold = job.hold
            if hold is None or hold.release_by is not ReleaseBy.SERVER_IDLE:
                continue
            up = self._upstreams.get(job.upstream)
            if up is None or not up.rules.idle_evidence:
                job = replace(job, hold=replace(hold, release_by=ReleaseBy.ADMIN))
                self._jobs[job.id] = job
                self.holds.rehold(job)
            elif not self._watching(job.id):
                self._watch_idle(job)

    def _watching(self, job_id: int) -> bool:
        return job_id in self._watched

    def _apply(self, transition: Transition) -> JobState:
        try:
            return self._apply_effects(transition)
        finally:
            self.holds.changed()

    def _apply_effects(self, transition: Transition) -> JobState:
        job = transition.state
        if job.phase.live:
            self._jobs[job.id] = job
        elif self._jobs.pop(job.id, None) is not None:
            self._ended(job)
        for effect in transition.effects:
            if isinstance(effect, Release):
                self._release(job.id)
            elif isinstance(effect, SetPhase):
                if job.hold is not None and self.holds.defer(job):
                    continue  # shown (ledger phase, log) once on disk: HoldBook.holds_saved
                self.state.ledger.set_phase(job.id, effect.phase)
                if job.hold is not None:
                    log.warning("%s", jobwatch.hold_line(job))
                elif job.detached_until is not None and job.detached_since is not None:
                    log.info(
                        "%s: the borrower of job %d disconnected; the server may go on "
                        "generating for it, so its reservation stays until an observation "
                        "shows the server idle (at most %g s)",
                        job.upstream,
                        job.id,
                        job.detached_until - job.detached_since,
                    )
            elif isinstance(effect, Follow):
                self._follow(job, effect.key)
            elif isinstance(effect, WatchIdle):
                if not self._watching(job.id):  # (a watch goes on from tracking to held)
                    self._watch_idle(job)
            elif isinstance(effect, CancelOnServer):
                self.supervisor.spawn(
                    self._cancel_on_server(job.upstream, [effect.key]),
                    name=f"reclaim cancel {job.upstream}",
                    essential=False,
                )
            elif isinstance(effect, CancelExchange):
                self._cancel_exchange(job)
        return job

    def _release(self, job_id: int) -> None:
        """Release the ledger entry and ask for a fresh sample of each resource; an
        exclusive upstream's server frees its memory first (the card stays reserved until it
        has), and the servers it excluded load their ``warm_model`` again after."""
        entry = self.state.ledger.get(job_id)
        card = self.card
        if entry is None or card is None or not card.is_exclusive(entry.upstream):
            self._release_now(job_id)
            return
        keys = frozenset(j.key for j in self._jobs.values() if j.key is not None)

        async def free_then_release() -> None:
            try:
                await card.after_job(entry.upstream, keys)
            finally:
                self._release_now(job_id)
            if not self._card_wanted(entry.upstream):
                await card.warm(entry.upstream)

        self.supervisor.spawn(
            free_then_release(), name=f"free {entry.upstream} job {job_id}", essential=False
        )

    def _card_wanted(self, upstream: str) -> bool:
        """True while a job of ``upstream`` holds the card or one of its requests waits."""
        return self.rooms.waiting(upstream) > 0 or any(
            j.upstream == upstream for j in self.state.ledger.jobs()
        )

    def _release_now(self, job_id: int) -> None:
        now = self.state.clock()
        released = self.state.ledger.release(job_id, now)
        if released is not None:
            for name in released.resources:
                self.state.samples.request(SampleKey.capacity(name))
            if self._after_release is not None:
                self._after_release(released, now)
            self._tell(released, started=False)
        self.rooms.serve()

    def _ended(self, job: JobState) -> None:
        """Count and log ``job``'s end (it has left ``_jobs``)."""
        outcome = job.outcome or job.final_outcome
        self.metrics.job_ended(job.upstream, outcome)
        self._account(job, outcome.value, self.state.clock())
        log.info(
            "%s: job %d ended: %s after %.3f s",
            job.upstream,
            job.id,
            outcome,
            self.state.clock() - job.admitted_at,
            extra={"upstream": job.upstream, "job": job.id, "outcome": outcome.value},
        )

    def changes(self, upstream: str) -> asyncio.Event:
        """The event set whenever a job of ``upstream`` changes phase (admitted work starts,
        lands, ends, is held or released): a reclaim waiting for that work to end clears it
        and waits on it. One per upstream, created on first use."""
        event = self._changes.get(upstream)
        if event is None:
            event = self._changes[upstream] = asyncio.Event()
        return event

    def _changed(self, upstream: str) -> None:
        event = self._changes.get(upstream)
        if event is not None:
            event.set()

    def _cancel_exchange(self, job: JobState) -> bool:
        """Cut ``job``'s exchange; True when it was still running (counted)."""
        exchange = self._upstreams[job.upstream].exchanges.get(job.id)
        edge = job.cut_by
        if exchange is not None and edge is not None and exchange.cut(edge):
            self.metrics.cancelled_jobs.labels(job.upstream, "stream").inc()
            return True
        return False

    async def _cancel_on_server(self, upstream: str, keys: list[str]) -> Outcome[None] | None:
        """Cancel the tracked jobs ``keys`` in ``upstream``'s queue; None when there is
        nothing to cancel or no controller to cancel it with."""
        if not keys or not self.calls.supports(upstream):
            return None
        return await self.calls.cancel(upstream, keys, why=f"reclaim on {upstream}")

    def _follow(self, job: JobState, key: str) -> None:
        """Keep a landed, tracked job reserved until the server finishes it."""
        controller = self._upstreams[job.upstream].controller
        assert controller is not None
        self.supervisor.spawn(
            jobwatch.follow(controller, key, job.id, self._step, self.state.clock),
            name=f"track {job.upstream} job {job.id}",
            essential=False,
        )

    def _watch_idle(self, job: JobState) -> None:
        """Release a held job, or end the tracking of a disconnected borrower's request, once
        a server observation taken after the hold or the disconnect shows the server idle
        (:func:`vacancyd.control.jobwatch.await_idle`). One task per job."""
        self._watched.add(job.id)
        self.supervisor.spawn(
            jobwatch.await_idle(job, self._jobs.get, self._step, self.state, self._watched),
            name=f"hold {job.upstream} job {job.id}",
            essential=False,
        )

    def _step(self, job_id: int, step: Callable[[JobState], Transition]) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        self._apply(step(job))
        self._changed(job.upstream)
