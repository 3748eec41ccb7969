"""``GET /usage`` (read scope): the usage ledger grouped, as ``vacancyd usage --url`` reads it
(docs/borrowers.md).

Query: ``since`` (``30m``, ``1h``, ``24h``, ``7d``, ``4w`` or a date ``YYYY-MM-DD`` in the
lender's local time; default ``24h``) and ``by`` (``borrower``, ``day`` or ``model``; default
``borrower``). Answer::

    {"since": str, "by": str,
     "energy_price_per_kwh": float | null, "currency": str,
     "rows": [{BY: key, "requests", "busy_s", "prompt_tokens", "completion_tokens",
               "energy_j", "energy_kwh", "cost"?, "currency"?}]}

(rows as :func:`vacancyd.core.usage.report_rows` makes them). 400 ``bad_request`` for a bad
``since`` or ``by``; 404 ``not_found`` when this daemon keeps no ledger; 503
``usage_unavailable`` when the ledger cannot be read now (why is in ``/status``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.core.usage import GROUP_BY, Since, UsageGroup, parse_since, report_rows

#: The ``since`` of a request that names none.
DEFAULT_SINCE = "24h"
#: The ``by`` of a request that names none.
DEFAULT_BY = "borrower"


class UsageSource(Protocol):
    """Where the rows come from (``vacancyd.runtime.usage.UsageStore``)."""

    async def groups(self, since: Since | float, by: str) -> list[UsageGroup]:
        """Groups of the jobs that ended since ``since``; raises an exception saying why
        the ledger cannot be read, ValueError for an unknown ``by``."""
        ...


@dataclass(frozen=True, slots=True)
class UsageReport:
    """What ``GET /usage`` answers from: the ledger, and the price of a kWh (None: no cost
    is shown) with its currency label."""

    source: UsageSource
    price_per_kwh: float | None = None
    currency: str = ""


def _error(status: int, message: str, kind: ErrorType, code: ErrorCode) -> web.Response:
    return web.json_response(error_body(message, kind, code), status=status)


def usage_handler(report: UsageReport | None) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /usage`` handler (the caller checks the read scope)."""

    async def handler(request: web.Request) -> web.Response:
        if report is None:
            return _error(
                404, "this daemon keeps no usage ledger", ErrorType.NOT_FOUND, ErrorCode.NOT_FOUND
            )
        by = request.query.get("by", DEFAULT_BY)
        if by not in GROUP_BY:
            return _error(
                400,
                f"by {by!r} is not one of {', '.join(GROUP_BY)}",
                ErrorType.INVALID_REQUEST,
                ErrorCode.BAD_REQUEST,
            )
        text = request.query.get("since", DEFAULT_SINCE)
        try:
            since = parse_since(text)
        except ValueError as exc:
            return _error(400, str(exc), ErrorType.INVALID_REQUEST, ErrorCode.BAD_REQUEST)
        try:
            groups = await report.source.groups(since, by)
        except Exception as exc:  # the ledger's own error, never a 500 with a traceback
            return _error(
                503,
                f"the usage ledger cannot be read now: {exc}",
                ErrorType.SERVER,
                ErrorCode.USAGE_UNAVAILABLE,
            )
        return web.json_response(
            {
                "since": text,
                "by": by,
                "energy_price_per_kwh": report.price_per_kwh,
                "currency": report.currency,
                "rows": report_rows(
                    groups, by, price_per_kwh=report.price_per_kwh, currency=report.currency
                ),
            }
        )

    return handler
