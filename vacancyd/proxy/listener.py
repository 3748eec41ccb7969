"""The listener's aiohttp low-level server around :meth:`Proxy.handle`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from vacancyd.proxy.handler import Proxy
from vacancyd.web.errors import json_error_for
from vacancyd.web.site import SERVER_HEADER


class ProxyRequest(web.BaseRequest):
    """A request on a proxy listener: every response prepared for it (the handler's own,
    a stream, aiohttp's error pages) names vacancyd as its ``Server``, never the Python or
    aiohttp version, nor the upstream's own (which the proxy drops)."""

    __slots__ = ()

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        response.headers[hdrs.SERVER] = SERVER_HEADER


async def _not_found(_request: web.BaseRequest) -> web.StreamResponse:
    raise web.HTTPNotFound()


async def _plain_expect(request: web.BaseRequest) -> None:
    """aiohttp's own ``Expect`` treatment (for a target no proxy route takes)."""
    if request.version != aiohttp.HttpVersion11:
        return
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0


#: A tracing wrapper around a handler: ``trace(request, handler)`` (an aiohttp middleware).
Trace = Callable[
    [web.BaseRequest, Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]],
    Awaitable[web.StreamResponse],
]


#: What a listener does to every reply before its head is written (``Server``, and
#: ``Connection: close`` while the daemon drains): ``hook(request, response)``.
ReplyHook = Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]


def make_server(
    proxy: Proxy,
    *,
    trace: Trace | None = None,
    reply_hook: ReplyHook | None = None,
    **handler_settings: Any,
) -> web.Server:
    """The listener's aiohttp low-level server: every request goes to ``proxy.handle``.

    No router and no middleware chain, so a refusal costs little more than aiohttp's own
    parsing and writing; what the application used to do is done here in the same order:
    a target without a path (``CONNECT host:port``, ``OPTIONS *``) is a 404; ``Expect`` is
    answered before the handler runs (:meth:`Proxy.expect`); ``trace`` (tracing on) wraps
    the handler; an aiohttp ``HTTPException`` of status >= 400 is answered as the JSON
    error envelope (:func:`~vacancyd.web.errors.json_error_for`); ``reply_hook`` runs on
    every reply before its head is written (default: name vacancyd as ``Server``).
    ``handler_settings`` are aiohttp's per-connection settings (``keepalive_timeout``,
    ``access_log_class``...), as ``web.AppRunner`` takes them.
    """
    loop = asyncio.get_running_loop()
    max_body = proxy.max_body
    handle = proxy.handle

    request_class: type[ProxyRequest] = ProxyRequest
    if reply_hook is not None:
        hook = reply_hook

        class HookedRequest(ProxyRequest):
            __slots__ = ()

            async def _prepare_hook(self, response: web.StreamResponse) -> None:
                await hook(self, response)

        request_class = HookedRequest

    def make_request(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        return request_class(
            message, payload, protocol, writer, task, loop, client_max_size=max_body
        )

    async def serve(request: web.BaseRequest) -> web.StreamResponse:
        # A target the application's one route (every path) would not have matched.
        routable = request.raw_path.startswith("/") or request.rel_url.path_safe.startswith("/")
        if request.headers.get(hdrs.EXPECT):
            early = await (proxy.expect(request) if routable else _plain_expect(request))
            await request.writer.drain()
            if early is not None:
                return early
        handler = handle if routable else _not_found
        try:
            if trace is not None:
                return await trace(request, handler)
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return json_error_for(request, exc)

    return web.Server(serve, request_factory=make_request, **handler_settings)
