"""A named borrower's own limits: the pure rule (vacancyd/core/quota.py) and the counts the
control layer keeps for it (vacancyd/control/borrowers.py), local days across DST included."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from vacancyd.control.borrowers import Borrowers, local_day
from vacancyd.core.quota import BorrowerLimits, LocalDay, busy_in_day, decide_quota, may_use
from vacancyd.core.reasons import RETRY_AFTER_S, Reason, Refuse
from vacancyd.core.refusal import render_refusal

DAY = LocalDay(start=1_000_000.0, end=1_086_400.0)


def test_under_the_quota_is_admitted() -> None:
    limits = BorrowerLimits(daily_busy_s=60)
    assert (
        decide_quota("friend", limits, used_s=59.9, running=0, now=DAY.start + 10, day=DAY) is None
    )


def test_a_used_up_quota_is_refused_until_local_midnight() -> None:
    limits = BorrowerLimits(daily_busy_s=60)
    now = DAY.end - (3 * 3600 + 11 * 60 + 30)  # 3 h 11 min 30 s before midnight
    refusal = decide_quota("friend", limits, used_s=60, running=0, now=now, day=DAY)
    assert isinstance(refusal, Refuse)
    assert refusal.reason is Reason.QUOTA_EXHAUSTED
    assert refusal.retry_after_s == 3 * 3600 + 11 * 60 + 30
    assert "resets at 00:00 local time (in 3 h 12 min)" in refusal.detail
    assert "'friend'" in refusal.detail


def test_the_last_second_still_waits_one_second() -> None:
    refusal = decide_quota(
        "f", BorrowerLimits(daily_busy_s=1), used_s=5, running=0, now=DAY.end - 0.2, day=DAY
    )
    assert refusal is not None and refusal.retry_after_s == 1
    assert "(in 1 s)" in refusal.detail


def test_max_concurrent_refuses_borrower_busy() -> None:
    limits = BorrowerLimits(max_concurrent=2)
    assert decide_quota("f", limits, used_s=0, running=1, now=DAY.start, day=DAY) is None
    refusal = decide_quota("f", limits, used_s=0, running=2, now=DAY.start, day=DAY)
    assert refusal is not None and refusal.reason is Reason.BORROWER_BUSY
    assert refusal.retry_after_s == RETRY_AFTER_S[Reason.BORROWER_BUSY]


def test_the_quota_comes_before_the_concurrency_cap() -> None:
    limits = BorrowerLimits(max_concurrent=1, daily_busy_s=10)
    refusal = decide_quota("f", limits, used_s=10, running=1, now=DAY.start, day=DAY)
    assert refusal is not None and refusal.reason is Reason.QUOTA_EXHAUSTED


def test_borrower_limits_render_429_with_the_whole_retry_after() -> None:
    refusal = decide_quota(
        "f", BorrowerLimits(daily_busy_s=1), used_s=2, running=0, now=DAY.start, day=DAY
    )
    assert refusal is not None
    status, headers, body = render_refusal(refusal, "ollama", 503, retry_after_max_s=60)
    assert status == 429
    assert headers["Retry-After"] == "86400"
    assert body["error"]["code"] == "quota_exhausted"
    assert body["error"]["type"] == "no_vacancy"


def test_upstreams_outside_the_list_are_named() -> None:
    limits = BorrowerLimits(upstreams=frozenset({"ollama"}))
    assert may_use("friend", limits, ["ollama"]) is None
    why = may_use("friend", limits, ["llama"])
    assert why is not None and "'friend'" in why and "'llama'" in why
    assert may_use("friend", BorrowerLimits(), ["anything"]) is None


def test_busy_in_day_clips_to_the_day() -> None:
    assert busy_in_day(DAY.start - 100, DAY.start + 50, DAY) == 50
    assert busy_in_day(DAY.end - 10, DAY.end + 10, DAY) == 10
    assert busy_in_day(DAY.start - 100, DAY.start - 50, DAY) == 0


@pytest.fixture
def berlin() -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()


def _wall(text: str) -> float:
    return time.mktime((*time.strptime(text, "%Y-%m-%d %H:%M")[:8], -1))


def test_local_days_across_dst_are_23_and_25_hours(berlin: None) -> None:
    spring = local_day(_wall("2026-03-29 12:00"))  # clocks go 02:00 -> 03:00
    assert spring.end - spring.start == 23 * 3600
    autumn = local_day(_wall("2026-10-25 12:00"))  # clocks go 03:00 -> 02:00
    assert autumn.end - autumn.start == 25 * 3600
    ordinary = local_day(_wall("2026-06-01 23:59"))
    assert ordinary.end - ordinary.start == 24 * 3600
    assert ordinary.end_clock == "00:00"
    assert time.localtime(ordinary.end).tm_hour == 0


def test_the_quota_on_a_25_hour_day_resets_at_its_midnight(berlin: None) -> None:
    now = _wall("2026-10-25 00:30")
    day = local_day(now)
    refusal = decide_quota(
        "f", BorrowerLimits(daily_busy_s=1), used_s=1, running=0, now=now, day=day
    )
    assert refusal is not None
    assert refusal.retry_after_s == 24 * 3600 + 30 * 60  # 23 h 30 min of clock, plus the hour


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _day(now: float) -> LocalDay:
    start = now - (now % 86400)
    return LocalDay(start, start + 86400)


def test_borrowers_count_running_and_finished_jobs_and_reset_at_midnight() -> None:
    clock = Clock(86400 * 10 + 3600)
    b = Borrowers(
        {"friend": BorrowerLimits(daily_busy_s=100, max_concurrent=1)}, wall=clock, day=_day
    )
    assert b.refusal("friend") is None
    b.started(1, "friend", clock.now)
    refusal = b.refusal("friend")
    assert refusal is not None and refusal.reason is Reason.BORROWER_BUSY
    clock.now += 60
    assert b.used_today("friend") == 60  # the running job counts as it goes
    assert b.ended(1, clock.now) == 60
    assert b.refusal("friend") is None
    b.started(2, "friend", clock.now)
    clock.now += 40
    b.ended(2, clock.now)
    refusal = b.refusal("friend")
    assert refusal is not None and refusal.reason is Reason.QUOTA_EXHAUSTED
    assert b.refusal("") is None and b.refusal("other") is None  # others are unaffected
    clock.now = 86400 * 11 + 1  # the next day
    assert b.refusal("friend") is None
    assert b.used_today("friend") == 0


def test_restored_usage_counts_only_for_its_own_day() -> None:
    clock = Clock(86400 * 10 + 3600)
    b = Borrowers({"friend": BorrowerLimits(daily_busy_s=100)}, wall=clock, day=_day)
    b.restore({"friend": 100.0}, _day(clock.now - 86400))  # yesterday's: ignored
    assert b.refusal("friend") is None
    b.restore({"friend": 100.0}, _day(clock.now))
    refusal = b.refusal("friend")
    assert refusal is not None and refusal.reason is Reason.QUOTA_EXHAUSTED


def test_forbidden_only_for_a_named_borrower_with_upstreams() -> None:
    b = Borrowers({"friend": BorrowerLimits(upstreams=frozenset({"a"}))})
    assert b.forbidden("friend", ["a"]) is None
    assert b.forbidden("friend", ["b"]) is not None
    assert b.forbidden("", ["b"]) is None
