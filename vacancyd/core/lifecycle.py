"""One borrowed job's life, as a pure state machine.

A job is born when admission reserves its resources in the ledger and ends when that
reservation is given back. In between it moves through these phases::

    admitted ──forwarding──▶ forwarding ──exchange ended──▶ released | cut
                                  │                              ▲
                                  ├─ tracked reply landed ─▶ tracking ──done──┘
                                  ├─ borrower disconnected ─▶   │   (server seen idle)
                                  │                              │
                                  ├─ cut, outcome uncertain ─▶ held ◀── tracking lost,
                                  └─ upstream silent ────────▶   │      detached work timeout
                                       server seen idle / admin ─┘

* ``forwarding``: the HTTP exchange with the upstream runs.
* ``tracking``: the exchange ended but the server still runs the work: a ComfyUI prompt in
  its queue, or, on a server that goes on generating for a request whose borrower
  disconnected (llama-server), that abandoned generation. The reservation stays until the
  server has finished it: the prompt left the queue, or a server observation taken after the
  disconnect shows the server idle. Detached work that still looks busy after
  ``detached_work_timeout_s`` is held (below) rather than released on a guess.
* ``held``: a reclaim cut the exchange but the server may still be working (a closed
  connection does not stop an OpenAI-compatible server), tracking lost sight of the work, or
  the upstream sent nothing for its silence limit (``upstream_silence_s``): a server that
  stopped answering may still hold the memory, so it is not lent again on a guess.
  The reservation stays until the server is seen idle after the hold began, or an
  administrator releases the job. Held work never defers a reclaim.
* ``released`` / ``cut``: terminal; ``cut`` when a reclaim cut the job first. Either way the
  job's :class:`JobOutcome` says how it ended (completed, borrower disconnected, upstream
  failed, cut).

When the daemon stops, the exchanges still running are cut (:meth:`JobState.cut_for_stop`:
their end counts as a cut, not as the borrower's disconnect, and is held as any cut whose
outcome is uncertain), and every job it stops watching while the server may still be working
on it is held (:meth:`JobState.stop_watching`), so the holds file keeps its resources
refused across the restart.

Each input is a method returning a :class:`Transition`: the job's next state and the effects
the executor (:mod:`vacancyd.control.work`) must carry out, as values. Nothing here does I/O
or reads a clock: times are monotonic seconds passed in by the caller. A job record holds
only plain values (ids, names, enums, floats), so held jobs can be written out and read back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from vacancyd.core.ledger import Admitted, AdmittedFields, Phase
from vacancyd.core.reasons import (  # re-exported; defined with the other codes
    HoldReason as HoldReason,
)
from vacancyd.core.reasons import (
    JobOutcome as JobOutcome,
)
from vacancyd.core.reclaim import Edge


class JobPhase(StrEnum):
    """Where one borrowed job is in its life (see the module docstring)."""

    ADMITTED = "admitted"
    FORWARDING = "forwarding"
    TRACKING = "tracking"
    HELD = "held"
    RELEASED = "released"
    CUT = "cut"

    @property
    def live(self) -> bool:
        """Not yet ended: the job still has a record."""
        return self not in (JobPhase.RELEASED, JobPhase.CUT)

    @property
    def defers_reclaim(self) -> bool:
        """A reclaim waits for (or cuts) jobs in this phase; held jobs never count."""
        return self in (JobPhase.ADMITTED, JobPhase.FORWARDING, JobPhase.TRACKING)


class ReleaseBy(StrEnum):
    """What ends a hold."""

    SERVER_IDLE = "server_idle"  #: a server observation taken after the hold shows it idle
    ADMIN = "admin"  #: only ``POST /admin/jobs/{id}/release``


class Ending(StrEnum):
    """How the proxy's exchange with the upstream ended, as it reports it."""

    COMPLETED = "completed"  #: the server's reply was relayed to its end (any HTTP status)
    CUT = "cut"  #: the forwarding was cancelled by a reclaim's cut
    #: The borrower went away (the handler was cancelled or raised, or the borrower stopped
    #: reading and was disconnected) before the reply ended; the upstream connection was
    #: closed, which not every server takes as a reason to stop.
    ABORTED = "aborted"
    #: The exchange with the server failed: unreachable, no valid HTTP reply, or a reply that
    #: broke off mid-way.
    UPSTREAM_FAILED = "failed"


