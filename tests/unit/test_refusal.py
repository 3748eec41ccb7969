"""Refusal rendering: which refusals an SDK may retry, and the Retry-After cap."""

from __future__ import annotations

import json

import pytest

from vacancyd.core.reasons import RETRY_AFTER_S, Reason, Refuse
from vacancyd.core.refusal import SDK_RETRYABLE, render_refusal, render_refusal_bytes


@pytest.mark.parametrize("reason", list(Reason))
def test_only_short_refusals_may_be_retried_by_an_sdk(reason: Reason) -> None:
    _, headers, body = render_refusal(Refuse.of(reason, "why"), "up")
    retryable = reason in (
        Reason.RESOURCE_BUSY,
        Reason.BODY_BUDGET_EXHAUSTED,
        Reason.BORROWER_BUSY,  # its own jobs end soon: a retry in 2 s is the point
    )
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


def test_the_flat_shape_keeps_the_sentence_under_error_and_the_fields_beside_it() -> None:
    refusal = Refuse.of(Reason.OWNER_ACTIVE, "the owner is using this machine")
    _, headers, envelope = render_refusal(refusal, "up")
    status, flat_headers, flat = render_refusal(refusal, "up", flat=True)
    assert status == 503 and flat_headers == headers
    assert flat["error"] == envelope["error"]["message"]
    assert flat["error"].startswith("No vacancy: the owner is using this machine")
    assert flat["code"] == "owner_active" and flat["type"] == "no_vacancy"
    assert flat["source"] == "vacancyd" and flat["upstream"] == "up"
    assert flat["retry_after_s"] == int(headers["Retry-After"])
    assert "param" not in flat


def test_flat_and_enveloped_renderings_are_cached_apart() -> None:
    refusal = Refuse.of(Reason.RESOURCE_BUSY, "busy")
    enveloped = render_refusal_bytes(refusal, "up")
    flat = render_refusal_bytes(refusal, "up", flat=True)
    assert json.loads(enveloped.body)["error"]["code"] == "resource_busy"
    assert json.loads(flat.body)["code"] == "resource_busy"
    assert render_refusal_bytes(refusal, "up", flat=True) is flat
