"""aiohttp's own HTTP errors answered in vacancyd's JSON error envelope, on every listener.

aiohttp raises its own exceptions for what never reaches a handler: a request target the
router cannot match (``CONNECT host:port`` has no path at all), a method a route does not
take, a body over ``client_max_size``. Left alone, those answer ``text/plain`` ("404: Not
Found"), which a client that parses our errors cannot read. :func:`json_errors` turns each
into the same ``{"error": {...}}`` body every other refusal has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.REQUEST_TOO_LARGE,
}


def json_error_for(request: web.BaseRequest, exc: web.HTTPException) -> web.Response:
    """The JSON error answering aiohttp's ``exc`` (status >= 400) for ``request``.

    The message names the method and the request target as sent (``request.raw_path``, so an
    authority-form ``CONNECT`` target is shown, not an empty path); ``Allow`` is kept on a
    405.
    """
    code = _CODES.get(exc.status, ErrorCode.HTTP_ERROR)
    return web.json_response(
        error_body(
            f"{request.method} {request.raw_path}: {exc.reason}",
            ErrorType.INVALID_REQUEST,
            code,
        ),
        status=exc.status,
        headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
    )


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer an aiohttp ``HTTPException`` of status >= 400 as a JSON error
    (:func:`json_error_for`); redirects and other statuses below 400 are re-raised
    unchanged."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error_for(request, exc)