@dataclass(frozen=True, slots=True)
class JobRules:
    """What the lifecycle needs to know about one upstream.

    ``tracked``: the adapter's controller follows work past the reply (ComfyUI).
    ``cut_is_uncertain``: a closed connection does not prove the server stopped.
    ``idle_evidence``: server observations can show the server idle (llama-server slots).
    ``silence_s``: seconds the upstream may send nothing (before its reply or between two
    pieces of it) before the proxy gives up on the exchange (:meth:`JobState.went_silent`); None
    when there is no limit.
    ``detached_s``: when set, the server may go on with a request whose borrower disconnected
    and its idleness can be observed: such a job is tracked until an observation shows the
    server idle, for at most this many seconds before it is held. None: a disconnect ends the
    job at once (the server stops, or nothing could show that it did).
    """

    tracked: bool = False
    cut_is_uncertain: bool = False
    idle_evidence: bool = False
    silence_s: float | None = None
    detached_s: float | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """Why and since when (monotonic s) a job is held, and what releases it."""

    reason: HoldReason
    since: float
    release_by: ReleaseBy
    detail: str = ""


@dataclass(frozen=True, slots=True)
class JobState(AdmittedFields):
    """One borrowed job's lifecycle record. Only :mod:`vacancyd.control.work` stores these.

    ``admitted``: what admission fixed (``id``, ``upstream``, ``resources``,
    ``admitted_at``, ``model``, ``borrower`` are read through it): the same record its
    ledger entry has, so those fields live in one place. The two differ in their lifetimes
    and phases: this one is ``HELD`` at once while the entry's phase becomes ``held`` only
    once the hold is on disk; an administrator's release drops the entry while the job still
    runs here; an exclusive upstream's entry is released only after its card is freed, after
    this one ended.

    ``key``: the job key the upstream's controller tracks (a ComfyUI prompt id), if any.
    ``landed``: the upstream accepted a tracked submission (200), so it is in its queue.
    ``cut_by``: the reclaim edge that cut the job. ``cancelled_on_server``: its cancel was
    already sent through the server's API. ``reserved``: the ledger still holds its
    resources (an administrator may release them while the exchange still runs).
    ``admitted_at``: monotonic seconds. ``outcome``: how the exchange ended, once it has
    (the job's :class:`JobOutcome` when it ends). ``detached_since`` / ``detached_until``:
    monotonic seconds between which a job whose borrower disconnected is tracked (the server
    may still be generating for it); None otherwise. ``cut_at_stop``: the daemon's stop cut
    the exchange, so its end is a cut, whatever the proxy saw. ``borrower``: who borrowed
    it, as admission was told ("": the unnamed borrower of the single borrow token).
    """

    admitted: Admitted
    phase: JobPhase = JobPhase.ADMITTED
    key: str | None = None
    landed: bool = False
    cut_by: Edge | None = None
    cancelled_on_server: bool = False
    reserved: bool = True
    hold: Hold | None = None
    outcome: JobOutcome | None = None
    detached_since: float | None = None
    detached_until: float | None = None
    cut_at_stop: bool = False

    @property
    def ledger_phase(self) -> Phase | None:
        """The ledger phase (the ``vacancyd_active_work`` label) for this job's phase."""
        return _LEDGER_PHASE.get(self.phase)

    # -- inputs ------------------------------------------------------------------------

    def forwarding(self, key: str | None) -> Transition:
        """The exchange starts; ``key`` is the tracked job key, if the controller has one."""
        return Transition(replace(self, phase=JobPhase.FORWARDING, key=key))

    def reply_arrived(self, status: int) -> Transition:
        """The upstream's response headers arrived with HTTP ``status``.

        A tracked submission answered 200 is in the server's queue; if a reclaim already cut
        the job, it must now be cancelled there.
        """
        if self.key is None or status != 200:
            return Transition(self)
        landed = replace(self, landed=True)
        if self.cut_by is not None and not self.cancelled_on_server:
            return Transition(
                replace(landed, cancelled_on_server=True), (CancelOnServer(self.key),)
            )
        return Transition(landed)

    def cut(self, edge: Edge, *, cancel_queued: bool = True) -> Transition:
        """A reclaim cuts this job.

        An untracked exchange is cancelled (closing the upstream connection). Tracked work
        that has landed is cancelled through the server's API (when ``cancel_queued``);
        tracked work not yet landed is cancelled once its reply arrives.
        """
        if not self.phase.defers_reclaim:
            return Transition(self)
        cut = replace(self, cut_by=edge)
        if self.key is None:
            return Transition(cut, (CancelExchange(),))
        if self.landed and cancel_queued and not self.cancelled_on_server:
            return Transition(replace(cut, cancelled_on_server=True), (CancelOnServer(self.key),))
        return Transition(cut)

    def exchange_ended(self, ending: Ending, rules: JobRules, now: float) -> Transition:
        """The proxy's exchange is over (``now``: monotonic s).

        A borrower's disconnect on a server that may go on generating (``rules.detached_s``
        set) keeps the job reserved in ``tracking`` until a server observation taken after
        ``now`` shows the server idle (:meth:`server_seen_idle`), or until ``now +
        detached_s`` (:meth:`detached_timed_out`).
        """
        if not self.phase.live:
            return Transition(self)
        if ending is Ending.ABORTED and self.cut_at_stop:
            ending = Ending.CUT  # the borrower did not leave: the stop reset its connection
        job = replace(self, outcome=_OUTCOME[ending])
        if (
            ending is Ending.COMPLETED
            and rules.tracked
            and self.key is not None
            and self.landed
            and self.cut_by is None
        ):
            return Transition(
                replace(job, phase=JobPhase.TRACKING), (SetPhase(Phase.TRACKING), Follow(self.key))
            )
        if ending is Ending.CUT and rules.cut_is_uncertain:
            return job._hold(Hold(HoldReason.CUT_UNCERTAIN, now, _release_by(rules)))
        if ending is Ending.ABORTED and rules.detached_s is not None and self.reserved:
            detached = replace(
                job,
                phase=JobPhase.TRACKING,
                detached_since=now,
                detached_until=now + rules.detached_s,
            )
            return Transition(detached, (SetPhase(Phase.TRACKING), WatchIdle(now)))
        return job._end()

    def detached_timed_out(self, now: float) -> Transition:
        """``detached_work_timeout_s`` passed (``now``: monotonic s) and no observation has
        shown the server idle since the borrower disconnected.

        The server may still be generating for the abandoned request, so its completion is
        uncertain: the job is held (reason ``detached_work``) until an observation taken after
        ``now`` shows the server idle or an administrator releases it, never released on a
        guess. A job an administrator already released just ends.
        """
        if self.phase is not JobPhase.TRACKING or self.detached_since is None:
            return Transition(self)
        if not self.reserved:
            return self._end()
        until = self.detached_until
        waited = "" if until is None else f" for {until - self.detached_since:g} s"
        detail = f"the borrower disconnected and the server still showed work in progress{waited}"
        return self._hold(Hold(HoldReason.DETACHED_WORK, now, ReleaseBy.SERVER_IDLE, detail))

    def went_silent(self, rules: JobRules, now: float) -> Transition:
        """The proxy gave up on the exchange because the upstream sent no byte for
        ``rules.silence_s`` seconds (``now``: monotonic s); the exchange is over.

        The job is held whatever the adapter says of cuts: a server that stopped sending
        cannot be trusted to have noticed the closed connection, and may still hold the
        memory. The hold ends as a cut job's would (an idle observation where the server
        offers one, else an administrator). A job an administrator already released just
        ends; one past its exchange (tracking, held, ended) is left as it is.
        """
        if self.phase not in (JobPhase.ADMITTED, JobPhase.FORWARDING):
            return Transition(self)
        limit = "its silence limit" if rules.silence_s is None else f"{rules.silence_s:g} s"
        detail = f"the upstream sent nothing for {limit}"
        failed = replace(self, outcome=JobOutcome.UPSTREAM_FAILED)
        if not self.reserved:
            return failed._end()
        return failed._hold(Hold(HoldReason.UPSTREAM_SILENT, now, _release_by(rules), detail))

    def cut_for_stop(self) -> Transition:
        """The daemon is stopping and is about to reset this job's borrower connection: the
        exchange's end, when the proxy reports it, is a cut (:meth:`exchange_ended` treats an
        ``aborted`` ending as ``cut``, which holds the job where a cut's outcome is
        uncertain). A job past its exchange is left as it is."""
        if self.phase not in (JobPhase.ADMITTED, JobPhase.FORWARDING):
            return Transition(self)
        return Transition(replace(self, cut_at_stop=True))

    def stop_watching(self, rules: JobRules, now: float) -> Transition:
        """The daemon stops (``now``: monotonic s) and will no longer watch this job.

        A job whose completion is uncertain is held, so it is written out and held again
        after the restart: detached work still tracked (reason ``detached_work``, released by
        an idle observation as before), tracked work the server still queues (reason
        ``tracking_lost``: the restarted daemon does not know it, so only an administrator
        releases it), and an exchange that has not reported its end (held as a cut, where a
        cut's outcome is uncertain). A held, ended or never forwarded job, or one an
        administrator already released, is left as it is.
        """
        if not self.reserved or not self.phase.live or self.phase is JobPhase.HELD:
            return Transition(self)
        if self.phase is JobPhase.TRACKING and self.detached_since is not None:
            detail = (
                "the borrower disconnected and vacancyd stopped before the server was seen idle"
            )
            return self._hold(Hold(HoldReason.DETACHED_WORK, now, ReleaseBy.SERVER_IDLE, detail))
        if self.phase is JobPhase.TRACKING:
            detail = "vacancyd stopped while the server still ran or queued it"
            return self._hold(Hold(HoldReason.TRACKING_LOST, now, ReleaseBy.ADMIN, detail))
        if self.phase is JobPhase.FORWARDING:
            return replace(self, cut_at_stop=True).exchange_ended(Ending.CUT, rules, now)
        return Transition(self)

    def tracking_done(self) -> Transition:
        """The server no longer runs or queues the tracked work. A job no longer tracked
        (held when the daemon stopped, whose follower is then cancelled) is left as it is."""
        if self.phase is not JobPhase.TRACKING:
            return Transition(self)
        return self._end()

    def tracking_lost(self, detail: str, now: float) -> Transition:
        """The server's queue could not be read; hold until an administrator releases."""
        if not self.phase.live:
            return Transition(self)
        hold = Hold(HoldReason.TRACKING_LOST, now, ReleaseBy.ADMIN, detail)
        return Transition(replace(self, phase=JobPhase.HELD, hold=hold), (SetPhase(Phase.HELD),))

    def server_seen_idle(self, observed_at: float) -> Transition:
        """A server observation taken at ``observed_at`` (monotonic s) shows every slot idle:
        it ends a hold released by that evidence, or the tracking of detached work, when it
        was taken after the hold or the disconnect began."""
        if (
            self.phase is JobPhase.HELD
            and self.hold is not None
            and self.hold.release_by is ReleaseBy.SERVER_IDLE
            and observed_at > self.hold.since
        ):
            return self._end()
        if (
            self.phase is JobPhase.TRACKING
            and self.detached_since is not None
            and observed_at > self.detached_since
        ):
            return self._end()
        return Transition(self)

    def admin_release(self) -> Transition:
        """An administrator frees the reservation now.

        A held job ends; a job whose exchange or tracking still runs keeps its record (a
        reclaim still sees it) and ends when that finishes.
        """
        if self.phase is JobPhase.HELD:
            return self._end()
        if not self.reserved:
            return Transition(self)
        return Transition(replace(self, reserved=False), (Release(),))

    def _hold(self, hold: Hold) -> Transition:
        effects: tuple[Effect, ...] = (SetPhase(Phase.HELD),)
        if hold.release_by is ReleaseBy.SERVER_IDLE:
            effects += (WatchIdle(hold.since),)
        return Transition(replace(self, phase=JobPhase.HELD, hold=hold), effects)

    def _end(self) -> Transition:
        phase = JobPhase.CUT if self.cut_by is not None else JobPhase.RELEASED
        effects: tuple[Effect, ...] = (Release(),) if self.reserved else ()
        ended = replace(self, phase=phase, reserved=False, outcome=self.final_outcome)
        return Transition(ended, effects)

    @property
    def final_outcome(self) -> JobOutcome:
        """How the job ends if it ends now: how its exchange ended, except that tracked work
        a reclaim cancelled was cut; a restored hold's reason stands in for an exchange this
        process never saw."""
        outcome = self.outcome
        if outcome is None and self.hold is not None:
            outcome = _HOLD_OUTCOME[self.hold.reason]
        if outcome is None or (outcome is JobOutcome.COMPLETED and self.cut_by is not None):
            return JobOutcome.CUT if self.cut_by is not None else JobOutcome.COMPLETED
        return outcome


