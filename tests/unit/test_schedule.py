"""The lending schedule's pure rules: windows, midnight, exceptions, DST, next change."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vacancyd.config import ConfigError, parse_config
from vacancyd.core.schedule import (
    Exception_,
    Schedule,
    Window,
    parse_time_of_day,
    parse_weekday,
)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
MON, TUE, WED, THU, FRI, SAT, SUN = range(7)
WEEKDAYS = frozenset({MON, TUE, WED, THU, FRI})


def at(tz: dt.tzinfo, *fields: int) -> float:
    return dt.datetime(*fields, tzinfo=tz).timestamp()  # type: ignore[misc, arg-type]


def night_and_weekend(tz: dt.tzinfo = BERLIN, **kw: object) -> Schedule:
    return Schedule(
        (Window(WEEKDAYS, 60, 7 * 60), Window(frozenset({SAT, SUN}), 10 * 60, 18 * 60)),
        tz,
        "test",
        **kw,  # type: ignore[arg-type]
    )


# 2026-11-30 is a Monday.
@pytest.mark.parametrize(
    ("when", "open_"),
    [
        ((2026, 11, 30, 0, 59), False),
        ((2026, 11, 30, 1, 0), True),  # start is inside
        ((2026, 11, 30, 6, 59), True),
        ((2026, 11, 30, 7, 0), False),  # end is outside
        ((2026, 12, 5, 1, 30), False),  # Saturday night: weekdays only
        ((2026, 12, 5, 10, 0), True),
        ((2026, 12, 6, 17, 59), True),
        ((2026, 12, 6, 18, 0), False),
    ],
)
def test_weekly_windows(when: tuple[int, ...], open_: bool) -> None:
    assert night_and_weekend().is_open(at(BERLIN, *when)) is open_


def test_window_across_midnight_starts_on_its_day_and_ends_the_next() -> None:
    s = Schedule((Window(frozenset({FRI}), 22 * 60, 6 * 60, across_midnight=True),), BERLIN)
    assert not s.is_open(at(BERLIN, 2026, 12, 4, 21, 59))  # Friday
    assert s.is_open(at(BERLIN, 2026, 12, 4, 22, 0))
    assert s.is_open(at(BERLIN, 2026, 12, 5, 5, 59))  # Saturday morning
    assert not s.is_open(at(BERLIN, 2026, 12, 5, 6, 0))
    assert not s.is_open(at(BERLIN, 2026, 12, 5, 23, 0))  # Saturday night is not Friday's
    assert not s.is_open(at(BERLIN, 2026, 12, 4, 3, 0))  # Friday early: Thursday is not listed


def test_sunday_across_midnight_wraps_to_monday() -> None:
    s = Schedule((Window(frozenset({SUN}), 23 * 60, 60, across_midnight=True),), BERLIN)
    assert s.is_open(at(BERLIN, 2026, 11, 30, 0, 30))  # Monday 00:30


def test_overlapping_windows_union() -> None:
    s = Schedule(
        (Window(frozenset({MON}), 60, 5 * 60), Window(frozenset({MON}), 4 * 60, 8 * 60)), BERLIN
    )
    assert s.is_open(at(BERLIN, 2026, 11, 30, 4, 30))
    assert s.is_open(at(BERLIN, 2026, 11, 30, 7, 30))
    start = at(BERLIN, 2026, 11, 30, 2, 0)
    assert s.next_change(start) == at(BERLIN, 2026, 11, 30, 8, 0)  # no change at 05:00


def test_dated_exceptions_override_their_span_only() -> None:
    holiday = Exception_(dt.date(2026, 12, 1))  # a Tuesday, closed all day
    extra = Exception_(dt.date(2026, 12, 2), lend=True, start_min=12 * 60, end_min=13 * 60)
    s = night_and_weekend(exceptions=(holiday, extra))
    assert not s.is_open(at(BERLIN, 2026, 12, 1, 2, 0))
    assert s.is_open(at(BERLIN, 2026, 12, 2, 12, 30))
    assert s.is_open(at(BERLIN, 2026, 12, 2, 2, 0))  # outside its span the week applies
    assert not s.is_open(at(BERLIN, 2026, 12, 2, 13, 0))


def test_disagreeing_overlapping_exceptions_are_refused() -> None:
    day = dt.date(2026, 12, 24)
    with pytest.raises(ValueError, match="overlap and disagree"):
        night_and_weekend(exceptions=(Exception_(day), Exception_(day, True, 600, 700)))


def test_spring_forward_window_in_the_skipped_hour_opens_when_the_clock_jumps() -> None:
    # Europe/Berlin skips 02:00-03:00 on 2026-03-29 (a Sunday).
    s = Schedule((Window(frozenset({SUN}), 2 * 60 + 30, 5 * 60),), BERLIN)
    before = at(BERLIN, 2026, 3, 29, 1, 30)
    jump = at(BERLIN, 2026, 3, 29, 3, 0)
    assert jump - before == 30 * 60  # 01:30 CET to 03:00 CEST is half an hour
    assert s.next_change(before) == jump
    assert not s.is_open(jump - 1)
    assert s.is_open(jump)


def test_fall_back_repeated_hour_is_inside_twice() -> None:
    # Europe/Berlin repeats 02:00-03:00 on 2026-10-25 (a Sunday).
    s = Schedule((Window(frozenset({SUN}), 2 * 60, 2 * 60 + 30),), BERLIN)
    first = dt.datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=0).timestamp()
    second = dt.datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=1).timestamp()
    assert second - first == 3600
    assert s.is_open(first) and s.is_open(second)
    assert not s.is_open(first + 30 * 60)  # 02:40 the first time
    closes = s.next_change(first)
    assert closes == dt.datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN, fold=0).timestamp()
    assert (
        s.next_change(closes) == dt.datetime(2026, 10, 25, 2, 0, tzinfo=BERLIN, fold=1).timestamp()
    )


def test_always_open_has_no_change() -> None:
    s = Schedule((Window(frozenset(range(7))),), BERLIN)
    assert s.is_open(at(BERLIN, 2026, 7, 1, 12, 0))
    assert s.next_change(at(BERLIN, 2026, 7, 1, 12, 0)) is None


ZONES = [BERLIN, NEW_YORK, ZoneInfo("Australia/Lord_Howe"), ZoneInfo("UTC")]
minutes = st.integers(0, 24 * 60 - 1)


@st.composite
def windows(draw: st.DrawFn) -> Window:
    days = frozenset(draw(st.sets(st.integers(0, 6), min_size=1)))
    start = draw(minutes)
    if draw(st.booleans()):
        end = draw(st.integers(0, start))
        return Window(days, start, end, across_midnight=True)
    return Window(days, start, draw(st.integers(start + 1, 24 * 60)))


@settings(max_examples=60, deadline=None)
@given(
    ws=st.lists(windows(), min_size=1, max_size=3),
    zone=st.sampled_from(ZONES),
    # Around the 2026 DST changes in both hemispheres, and ordinary weeks.
    start=st.sampled_from(
        [
            at(ZoneInfo("UTC"), 2026, 3, 28),
            at(ZoneInfo("UTC"), 2026, 10, 24),
            at(ZoneInfo("UTC"), 2026, 4, 4),
            at(ZoneInfo("UTC"), 2026, 7, 1),
        ]
    ),
    offset_min=st.integers(0, 3 * 24 * 60),
)
def test_next_change_is_the_first_change(
    ws: list[Window], zone: ZoneInfo, start: float, offset_min: int
) -> None:
    """Checked against a minute-by-minute walk: the answer is constant until next_change and
    differs right at it."""
    s = Schedule(tuple(ws), zone)
    t0 = start + offset_min * 60 + 17  # not on a minute boundary
    change = s.next_change(t0, horizon_s=2 * 86400)
    current = s.is_open(t0)
    t = float(int(t0 // 60 + 1) * 60)
    limit = t0 + 2 * 86400 if change is None else change
    while t < limit:
        assert s.is_open(t) == current, dt.datetime.fromtimestamp(t, zone)
        t += 60
    if change is not None:
        assert s.is_open(change) != current
        assert change % 60 == 0 or zone is ZoneInfo("Australia/Lord_Howe")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("24:00", "hour 24 is out of range"),
        ("7:60", "minute 60"),
        ("0700", "HH:MM"),
        ("", "HH:MM"),
    ],
)
def test_bad_times(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_time_of_day(text)


def test_weekday_names() -> None:
    assert parse_weekday("Mon") == 0 and parse_weekday("sunday") == 6
    with pytest.raises(ValueError, match="unknown weekday 'mo'"):
        parse_weekday("mo")


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        (
            'window = [{days = ["fri"], start = "22:00", end = "06:00"}]',
            r"schedule\.window\[0\]: window end 06:00 is not after its start 22:00; a window "
            r"that runs past midnight must say across_midnight = true",
        ),
        ('window = [{days = ["funday"]}]', r"schedule\.window\[0\]: unknown weekday 'funday'"),
        (
            'window = [{days = ["mon"], start = "24:00"}]',
            r"schedule\.window\[0\]: start: time '24:00': hour 24 is out of range 0-23",
        ),
        (
            'timezone = "Mars/Olympus_Mons"\nwindow = [{days = ["mon"]}]',
            r"schedule\.timezone: time zone 'Mars/Olympus_Mons' does not exist",
        ),
        ("window = []", r"schedule\.window: List should have at least 1 item"),
        (
            'window = [{days = ["mon"]}]\nexception = [{date = 2026-12-25, start = "10:00", '
            'end = "09:00"}]',
            r"schedule\.exception\[0\]: exception on 2026-12-25: end must be after start",
        ),
    ],
)
def test_bad_schedule_config(toml: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config("[schedule]\n" + toml)


def test_schedule_config_builds_the_core_schedule() -> None:
    settings_ = parse_config(
        '[schedule]\ntimezone = "Europe/Berlin"\n'
        'window = [{days = ["mon", "tue", "wed", "thu", "fri"], start = "01:00", end = "07:00"},'
        ' {days = ["fri"], start = "22:00", end = "06:00", across_midnight = true}]\n'
        "exception = [{date = 2026-12-25}]\n"
    )
    assert settings_.schedule is not None
    s = settings_.schedule.build(BERLIN, "Europe/Berlin")
    assert s.describe() == ["mon,tue,wed,thu,fri 01:00-07:00", "fri 22:00-06:00 (next day)"]
    assert not s.is_open(at(BERLIN, 2026, 12, 25, 2, 0))  # a Friday, but the holiday
    assert s.is_open(at(BERLIN, 2026, 12, 24, 2, 0))
