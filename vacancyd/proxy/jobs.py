"""A work request from its checks to its admission and the forwarding of the admitted job
(:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from vacancyd.adapters.base import BadRequest
from vacancyd.adapters.bodyparse import SMALL_JSON_BYTES, run_cooperatively
from vacancyd.adapters.bodyparse import run as run_steps
from vacancyd.control.admission import Refused
from vacancyd.control.job import JobHandle
from vacancyd.core.classify import Classification
from vacancyd.core.lifecycle import Ending
from vacancyd.core.reasons import ErrorCode, ErrorType, Reason, Refuse
from vacancyd.core.snapshot import RequestFacts
from vacancyd.proxy import bodies, observe, tunnel
from vacancyd.proxy.forward import Exchange, Forwarding
from vacancyd.proxy.refusing import Refusing

#: The whole proxy logs as ``vacancyd.proxy.app`` (docs/observability.md names it).
log = logging.getLogger("vacancyd.proxy.app")


class Working(Refusing, Forwarding):
    """A work request: refused early, or its body read, admitted by :class:`Admission` and
    forwarded as a job through its :class:`JobHandle`."""

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
                chosen = self.admission.choose(self.admits, facts)
                if isinstance(chosen, Refused):
                    return await self._refuse(request, chosen.refusal)
                runs = self.members[chosen]
                name = chosen
            borrower = self.auth.borrower(request)
            decision = await self.admission.admit(name, facts, borrower=borrower)
            if isinstance(decision, Refused):
                return await self._refuse(request, decision.refusal)
            job = decision.job
            request[observe.JOB] = job.admitted
            self.metrics.decision(name, "admitted")
            self.metrics.borrower_request(borrower, name, True)
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

    async def _run_job(
        self,
        request: web.BaseRequest,
        c: Classification,
        query: str,
        job: JobHandle,
        body: bytes,
        key: str | None,
        on_sent: Callable[[], None],
    ) -> web.StreamResponse:
        """Forward an admitted job; reports the exchange through its handle.

        The handle gets the :class:`Exchange`, which a reclaim's cut calls: it closes the
        upstream connection at once (whatever the forwarding waits for from the upstream
        raises) and resets a stalled borrower's connection; the forwarding sees the cut and
        tells the borrower (503, or an aborted stream). The handler's task is never
        cancelled for it; only where the cut reset the borrower's connection does the
        listener cancel the handler, as for any lost connection, and that cancellation is
        taken back here and the end counted as the cut it is.
        """
        exchange = Exchange(job, request, len(body))
        job.forwarding(key, exchange)
        ending = Ending.ABORTED
        try:
            try:
                response = await self._forward(
                    request, c, query, body=body, on_sent=on_sent, exchange=exchange, tracked=key
                )
            except asyncio.CancelledError:
                edge = exchange.cut_edge
                if edge is None or not exchange.reset_borrower:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # the lost connection's cancellation: the cut's doing
                ending = Ending.CUT
                return self._after_cut(request, exchange, edge)
            ending = exchange.failed or Ending.COMPLETED
            return response
        finally:
            self._end_exchange(exchange, ending)