def _release_by(rules: JobRules) -> ReleaseBy:
    """What can end a hold on an upstream with ``rules``."""
    return ReleaseBy.SERVER_IDLE if rules.idle_evidence else ReleaseBy.ADMIN


_OUTCOME = {
    Ending.COMPLETED: JobOutcome.COMPLETED,
    Ending.CUT: JobOutcome.CUT,
    Ending.ABORTED: JobOutcome.BORROWER_DISCONNECTED,
    Ending.UPSTREAM_FAILED: JobOutcome.UPSTREAM_FAILED,
}

#: What a held job restored after a restart ended as, by why it was held.
_HOLD_OUTCOME = {
    HoldReason.CUT_UNCERTAIN: JobOutcome.CUT,
    HoldReason.TRACKING_LOST: JobOutcome.COMPLETED,
    HoldReason.UPSTREAM_SILENT: JobOutcome.UPSTREAM_FAILED,
    HoldReason.DETACHED_WORK: JobOutcome.BORROWER_DISCONNECTED,
}

_LEDGER_PHASE = {
    JobPhase.ADMITTED: Phase.FORWARDING,
    JobPhase.FORWARDING: Phase.FORWARDING,
    JobPhase.TRACKING: Phase.TRACKING,
    JobPhase.HELD: Phase.HELD,
}


