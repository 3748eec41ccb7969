"""The per-upstream gated proxy (spec "Proxy"; product map P1, P3–P9, P11, P12).

Order for every request: authenticate (borrow scope) -> classify -> by class:

* work: early 413 on Content-Length -> gate steps 1–5 -> buffer body within limits ->
  read the model name -> gate step 6 (one fresh observation and a second decision when the
  refusal says a fresher sample could change it) -> ledger reservation -> forward, streaming
  the response -> release the reservation when the response ends, the client goes away or
  the upstream fails.
* pass-through and borrower results: forwarded unconditionally.
* management and unlisted GET/HEAD: 403 ``management_denied`` unless ``management = "allow"``.
* any other unlisted method: 501, always.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from vacancyd.adapters.base import Adapter, BadRequest
from vacancyd.api.auth import Authenticator
from vacancyd.api.metrics import Metrics
from vacancyd.config.model import LimitsSettings, UpstreamSettings
from vacancyd.core import gate
from vacancyd.core.classify import Classification, RouteClass, classify
from vacancyd.core.ledger import Job
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Admit, Reason, Refuse
from vacancyd.core.refusal import error_body, render_refusal
from vacancyd.core.snapshot import RequestFacts
from vacancyd.proxy import bodies, headers
from vacancyd.state import SharedState

log = logging.getLogger(__name__)
MIB = 1024 * 1024
#: How long a refusal that a fresh observation could change waits for one (seconds).
REFRESH_WAIT_S = 2.0
#: aiohttp warns about (and may stall the loop on) raw bytes bodies past 1 MiB.
LARGE_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Upstream:
    """Everything the proxy needs about one ``[[upstream]]``."""

    settings: UpstreamSettings
    policy: UpstreamPolicy
    adapter: Adapter
    target: URL
    credential: str | None

    @property
    def name(self) -> str:
        return self.settings.name


def json_error(status: int, message: str, type_: str, code: str, **extra: Any) -> web.Response:
    return web.json_response(error_body(message, type_, code, **extra), status=status)


class Proxy:
    """Handles every request on one upstream's listener."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        state: SharedState,
        auth: Authenticator,
        metrics: Metrics,
        limits: LimitsSettings,
        session: aiohttp.ClientSession,
    ) -> None:
        self.upstream = upstream
        self.state = state
        self.auth = auth
        self.metrics = metrics
        self.limits = limits
        self.session = session
        self.budget = bodies.BodyBudget(limits.buffered_budget_mib * MIB)
        self.max_body = limits.max_request_body_mib * MIB

    # -- entry point ---------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        klass = "unauthenticated"
        response: web.StreamResponse | None = None
        try:
            denied = self.auth.check(request, "borrow")
            if denied is not None:
                response = denied
                return denied
            path, _, query = request.raw_path.partition("?")
            c = classify(request.method, path, query, self.upstream.adapter.table)
            klass = c.klass.value
            response = await self._dispatch(request, c, query)
            return response
        finally:
            code = str(response.status) if response is not None else "disconnected"
            self.metrics.proxied.labels(self.upstream.name, klass, code).inc()

    async def _dispatch(
        self, request: web.Request, c: Classification, query: str
    ) -> web.StreamResponse:
        allow_management = self.upstream.settings.management == "allow"
        if c.klass is RouteClass.WORK:
            return await self._work(request, c, query)
        if c.klass in (RouteClass.PASSTHROUGH, RouteClass.RESULTS):
            return await self._forward(request, c, query)
        readish = request.method in ("GET", "HEAD")
        if c.klass is RouteClass.MANAGEMENT or (c.klass is RouteClass.UNRECOGNIZED and readish):
            if allow_management:
                return await self._forward(request, c, query)
            reads = self.upstream.adapter.table.borrower_reads()
            return json_error(
                403,
                f"{request.method} {c.path} is not a borrower route on this lender "
                f"({'a management route' if c.klass is RouteClass.MANAGEMENT else c.why}); "
                f"borrower reads: {', '.join(reads)}",
                "permission_error",
                "management_denied",
                borrower_reads=reads,
            )
        return json_error(
            501,
            f"{request.method} {c.path} is not a route vacancyd's {self.upstream.adapter.name!r} "
            f"adapter recognizes ({c.why}); if the server really has it, report it to the "
            "vacancyd project so the adapter can classify it",
            "not_implemented",
            "unrecognized_route",
        )

    # -- work ----------------------------------------------------------------------------

    async def _refuse(self, request: web.Request, refusal: Refuse) -> web.StreamResponse:
        status, hdrs, body = render_refusal(
            refusal, self.upstream.name, self.upstream.settings.refusal_status
        )
        self.metrics.decision(self.upstream.name, "refused", refusal.reason.value)
        log.debug(
            "refused %s %s on %s: %s (%s)",
            request.method,
            request.path,
            self.upstream.name,
            refusal.reason,
            refusal.detail,
        )
        return await self._answer_and_drain(
            request, web.json_response(body, status=status, headers=hdrs)
        )

    async def _answer_and_drain(
        self, request: web.Request, response: web.StreamResponse
    ) -> web.StreamResponse:
        """Send ``response`` now, then drop what is left of the body (up to 2× the limit)."""
        if request.body_exists and not request.content.is_eof():
            await response.prepare(request)
            await response.write_eof()
            await bodies.drain(request, 2 * self.max_body, self.limits.body_read_timeout_s)
        return response

    async def _work(
        self, request: web.Request, c: Classification, query: str
    ) -> web.StreamResponse:
        assert c.route is not None
        name = self.upstream.name
        try:
            bodies.check_declared_length(request, self.max_body)
        except bodies.BodyError as exc:
            return await self._answer_and_drain(
                request, json_error(exc.status, str(exc), "invalid_request_error", exc.code)
            )
        early = gate.decide_before_body(self.state.snapshot(), self.upstream.policy)
        if early is not None and early.extra.get("refresh") is None:
            return await self._refuse(request, early)

        try:
            body, reservation = await bodies.read_body(
                request,
                max_bytes=self.max_body,
                budget=self.budget,
                read_timeout_s=self.limits.body_read_timeout_s,
                idle_timeout_s=self.limits.body_idle_timeout_s,
            )
        except bodies.BodyError as exc:
            if exc.status == 503:
                return await self._refuse(
                    request, Refuse.of(Reason.BODY_BUDGET_EXHAUSTED, str(exc))
                )
            response = json_error(exc.status, str(exc), "invalid_request_error", exc.code)
            if exc.status == 408:
                response.force_close()
                return response
            return await self._answer_and_drain(request, response)

        try:
            try:
                facts = self.upstream.adapter.read_facts(
                    c.route, body, request.content_type if request.body_exists else ""
                )
            except BadRequest as exc:
                return json_error(400, str(exc), "invalid_request_error", exc.code)
            decision = await self._decide(facts)
            if isinstance(decision, Refuse):
                return await self._refuse(request, decision)
            job = decision
            self.metrics.decision(name, "admitted")
            log.debug("admitted %s %s on %s as job %d", request.method, c.path, name, job.id)
            try:
                return await self._forward(
                    request, c, query, body=body, on_sent=reservation.release
                )
            finally:
                self.state.released(job.id, asyncio.get_running_loop().time())
        finally:
            reservation.release()

    async def _decide(self, facts: RequestFacts) -> Job | Refuse:
        """Gate then ledger, with at most one fresh observation in between (product map A8)."""
        for attempt in (1, 2):
            snap = self.state.snapshot()
            decision = gate.decide(facts, snap, self.upstream.policy)
            if isinstance(decision, Admit):
                return self._reserve(decision, snap.now, facts)
            refresh = decision.extra.get("refresh")
            if attempt == 2 or refresh is None:
                return decision
            key = f"server:{self.upstream.name}" if refresh == "server" else decision.resource
            if key is None or not await self.state.fresh_sample(key, REFRESH_WAIT_S):
                return decision
        raise AssertionError("unreachable")

    def _reserve(self, admit: Admit, now: float, facts: RequestFacts) -> Job | Refuse:
        if admit.credit is not None and admit.credit.applied:
            log.info(
                "residency credit on %s for model %r: %s",
                self.upstream.name,
                facts.model,
                admit.credit.why,
            )
        return self.state.ledger.reserve(self.upstream.name, admit.resources, now, facts.model)

    # -- forwarding ----------------------------------------------------------------------

    def _url(self, c: Classification, query: str) -> URL:
        target = self.upstream.target
        return URL.build(
            scheme=target.scheme,
            authority=target.raw_authority,
            path=c.path,
            query_string=query,
            encoded=True,
        )

    async def _forward(
        self,
        request: web.Request,
        c: Classification,
        query: str,
        *,
        body: bytes | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        up = self.upstream
        out_headers = headers.request_headers(
            request.headers,
            target=up.target,
            forward_authorization=up.settings.forward_authorization,
            credential=up.credential,
        )
        data: Any = body
        if body is not None and len(body) > LARGE_BODY_BYTES:
            data = io.BytesIO(body)  # aiohttp sends large in-memory bodies in chunks this way
        if body is None and request.body_exists:
            data = request.content
        try:
            upstream_resp = await self.session.request(
                request.method,
                self._url(c, query),
                headers=out_headers,
                data=data,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.metrics.upstream_errors.labels(up.name, "connect").inc()
            log.warning(
                "upstream %s unreachable for %s %s: %s", up.name, request.method, c.path, exc
            )
            return json_error(
                502,
                f"the upstream server of {up.name!r} could not be reached: "
                f"{exc.__class__.__name__}",
                "upstream_error",
                "upstream_unreachable",
                upstream=up.name,
            )
        try:
            if on_sent is not None:
                on_sent()
            response = web.StreamResponse(
                status=upstream_resp.status,
                reason=upstream_resp.reason,
                headers=headers.response_headers(upstream_resp.headers, target=up.target),
            )
            await response.prepare(request)
            stalled = self.limits.write_stall_timeout_s
            try:
                async for chunk in upstream_resp.content.iter_any():
                    async with asyncio.timeout(stalled):
                        await response.write(chunk)
            except TimeoutError:
                log.warning(
                    "%s: borrower stopped reading for %g s; disconnecting", up.name, stalled
                )
                self._cut(request)
                return response
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                if request.transport is None or request.transport.is_closing():
                    return response  # the borrower went away; nothing left to tell it
                self.metrics.upstream_errors.labels(up.name, "stream").inc()
                log.warning("%s: upstream broke mid-response: %s", up.name, exc)
                self._cut(request)
                return response
            await response.write_eof()
            return response
        finally:
            # A fully read response returns its connection to the pool; anything else
            # (cancelled by a client disconnect, cut, stalled) closes it, which is what
            # tells the upstream to stop.
            if upstream_resp.content.at_eof():
                upstream_resp.release()
            else:
                upstream_resp.close()

    @staticmethod
    def _cut(request: web.Request) -> None:
        """Abort the borrower's connection so a cut stream never looks like a clean end."""
        transport = request.transport
        if transport is not None:
            transport.abort()


def make_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=proxy.max_body)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app
