"""Refusal rendering: which refusals an SDK may retry, and the Retry-After cap."""

from __future__ import annotations

import pytest

from vacancyd.core.reasons import RETRY_AFTER_S, Reason, Refuse
from vacancyd.core.refusal import SDK_RETRYABLE, render_refusal


@pytest.mark.parametrize("reason", list(Reason))
def test_only_short_refusals_may_be_retried_by_an_sdk(reason: Reason) -> None:
    _, headers, body = render_refusal(Refuse.of(reason, "why"), "up")
    retryable = reason in (Reason.RESOURCE_BUSY, Reason.BODY_BUDGET_EXHAUSTED)
    assert ("x-should-retry" not in headers) is retryable
    if not retryable:
        assert headers["x-should-retry"] == "false"
    assert headers["Retry-After"] == str(RETRY_AFTER_S[reason])
    assert body["error"]["retry_after_s"] == RETRY_AFTER_S[reason]
    assert "retry_after_hint_s" not in body["error"]


def test_cap_lowers_the_header_and_keeps_the_hint_in_the_body() -> None:
    status, headers, body = render_refusal(
        Refuse.of(Reason.LENDING_DISABLED, "off"), "up", status=429, retry_after_max_s=10
    )
    assert status == 429 and headers["Retry-After"] == "10"
    assert headers["x-should-retry"] == "false"
    assert body["error"]["retry_after_s"] == 10 and body["error"]["retry_after_hint_s"] == 300


def test_cap_above_the_hint_changes_nothing() -> None:
    _, headers, body = render_refusal(
        Refuse.of(Reason.RESOURCE_BUSY, "busy"), "up", retry_after_max_s=10
    )
    assert headers == {"Retry-After": "2"}
    assert "retry_after_hint_s" not in body["error"]


def test_a_long_busy_hint_is_not_retried() -> None:
    refusal = Refuse.of(Reason.RESOURCE_BUSY, "busy", retry_after_s=90)
    assert Reason.RESOURCE_BUSY in SDK_RETRYABLE
    _, headers, _ = render_refusal(refusal, "up")
    assert headers["x-should-retry"] == "false"
