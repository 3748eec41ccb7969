"""The per-upstream gated proxy (docs/architecture.md).

Order for every request: authenticate (borrow scope) -> classify -> by class:

* work: early 413 on Content-Length -> gate steps 1–5 -> buffer body within limits ->
  read the model name -> ask :class:`~vacancyd.control.work.Work` for admission (gate step
  6, a fresh observation if one could change the answer, the ledger reservation) -> forward,
  streaming the response -> tell ``Work`` how the exchange ended. Everything after that
  (release, tracking work the server still runs, holding a cut job) is ``Work``'s.
* reclaim (docs/reclaim.md): while a reclaim is open on the upstream, work is refused
  before the body is read; a reclaim may cut an admitted job — before response headers the
  borrower gets 503 with the edge's reason, after them the connection is aborted so the
  stream never ends cleanly. The forwarding runs on its own task so a cut closes the
  upstream connection at once, even while the borrower is stalled.
* pass-through and borrower results: forwarded unconditionally; a WebSocket upgrade is
  tunneled only on a route the adapter lists as a WebSocket (ComfyUI's ``/ws`` progress
  channel; :mod:`vacancyd.proxy.tunnel`) and refused (501) on every other route.
* management and unlisted GET/HEAD: 403 ``management_denied`` unless ``management = "allow"``.
* any other unlisted method: 501, always.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from yarl import URL

from vacancyd.adapters.base import Adapter, BadRequest, Controller, UpstreamError, Waker
from vacancyd.adapters.bodyparse import SMALL_JSON_BYTES, run_cooperatively
from vacancyd.adapters.bodyparse import run as run_steps
from vacancyd.config.model import LimitsSettings, UpstreamSettings
from vacancyd.control.work import Work
from vacancyd.core import gate
from vacancyd.core.classify import Classification, Classifier, RouteClass
from vacancyd.core.lifecycle import Ending, JobState
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import ErrorCode, ErrorType, Reason, Refuse
from vacancyd.core.reclaim import Edge
from vacancyd.core.refusal import RenderedRefusal, error_body, render_refusal_bytes
from vacancyd.core.snapshot import RequestFacts, Snapshot
from vacancyd.proxy import bodies, client, headers, observe, probe, reply, tunnel
from vacancyd.state import SharedState
from vacancyd.web.auth import Authenticator
from vacancyd.web.errors import json_error_for
from vacancyd.web.metrics import Metrics
from vacancyd.web.site import SERVER_HEADER, reset_connection

log = logging.getLogger(__name__)
MIB = 1024 * 1024
#: Upstream URLs remembered per listener (oldest forgotten first).
URL_CACHE_SIZE = 256
#: Statuses whose responses carry no body (RFC 9110 §6.4.1): always streamed as they are.
NO_BODY_STATUSES = frozenset({204, 304})
#: Serialized refusal replies kept per listener (all forgotten at once when full).
TEMPLATE_CACHE_SIZE = 512


@dataclass(frozen=True)
class Upstream:
    """Everything the proxy needs about one ``[[upstream]]``."""

    settings: UpstreamSettings
    policy: UpstreamPolicy
    adapter: Adapter
    target: URL
    credential: str | None

    #: A pool's listener borrows its first member's settings under the pool's own name.
    alias: str | None = None

    @property
    def name(self) -> str:
        return self.alias or self.settings.name


def origin_form(raw_target: str) -> str:
    """The request target as path and query (RFC 9112 §3.2): an absolute-form target
    (``http://host/v1/models``, which servers must accept) loses its scheme and authority;
    the path stays exactly as sent, so classification sees what the borrower wrote."""
    scheme, sep, rest = raw_target.partition("://")
    if not sep or "/" in scheme or scheme.lower() not in ("http", "https"):
        return raw_target
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    return tail if tail.startswith("/") else "/" + tail


class _Exchange:
    """The proxy's own view of one job's exchange: the response the borrower already has,
    whether :class:`Work` has been told it ended, and whether a reclaim's cut is what
    cancelled the handler.

    Written only by the forwarding code; the job's life is in :class:`Work`.
    """

    __slots__ = ("cutting", "ended", "failed", "job", "response")

    def __init__(self, job: JobState) -> None:
        self.job = job
        self.response: web.StreamResponse | None = None
        self.ended = False
        self.cutting = False
        #: How the exchange ended when the handler still returns a response although it did
        #: not end well: the upstream failed, or the borrower stopped reading and was cut off.
        self.failed: Ending | None = None


def json_error(
    status: int, message: str, type_: ErrorType, code: ErrorCode | Reason, **extra: Any
) -> web.Response:
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
        work: Work,
        controller: Controller | None = None,
        tunnels: tunnel.TunnelLimits | None = None,
        members: Mapping[str, Proxy] | None = None,
        upstream_client: client.UpstreamClient | None = None,
    ) -> None:
        self.upstream = upstream
        #: A pool's member proxies, first member first (``[[pool]]``); empty otherwise.
        self.members: Mapping[str, Proxy] = members or {}
        self.work = work
        self.controller = controller
        self.tunnels = tunnel.Tunnels(tunnels or tunnel.TunnelLimits())
        self.state = state
        self.auth = auth
        self.metrics = metrics
        self.limits = limits
        self.session = session  # WebSocket tunnels
        #: Forwarded requests go through this pooled client (vacancyd.proxy.client).
        self.client = upstream_client or client.UpstreamClient(
            upstream.target.raw_host or "127.0.0.1",
            upstream.target.port or 80,
            connect_timeout_s=limits.upstream_connect_timeout_s,
        )
        self.budget = bodies.BodyBudget(limits.buffered_budget_mib * MIB)
        self.max_body = limits.max_request_body_mib * MIB
        self.max_passthrough_body = limits.max_passthrough_body_kib * 1024
        settings = upstream.settings
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in settings.allowed_origins)
        self.pass_response = frozenset(h.lower() for h in settings.pass_response_headers)
        self.classify = Classifier(upstream.adapter.table)
        #: The silence limit (seconds, None: none): no byte from the upstream for that long,
        #: counted from the end of the request body and paused while the borrower is not
        #: reading, gives a borrowed job up (held) and ends a pass-through request with 504
        #: (vacancyd.proxy.client).
        self.silence_s = settings.silence_limit
        self._urls: dict[tuple[str, str], URL] = {}
        #: The controller when it wakes a sleeping server before work (decided once: a
        #: runtime-checkable Protocol's isinstance costs more than the rest of the check).
        self._waker: Waker | None = controller if isinstance(controller, Waker) else None
        self._templates: dict[int, tuple[RenderedRefusal, reply.Template]] = {}
        self._last_refusal: tuple[Refuse, bool, reply.Template, str] | None = None

    def _flat(self, request: web.BaseRequest) -> bool:
        """Whether vacancyd's errors on this request take the server's flat native shape."""
        prefixes = self.upstream.adapter.flat_error_prefixes
        return bool(prefixes) and request.path.startswith(prefixes)

    def _json_error(
        self,
        request: web.BaseRequest,
        status: int,
        message: str,
        type_: ErrorType,
        code: ErrorCode | Reason,
        **extra: Any,
    ) -> web.Response:
        """:func:`json_error` in the shape the request's route speaks (:meth:`_flat`)."""
        body = error_body(message, type_, code, flat=self._flat(request), **extra)
        return web.json_response(body, status=status)

    # -- entry point ---------------------------------------------------------------------

    def probe(self, request: web.BaseRequest) -> web.Response:
        """The lendability probe for this upstream (:mod:`vacancyd.proxy.probe`)."""
        if not self.upstream.settings.public_probe:
            denied = self.auth.check(request, probe.SCOPE)
            if denied is not None:
                return denied
        # A pool is lendable when any member is; otherwise the first member's answer stands.
        answers = [
            probe.answer(
                request,
                self.work,
                proxy.upstream.policy,
                canonical_model=proxy.upstream.adapter.canonical_model,
                refusal_status=proxy.upstream.settings.refusal_status,
            )
            for proxy in (list(self.members.values()) or [self])
        ]
        return next((a for a in answers if a.status == 200), answers[0])

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

    # -- work ----------------------------------------------------------------------------

    def _refusal_response(self, request: web.BaseRequest, refusal: Refuse) -> web.StreamResponse:
        name = self.upstream.name
        flat = self._flat(request)
        last = self._last_refusal
        if last is not None and last[0] is refusal and last[1] is flat:
            template, reason = last[2], last[3]  # a switch's refusal: one shared value
        else:
            template = self._template(refusal, flat)
            reason = refusal.reason.value
            self._last_refusal = (refusal, flat, template, reason)
        request[observe.REFUSAL] = refusal
        self.metrics.decision(name, "refused", reason)
        if refusal.credit is not None:
            self.metrics.residency(name, refusal.credit)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "refused %s %s on %s: %s (%s)",
                request.method,
                request.path,
                name,
                refusal.reason,
                refusal.detail,
            )
        return template.reply(request)

    def _template(self, refusal: Refuse, flat: bool) -> reply.Template:
        """The serialized reply for ``refusal`` (in the flat shape when ``flat``), kept per
        distinct rendering (a flood of the same refusal is one dictionary lookup after the
        first)."""
        settings = self.upstream.settings
        rendered = render_refusal_bytes(
            refusal, self.upstream.name, settings.refusal_status, settings.retry_after_max_s, flat
        )
        kept = self._templates.get(id(rendered))
        if kept is not None and kept[0] is rendered:
            return kept[1]
        template = reply.Template(rendered.status, rendered.headers, rendered.body)
        if len(self._templates) >= TEMPLATE_CACHE_SIZE:
            self._templates.clear()
        self._templates[id(rendered)] = (rendered, template)
        return template

    async def _refuse(self, request: web.BaseRequest, refusal: Refuse) -> web.StreamResponse:
        return await self._answer_and_drain(request, self._refusal_response(request, refusal))

    async def _answer_and_drain(
        self, request: web.BaseRequest, response: web.StreamResponse
    ) -> web.StreamResponse:
        """Send ``response`` now, then drop what is left of the body (up to 2× the limit)."""
        if request.body_exists and not request.content.is_eof():
            await response.prepare(request)
            await response.write_eof()
            await bodies.drain(request, 2 * self.max_body, self.limits.body_read_timeout_s)
        return response

    async def _work(
        self, request: web.BaseRequest, c: Classification, query: str
    ) -> web.StreamResponse:
        assert c.route is not None
        name = self.upstream.name
        if tunnel.is_upgrade(request):
            return self._json_error(
                request,
                501,
                f"{c.path} is a work route; vacancyd does not tunnel WebSocket work",
                ErrorType.NOT_IMPLEMENTED,
                ErrorCode.WEBSOCKET_WORK_UNSUPPORTED,
            )
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/").lower() not in self.allowed_origins:
            response = self._json_error(
                request,
                403,
                f"borrowed work from the web page {origin!r} is not allowed on {name!r} "
                "(the upstream's allowed_origins)",
                ErrorType.PERMISSION,
                ErrorCode.ORIGIN_NOT_ALLOWED,
            )
            response.force_close()
            return response
        try:
            bodies.check_declared_length(request, self.max_body)
        except bodies.BodyError as exc:
            return await self._answer_and_drain(
                request,
                self._json_error(
                    request, exc.status, str(exc), ErrorType.INVALID_REQUEST, exc.code
                ),
            )
        early = self._early_refusal()
        if early is not None:
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
            response = self._json_error(
                request, exc.status, str(exc), ErrorType.INVALID_REQUEST, exc.code
            )
            if exc.status == 408:
                response.force_close()
                return response
            return await self._answer_and_drain(request, response)

        try:
            try:
                facts = await self._read_facts(c, body, request.headers.get("Content-Type", ""))
            except BadRequest as exc:
                return self._json_error(request, 400, str(exc), ErrorType.INVALID_REQUEST, exc.code)
            runs = self
            if self.members:
                chosen = self.work.choose(list(self.members), facts)
                if isinstance(chosen, Refuse):
                    return await self._refuse(request, chosen)
                runs = self.members[chosen]
                name = chosen
            decision = await self.work.admit(name, facts)
            if isinstance(decision, Refuse):
                return await self._refuse(request, decision)
            job = decision
            request[observe.JOB] = job
            self.metrics.decision(name, "admitted")
            log.debug("admitted %s %s on %s as job %d", request.method, c.path, name, job.id)
            cap = runs.upstream.adapter.cap_keep_alive
            if cap is not None:
                steps = cap(c.route, body, runs.upstream.settings.keep_alive_max_s)
                if len(body) <= SMALL_JSON_BYTES:
                    body = run_steps(steps)
                else:
                    body = await run_cooperatively(steps)
            key: str | None = None
            if runs.controller is not None:
                body, key = runs.controller.prepare(c.route, body)
            return await runs._run_job(request, c, query, job, body, key, reservation.release)
        finally:
            reservation.release()

    async def _read_facts(self, c: Classification, body: bytes, ctype: str) -> RequestFacts:
        """The body's facts; a large body is read in slices that hand the loop back, so a
        borrower's body never holds the loop the owner's reclaim runs on."""
        assert c.route is not None
        adapter = self.upstream.adapter
        if len(body) <= SMALL_JSON_BYTES:
            return adapter.read_facts(c.route, body, ctype)
        if len(body) <= bodies.JOIN_ON_LOOP_BYTES:
            return await run_cooperatively(adapter.read_facts_steps(c.route, body, ctype))
        async with self.budget.copying:  # the parser may copy a long value whole: one at a time
            return await run_cooperatively(adapter.read_facts_steps(c.route, body, ctype))

    def _reclaim_refusal(self) -> Refuse | None:
        return self.work.refusal(self.upstream.name)

    def _early_refusal(self) -> Refuse | None:
        """Gate steps 1–5 and the reclaim check, before the body is read: a refusal no fresh
        sample can change. A pool refuses only when every member does (the one that frees up
        first answers).

        The switches, the owner's holds and presence come first and need no snapshot, so a
        refusal for any of them (lending off, the owner present or pausing) builds none; a
        snapshot is built, once, only when they let a member through to the later steps,
        which then start again from step 1 on it (the same answer for the steps already
        asked).
        """
        state = self.state
        switched_off = gate.decide_switches(state.stopping, state.lending_enabled)
        if switched_off is not None:
            return switched_off  # the same for every member, and no snapshot needed
        proxies = list(self.members.values()) or [self]
        refusals: list[Refuse] = []
        now = state.clock()
        presence = state.presence_view(now)
        snap: Snapshot | None = None
        for proxy in proxies:
            policy = proxy.upstream.policy
            refusal = gate.decide_owner_steps(state.holds, presence, now, policy)
            if refusal is None:
                if snap is None:
                    snap = state.snapshot()
                refusal = gate.decide_before_body(snap, policy)
                if refusal is not None and refusal.extra.get("refresh") is not None:
                    refusal = None  # a fresh sample may still admit it: let the body come
                refusal = refusal or proxy._reclaim_refusal()
                if refusal is None:
                    return None
            refusals.append(refusal)
        if len(refusals) == 1:
            return refusals[0]
        return min(refusals, key=lambda r: r.retry_after_s)

    async def _run_job(
        self,
        request: web.BaseRequest,
        c: Classification,
        query: str,
        job: JobState,
        body: bytes,
        key: str | None,
        on_sent: Callable[[], None],
    ) -> web.StreamResponse:
        """Forward an admitted job; tells :class:`Work` how the exchange ended.

        A reclaim's cut cancels the handler's own task (no task per request), which closes
        the upstream connection at once even while the borrower is stalled; that one
        cancellation is then taken back and the borrower told (503, or an aborted stream).
        """
        exchange = _Exchange(job)
        task = asyncio.current_task()
        assert task is not None

        def cut() -> bool:
            if exchange.ended or exchange.cutting:
                return False
            exchange.cutting = True
            task.cancel()
            return True

        self.work.forwarding(job.id, key, cut)
        ending = Ending.ABORTED
        try:
            try:
                response = await self._forward(
                    request, c, query, body=body, on_sent=on_sent, exchange=exchange, tracked=key
                )
            except asyncio.CancelledError:
                edge = self.work.cut_by(job.id)
                if edge is None or not exchange.cutting:
                    raise
                task.uncancel()  # the cut's own cancellation, delivered: the request goes on
                ending = Ending.CUT
                return self._after_cut(request, exchange, edge)
            ending = exchange.failed or Ending.COMPLETED
            return response
        finally:
            self._end_exchange(exchange, ending)

    def _end_exchange(self, exchange: _Exchange, ending: Ending) -> None:
        """Tell :class:`Work` once that ``exchange`` ended (releasing or tracking its job)."""
        if not exchange.ended:
            exchange.ended = True
            self.work.exchange_ended(exchange.job.id, ending)

    def _after_cut(
        self, request: web.BaseRequest, exchange: _Exchange, edge: Edge
    ) -> web.StreamResponse:
        """503 with the edge's reason before headers; an aborted stream after them."""
        name = self.upstream.name
        job_id = exchange.job.id
        if exchange.response is not None:
            log.info("%s: job %d cut mid-stream by a %s reclaim", name, job_id, edge.trigger)
            self._cut(request)
            return exchange.response
        log.info(
            "%s: job %d cancelled before its reply by a %s reclaim", name, job_id, edge.trigger
        )
        refusal = Refuse.of(
            edge.reason, f"the lender reclaimed {name!r} ({edge.trigger}) before the reply"
        )
        settings = self.upstream.settings
        rendered = render_refusal_bytes(
            refusal, name, settings.refusal_status, settings.retry_after_max_s, self._flat(request)
        )
        request[observe.REFUSAL] = refusal
        self.metrics.decision(name, "cancelled", refusal.reason.value)
        return web.Response(status=rendered.status, headers=rendered.headers, body=rendered.body)

    # -- forwarding ----------------------------------------------------------------------

    def _request_headers(self, request: web.BaseRequest) -> Any:
        up = self.upstream
        return headers.request_headers(
            request.headers,
            target=up.target,
            forward_authorization=up.settings.forward_authorization,
            credential=up.credential,
            peer=request.remote,
            forwarded=up.settings.forwarded_headers,
            scheme="https" if request.secure else "http",
        )

    def _url(self, c: Classification, query: str) -> URL:
        """The upstream URL for a request (remembered for recent path/query pairs)."""
        key = (c.path, query)
        url = self._urls.get(key)
        if url is None:
            target = self.upstream.target
            url = URL.build(
                scheme=target.scheme,
                authority=target.raw_authority,
                path=c.path,
                query_string=query,
                encoded=True,
            )
            if len(self._urls) >= URL_CACHE_SIZE:
                del self._urls[next(iter(self._urls))]
            self._urls[key] = url
        return url

    async def _wake(self, request: web.BaseRequest, waker: Waker) -> web.Response | None:
        """Wake a server a reclaim put to sleep before forwarding borrowed work to it; a 502
        when it cannot be woken."""
        name = self.upstream.name
        try:
            took = await waker.ensure_awake()
        except (UpstreamError, TimeoutError) as exc:
            why = str(exc) or "timed out"
            self.metrics.wake_seconds.labels(name, "failed").observe(0)
            log.warning("upstream %s could not be woken: %s", name, why)
            return self._json_error(
                request,
                502,
                f"the upstream server of {name!r} is asleep and could not be woken ({why})",
                ErrorType.UPSTREAM,
                ErrorCode.UPSTREAM_UNREACHABLE,
                upstream=name,
            )
        if took is not None:
            self.metrics.wake_seconds.labels(name, "woken").observe(took)
            log.info("upstream %s woken in %.2f s for a borrowed request", name, took)
        return None

    async def _forward(
        self,
        request: web.BaseRequest,
        c: Classification,
        query: str,
        *,
        body: bytes | None = None,
        on_sent: Callable[[], None] | None = None,
        exchange: _Exchange | None = None,
        tracked: str | None = None,
    ) -> web.StreamResponse:
        up = self.upstream
        if exchange is not None and self._waker is not None:
            failed = await self._wake(request, self._waker)
            if failed is not None:
                exchange.failed = Ending.UPSTREAM_FAILED
                return failed
        out_headers = self._request_headers(request)
        observe.inject_trace_context(out_headers)
        try:
            upstream_resp = await self.client.request(
                request.method,
                _target(c, query),
                out_headers.items(),
                body,
                silence_s=self.silence_s,
            )
        except client.UpstreamSilent:
            if exchange is None:
                return self._silent_passthrough(request, c, None)
            return self._silent(request, exchange, c)
        except (client.ForwardError, ValueError) as exc:
            # Connecting failed (refused, timed out) or the server answered with something
            # that is not a valid HTTP response (garbage, oversized headers, a hang-up).
            unreachable = isinstance(exc, client.ConnectFailed)
            stage = "connect" if unreachable else "response"
            self.metrics.upstream_error(up.name, stage)
            if unreachable:  # the lendability probe answers upstream_unreachable from now
                self.state.record_reach(
                    up.name, False, self.state.clock(), f"a borrowed request: {exc}"
                )
            log.warning(
                "upstream %s %s for %s %s: %s",
                up.name,
                "unreachable" if unreachable else "sent no valid response",
                request.method,
                c.path,
                exc,
            )
            what = "could not be reached" if unreachable else "did not send a valid HTTP response"
            if exchange is not None:
                exchange.failed = Ending.UPSTREAM_FAILED
            return self._json_error(
                request,
                502,
                f"the upstream server of {up.name!r} {what} ({exc.__class__.__name__}: {exc})",
                ErrorType.UPSTREAM,
                ErrorCode.UPSTREAM_UNREACHABLE
                if unreachable
                else ErrorCode.UPSTREAM_PROTOCOL_ERROR,
                upstream=up.name,
            )
        try:
            if on_sent is not None:
                on_sent()
            if exchange is not None and tracked is not None:
                edge = self.work.reply_arrived(exchange.job.id, upstream_resp.status)
                if edge is not None:
                    return self._after_cut(request, exchange, edge)
            out_headers = headers.response_headers(
                upstream_resp.headers, target=up.target, allow=self.pass_response
            )
            complete = _complete_body(request, upstream_resp)
            response: web.StreamResponse
            if complete is not None:
                # The whole reply arrived with its headers (a small JSON answer): send both
                # in one write instead of two. Nothing is held back that was not already here.
                response = web.Response(
                    status=upstream_resp.status,
                    reason=upstream_resp.reason,
                    headers=out_headers,
                    body=complete,
                )
            else:
                response = web.StreamResponse(
                    status=upstream_resp.status, reason=upstream_resp.reason, headers=out_headers
                )
            if exchange is not None:
                exchange.response = response
                if complete is not None:
                    # The upstream has finished: end the job now rather than after the
                    # borrower has the reply, so the fresh capacity sample its release asks
                    # for is under way while the reply travels (the next back-to-back
                    # request needs one taken after this release).
                    self._end_exchange(exchange, Ending.COMPLETED)
            await response.prepare(request)
            stalled = self.limits.write_stall_timeout_s
            try:
                if complete is None:
                    async for chunk in upstream_resp.iter_chunks():
                        async with asyncio.timeout(stalled):
                            await response.write(chunk)
                async with asyncio.timeout(stalled):
                    await response.write_eof()
            except client.UpstreamSilent:
                if exchange is None:
                    return self._silent_passthrough(request, c, response)
                return self._silent(request, exchange, c)
            except TimeoutError:
                log.warning(
                    "%s: borrower stopped reading for %g s; disconnecting", up.name, stalled
                )
                if exchange is not None:
                    exchange.failed = Ending.ABORTED
                self._cut(request)
                return response
            except client.BrokenBody as exc:
                if request.transport is None or request.transport.is_closing():
                    if exchange is not None:
                        exchange.failed = Ending.ABORTED
                    return response  # the borrower went away; nothing left to tell it
                if exchange is not None:
                    exchange.failed = Ending.UPSTREAM_FAILED
                self.metrics.upstream_error(up.name, "stream")
                log.warning("%s: upstream broke mid-response: %s", up.name, exc)
                self._cut(request)
                return response
            return response
        finally:
            # A fully read response returns its connection to the pool; anything else
            # (cancelled by a client disconnect, cut, stalled) aborts it, which is what
            # tells the upstream to stop.
            upstream_resp.release()

    def _silent_passthrough(
        self, request: web.BaseRequest, c: Classification, begun: web.StreamResponse | None
    ) -> web.StreamResponse:
        """A pass-through request (no job, nothing reserved) whose upstream sent nothing for
        ``upstream_silence_s``: 504 before the reply's headers, a reset connection after
        them, so a hung server cannot hold a borrower's connection open forever."""
        name = self.upstream.name
        self.metrics.upstream_error(name, "silent")
        log.warning(
            "%s: upstream sent nothing for %g s on pass-through %s %s%s",
            name,
            self.silence_s,
            request.method,
            c.path,
            "; cutting the reply" if begun is not None else "; answering 504",
        )
        if begun is not None:
            self._cut(request)
            return begun
        return self._json_error(
            request,
            504,
            f"the upstream server of {name!r} sent nothing for {self.silence_s:g} s; "
            "vacancyd gave up waiting",
            ErrorType.UPSTREAM,
            ErrorCode.UPSTREAM_TIMEOUT,
            upstream=name,
        )

    def _silent(
        self, request: web.BaseRequest, exchange: _Exchange, c: Classification
    ) -> web.StreamResponse:
        """The upstream sent nothing for ``upstream_silence_s``: :class:`Work` holds the job
        (the server may still be working), and the borrower gets 504 before the reply's
        headers, or a reset connection after them (a stream must never end cleanly)."""
        name = self.upstream.name
        job_id = exchange.job.id
        self.metrics.upstream_error(name, "silent")
        if not exchange.ended:
            exchange.ended = True
            self.work.upstream_silent(job_id)
        log.warning(
            "%s: upstream sent nothing for %g s on job %d (%s %s)%s",
            name,
            self.silence_s,
            job_id,
            request.method,
            c.path,
            "; cutting the stream" if exchange.response is not None else "; answering 504",
        )
        if exchange.response is not None:
            self._cut(request)
            return exchange.response
        return self._json_error(
            request,
            504,
            f"the upstream server of {name!r} sent nothing for {self.silence_s:g} s; "
            "vacancyd gave up waiting and keeps its resources reserved in case it is still "
            "working",
            ErrorType.UPSTREAM,
            ErrorCode.UPSTREAM_TIMEOUT,
            upstream=name,
            job=job_id,
        )

    @staticmethod
    def _cut(request: web.BaseRequest) -> None:
        """Reset the borrower's connection so a cut stream never looks like a clean end."""
        reset_connection(request.transport)


def _target(c: Classification, query: str) -> str:
    """The request target sent upstream: the dot-resolved raw path and the query as sent."""
    return f"{c.path}?{query}" if query else c.path


def _complete_body(request: web.BaseRequest, upstream: client.Response) -> bytes | None:
    """The upstream's whole body when it is already buffered, else None (stream it).

    Never for HEAD or bodiless statuses, whose headers must pass exactly as sent.
    """
    status = upstream.status
    if request.method == "HEAD" or status < 200 or status in NO_BODY_STATUSES:
        return None
    return upstream.complete_body()


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
