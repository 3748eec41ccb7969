"""Render refusals and proxy errors as OpenAI-shaped JSON (docs/architecture.md).

Body shape, shared by every error vacancyd itself produces::

    {"error": {"message": str, "type": str, "code": str, "param": null,
               "source": "vacancyd", ...extra}}

``source`` lets a client tell a lender's refusal from an error the upstream returned.
Refusals use ``type = "no_vacancy"`` and ``code`` = the gate's reason.

Routes whose server speaks a flat error shape of its own (Ollama's native ``/api/...``
routes answer ``{"error": "<sentence>"}``, and its client reads the sentence from there) get
the ``flat`` form instead: the sentence under ``error`` and every other field beside it::

    {"error": str, "type": str, "code": str, "source": "vacancyd", ...extra}
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from vacancyd.core.reasons import BORROWER_LIMITS, Credit, ErrorCode, ErrorType, Reason, Refuse

SOURCE = "vacancyd"

#: The OpenAI SDKs wait out a Retry-After of up to 60 s and retry (openai-python
#: ``_base_client._calculate_retry_timeout``), twice by default.
SDK_MAX_RETRY_AFTER_S = 60

#: Refusals worth retrying within an SDK's own retry loop: the lender is busy with other
#: borrowed work (or the borrower with its own ``max_concurrent`` jobs) or its body buffer
#: is full, which clears in a couple of seconds. Every other
#: reason (the owner, the switches, capacity, pressure, a reclaim) lasts far longer than an
#: SDK's retries, so those refusals carry ``x-should-retry: false`` and the caller gets the
#: refusal at once instead of blocking on retries that cannot succeed.
SDK_RETRYABLE: frozenset[Reason] = frozenset(
    {Reason.RESOURCE_BUSY, Reason.BODY_BUDGET_EXHAUSTED, Reason.BORROWER_BUSY}
)


def error_body(
    message: str, type_: ErrorType, code: ErrorCode | Reason, *, flat: bool = False, **extra: Any
) -> dict[str, Any]:
    """The JSON body for any error vacancyd answers itself (``flat``: the native form of a
    server whose errors are ``{"error": "<sentence>"}``, see the module docstring)."""
    if flat:
        return {"error": message, "type": type_, "code": code, "source": SOURCE, **extra}
    error: dict[str, Any] = {
        "message": message,
        "type": type_,
        "code": code,
        "param": None,
        "source": SOURCE,
    }
    error.update(extra)
    return {"error": error}


def retry_after(refusal: Refuse, max_s: int | None = None) -> int:
    """Whole seconds to send in Retry-After: the refusal's hint, capped at ``max_s`` if set."""
    if max_s is None:
        return refusal.retry_after_s
    return min(refusal.retry_after_s, max_s)


def render_refusal(
    refusal: Refuse,
    upstream: str,
    status: int = 503,
    retry_after_max_s: int | None = None,
    flat: bool = False,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, body) for a gate or ledger refusal on ``upstream``; ``flat`` renders
    the body in the flat shape (module docstring).

    ``status`` is the upstream's ``refusal_status`` (503 or 429); a borrower's own limits
    (:data:`~vacancyd.core.reasons.BORROWER_LIMITS`) are always 429 and their Retry-After is
    never capped. ``retry_after_max_s`` caps the Retry-After hint (the upstream's
    ``retry_after_max_s``); the body's ``retry_after_s`` is the value sent, and
    ``retry_after_hint_s`` the uncapped hint when the cap lowered it.
    """
    own_status = BORROWER_LIMITS.get(refusal.reason)
    if own_status is not None:  # a borrower's own limit: its status, its whole Retry-After
        status, retry_after_max_s = own_status, None
    seconds = retry_after(refusal, retry_after_max_s)
    headers = {"Retry-After": str(seconds)}
    if refusal.reason not in SDK_RETRYABLE or seconds > SDK_MAX_RETRY_AFTER_S:
        headers["x-should-retry"] = "false"
    extra: dict[str, Any] = {"retry_after_s": seconds, "upstream": upstream}
    if seconds != refusal.retry_after_s:
        extra["retry_after_hint_s"] = refusal.retry_after_s
    if refusal.resource is not None:
        extra["resource"] = refusal.resource
    # An owner hold says which control holds the host and, when known, until when (epoch s).
    for key in ("hold", "until"):
        if key in refusal.extra:
            extra[key] = refusal.extra[key]
    if refusal.credit is not None:
        extra["residency_credit"] = {"applied": refusal.credit.applied, "why": refusal.credit.why}
    body = error_body(
        f"No vacancy: {refusal.detail}", ErrorType.NO_VACANCY, refusal.reason, flat=flat, **extra
    )
    return status, headers, body


@dataclass(frozen=True, slots=True)
class RenderedRefusal:
    """A refusal ready for the wire: status, headers (``Content-Type`` included) and the
    JSON body as UTF-8 bytes. Shared between requests: never mutate ``headers``."""

    status: int
    headers: dict[str, str]
    body: bytes


#: Distinct refusals rendered ahead of time; the details of most refusals repeat exactly
#: (a switch, a reason, a resource), so a flood of them is served from here.
RENDERED_CACHE_SIZE = 512


def render_refusal_bytes(
    refusal: Refuse,
    upstream: str,
    status: int = 503,
    retry_after_max_s: int | None = None,
    flat: bool = False,
) -> RenderedRefusal:
    """:func:`render_refusal`, serialized, and remembered per distinct refusal value (every
    field counts, ``extra`` included); a refusal whose ``extra`` holds an unhashable value
    is rendered afresh."""
    key = (
        refusal.reason,
        refusal.retry_after_s,
        refusal.detail,
        refusal.resource,
        refusal.credit,
        tuple(sorted(refusal.extra.items())),
        upstream,
        status,
        retry_after_max_s,
        flat,
    )
    try:
        hash(key)
    except TypeError:
        return _serialize(refusal, upstream, status, retry_after_max_s, flat)
    return _rendered(key)


_Key = tuple[
    Reason,
    int,
    str,
    str | None,
    Credit | None,
    tuple[tuple[str, object], ...],
    str,
    int,
    int | None,
    bool,
]


@functools.lru_cache(maxsize=RENDERED_CACHE_SIZE)
def _rendered(key: _Key) -> RenderedRefusal:
    reason, retry_after_s, detail, resource, credit, extra, upstream, status, cap, flat = key
    refusal = Refuse(reason, retry_after_s, detail, resource, credit, dict(extra))
    return _serialize(refusal, upstream, status, cap, flat)


def _serialize(
    refusal: Refuse, upstream: str, status: int, retry_after_max_s: int | None, flat: bool
) -> RenderedRefusal:
    code, headers, body = render_refusal(refusal, upstream, status, retry_after_max_s, flat)
    headers["Content-Type"] = "application/json; charset=utf-8"
    return RenderedRefusal(code, headers, json.dumps(body).encode())
