"""The pure side of usage reports (vacancyd.core.usage): --since values, report rows with
kWh and cost, and reading them back."""

from __future__ import annotations

import datetime as dt

import pytest

from vacancyd.core.usage import (
    UNNAMED_LABEL,
    UsageGroup,
    groups_from_rows,
    parse_since,
    report_rows,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h", 3600), ("24h", 86400), ("7d", 7 * 86400), ("30m", 1800), ("2w", 14 * 86400)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_since(text).seconds == seconds


def test_a_date() -> None:
    assert parse_since("2027-03-01").day == dt.date(2027, 3, 1)


@pytest.mark.parametrize(
    "text", ["", "1", "h", "-1h", "1.5h", "0h", "1y", "2027-13-01", "2027-02-30", "yesterday", "٣h"]
)
def test_bad_values_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_since(text)
    assert repr(text) in str(info.value)


def test_a_duration_too_long_says_so() -> None:
    # 9999999w is a duration, only too long: not "neither a time back from now nor a date"
    with pytest.raises(ValueError, match="too far back") as info:
        parse_since("9999999w")
    assert "'9999999w'" in str(info.value)
    assert parse_since("999999w").seconds == 999999 * 7 * 86400


GROUPS = [
    UsageGroup("", 2, 5.0, 20, 40, 7_200_000.0),
    UsageGroup("friend", 1, 1.25, None, None, None),
]


def test_rows_name_the_group_key_after_by_and_show_the_unnamed_label() -> None:
    rows = report_rows(GROUPS, "borrower")
    assert rows == [
        {
            "borrower": UNNAMED_LABEL,
            "requests": 2,
            "busy_s": 5.0,
            "prompt_tokens": 20,
            "completion_tokens": 40,
            "energy_j": 7_200_000.0,
            "energy_kwh": 2.0,
        },
        {
            "borrower": "friend",
            "requests": 1,
            "busy_s": 1.25,
            "prompt_tokens": None,
            "completion_tokens": None,
            "energy_j": None,
            "energy_kwh": None,
        },
    ]
    assert all("model" in r and "borrower" not in r for r in report_rows(GROUPS, "model"))


def test_a_price_adds_cost_and_currency() -> None:
    rows = report_rows(GROUPS, "day", price_per_kwh=0.3, currency="EUR")
    assert (rows[0]["cost"], rows[0]["currency"]) == (0.6, "EUR")
    assert rows[1]["cost"] is None


def test_rows_read_back_and_bad_shapes_are_named() -> None:
    back = groups_from_rows(report_rows(GROUPS, "model"), "model")
    assert back == GROUPS
    with pytest.raises(ValueError, match=r"rows\[0\].requests"):
        groups_from_rows([{"model": "x", "requests": "2", "busy_s": 1}], "model")
    with pytest.raises(ValueError, match="not a list"):
        groups_from_rows({"rows": []}, "model")
    with pytest.raises(ValueError, match="cannot group by"):
        report_rows(GROUPS, "upstream")
