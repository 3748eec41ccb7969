"""The listener's entry point: authenticate, classify and hand a request to its path
(:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

import aiohttp
from aiohttp import hdrs, web

from vacancyd.core.classify import Classification, RouteClass
from vacancyd.core.reasons import ErrorType
from vacancyd.proxy import bodies, observe, probe
from vacancyd.proxy.base import origin_form
from vacancyd.proxy.jobs import Working
from vacancyd.proxy.routes import Routing


class Proxy(Working, Routing):
    """Handles every request on one upstream's listener."""

    # -- entry point ---------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The listener's only route: every request, whatever its path."""
        path, _, query = origin_form(request.raw_path).partition("?")
        if path == probe.PATH:
            return self.probe(request)  # not a proxied request: no upstream, no counters
        klass = "unauthenticated"
        response: web.StreamResponse | None = None
        try:
            denied = self.auth.check(request, "borrow")
            if denied is not None:
                response = denied
                return denied
            c = self.classify(request.method, path, query)
            klass = c.klass.value
            request[observe.ROUTE_CLASS] = klass
            why = self.admission.forbidden(self.auth.borrower(request), self.upstream.name)
            if why is not None:  # a named borrower off its upstreams: never forwarded
                response = await self._answer_and_drain(request, self._not_allowed(request, why))
                return response
            response = await self._dispatch(request, c, query)
            return response
        finally:
            code = str(response.status) if response is not None else "disconnected"
            self.metrics.request(self.upstream.name, klass, code)

    async def _dispatch(
        self, request: web.BaseRequest, c: Classification, query: str
    ) -> web.StreamResponse:
        if c.klass is RouteClass.WORK:
            return await self._work(request, c, query)
        refusal = self._route_refusal(request, c)
        if refusal is not None:
            return refusal
        return await self._pass(request, c, query)

    async def expect(self, request: web.BaseRequest) -> web.StreamResponse | None:
        """``Expect: 100-continue`` (RFC 9110 §10.1.1): a work request that would be refused
        whatever its body says is answered now, before the borrower uploads the body.

        Anything else gets aiohttp's usual treatment: ignored before HTTP/1.1, 417 for an
        unknown expectation (raises ``HTTPExpectationFailed``). A returned response replaces
        the handler.
        """
        if request.version != aiohttp.HttpVersion11:
            return None
        expect = request.headers.get(hdrs.EXPECT, "")
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        answer = self._answer_before_body(request)
        if answer is not None:
            return answer
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None

    def _answer_before_body(self, request: web.BaseRequest) -> web.StreamResponse | None:
        if self.auth.check(request, "borrow", record=False) is not None:
            return self.auth.check(request, "borrow")
        path, _, query = origin_form(request.raw_path).partition("?")
        c = self.classify(request.method, path, query)
        answer: web.StreamResponse | None = None
        why = self.admission.forbidden(self.auth.borrower(request), self.upstream.name)
        if why is not None:
            answer = self._not_allowed(request, why)
            self.metrics.request(self.upstream.name, c.klass.value, str(answer.status))
            return answer
        if c.klass is not RouteClass.WORK:
            answer = self._route_refusal(request, c)
            if answer is not None:
                self.metrics.request(self.upstream.name, c.klass.value, str(answer.status))
            return answer
        try:
            bodies.check_declared_length(request, self.max_body)
        except bodies.BodyError as exc:
            answer = self._json_error(
                request, exc.status, str(exc), ErrorType.INVALID_REQUEST, exc.code
            )
        else:
            refusal = self._early_refusal()
            if refusal is not None:
                answer = self._refusal_response(request, refusal)
        if answer is not None:
            self.metrics.request(self.upstream.name, c.klass.value, str(answer.status))
        return answer
