"""The asyncio side of ``busy = "wait"``: park requests in their upstream's FIFO, wake them.

The queue itself is pure (:mod:`vacancyd.core.waiting`); this module holds one future per
waiting request and serves the queues whenever something that could change an answer
happens: a job is released, a capacity or server sample lands, or a state change arrives
(owner return, veto, pressure, a switch, a reclaim). Serving runs each head's admission
attempt synchronously, so an admission and its reservation happen in one step of the event
loop, exactly as for a request that never waited.

No task is started per waiter: each request waits on its own handler task, with its own
deadline, and leaves its queue in a ``finally`` — a client that disconnects (aiohttp cancels
its handler) is out of the queue at once. A job admitted for a waiter that is gone by the time
it would run is released, never leaked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vacancyd.core.observations import SampleKey
from vacancyd.core.reasons import Refuse
from vacancyd.core.waiting import Waiter, WaitQueue, refresh_key, waits_on

log = logging.getLogger(__name__)

J = TypeVar("J")

#: Outcomes of a wait, the ``outcome`` label of ``vacancyd_wait_seconds``.
ADMITTED, REFUSED, TIMED_OUT, FULL, DISCONNECTED = (
    "admitted",
    "refused",
    "timeout",
    "queue_full",
    "disconnected",
)

Observe = Callable[[str, str, float], None]


@dataclass
class _Room(Generic[J]):
    queue: WaitQueue
    futures: dict[int, asyncio.Future[J | Refuse]] = field(default_factory=dict)
    attempts: dict[int, Callable[[], J | Refuse]] = field(default_factory=dict)


class WaitRooms(Generic[J]):
    """Every waiting upstream's queue and the futures of the requests in it.

    ``clock``: monotonic seconds (``SharedState.clock``). ``request_sample(key)``: ask a collector
    for a sample now (a refusal's ``refresh`` hint names the key). ``observe(upstream,
    outcome, waited_s)``: called once per finished wait, for metrics. ``counts``: a mapping
    kept equal to the number of waiting requests per upstream (the ledger reads it for the
    priority of exclusive upstreams).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        request_sample: Callable[[SampleKey], None] | None = None,
        observe: Observe | None = None,
        counts: dict[str, int] | None = None,
    ) -> None:
        self.clock = clock
        self.request_sample = request_sample
        self.observe = observe
        self._counts = counts if counts is not None else {}
        self._rooms: dict[str, _Room[J]] = {}
        self._order: list[str] = []
        self._serving = False
        self._again = False

    def add(self, upstream: str, *, max_waiting: int, timeout_s: float) -> None:
        """Give ``upstream`` a wait queue. Raises ValueError for bad bounds."""
        self._rooms[upstream] = _Room(WaitQueue(upstream, max_waiting, timeout_s))
        if upstream not in self._order:
            self._order.append(upstream)

    def set_order(self, order: Sequence[str]) -> None:
        """Serve queues in this order (priority upstreams first); others follow."""
        self._order = [n for n in order if n in self._rooms] + [
            n for n in self._order if n not in order
        ]

    def has_queue(self, upstream: str) -> bool:
        return upstream in self._rooms

    def waiting(self, upstream: str) -> int:
        room = self._rooms.get(upstream)
        return 0 if room is None else len(room.queue)

    def counts(self) -> dict[str, int]:
        """Waiting requests per upstream with a queue."""
        return {name: len(room.queue) for name, room in self._rooms.items()}

    async def wait(
        self, upstream: str, attempt: Callable[[], J | Refuse], release: Callable[[J], None]
    ) -> J | Refuse:
        """Wait in ``upstream``'s queue until ``attempt()`` admits or finally refuses.

        ``attempt()`` runs the gate and reserves the job (returning it) or returns the
        refusal; it is called when this request reaches the head and something changed.
        ``release(job)`` gives back a job admitted for this request after it was cancelled.
        Returns the job, a final refusal, or the ``resource_busy`` refusal of a full queue
        or an expired wait. Raises CancelledError when the client goes away (the request
        has left the queue by then).
        """
        room = self._rooms[upstream]
        joined = room.queue.join(self.clock())
        if isinstance(joined, Refuse):
            self._observed(upstream, FULL, 0.0)
            return joined
        waiter = joined
        future: asyncio.Future[J | Refuse] = asyncio.get_running_loop().create_future()
        room.futures[waiter.id] = future
        room.attempts[waiter.id] = attempt
        self._counts[upstream] = len(room.queue)
        outcome = DISCONNECTED
        try:
            if room.queue.head() == waiter:
                # Only a new head can be answered now: behind others nothing has changed for
                # the head since it was last tried.
                self.serve()
            try:
                async with asyncio.timeout(max(0.0, waiter.deadline - self.clock())):
                    result = await asyncio.shield(future)
            except TimeoutError:
                if future.done() and not future.cancelled():
                    result = future.result()  # answered in the same loop step as the timeout
                else:
                    outcome = TIMED_OUT
                    return room.queue.timed_out(waiter, self.clock())
            outcome = REFUSED if isinstance(result, Refuse) else ADMITTED
            return result
        finally:
            was_head = room.queue.head() == waiter
            room.queue.leave(waiter.id)
            self._counts[upstream] = len(room.queue)
            room.futures.pop(waiter.id, None)
            room.attempts.pop(waiter.id, None)
            if outcome == DISCONNECTED and future.done() and not future.cancelled():
                late = future.result()
                if not isinstance(late, Refuse):
                    release(late)  # admitted as the client went away: never leak the job
            future.cancel()
            self._observed(upstream, outcome, waiter.waited_s(self.clock()))
            if was_head:
                self.serve()

    def serve(self) -> None:
        """Answer every head that can be answered now, queue by queue (re-entrant safe)."""
        if self._serving:
            self._again = True
            return
        self._serving = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for name in self._order:
                    self._serve_room(name, self._rooms[name])
        finally:
            self._serving = False

    def _serve_room(self, name: str, room: _Room[J]) -> None:
        if not room.queue:
            return
        now = self.clock()
        for gone in room.queue.expire(now):
            self._answer(room, gone, room.queue.timed_out(gone, now))
        self._counts[name] = len(room.queue)

        def attempt(waiter: Waiter) -> J | Refuse:
            # A waiter is in the queue exactly while its future is pending: answering
            # removes it first, and a request that leaves removes it in its ``finally``.
            decision = room.attempts[waiter.id]()
            if isinstance(decision, Refuse) and waits_on(decision):
                self._refresh(name, decision)
            return decision

        for waiter, decision in room.queue.serve(attempt):
            self._answer(room, waiter, decision)
        self._counts[name] = len(room.queue)

    def _answer(self, room: _Room[J], waiter: Waiter, decision: J | Refuse) -> None:
        future = room.futures.get(waiter.id)
        if future is not None and not future.done():
            future.set_result(decision)

    def _refresh(self, upstream: str, refusal: Refuse) -> None:
        """Ask for the sample a head's refusal waits on; its arrival serves the queue again."""
        key = refresh_key(refusal, upstream)
        if self.request_sample is not None and key is not None:
            self.request_sample(key)

    def next_deadline(self) -> float | None:
        """The earliest deadline of any waiter (monotonic seconds), or None."""
        deadlines = [d for r in self._rooms.values() if (d := r.queue.next_deadline()) is not None]
        return min(deadlines, default=None)

    def _observed(self, upstream: str, outcome: str, waited_s: float) -> None:
        if self.observe is not None:
            try:
                self.observe(upstream, outcome, waited_s)
            except Exception:  # metrics must never break a request
                log.exception("wait metrics failed")
