"""The admission entry point: every way a borrowed request is admitted or refused.

One :class:`Admission` per daemon answers each question the proxy and the lendability probe
ask about a borrowed request, and nothing else decides one:

* :meth:`Admission.early`: before the body is read, the refusal no fresh sample can change
  (gate steps 1–5 and an open reclaim), for a listener or a pool (which refuses only when
  every member does);
* :meth:`Admission.would_admit`: would a request be admitted now (the lendability probe):
  the same checks as :meth:`Admission.admit` without reserving, sampling or waiting;
* :meth:`Admission.choose`: the pool member a request goes to;
* :meth:`Admission.admit`: the full decision: the gate on a snapshot, at most one fresh
  sample where the refusal's :class:`~vacancyd.core.reasons.Refresh` hint says one could
  change it, the reclaim check and the ledger reservation; the bounded wait of an upstream
  with ``busy = "wait"`` (:mod:`vacancyd.control.waiting`); an exclusive job's unload of the
  servers it shares the card with, and its charge on a fresh sample after it.

Each answer is a typed outcome: :class:`Admitted` carries the job's
:class:`~vacancyd.control.job.JobHandle`, through which the proxy reports the exchange;
:class:`Refused` carries the :class:`~vacancyd.core.reasons.Refuse` the borrower is told.
The rules are the core's (:mod:`vacancyd.core.gate`, :mod:`vacancyd.core.pool`,
:mod:`vacancyd.core.waiting`); the job records and every ledger write are
:class:`~vacancyd.control.work.Work`'s. Times are monotonic seconds from
``SharedState.clock``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vacancyd.control.job import JobHandle
from vacancyd.control.work import Work
from vacancyd.core import gate, pool
from vacancyd.core.lifecycle import JobState
from vacancyd.core.observations import SampleKey
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Admit, Decision, Reason, Refresh, Refuse
from vacancyd.core.snapshot import RequestFacts, Snapshot
from vacancyd.core.waiting import refresh_key, waits_on
from vacancyd.state import SharedState

#: How long a refusal that a fresh observation could change waits for one (seconds).
REFRESH_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request is admitted: ``job`` is its handle (the reservation is held)."""

    job: JobHandle


@dataclass(frozen=True, slots=True)
class Refused:
    """The request is refused: ``refusal`` says why (rendered as the refusal reply)."""

    refusal: Refuse


