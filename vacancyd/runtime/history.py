"""The lender's durable history (docs/observability.md, "Status page"): one sample a minute
and one at every presence or lending edge, written to the ``history`` table of the usage
database, and read back for the status page's 24-hour timeline.

:class:`HistoryRecorder` takes each sample from the store on the event loop (a few dict
reads) and hands it to the database's own thread (:class:`HistoryStore`), so the loop never
waits for the disk. Nothing here raises into the daemon: a sample that cannot be taken or
written is logged and the next one is tried on time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from vacancyd.core.events import (
    HoldChanged,
    JobChanged,
    LendingSwitched,
    StateEvent,
    VetoChanged,
)
from vacancyd.core.history import (
    SAMPLE_INTERVAL_S,
    UNNAMED,
    HistorySample,
    ResourceSample,
    next_due,
)
from vacancyd.core.observations import Quality
from vacancyd.core.policy import ResourceKind
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

#: The state transitions that are presence or lending edges: each gets a sample of its own.
EDGES = (VetoChanged, LendingSwitched, HoldChanged)
#: At most this many jobs started between two samples are remembered for the next one (a
#: flood of short jobs cannot grow the recorder; the ones past it are not counted).
MAX_STARTED = 10_000


class HistoryStore(Protocol):
    """Where samples go (``vacancyd.runtime.usage.UsageStore``)."""

    def record_history(self, sample: HistorySample) -> concurrent.futures.Future[None]:
        """Write ``sample`` off the loop; returns at once, the future never raises."""
        ...

    async def history(self, since: float) -> list[HistorySample]:
        """The samples taken at or after ``since`` (wall s), oldest first."""
        ...


def take_sample(
    state: SharedState,
    now_wall: float,
    now: float | None = None,
    since_last: Mapping[int, str] | None = None,
    borrowers: Mapping[int, str] | None = None,
) -> HistorySample:
    """The lender now, from the store (call on the event loop).

    ``now_wall``: the sample's wall time (s since the epoch); ``now``: the store's monotonic
    clock, for the readings' freshness. Owner present: the owner veto is engaged. Lending:
    the lending switch is on and no hold covers the whole host (a pause, the schedule,
    battery). Per GPU resource: memory used (the device's figure, else total - free) and
    temperature from its newest reading while that is not unknown (a stale one still
    counts, a failed one does not). Jobs: every borrowed job in the ledger (held and tracked
    ones too) and every job in ``since_last`` (job id -> borrower: the jobs that started
    since the previous sample, so one shorter than the interval still shows), each counted
    once by its borrower (``borrowers``: each live job's borrower by job id, as
    :meth:`vacancyd.control.work.Work.borrowers`; ``""`` for the unnamed one).
    """
    at = state.clock() if now is None else now
    resources: dict[str, ResourceSample] = {}
    for name, policy in state.resources.items():
        if policy.kind is not ResourceKind.GPU:
            continue
        observation = state.capacity[name]
        reading = observation.value
        if reading is None or observation.quality(at, policy.stale_after_s) is Quality.UNKNOWN:
            resources[name] = ResourceSample()
            continue
        used = reading.used_mib
        if used is None and reading.total_mib is not None and reading.free_mib is not None:
            used = max(reading.total_mib - reading.free_mib, 0.0)
        resources[name] = ResourceSample(used, reading.total_mib, reading.temperature_c)
    jobs = dict(since_last or {})
    live = borrowers or {}
    for job in state.ledger.jobs():
        jobs[job.id] = live.get(job.id, jobs.get(job.id, UNNAMED))
    per_borrower: dict[str, int] = {}
    for name in jobs.values():
        per_borrower[name] = per_borrower.get(name, 0) + 1
    return HistorySample(
        at_wall=now_wall,
        owner_present=state.veto.engaged,
        lending=state.lending_enabled and not any(h.resources is None for h in state.holds),
        resources=resources,
        borrowers=per_borrower,
    )


class HistoryRecorder:
    """Samples ``state`` into ``store``: at start, every ``interval_s`` seconds, and at each
    presence or lending edge (:data:`EDGES`; edges within ``MIN_GAP_S`` of the last sample
    share the next one). Each sample also counts the jobs that started since the previous
    one (``job`` events), so work shorter than the interval is not lost between samples.
    ``wall_clock``: seconds since the epoch, for the samples' times; the schedule runs on
    the store's monotonic clock. ``borrowers``: each live job's borrower by job id, read at
    each sample and each job's start (:meth:`vacancyd.control.work.Work.borrowers`; by
    default none: every job is the unnamed borrower's)."""

    def __init__(
        self,
        state: SharedState,
        store: HistoryStore,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        wall_clock: Callable[[], float] = time.time,
        borrowers: Callable[[], Mapping[int, str]] = dict,
    ) -> None:
        self.state = state
        self.borrowers = borrowers
        self.store = store
        self.interval_s = interval_s
        self.wall_clock = wall_clock
        #: Samples handed to the store so far.
        self.recorded = 0
        self._edge = asyncio.Event()
        self._last_at: float | None = None
        self._failing = False
        #: Jobs that started since the last sample (id -> borrower), kept until it is taken.
        self._started: dict[int, str] = {}

    def _on_event(self, event: StateEvent) -> None:
        if isinstance(event, EDGES):
            self._edge.set()
        elif isinstance(event, JobChanged) and event.change == "started":
            if len(self._started) < MAX_STARTED:
                self._started[event.job] = self.borrowers().get(event.job, UNNAMED)

    async def run(self) -> None:
        """Record until cancelled (a supervised task). Never raises otherwise."""
        unsubscribe = self.state.subscribe(self._on_event)
        try:
            while True:
                now = self.state.clock()
                edge = self._edge.is_set()
                due = next_due(self._last_at, now, edge=edge, interval_s=self.interval_s)
                if due > now:
                    if edge:
                        await asyncio.sleep(due - now)  # an edge too soon after a sample
                    else:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(due - now):
                                await self._edge.wait()
                    continue
                self._edge.clear()
                self._last_at = now
                self.record_now(now)
        finally:
            unsubscribe()

    def record_now(self, now: float | None = None) -> None:
        """Take one sample and hand it to the store now; logs (once per run of failures)
        rather than raises."""
        started, self._started = self._started, {}
        try:
            sample = take_sample(self.state, self.wall_clock(), now, started, self.borrowers())
            self.store.record_history(sample)
        except Exception:
            if not self._failing:
                log.exception("could not record the lender's history")
            self._failing = True
            return
        self._failing = False
        self.recorded += 1
