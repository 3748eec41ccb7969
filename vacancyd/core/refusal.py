"""Render refusals and proxy errors as OpenAI-shaped JSON (docs/architecture.md).

Body shape, shared by every error vacancyd itself produces::

    {"error": {"message": str, "type": str, "code": str, "param": null,
               "source": "vacancyd", ...extra}}

``source`` lets a client tell a lender's refusal from an error the upstream returned.
Refusals use ``type = "no_vacancy"`` and ``code`` = the gate's reason.
"""

from __future__ import annotations

from typing import Any

from vacancyd.core.reasons import ErrorCode, ErrorType, Reason, Refuse

SOURCE = "vacancyd"

#: The OpenAI SDKs honour Retry-After only up to 60 s and otherwise retry at once
#: (openai-python ``_base_client._should_retry``); above that we tell them not to retry.
SDK_MAX_RETRY_AFTER_S = 60


def error_body(
    message: str, type_: ErrorType, code: ErrorCode | Reason, **extra: Any
) -> dict[str, Any]:
    """The JSON body for any error vacancyd answers itself."""
    error: dict[str, Any] = {
        "message": message,
        "type": type_,
        "code": code,
        "param": None,
        "source": SOURCE,
    }
    error.update(extra)
    return {"error": error}


def render_refusal(
    refusal: Refuse, upstream: str, status: int = 503
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, body) for a gate or ledger refusal on ``upstream``."""
    headers = {"Retry-After": str(refusal.retry_after_s)}
    if refusal.retry_after_s > SDK_MAX_RETRY_AFTER_S:
        headers["x-should-retry"] = "false"
    extra: dict[str, Any] = {"retry_after_s": refusal.retry_after_s, "upstream": upstream}
    if refusal.resource is not None:
        extra["resource"] = refusal.resource
    # An owner hold says which control holds the host and, when known, until when (epoch s).
    for key in ("hold", "until"):
        if key in refusal.extra:
            extra[key] = refusal.extra[key]
    if refusal.credit is not None:
        extra["residency_credit"] = {"applied": refusal.credit.applied, "why": refusal.credit.why}
    body = error_body(
        f"No vacancy: {refusal.detail}", ErrorType.NO_VACANCY, refusal.reason, **extra
    )
    return status, headers, body