class Admission:
    """Every admission decision of this daemon; one per daemon, used from the event loop.

    ``state``: the shared store the decisions read (snapshots, switches, presence, holds)
    and ask fresh samples of; ``work``: the job records, the ledger writes, the reclaim
    check, the wait queues and the card sharing.
    """

    def __init__(self, state: SharedState, work: Work) -> None:
        self.state = state
        self.work = work

    # -- before the body -----------------------------------------------------------------

    def early(self, upstreams: Sequence[str]) -> Refused | None:
        """Gate steps 1–5 and the reclaim check before the body is read: the refusal no
        fresh sample can change, or None to read the body. ``upstreams``: the listener's
        upstream, or a pool's members, of which it refuses only when every one does (the
        one that frees up first answers).

        The switches, the owner's holds and presence come first and need no snapshot, so a
        refusal for any of them (lending off, the owner present or pausing) builds none; a
        snapshot is built, once, only when they let a member through to the later steps,
        which then start again from step 1 on it (the same answer for the steps already
        asked).
        """
        state = self.state
        switched_off = gate.decide_switches(state.stopping, state.lending_enabled)
        if switched_off is not None:
            return Refused(switched_off)  # the same for every member, and no snapshot needed
        refusals: list[Refuse] = []
        now = state.clock()
        presence = state.presence_view(now)
        snap: Snapshot | None = None
        for name in upstreams:
            policy = state.upstreams[name]
            refusal = gate.decide_owner_steps(state.holds, presence, now, policy)
            if refusal is None:
                if snap is None:
                    snap = state.snapshot()
                refusal = gate.decide_before_body(snap, policy)
                if refusal is not None and refusal.refresh is not None:
                    refusal = None  # a fresh sample may still admit it: let the body come
                refusal = refusal or self.work.refusal(name)
                if refusal is None:
                    return None
            refusals.append(refusal)
        if len(refusals) == 1:
            return Refused(refusals[0])
        return Refused(min(refusals, key=lambda r: r.retry_after_s))

    def forbidden(self, borrower: str, upstream: str) -> str | None:
        """Why ``borrower`` may not use ``upstream`` (an upstream's or a pool's listener) at
        all, a sentence naming both for the 403; None when it may. Decides nothing else and
        counts nothing: the request never reaches admission."""
        return self.work.forbidden(borrower, upstream)

    def would_admit(self, upstream: str, facts: RequestFacts) -> Refused | None:
        """None when a request with ``facts`` would be admitted on ``upstream`` now, else
        the refusal it would get (``resource_busy`` while others wait for it). Reserves,
        samples and waits for nothing: the lendability probe asks this."""
        policy = self.state.upstreams[upstream]
        decision = self._decide(facts, self.state.snapshot(), policy)
        if isinstance(decision, Refuse):
            return Refused(decision)
        refusal = self.work.refusal(upstream)
        rooms = self.work.rooms
        if refusal is None and rooms.has_queue(upstream) and rooms.waiting(upstream):
            refusal = _busy()
        refusal = refusal or self.state.ledger.fits(upstream, decision.resources)
        return None if refusal is None else Refused(refusal)

    def unreachable(self, upstream: str) -> bool:
        """True while ``upstream``'s server does not accept connections (the daemon's own
        connection check, or a borrowed request that could not connect, said so last)."""
        return self.state.upstream_unreachable(upstream)

    def found_unreachable(self, upstream: str, why: str) -> None:
        """A request could not connect to ``upstream``'s server (``why``, for a person):
        the lendability probe answers ``upstream_unreachable`` from now."""
        self.state.record_reach(upstream, False, self.state.clock(), why)

    # -- with the body ---------------------------------------------------------------------

    def choose(self, members: Sequence[str], facts: RequestFacts) -> str | Refused:
        """The pool member a request should go to, or the refusal when none can take it.

        The member the gate admits with the most room after the charge wins
        (:func:`vacancyd.core.pool.choose_member`). When none admits now, a member whose
        refusal a fresh sample may change is chosen (its admission takes that sample), then,
        when every member is busy, the waiting member with the shortest queue.
        """
        snap = self.state.snapshot()
        policies = [self.state.upstreams[m] for m in members]
        choice = pool.choose_member(
            facts,
            snap,
            policies,
            lambda p: self.work.refusal(p.name) or self.state.ledger.fits(p.name, p.resources),
        )
        if isinstance(choice, pool.Choice):
            return choice.member.name
        for policy in policies:
            refusal = gate.decide(facts, snap, policy)
            if isinstance(refusal, Refuse) and refusal.refresh is not None:
                return policy.name
        rooms = self.work.rooms
        if choice.reason is Reason.RESOURCE_BUSY:
            waiting = [m for m in members if rooms.has_queue(m)]
            if waiting:
                return min(waiting, key=rooms.waiting)
        return Refused(choice)

    async def admit(
        self, upstream: str, facts: RequestFacts, *, borrower: str = ""
    ) -> Admitted | Refused:
        """Gate then ledger, with at most one fresh observation in between; then, where the
        upstream says so, a wait for a slot and the exclusive job's unload. ``borrower``:
        who borrows ("": the unnamed borrower of the single borrow token), recorded on the
        job.

        A refusal that says a fresher sample could change it (``Refuse.refresh``) waits up
        to :data:`REFRESH_WAIT_S` seconds for one and decides once
        more; the second decision stands. The sample waited for is the one the refusal
        needs: after the last release for the post-completion rule (asked for by that
        release, so usually under way or done already), otherwise one taken after the
        request arrived. With ``busy = "wait"``, a ``resource_busy`` refusal (and any
        request arriving while others wait) joins the upstream's FIFO instead; only
        ``resource_busy`` ever waits. Raises CancelledError when the client goes away
        (nothing stays reserved for it).

        A named borrower's own limits come first, and again right before the reservation
        (:mod:`vacancyd.core.quota`): ``quota_exhausted`` when its ``daily_busy_s`` is used
        up, ``borrower_busy`` when its ``max_concurrent`` jobs run; neither waits.
        """
        own = self.work.borrower_refusal(borrower)
        if own is not None:
            return Refused(own)
        rooms = self.work.rooms
        waits = rooms.has_queue(upstream)
        if waits and rooms.waiting(upstream):
            # Others wait already: join behind them (FIFO), unless the gate refuses anyway.
            early = self._attempt(upstream, facts, reserve=False)
            decision: JobState | Refuse = (
                early if isinstance(early, Refuse) and not waits_on(early) else _busy()
            )
        else:
            decision = await self._admit_once(upstream, facts, borrower)
        if waits and isinstance(decision, Refuse) and decision.reason is Reason.RESOURCE_BUSY:
            decision = await rooms.wait(
                upstream, lambda: self._attempt(upstream, facts, borrower=borrower), self.work.drop
            )
        card = self.work.card
        if isinstance(decision, JobState) and card is not None and card.is_exclusive(upstream):
            decision = await self._take_card(decision, facts)
        if isinstance(decision, Refuse):
            return Refused(decision)
        return Admitted(JobHandle(self.work, decision))

    async def _admit_once(
        self, upstream: str, facts: RequestFacts, borrower: str
    ) -> JobState | Refuse:
        """Decide, taking a fresh sample of each input a refusal names at most once — or
        again when another job was released on the upstream's resources since that sample
        (concurrent jobs release often), within ``REFRESH_WAIT_S`` × 2 in all."""
        policy = self.state.upstreams[upstream]
        refreshed: dict[SampleKey, float | None] = {}
        started = self.state.clock()
        while True:
            snap = self.state.snapshot()
            decision = self._decide(facts, snap, policy)
            if isinstance(decision, Admit):
                return self._reserve(upstream, decision, snap.now, facts, borrower)
            key = refresh_key(decision, upstream)
            released = max(
                (v.released_at or 0.0 for n in policy.resources if (v := snap.resources.get(n))),
                default=None,
            )
            if key is None or (
                key in refreshed
                and (
                    refreshed[key] == released or self.state.clock() - started > 2 * REFRESH_WAIT_S
                )
            ):
                return decision
            refreshed[key] = released
            view = snap.resources.get(key.name) if decision.refresh is Refresh.CAPACITY else None
            after = view.released_at if view is not None else None
            if not await self.state.samples.fresh(key, REFRESH_WAIT_S, after=after):
                return decision

    def _attempt(
        self, upstream: str, facts: RequestFacts, *, reserve: bool = True, borrower: str = ""
    ) -> JobState | Refuse:
        """One synchronous admission attempt (a waiting request's turn); with ``reserve``
        False, only the refusal it would get (an admission is reported as ``resource_busy``)."""
        snap = self.state.snapshot()
        decision = self._decide(facts, snap, self.state.upstreams[upstream])
        if isinstance(decision, Refuse):
            return decision
        if not reserve:
            return _busy()
        return self._reserve(upstream, decision, snap.now, facts, borrower)

    def _reserve(
        self, upstream: str, admit: Admit, now: float, facts: RequestFacts, borrower: str
    ) -> JobState | Refuse:
        """The borrower's own limits, the reclaim check, then the ledger's reservation
        (:meth:`Work.reserve`)."""
        refusal = self.work.borrower_refusal(borrower) or self.work.refusal(upstream)
        if refusal is not None:
            return refusal
        return self.work.reserve(upstream, admit, now, facts, borrower)

    def _decide(self, facts: RequestFacts, snap: Snapshot, policy: UpstreamPolicy) -> Decision:
        """The gate's decision; for an exclusive upstream a memory refusal is provisional,
        since the memory the other servers hold is given back by the unload before the job
        runs (the job is charged again on a fresh sample after it: :meth:`_take_card`)."""
        decision = gate.decide(facts, snap, policy)
        if (
            isinstance(decision, Refuse)
            and decision.reason is Reason.INSUFFICIENT_CAPACITY
            and policy.exclusive_of
            and self.work.card is not None
        ):
            return Admit(resources=policy.resources)
        return decision

    async def _take_card(self, job: JobState, facts: RequestFacts) -> JobState | Refuse:
        """Unload the servers an exclusive job shares the card with, then charge it on a
        fresh capacity sample; a refusal releases the job."""
        card = self.work.card
        assert card is not None
        policy = self.state.upstreams[job.upstream]
        try:
            refusal = await card.before_forward(job.upstream)
            if refusal is None:
                await self.state.samples.fresh(SampleKey.capacity(policy.resource), REFRESH_WAIT_S)
                decision = gate.decide(facts, self.state.snapshot(), policy)
                if isinstance(decision, Refuse):
                    refusal = decision
                else:
                    self.work.charge(job.id, decision.charged_mib)
        except BaseException:
            self.work.drop(job)
            raise
        now = self.work.get(job.id)
        edge = None if now is None else now.cut_by
        if refusal is None and edge is not None:
            # A reclaim cut the job while the card was being cleared: it never runs.
            refusal = Refuse.of(
                edge.reason,
                f"the lender reclaimed {job.upstream!r} ({edge.trigger}) before the job was "
                "forwarded",
            )
        if refusal is not None:
            self.work.drop(job)
            return refusal
        return job


def _busy() -> Refuse:
    return Refuse.of(Reason.RESOURCE_BUSY, "other requests wait for this upstream")
