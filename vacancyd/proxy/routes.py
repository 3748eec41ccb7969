"""Requests that are not work: the probe, pass-through (and its WebSocket tunnels),
management and unrecognized routes (:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

from aiohttp import web

from vacancyd.core.classify import Classification, RouteClass
from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.proxy import bodies, probe, tunnel
from vacancyd.proxy.base import json_error
from vacancyd.proxy.forward import Forwarding


class Routing(Forwarding):
    """Requests that are not work: the lendability probe, pass-through and borrower results,
    management and unlisted routes."""

    def probe(self, request: web.BaseRequest) -> web.Response:
        """The lendability probe for this upstream (:mod:`vacancyd.proxy.probe`)."""
        if not self.upstream.settings.public_probe:
            denied = self.auth.check(request, probe.SCOPE)
            if denied is not None:
                return denied
        # A pool is lendable when any member is; otherwise the first member's answer stands.
        proxies: list[Routing] = list(self.members.values()) or [self]
        answers = [
            probe.answer(
                request,
                self.admission,
                proxy.upstream.policy,
                canonical_model=proxy.upstream.adapter.canonical_model,
                refusal_status=proxy.upstream.settings.refusal_status,
            )
            for proxy in proxies
        ]
        return next((a for a in answers if a.status == 200), answers[0])

    def _route_refusal(self, request: web.BaseRequest, c: Classification) -> web.Response | None:
        """The answer to a request on a route that is not work, when the route alone decides
        it (so ``Expect: 100-continue`` gets it before the body): a result that is not the
        borrower's (404), a management or unlisted route (403 or 501), a WebSocket upgrade
        on a route the adapter lists no WebSocket for (501). None: forward it."""
        if c.klass is RouteClass.RESULTS and self.controller is not None:
            assert c.route is not None
            if not self.controller.allows_result(c.route, c.path):
                return self._json_error(
                    request,
                    404,
                    f"{c.path} does not name work borrowed through this lender",
                    ErrorType.NOT_FOUND,
                    ErrorCode.UNKNOWN_RESULT,
                )
        if c.klass in (RouteClass.PASSTHROUGH, RouteClass.RESULTS):
            return self._upgrade_refusal(request, c)
        allow_management = self.upstream.settings.management == "allow"
        readish = request.method in ("GET", "HEAD")
        if c.klass is RouteClass.MANAGEMENT or (c.klass is RouteClass.UNRECOGNIZED and readish):
            if allow_management:
                return self._upgrade_refusal(request, c)
            reads = self.upstream.adapter.table.borrower_reads()
            return self._json_error(
                request,
                403,
                f"{request.method} {c.path} is not a borrower route on this lender "
                f"({'a management route' if c.klass is RouteClass.MANAGEMENT else c.why}); "
                f"borrower reads: {', '.join(reads)}",
                ErrorType.PERMISSION,
                ErrorCode.MANAGEMENT_DENIED,
                borrower_reads=reads,
            )
        return self._json_error(
            request,
            501,
            f"{request.method} {c.path} is not a route vacancyd's {self.upstream.adapter.name!r} "
            f"adapter recognizes ({c.why}); if the server really has it, report it to the "
            "vacancyd project so the adapter can classify it",
            ErrorType.NOT_IMPLEMENTED,
            ErrorCode.UNRECOGNIZED_ROUTE,
        )

    def _upgrade_refusal(self, request: web.BaseRequest, c: Classification) -> web.Response | None:
        """501 for a WebSocket upgrade on a route whose server offers none (the adapter's
        route says ``websocket``): a tunnel there would be borrowed work that no gate
        admits, no reclaim cuts and lending off does not stop. None otherwise."""
        if not tunnel.is_upgrade(request) or (c.route is not None and c.route.websocket):
            return None
        return json_error(
            501,
            f"{request.method} {c.path} is not a WebSocket route of vacancyd's "
            f"{self.upstream.adapter.name!r} adapter; WebSocket upgrades are tunneled only "
            "on the progress channels the adapter lists (ComfyUI /ws)",
            ErrorType.NOT_IMPLEMENTED,
            ErrorCode.WEBSOCKET_NOT_OFFERED,
        )

    async def _pass(
        self, request: web.BaseRequest, c: Classification, query: str
    ) -> web.StreamResponse:
        """Forward a non-work request; a WebSocket upgrade on it is tunneled (the caller
        has refused upgrades on routes without a WebSocket: :meth:`_route_refusal`)."""
        if tunnel.is_upgrade(request):
            up = self.upstream
            return await self.tunnels.serve(
                request,
                self.session,
                self._url(c, query),
                self._request_headers(request),
                up.name,
            )
        limit = self.max_passthrough_body
        if c.klass not in (RouteClass.PASSTHROUGH, RouteClass.RESULTS):
            limit = self.max_body  # a management route the owner opened
        try:
            bodies.check_forwarded_body(request, limit)
            body, reservation = await bodies.read_body(
                request,
                max_bytes=limit,
                budget=self.budget,
                read_timeout_s=self.limits.body_read_timeout_s,
                idle_timeout_s=self.limits.body_idle_timeout_s,
            )
        except bodies.BodyError as exc:
            response = self._json_error(
                request, exc.status, str(exc), ErrorType.INVALID_REQUEST, exc.code
            )
            response.force_close()  # never leave an unread body on a kept-alive connection
            return response
        try:
            return await self._forward(
                request, c, query, body=body if request.body_exists else None
            )
        finally:
            reservation.release()
