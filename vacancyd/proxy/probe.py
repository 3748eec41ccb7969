"""The lendability probe: would a borrowed request on this upstream be admitted now?

A balancer's health check points here instead of at the upstream's own health route (which
vacancyd passes through, so it stays green while the lender refuses everything). Two places
answer it, with the same decision:

* ``GET|HEAD /.well-known/vacancyd/lendable`` on the upstream's own proxy listener (a path
  no inference server serves), so a health check on the backend's own address and port
  works unchanged;
* ``GET|HEAD /lendable/{upstream}`` on the API listener.

``?model=NAME`` asks about that model's footprint (a name of the upstream's
``models.footprint_mib`` table, matched by the adapter's name rule). The answer is ``200``
with ``{"lendable": true, ...}``, or the upstream's ``refusal_status`` (503 by default) with
``Retry-After`` and ``{"lendable": false, "reason": CODE, "retry_after_s": N, ...}``: the
gate's reason code only, never its detail, so the route can be public. Unknown upstream or
model: 404 JSON. While the upstream's server does not accept connections (the daemon's own
connection check, or a borrowed request that could not connect, said so last) the answer
is ``503`` with reason ``upstream_unreachable`` instead of any other answer, whatever
``refusal_status`` says: nothing would serve the request.

It runs the admission checks a work request meets before forwarding (gate, open reclaim,
ledger) on one snapshot without reserving anything: it calls no upstream, takes no ledger
slot, asks no collector for a fresh sample, and so a flood of probes costs a few
microseconds each and cannot change an admission. It needs a token with the ``probe``
scope (``borrow``, ``read`` and ``admin`` imply it) unless the upstream sets
``public_probe = true``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vacancyd.core import reach
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import ErrorCode, ErrorType, Refuse
from vacancyd.core.refusal import SDK_MAX_RETRY_AFTER_S, error_body
from vacancyd.core.snapshot import RequestFacts

if TYPE_CHECKING:
    from vacancyd.control.admission import Admission

#: The probe's path on every upstream listener.
PATH = "/.well-known/vacancyd/lendable"
#: The scope a probe token needs (implied by borrow, read and admin).
SCOPE = "probe"


def decide(admission: Admission, upstream: str, model: str | None) -> Refuse | None:
    """None when a borrowed request for ``model`` (None: no model named) would be admitted
    on ``upstream`` now, else the refusal it would get. Reserves, samples, waits for
    nothing: the gate (residency credit included), an open reclaim, the ledger's slots
    (:meth:`Admission.would_admit`)."""
    refused = admission.would_admit(upstream, RequestFacts(model=model))
    return None if refused is None else refused.refusal


def _not_found(message: str, code: ErrorCode, **extra: Any) -> web.Response:
    return web.json_response(
        error_body(message, ErrorType.NOT_FOUND, code, **extra),
        status=404,
        headers={"Cache-Control": "no-store"},
    )


def answer(
    request: web.BaseRequest,
    admission: Admission,
    policy: UpstreamPolicy,
    *,
    canonical_model: Callable[[str], str] = str,
    refusal_status: int = 503,
) -> web.Response:
    """The probe's response for ``request`` (GET or HEAD) on ``policy``'s upstream."""
    if request.method not in ("GET", "HEAD"):
        return web.json_response(
            error_body(
                f"{request.method} {request.path}: use GET or HEAD",
                ErrorType.INVALID_REQUEST,
                ErrorCode.METHOD_NOT_ALLOWED,
            ),
            status=405,
            headers={"Allow": "GET, HEAD"},
        )
    raw = request.query.get("model")
    model: str | None = None
    if raw is not None:
        model = canonical_model(raw.strip()) if raw.strip() else None
        if model is None or model not in policy.footprint_mib:
            known = sorted(policy.footprint_mib)
            return _not_found(
                f"upstream {policy.name!r} has no model {raw!r} in models.footprint_mib"
                + (f" (configured: {', '.join(known)})" if known else " (none configured)"),
                ErrorCode.UNKNOWN_MODEL,
                models=known,
            )
    # A server that does not answer comes first: whatever the gate says, nothing would
    # serve the request (and a transient refusal would hide why).
    down = admission.unreachable(policy.name)
    refusal = None if down else decide(admission, policy.name, model)
    doc: dict[str, object] = {
        "lendable": refusal is None and not down,
        "upstream": policy.name,
        "model": model,
    }
    headers = {"Cache-Control": "no-store"}
    if down:
        # Not a refusal of the lender's: the server behind it is gone. Always 503, which
        # every balancer reads as "out of rotation" (a 429 would read as "slow down").
        doc["reason"] = reach.UPSTREAM_UNREACHABLE
        doc["retry_after_s"] = reach.UNREACHABLE_RETRY_AFTER_S
        headers["Retry-After"] = str(reach.UNREACHABLE_RETRY_AFTER_S)
        return web.json_response(doc, status=503, headers=headers)
    if refusal is None:
        return web.json_response(doc, headers=headers)
    doc["reason"] = refusal.reason.value
    doc["retry_after_s"] = refusal.retry_after_s
    headers["Retry-After"] = str(refusal.retry_after_s)
    if refusal.retry_after_s > SDK_MAX_RETRY_AFTER_S:
        headers["x-should-retry"] = "false"
    return web.json_response(doc, status=refusal_status, headers=headers)


def unknown_upstream(name: str, known: list[str] | None) -> web.Response:
    """404 for ``/lendable/NAME`` when no upstream is called NAME; ``known`` (None: not
    told) lists the declared ones."""
    if known is None:
        return _not_found(f"no upstream named {name!r}", ErrorCode.UNKNOWN_UPSTREAM)
    return _not_found(
        f"no upstream named {name!r} (declared: {', '.join(known) or 'none'})",
        ErrorCode.UNKNOWN_UPSTREAM,
        upstreams=known,
    )


@dataclass(frozen=True, slots=True)
class ProbeEndpoint:
    """One upstream's probe as the API listener serves it: ``answer(request)`` checks its
    own token rule; ``public`` says whether it needs none."""

    public: bool
    answer: Callable[[web.Request], web.Response]