# -- effects the executor carries out --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Release:
    """Give the reservation back and ask for a fresh sample of each resource."""


@dataclass(frozen=True, slots=True)
class SetPhase:
    """Record ``phase`` in the ledger."""

    phase: Phase


@dataclass(frozen=True, slots=True)
class CancelExchange:
    """Cancel the running exchange (closing the upstream connection at once): the executor
    calls the job's :class:`Cuttable` exchange with the edge that cut it."""


class Cuttable(Protocol):
    """The running HTTP exchange of one job, as its carrier (the proxy) hands it over when
    forwarding starts; a reclaim's :class:`CancelExchange` is carried out by calling
    :meth:`cut`."""

    def cut(self, edge: Edge) -> bool:
        """End the exchange now because ``edge`` cut the job: the upstream connection is
        closed at once and the borrower told (503 before the reply, an aborted stream
        after). Returns True when it cut a running exchange, False when it had already
        ended (or was cut before). Never raises, never blocks."""
        ...


@dataclass(frozen=True, slots=True)
class CancelOnServer:
    """Cancel tracked work ``key`` through the server's API."""

    key: str


@dataclass(frozen=True, slots=True)
class Follow:
    """Follow tracked work ``key`` until the server has finished it."""

    key: str


@dataclass(frozen=True, slots=True)
class WatchIdle:
    """Watch server observations taken after ``since`` (monotonic s) for an idle server
    (and, for detached work, the job's ``detached_until``)."""

    since: float


Effect = Release | SetPhase | CancelExchange | CancelOnServer | Follow | WatchIdle


@dataclass(frozen=True, slots=True)
class Transition:
    """A job's next state and the effects that carry it out, in order."""

    state: JobState
    effects: tuple[Effect, ...] = ()
