"""WaitRooms: FIFO admission on release, timeouts, disconnects, mass refusal, bounds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from vacancyd.control.waiting import WaitRooms
from vacancyd.core.reasons import Reason, Refuse


@dataclass
class Card:
    """A stand-in ledger: ``slots`` jobs at once; ``refuse_all`` plays an owner return."""

    slots: int
    running: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    refuse_all: Refuse | None = None

    def attempt(self, who: str):  # type: ignore[no-untyped-def]
        def go() -> str | Refuse:
            if self.refuse_all is not None:
                return self.refuse_all
            if len(self.running) >= self.slots:
                return Refuse.of(Reason.RESOURCE_BUSY, "slots taken")
            self.running.append(who)
            return who

        return go

    def release(self, who: str) -> None:
        self.running.remove(who)
        self.released.append(who)


def rooms(card: Card, *, max_waiting: int = 8, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    seen: list[tuple[str, str]] = []
    r: WaitRooms[str] = WaitRooms(
        asyncio.get_running_loop().time, observe=lambda u, o, _s: seen.append((u, o))
    )
    r.add("up", max_waiting=max_waiting, timeout_s=timeout_s)
    return r, seen


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_are_admitted_in_arrival_order_as_slots_free() -> None:
    card = Card(slots=1, running=["owner-of-slot"])
    r, seen = rooms(card)
    tasks = [
        asyncio.create_task(r.wait("up", card.attempt(f"w{i}"), card.release)) for i in range(3)
    ]
    await settle()
    assert r.waiting("up") == 3 and not any(t.done() for t in tasks)
    card.running.clear()
    r.serve()  # the ledger released a job
    await settle()
    assert tasks[0].done() and await tasks[0] == "w0" and not tasks[1].done()
    card.release("w0")
    r.serve()
    await settle()
    assert await tasks[1] == "w1" and not tasks[2].done()
    # a newcomer while someone waits joins behind, even if a slot is free right now
    card.release("w1")
    late = asyncio.create_task(r.wait("up", card.attempt("late"), card.release))
    await settle()
    assert not late.done() and r.waiting("up") == 2
    r.serve()
    assert await tasks[2] == "w2" and not late.done()
    card.release("w2")
    r.serve()
    assert await late == "late"
    assert [o for _, o in seen] == ["admitted"] * 4


async def test_timeout_and_queue_full_are_resource_busy() -> None:
    card = Card(slots=0)
    r, seen = rooms(card, max_waiting=1, timeout_s=0.2)
    first = asyncio.create_task(r.wait("up", card.attempt("a"), card.release))
    await settle()
    full = await r.wait("up", card.attempt("b"), card.release)
    assert isinstance(full, Refuse) and full.reason is Reason.RESOURCE_BUSY
    assert "wait queue is full (1 waiting)" in full.detail
    timed_out = await first
    assert isinstance(timed_out, Refuse) and timed_out.reason is Reason.RESOURCE_BUSY
    assert "stayed taken for the whole wait" in timed_out.detail
    assert 0.15 <= float(timed_out.extra["waited_s"]) < 1.0  # type: ignore[arg-type]
    assert [o for _, o in seen] == ["queue_full", "timeout"] and r.waiting("up") == 0


async def test_a_disconnected_waiter_leaves_at_once_and_never_leaks_a_job() -> None:
    card = Card(slots=0)
    r, seen = rooms(card)
    gone = asyncio.create_task(r.wait("up", card.attempt("gone"), card.release))
    stays = asyncio.create_task(r.wait("up", card.attempt("stays"), card.release))
    await settle()
    gone.cancel()  # aiohttp cancels the handler of a client that disconnects
    await asyncio.gather(gone, return_exceptions=True)
    assert r.waiting("up") == 1 and ("up", "disconnected") in seen
    # the client goes away in the same loop step as its admission: the job is released
    card.slots = 1
    r.serve()
    stays.cancel()
    await asyncio.gather(stays, return_exceptions=True)
    assert card.released == ["stays"] and card.running == []


async def test_owner_return_refuses_every_waiter_with_the_real_reason() -> None:
    card = Card(slots=0)
    r, _ = rooms(card)
    tasks = [
        asyncio.create_task(r.wait("up", card.attempt(f"w{i}"), card.release)) for i in range(5)
    ]
    await settle()
    card.refuse_all = Refuse.of(Reason.OWNER_ACTIVE, "the owner is using this machine")
    r.serve()
    answers = await asyncio.gather(*tasks)
    assert all(isinstance(a, Refuse) and a.reason is Reason.OWNER_ACTIVE for a in answers)
    assert r.waiting("up") == 0


async def test_a_thousand_waiters_stay_bounded_and_leave_no_task() -> None:
    card = Card(slots=0)
    r, seen = rooms(card, max_waiting=50, timeout_s=30.0)
    before = len(asyncio.all_tasks())
    tasks = [
        asyncio.create_task(r.wait("up", card.attempt(f"w{i}"), card.release)) for i in range(1000)
    ]
    await settle()
    refused_now = [t for t in tasks if t.done()]
    assert len(refused_now) == 950 and r.waiting("up") == 50
    assert all(isinstance(t.result(), Refuse) for t in refused_now)
    card.slots = 10
    r.serve()
    await settle()
    assert len(card.running) == 10 and r.waiting("up") == 40
    card.refuse_all = Refuse.of(Reason.LENDING_DISABLED, "lending is switched off")
    r.serve()
    await asyncio.gather(*tasks)
    assert r.waiting("up") == 0 and len(asyncio.all_tasks()) == before
    outcomes = [o for _, o in seen]
    assert outcomes.count("queue_full") == 950 and outcomes.count("admitted") == 10
    assert outcomes.count("refused") == 40
