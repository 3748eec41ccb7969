"""Forwarding a request to the upstream and streaming its reply to the borrower, for work
and pass-through alike; what the borrower is told when the upstream fails, falls silent
or a reclaim cuts the job (:mod:`vacancyd.proxy.app`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from vacancyd.adapters.usage import TAIL_BYTES, TokenUsage, UsageTap, read_usage
from vacancyd.control.job import JobHandle
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.core.classify import Classification
from vacancyd.core.lifecycle import Ending
from vacancyd.core.reasons import ErrorCode, ErrorType, Refuse
from vacancyd.core.reclaim import Edge
from vacancyd.core.refusal import render_refusal_bytes
from vacancyd.proxy import client, headers, observe
from vacancyd.proxy.base import NO_BODY_STATUSES, ProxyBase
from vacancyd.web.site import reset_connection

#: The whole proxy logs as ``vacancyd.proxy.app`` (docs/observability.md names it).
log = logging.getLogger("vacancyd.proxy.app")


class Exchange:
    """The proxy's own view of one job's exchange: the borrower's request, the response it
    already has, the upstream request (a :class:`~vacancyd.proxy.client.Call`), whether the
    job's handle has been told it ended, and the edge that cut it.

    A reclaim cuts it through :meth:`cut` (it is the job's
    :class:`~vacancyd.core.lifecycle.Cuttable`); the forwarding code sees ``cut_edge`` set
    where the cut interrupted it and answers as for a cut. Written only by the forwarding
    code and :meth:`cut`; the job's life is in :class:`Work`.
    """

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "call",
        "cut_edge",
        "ended",
        "failed",
        "job",
        "request",
        "reset_borrower",
        "response",
        "tap",
        "tokens",
        "waking",
    )

    def __init__(self, job: JobHandle, request: web.BaseRequest, bytes_in: int = 0) -> None:
        self.job = job
        self.request = request
        #: The upstream request, which a cut ends (vacancyd.proxy.client).
        self.call = client.Call()
        self.response: web.StreamResponse | None = None
        self.ended = False
        #: The reclaim edge that cut the exchange; None while it was not cut.
        self.cut_edge: Edge | None = None
        #: The cut reset the connection of a borrower that had stopped reading.
        self.reset_borrower = False
        #: The wake of a sleeping server before the request goes out, while it runs.
        self.waking: asyncio.Future[Any] | None = None
        #: How the exchange ended when the handler still returns a response although it did
        #: not end well: the upstream failed, the borrower stopped reading and was cut off,
        #: or a reclaim cut it.
        self.failed: Ending | None = None
        #: Body bytes read from the borrower / sent to it (the usage ledger).
        self.bytes_in = bytes_in
        self.bytes_out = 0
        #: The end of a streamed reply, for its token counts (None: not read: the job is not
        #: accounted, the reply is compressed or arrived whole).
        self.tap: UsageTap | None = None
        #: The tokens of a reply that arrived whole (None: none reported or not read).
        self.tokens: TokenUsage | None = None

    def report_usage(self) -> None:
        """Tell the job's handle what the exchange carried (once, before its end)."""
        job = self.job
        if not job.accounted:
            return
        tokens = self.tokens if self.tap is None else self.tap.usage()
        job.used(
            prompt_tokens=None if tokens is None else tokens.prompt,
            completion_tokens=None if tokens is None else tokens.completion,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
        )

    def cut(self, edge: Edge) -> bool:
        """A reclaim cuts the job (``edge``): end the upstream request at once (a pending
        connect, wait for the reply or read of its body raises
        :class:`~vacancyd.proxy.client.Cut`, the connection is aborted), stop a wake under
        way, and reset the borrower's connection if the borrower has stopped reading
        mid-stream (the forwarding is then stuck writing to it, not reading the upstream).
        False when the exchange had already ended or been cut."""
        if self.ended or self.cut_edge is not None:
            return False
        self.cut_edge = edge
        self.call.abort()
        if self.waking is not None:
            # A wake is the controller's call, not a connection this exchange owns: it runs
            # in a task of its own (Forwarding._wake), which the cut cancels, as before.
            self.waking.cancel()
        if self.response is not None:
            protocol = self.request.protocol
            if protocol is not None and protocol.writing_paused:
                self.reset_borrower = True
                reset_connection(self.request.transport)
        return True


