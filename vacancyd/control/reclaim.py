"""Execute reclaim plans: refuse, wait, cut, cancel queued prompts, unload (docs/reclaim.md).

The pure decisions live in :mod:`vacancyd.core.reclaim`; this module owns the effects:

* borrowed jobs live in :class:`vacancyd.control.work.Work`; a reclaim reads the jobs that
  defer it there and asks it to cut them (which closes the upstream connection at once even
  when the borrower has stopped reading, or cancels queued work through the server's API);
* edges arrive as direct calls: the state's writers return the edges they raise and their
  callers hand them to :meth:`Reclaimer.answer` — the owner controls for presence and holds
  (:mod:`vacancyd.control.owner`), this module for GPU pressure and the operator's
  ``POST /admin/reclaim`` — and each affected upstream gets one reclaim task, started by
  that call (:meth:`Reclaimer.raise_edge`); the state's events are for observers only;
* new work on an upstream with an open reclaim is refused by admission, which reads the
  reclaim published in the state (:func:`vacancyd.core.reclaim.refusal`);
* each task re-plans after every such write, whenever one of its jobs changes phase
  (:meth:`vacancyd.control.work.Work.changes`) and at its deadline, publishes its phase in
  /status, cuts and cancels, and unloads through :mod:`vacancyd.control.upstreamcalls`
  (deadline, outcome, metric and log line). Upstreams reclaim concurrently, on their own
  tasks, detached from the collectors' sampling loops.
* when lending resumes after a reclaim unloaded an upstream with ``warm_model`` — whatever
  stopped it: the owner's return, a hold (schedule, pause, battery, exclusive app), GPU
  pressure — that model is loaded again, at most once per :data:`WARM_MIN_INTERVAL_S` per
  upstream (off by default).

Nothing here raises into the caller: upstream failures are logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from vacancyd.control.spawn import Spawner
from vacancyd.control.upstreamcalls import Status, UpstreamCalls
from vacancyd.control.work import Work
from vacancyd.core.lifecycle import JobState
from vacancyd.core.observations import CapacityReading
from vacancyd.core.reasons import ReclaimOutcome
from vacancyd.core.reclaim import (
    Edge,
    OnOwnerReturn,
    Proceed,
    Reclaim,
    ReclaimPhase,
    ReclaimPolicy,
    StandDown,
    Trigger,
    Wait,
    affected_upstreams,
    decided,
    lending_resumed,
    open_reclaim,
    plan,
    trigger_cleared,
    warm_delay_s,
)
from vacancyd.state import PressureSample, SharedState
from vacancyd.web.catalogue import counter
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)

#: A waiting reclaim re-checks its trigger at least this often (seconds), besides on events.
RECHECK_S = 0.5
#: An upstream's warm reloads come at most this often (seconds): lending that stops and
#: resumes quickly (a flapping hold or pressure edge) does not reload the model each time.
WARM_MIN_INTERVAL_S = 60.0


class Reclaimer:
    """Owns every upstream's reclaim; one per daemon."""

    def __init__(
        self,
        state: SharedState,
        *,
        policies: Mapping[str, ReclaimPolicy],
        calls: UpstreamCalls,
        warm_models: Mapping[str, str],
        supervisor: Spawner,
        metrics: Metrics,
        work: Work,
    ) -> None:
        self.state = state
        self.work = work
        self.policies = dict(policies)
        self.calls = calls
        self.warm_models = dict(warm_models)
        self.supervisor = supervisor
        self.reclaims: dict[str, Reclaim] = {}
        self._unloaded: set[str] = set()
        #: Upstreams whose warm reload is scheduled, and when each last had one (monotonic s).
        self._warming: set[str] = set()
        self._warmed_at: dict[str, float] = {}
        registry = metrics.registry
        self.m_reclaims = counter("vacancyd_reclaims", registry=registry)

    # -- where edges come from -----------------------------------------------------------

    def answer(self, edges: Sequence[Edge]) -> list[str]:
        """Answer what one write into the store raised (``edges``, returned by the state's
        writer; often none): open or extend a reclaim on every upstream each edge affects
        (:meth:`raise_edge`), then let every open reclaim re-plan and warm what resumed.
        Called after each presence, pressure and owner-controls write. Returns the upstreams
        the edges reclaim, in order, without repeats."""
        names: list[str] = []
        for edge in edges:
            names += [n for n in self.raise_edge(edge) if n not in names]
        self._warm_resumed()
        for name in list(self.reclaims):
            self._wake(name)
        return names

    def record_pressure(self, name: str, sample: PressureSample, now: float) -> list[str]:
        """A pressure poll of GPU ``name`` at ``now`` (monotonic s): recorded in the state,
        and its rising edge, if any, answered. Returns the upstreams it reclaims."""
        return self.answer(self.state.record_pressure(name, sample, now))

    def record_capacity(self, name: str, reading: CapacityReading, now: float) -> list[str]:
        """A capacity sample of resource ``name`` at ``now`` (monotonic s): recorded in the
        state, and the thermal edge of a GPU that stayed too hot, if any, answered."""
        return self.answer(self.state.record_capacity(name, reading, now))

    def record_pressure_failure(self, name: str, error: str, now: float) -> list[str]:
        """A failed pressure poll of GPU ``name``: as :meth:`record_pressure`."""
        return self.answer(self.state.record_pressure_failure(name, error, now))

    def reclaim(self, resource: str | None, detail: str) -> list[str]:
        """An operator's reclaim (``POST /admin/reclaim``), of every upstream or of those
        depending on ``resource``; returns the upstreams it reclaims."""
        now = self.state.clock()
        return self.answer(
            self.state.raise_edge(Trigger.ADMIN, now, resource=resource, detail=detail)
        )

    def raise_edge(self, edge: Edge) -> list[str]:
        """Answer one edge on every upstream it affects; returns their names."""
        names = affected_upstreams(edge, self.state.upstreams, veto_active=self.state.veto.engaged)
        names = [n for n in names if n in self.policies]
        for name in names:
            reclaim, new = open_reclaim(self.reclaims.get(name), edge, name, self.policies[name])
            self.reclaims[name] = reclaim
            self._publish(reclaim)
            if new:
                log.info(
                    "reclaim on %s (%s edge%s): policy %s, deadline in %s",
                    name,
                    edge.trigger,
                    f" on {edge.resource}" if edge.resource else "",
                    reclaim.policy.on_owner_return,
                    "none"
                    if reclaim.deadline is None
                    else f"{max(0.0, reclaim.deadline - edge.at):g} s",
                )
                self.supervisor.spawn(self._run(name), name=f"reclaim {name}", essential=False)
            else:
                log.info("reclaim on %s absorbs a further %s edge", name, edge.trigger)
                self._wake(name)
        return names

    # -- one upstream's reclaim ----------------------------------------------------------

    def _active(self, reclaim: Reclaim) -> list[JobState]:
        """Work admitted no later than the first edge that has not ended (held excluded)."""
        return self.work.active(reclaim.upstream, admitted_by=reclaim.first.at)

    async def _run(self, name: str) -> None:
        try:
            await self._drive(name)
        except Exception:
            log.exception("reclaim on %s failed; cutting its work as a fallback", name)
            r = self.reclaims.get(name)
            if r is not None and r.is_open:
                if r.policy.on_owner_return is not OnOwnerReturn.FINISH:
                    await self.work.cut(self._active(r), r.first, cancel_queued=False)
                self._set(
                    Reclaim(
                        r.upstream,
                        r.policy,
                        r.edges,
                        r.deadline,
                        ReclaimPhase.DONE,
                        self.state.clock(),
                        "failed",
                    )
                )

    async def _drive(self, name: str) -> None:
        # Set by Work whenever a job of this upstream changes phase, and by answer() after
        # every write into the store that may clear the trigger.
        changed = self.work.changes(name)
        while True:
            changed.clear()  # before planning, so a change during the plan wakes the wait
            reclaim = self.reclaims[name]
            now = self.state.clock()
            snap = self.state.snapshot(now)
            active = self._active(reclaim)
            action = plan(
                reclaim,
                trigger_cleared=trigger_cleared(reclaim, snap, self.state.upstreams[name]),
                active_work=len(active),
                now=now,
            )
            if isinstance(action, Wait):
                timeout = RECHECK_S
                if action.until is not None:
                    timeout = min(timeout, max(0.0, action.until - now))
                try:
                    async with asyncio.timeout(timeout):
                        await changed.wait()
                except TimeoutError:
                    pass
                continue
            reclaim = decided(reclaim, action, now)
            self._set(reclaim)
            trigger = reclaim.first.trigger.value
            if isinstance(action, StandDown):
                log.info("reclaim on %s stands down: %s", name, action.why)
                self.m_reclaims.labels(name, trigger, ReclaimOutcome.STOOD_DOWN).inc()
                return
            await self._proceed(reclaim, action, active)
            self.m_reclaims.labels(name, trigger, action.outcome).inc()
            self._set(
                Reclaim(
                    reclaim.upstream,
                    reclaim.policy,
                    reclaim.edges,
                    reclaim.deadline,
                    ReclaimPhase.DONE,
                    reclaim.decided_at,
                    reclaim.outcome,
                )
            )
            return

    async def _proceed(self, reclaim: Reclaim, action: Proceed, active: list[JobState]) -> None:
        name = reclaim.upstream
        log.info(
            "reclaim on %s proceeds (%s): %d borrowed job(s) %s%s",
            name,
            action.outcome,
            len(active),
            "cut" if action.cut else "left running",
            ", then unload" if action.unload else "",
        )
        if action.cut:
            await self.work.cut(active, reclaim.first)
        if action.unload:
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        outcome = await self.calls.unload(name, self.work.keys(name), why="reclaim")
        if outcome.status in (Status.NOT_SUPPORTED, Status.SKIPPED):
            return
        # Whatever the outcome, what was resident before may not be any more.
        self.state.yielded(name, asyncio.get_running_loop().time())
        if outcome.done:
            self._unloaded.add(name)
            self._warm_resumed()  # lending may have resumed while it was unloading

    # -- warm reload ----------------------------------------------------------------

    def _may_warm(self, name: str) -> bool:
        """``name`` was unloaded by a reclaim and lending on it has resumed."""
        current = self.reclaims.get(name)
        if current is not None and current.is_open:
            return False  # a trigger (owner, hold, pressure, operator) still holds it
        policy = self.state.upstreams.get(name)
        return policy is not None and lending_resumed(self.state.snapshot(), policy)

    def _warm_resumed(self) -> None:
        """Schedule a warm reload for each unloaded upstream with ``warm_model`` on which
        lending has resumed (called on every state change)."""
        for name in sorted(self._unloaded & self.warm_models.keys() - self._warming):
            if not self.calls.supports(name) or not self._may_warm(name):
                continue
            self._warming.add(name)
            delay = warm_delay_s(self._warmed_at.get(name), self.state.clock(), WARM_MIN_INTERVAL_S)
            self.supervisor.spawn(
                self._warm_when_due(name, delay), name=f"warm {name}", essential=False
            )

    async def _warm_when_due(self, name: str, delay_s: float) -> None:
        """Warm ``name`` after ``delay_s`` seconds (the rate limit), if lending is still on."""
        try:
            if delay_s > 0:
                log.info("warm reload of %s in %.0f s (rate limit)", name, delay_s)
                await asyncio.sleep(delay_s)
            if name not in self._unloaded or not self._may_warm(name):
                return  # stopped again meanwhile: the next resume schedules it
            self._unloaded.discard(name)
            self._warmed_at[name] = self.state.clock()
            await self._warm(name, self.warm_models[name])
        finally:
            self._warming.discard(name)

    async def _warm(self, name: str, model: str) -> None:
        await self.calls.warm(name, model, why="warm reload")

    # -- publication ---------------------------------------------------------------------

    def _set(self, reclaim: Reclaim) -> None:
        self.reclaims[reclaim.upstream] = reclaim
        self._publish(reclaim)

    def _publish(self, r: Reclaim) -> None:
        self.state.publish_reclaim(r)
        self._warm_resumed()  # a reclaim that ended may have been all that held lending

    def _wake(self, name: str) -> None:
        """Let ``name``'s reclaim, if one waits, plan again now."""
        self.work.changes(name).set()
