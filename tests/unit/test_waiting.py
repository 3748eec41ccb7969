"""The bounded FIFO wait queue (busy = "wait"): order, bounds, timeouts, serving."""

from __future__ import annotations

import pytest

from vacancyd.core.observations import SampleKey
from vacancyd.core.reasons import Admit, Decision, Reason, Refresh, Refuse
from vacancyd.core.waiting import Waiter, WaitQueue, refresh_key, waits_on


def test_fifo_bound_and_leave() -> None:
    q = WaitQueue("up", max_waiting=2, timeout_s=10.0)
    a, b = q.join(0.0), q.join(1.0)
    assert isinstance(a, Waiter) and isinstance(b, Waiter)
    full = q.join(2.0)
    assert isinstance(full, Refuse) and full.reason is Reason.RESOURCE_BUSY
    assert "wait queue is full (2 waiting)" in full.detail and full.retry_after_s == 2
    assert q.head() == a and len(q) == 2
    assert q.leave(a.id) == a and q.leave(a.id) is None
    assert q.head() == b and a.id not in q
    c = q.join(3.0)
    assert isinstance(c, Waiter) and [w.id for w in q] == [b.id, c.id]


def test_expire_pops_from_the_head_in_deadline_order() -> None:
    q = WaitQueue("up", max_waiting=10, timeout_s=5.0)
    ws = [q.join(float(t)) for t in range(4)]
    assert q.next_deadline() == 5.0
    gone = q.expire(6.5)
    assert gone == ws[:2] and q.next_deadline() == 7.0
    refusal = q.timed_out(gone[0], 6.5)
    assert (
        refusal.reason is Reason.RESOURCE_BUSY and "6.5 s of wait_timeout_s = 5 s" in refusal.detail
    )
    assert q.expire(6.9) == []


def test_serve_stops_at_the_first_waiter_that_still_waits() -> None:
    q = WaitQueue("up", max_waiting=10, timeout_s=5.0)
    ws = [q.join(0.0) for _ in range(5)]
    assert all(isinstance(w, Waiter) for w in ws)
    answers: list[Decision] = [
        Admit(resources=("gpu",)),
        Refuse.of(Reason.OWNER_ACTIVE, "owner"),
        Refuse.of(Reason.RESOURCE_BUSY, "slots taken"),
    ]
    asked: list[int] = []

    def decide(w: Waiter) -> Decision:
        asked.append(w.id)
        return answers[len(asked) - 1]

    served = q.serve(decide)
    assert [w.id for w, _ in served] == [ws[0].id, ws[1].id]  # type: ignore[union-attr]
    assert isinstance(served[1][1], Refuse) and served[1][1].reason is Reason.OWNER_ACTIVE
    assert asked == [ws[0].id, ws[1].id, ws[2].id]  # type: ignore[union-attr]
    assert q.head() == ws[2] and len(q) == 3


def test_what_keeps_a_waiter_waiting() -> None:
    assert waits_on(Refuse.of(Reason.RESOURCE_BUSY, "x"))
    assert waits_on(Refuse.of(Reason.INSUFFICIENT_CAPACITY, "x", refresh=Refresh.SERVER))
    for reason in (Reason.OWNER_ACTIVE, Reason.LENDING_DISABLED, Reason.RESOURCE_PRESSURED):
        assert not waits_on(Refuse.of(reason, "x"))


def test_the_sample_a_refresh_hint_names() -> None:
    server = Refuse.of(Reason.RESOURCE_UNMEASURED, "x", refresh=Refresh.SERVER)
    capacity = Refuse.of(Reason.RESOURCE_BUSY, "x", resource="gpu0", refresh=Refresh.CAPACITY)
    assert refresh_key(server, "llm") == SampleKey.server("llm")
    assert refresh_key(capacity, "llm") == SampleKey.capacity("gpu0")
    assert str(SampleKey.server("llm")) == "server:llm"
    assert refresh_key(Refuse.of(Reason.RESOURCE_BUSY, "x", resource="gpu0"), "llm") is None


def test_bad_bounds_are_errors() -> None:
    with pytest.raises(ValueError, match="max_waiting"):
        WaitQueue("up", max_waiting=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout"):
        WaitQueue("up", max_waiting=1, timeout_s=0.0)


def test_drain_empties_the_queue() -> None:
    q = WaitQueue("up", max_waiting=3, timeout_s=1.0)
    ws = [q.join(0.0) for _ in range(3)]
    assert q.drain() == ws and len(q) == 0 and q.head() is None