class Forwarding(ProxyBase):
    """Forwarding a request upstream and streaming the reply back; the end of a job's
    exchange (completed, failed, silent, cut) as the proxy sees it."""

    def _end_exchange(self, exchange: Exchange, ending: Ending) -> None:
        """Tell the job's handle once that ``exchange`` ended (releasing or tracking its job)."""
        if not exchange.ended:
            exchange.ended = True
            exchange.report_usage()
            exchange.job.ended(ending)

    def _after_cut(
        self, request: web.BaseRequest, exchange: Exchange, edge: Edge
    ) -> web.StreamResponse:
        """503 with the edge's reason before headers; an aborted stream after them."""
        if exchange.cut_edge is not None:
            exchange.failed = Ending.CUT  # (a tracked job cut before its reply ends as it did)
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
    async def _wake(
        self, request: web.BaseRequest, calls: UpstreamCalls, exchange: Exchange
    ) -> web.Response | None:
        """Wake a server a reclaim put to sleep before forwarding borrowed work to it (the
        call is bounded, counted and logged by ``calls``); a 502 when it cannot be woken.
        The wake runs in a task of its own, which a cut of ``exchange`` cancels; None then
        too, with ``exchange.cut_edge`` set."""
        name = self.upstream.name
        # Awaited right here, never left behind (the handler's own cancellation reaches it).
        waking = asyncio.get_running_loop().create_task(calls.wake(name, why="borrowed request"))
        exchange.waking = waking
        try:
            woken = await waking
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if exchange.cut_edge is None or (current is not None and current.cancelling()):
                raise  # the borrower went away (its handler was cancelled): not a cut
            return None
        finally:
            exchange.waking = None
        if woken.done:
            return None
        return self._json_error(
            request,
            502,
            f"the upstream server of {name!r} is asleep and could not be woken ({woken.detail})",
            ErrorType.UPSTREAM,
            ErrorCode.UPSTREAM_UNREACHABLE,
            upstream=name,
        )

    async def _forward(
        self,
        request: web.BaseRequest,
        c: Classification,
        query: str,
        *,
        body: bytes | None = None,
        on_sent: Callable[[], None] | None = None,
        exchange: Exchange | None = None,
        tracked: str | None = None,
    ) -> web.StreamResponse:
        up = self.upstream
        if exchange is not None and self._waker is not None and exchange.cut_edge is None:
            failed = await self._wake(request, self._waker, exchange)
            if failed is not None:
                exchange.failed = Ending.UPSTREAM_FAILED
                return failed
        if exchange is not None and exchange.cut_edge is not None:
            return self._after_cut(request, exchange, exchange.cut_edge)  # cut before it left
        out_headers = self._request_headers(request)
        observe.inject_trace_context(out_headers)
        try:
            upstream_resp = await self.client.request(
                request.method,
                _target(c, query),
                out_headers.items(),
                body,
                silence_s=self.silence_s,
                call=None if exchange is None else exchange.call,
            )
        except client.Cut:
            assert exchange is not None and exchange.cut_edge is not None
            return self._after_cut(request, exchange, exchange.cut_edge)
        except client.UpstreamSilent:
            if exchange is None:
                return self._silent_passthrough(request, c, None)
            return self._silent(request, exchange, c)
        except (client.ForwardError, ValueError) as exc:
            return self._forward_failed(request, c, exc, exchange)
        try:
            if on_sent is not None:
                on_sent()
            if exchange is not None and tracked is not None:
                edge = exchange.job.reply_arrived(upstream_resp.status)
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
                if exchange.job.accounted and "Content-Encoding" not in upstream_resp.headers:
                    # Tokens are read from the end of the reply (usage, eval_count, timings),
                    # never from a compressed one; a streamed reply keeps only its tail.
                    if complete is None:
                        exchange.tap = UsageTap()
                    else:
                        exchange.tokens = read_usage(complete[-TAIL_BYTES:])
                if complete is not None:
                    exchange.bytes_out = len(complete)
                    # The upstream has finished: end the job now rather than after the
                    # borrower has the reply, so the fresh capacity sample its release asks
                    # for is under way while the reply travels (the next back-to-back
                    # request needs one taken after this release).
                    self._end_exchange(exchange, Ending.COMPLETED)
            return await self._relay(request, c, upstream_resp, response, complete, exchange)
        finally:
            # A fully read response returns its connection to the pool; anything else
            # (cancelled by a client disconnect, cut, stalled) aborts it, which is what
            # tells the upstream to stop.
            upstream_resp.release()

    async def _relay(
        self,
        request: web.BaseRequest,
        c: Classification,
        upstream_resp: client.Response,
        response: web.StreamResponse,
        complete: bytes | None,
        exchange: Exchange | None,
    ) -> web.StreamResponse:
        """Send ``response`` and relay the upstream's body into it (``complete``: the whole
        body, already in ``response``); a cut, the upstream's silence or break, or a borrower
        that stops reading end it as each must (503 or aborted stream, 504 or reset, reset)."""
        await response.prepare(request)
        stalled = self.limits.write_stall_timeout_s
        try:
            if complete is None and exchange is None:
                async for chunk in upstream_resp.iter_chunks():
                    async with asyncio.timeout(stalled):
                        await response.write(chunk)
            elif complete is None:
                assert exchange is not None
                tap = exchange.tap
                async for chunk in upstream_resp.iter_chunks():
                    async with asyncio.timeout(stalled):
                        await response.write(chunk)
                    exchange.bytes_out += len(chunk)
                    if tap is not None:
                        tap.feed(chunk)
            async with asyncio.timeout(stalled):
                await response.write_eof()
        except client.Cut:
            assert exchange is not None and exchange.cut_edge is not None
            return self._after_cut(request, exchange, exchange.cut_edge)
        except ConnectionError:
            # Writing to a borrower whose connection the cut reset (where the listener
            # does not cancel the handler of a lost connection, aiohttp's default).
            if exchange is None or exchange.cut_edge is None:
                raise
            return self._after_cut(request, exchange, exchange.cut_edge)
        except client.UpstreamSilent:
            if exchange is None:
                return self._silent_passthrough(request, c, response)
            return self._silent(request, exchange, c)
        except TimeoutError:
            return self._stalled(request, exchange, response, stalled)
        except client.BrokenBody as exc:
            return self._broken(request, exchange, response, exc)
        return response

    def _forward_failed(
        self,
        request: web.BaseRequest,
        c: Classification,
        exc: client.ForwardError | ValueError,
        exchange: Exchange | None,
    ) -> web.Response:
        """502 for a request the upstream never answered: connecting failed (refused, timed
        out) or the server answered with something that is not a valid HTTP response
        (garbage, oversized headers, a hang-up)."""
        up = self.upstream
        unreachable = isinstance(exc, client.ConnectFailed)
        stage = "connect" if unreachable else "response"
        self.metrics.upstream_error(up.name, stage)
        if unreachable:  # the lendability probe answers upstream_unreachable from now
            self.admission.found_unreachable(up.name, f"a borrowed request: {exc}")
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
            ErrorCode.UPSTREAM_UNREACHABLE if unreachable else ErrorCode.UPSTREAM_PROTOCOL_ERROR,
            upstream=up.name,
        )

    def _stalled(
        self,
        request: web.BaseRequest,
        exchange: Exchange | None,
        response: web.StreamResponse,
        stalled: float,
    ) -> web.StreamResponse:
        """The borrower stopped reading the reply for ``stalled`` seconds: disconnect it."""
        log.warning(
            "%s: borrower stopped reading for %g s; disconnecting", self.upstream.name, stalled
        )
        if exchange is not None:
            exchange.failed = Ending.ABORTED
        self._cut(request)
        return response

    def _broken(
        self,
        request: web.BaseRequest,
        exchange: Exchange | None,
        response: web.StreamResponse,
        exc: client.BrokenBody,
    ) -> web.StreamResponse:
        """The reply's body broke off mid-stream: the borrower went away, or the upstream
        broke (the borrower's connection is reset so the stream never ends cleanly)."""
        if request.transport is None or request.transport.is_closing():
            if exchange is not None:
                exchange.failed = Ending.ABORTED
            return response  # the borrower went away; nothing left to tell it
        if exchange is not None:
            exchange.failed = Ending.UPSTREAM_FAILED
        self.metrics.upstream_error(self.upstream.name, "stream")
        log.warning("%s: upstream broke mid-response: %s", self.upstream.name, exc)
        self._cut(request)
        return response

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
        self, request: web.BaseRequest, exchange: Exchange, c: Classification
    ) -> web.StreamResponse:
        """The upstream sent nothing for ``upstream_silence_s``: the job's handle is told,
        and the job is held (the server may still be working); the borrower gets 504 before
        the reply's headers, or a reset connection after them (a stream must never end
        cleanly)."""
        name = self.upstream.name
        job_id = exchange.job.id
        self.metrics.upstream_error(name, "silent")
        if not exchange.ended:
            exchange.ended = True
            exchange.report_usage()
            exchange.job.silent()
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
