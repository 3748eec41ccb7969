"""A bounded FIFO of borrowed requests waiting for a slot (``busy = "wait"``).

Pure data: no clock, no asyncio. Callers pass monotonic ``now`` in seconds and keep the
futures that wake each waiting request themselves (``vacancyd.control.waiting``).

Rules:

* Only a request the ledger refused ``resource_busy`` waits. Every other refusal is final.
* A queue holds at most ``max_waiting`` requests; one more is refused ``resource_busy`` at
  once, saying the queue is full.
* Order is strict FIFO: the head is served first, and a request arriving while others wait
  joins behind them even when a slot happens to be free at that instant.
* Every waiter has the same timeout, so deadlines are in join order and the head is always
  the first to expire.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from vacancyd.core.observations import SampleKey
from vacancyd.core.reasons import Reason, Refresh, Refuse

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Waiter:
    """One waiting request. ``joined_at`` and ``deadline`` are monotonic seconds."""

    id: int
    joined_at: float
    deadline: float

    def waited_s(self, now: float) -> float:
        return max(0.0, now - self.joined_at)


def waits_on(refusal: Refuse) -> bool:
    """True when ``refusal`` is one a waiting request keeps waiting through.

    That is ``resource_busy`` (a slot is taken, or the capacity sample that must follow a
    release has not arrived yet) and any refusal a fresh sample may change (it carries a
    ``refresh`` hint: the next sample decides again).
    """
    return refusal.reason is Reason.RESOURCE_BUSY or refusal.refresh is not None


def refresh_key(refusal: Refuse, upstream: str) -> SampleKey | None:
    """The sample whose fresh reading could change ``refusal`` on ``upstream`` (its server's
    observation, or the refused resource's capacity), or None when no sample could."""
    if refusal.refresh is Refresh.SERVER:
        return SampleKey.server(upstream)
    if refusal.refresh is None or refusal.resource is None:
        return None
    return SampleKey.capacity(refusal.resource)


@dataclass
class WaitQueue:
    """The waiting requests of one upstream, oldest first.

    ``max_waiting``: most requests that may wait at once (at least 1).
    ``timeout_s``: seconds a request may wait before it gets the ``resource_busy`` refusal.
    """

    upstream: str
    max_waiting: int
    timeout_s: float
    _waiters: OrderedDict[int, Waiter] = field(default_factory=OrderedDict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if not self.timeout_s > 0:
            raise ValueError(f"wait timeout must be positive, got {self.timeout_s}")

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._waiters.values()))

    def __contains__(self, waiter_id: object) -> bool:
        return waiter_id in self._waiters

    def join(self, now: float) -> Waiter | Refuse:
        """Append a waiter at ``now``; refuse ``resource_busy`` when the queue is full."""
        if len(self._waiters) >= self.max_waiting:
            return Refuse.of(
                Reason.RESOURCE_BUSY,
                f"every slot of {self.upstream!r} is taken and its wait queue is full "
                f"({self.max_waiting} waiting)",
                extra={"waiting": len(self._waiters)},
            )
        waiter = Waiter(next(self._ids), now, now + self.timeout_s)
        self._waiters[waiter.id] = waiter
        return waiter

    def leave(self, waiter_id: int) -> Waiter | None:
        """Remove a waiter (served, timed out, disconnected); idempotent."""
        return self._waiters.pop(waiter_id, None)

    def head(self) -> Waiter | None:
        return next(iter(self._waiters.values()), None)

    def next_deadline(self) -> float | None:
        """The earliest deadline (the head's), or None when nobody waits."""
        head = self.head()
        return None if head is None else head.deadline

    def expire(self, now: float) -> list[Waiter]:
        """Remove and return every waiter whose deadline is at or before ``now``."""
        gone: list[Waiter] = []
        while (head := self.head()) is not None and head.deadline <= now:
            gone.append(head)
            del self._waiters[head.id]
        return gone

    def timed_out(self, waiter: Waiter, now: float) -> Refuse:
        """The refusal a waiter gets when its wait ends without a slot."""
        return Refuse.of(
            Reason.RESOURCE_BUSY,
            f"every slot of {self.upstream!r} stayed taken for the whole wait "
            f"({waiter.waited_s(now):.1f} s of wait_timeout_s = {self.timeout_s:g} s)",
            extra={"waited_s": round(waiter.waited_s(now), 3)},
        )

    def serve(self, decide: Callable[[Waiter], T | Refuse]) -> list[tuple[Waiter, T | Refuse]]:
        """Serve waiters from the head while they can be answered.

        ``decide(waiter)`` runs the gate and ledger for that waiter and returns its admission
        (a reserved job, say) or a refusal. An admission or a final refusal removes the waiter
        and is returned; the first refusal that :func:`waits_on` stops the pass, so one pass
        costs one decision per answered waiter plus one.
        """
        answered: list[tuple[Waiter, T | Refuse]] = []
        while (head := self.head()) is not None:
            decision = decide(head)
            if isinstance(decision, Refuse) and waits_on(decision):
                break
            del self._waiters[head.id]
            answered.append((head, decision))
        return answered

    def drain(self) -> list[Waiter]:
        """Remove and return every waiter (the daemon stops)."""
        gone = list(self._waiters.values())
        self._waiters.clear()
        return gone
