"""Every call vacancyd makes to an upstream server's own API, in one place.

The adapters (:mod:`vacancyd.adapters`) speak each server's wire protocol through their
:class:`~vacancyd.adapters.base.Controller`; this module is the only caller of those
methods that change what a server holds or runs, and owns around each call:

* its **deadline** (seconds, the module constants below, read at call time);
* its **typed outcome**, :class:`Outcome`: ``done``, ``skipped`` (the server declined, and
  said why), ``failed`` (an :class:`~vacancyd.adapters.base.UpstreamError`), ``timed_out``
  or ``not_supported`` (no controller, or none with that API);
* its **metrics**: every call is counted in ``vacancyd_upstream_calls_total{upstream,call,
  outcome}``, and the older per-purpose series go on as before (a reclaim's unload in
  ``vacancyd_unload_duration_seconds``, a wake in ``vacancyd_wake_duration_seconds``, a
  queued job cancelled in ``vacancyd_reclaim_cancelled_jobs_total{kind="queued"}``);
* its **log line**, one format (:meth:`Outcome.line`): ``WHY: unloaded NAME in 0.12 s:
  DETAIL`` when done, ``WHY: unload of NAME failed after 0.12 s: DETAIL`` otherwise.

The calls (:class:`Call`): ``unload`` (a reclaim hands the server's memory back; vLLM's is a
sleep), ``clear`` (the unload before an exclusive job), ``free`` (an exclusive job's own
server frees its memory after it), ``warm`` (load ``warm_model`` again), ``cancel`` (cancel
tracked borrowed jobs in the server's queue), ``wake`` (wake a server a reclaim put to
sleep), ``resident`` (read which models the server holds). Nothing here raises an upstream
failure into the caller: it is the outcome. Cancellation of the calling task propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from vacancyd.adapters.base import Controller, UpstreamError, Waker
from vacancyd.web.catalogue import counter, histogram
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A reclaim's unload must finish within this many seconds.
UNLOAD_DEADLINE_S = 10.0
#: A warm reload of ``warm_model`` must finish within this many seconds.
WARM_DEADLINE_S = 10.0
#: Cancelling tracked borrowed jobs through the server's API is bounded by this (seconds).
CANCEL_DEADLINE_S = 10.0
#: An exclusive job's own server must free its memory within this many seconds.
FREE_DEADLINE_S = 10.0
#: One read of a server's resident models is bounded by this (seconds).
RESIDENT_DEADLINE_S = 10.0
#: Waking a sleeping server (vLLM sleep mode) before a borrowed request, and confirming it
#: is awake (seconds).
WAKE_DEADLINE_S = 60.0


class Call(StrEnum):
    """Which call; the values are the ``call`` label of ``vacancyd_upstream_calls_total``."""

    UNLOAD = "unload"
    CLEAR = "clear"
    FREE = "free"
    WARM = "warm"
    CANCEL = "cancel"
    WAKE = "wake"
    RESIDENT = "resident"


#: How a done call reads in its log line ("unloaded NAME in 0.12 s").
_DONE = {
    Call.UNLOAD: "unloaded",
    Call.CLEAR: "cleared",
    Call.FREE: "freed",
    Call.WARM: "warmed",
    Call.CANCEL: "cancelled on",
    Call.WAKE: "woke",
    Call.RESIDENT: "read residency of",
}


class Status(StrEnum):
    """How a call ended; the values are the ``outcome`` label of
    ``vacancyd_upstream_calls_total``."""

    DONE = "done"
    #: The server declined and said why (an unload with foreign work queued, a vLLM server
    #: started without sleep mode): nothing changed on it.
    SKIPPED = "skipped"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    #: No controller for the upstream, or one without this API: nothing was sent.
    NOT_SUPPORTED = "not_supported"


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """One call's result. ``detail``: the server's summary, or why it failed or was not
    made; ``elapsed_s``: seconds from the call to its end (0 when not made); ``value``:
    what a done call returned (``resident``: the model names or None when the server cannot
    tell; ``wake``: the seconds the wake took, None when it was awake), else None."""

    call: Call
    upstream: str
    status: Status
    detail: str
    elapsed_s: float = 0.0
    value: T | None = None

    @property
    def done(self) -> bool:
        return self.status is Status.DONE

    def line(self, why: str, subject: str | None = None) -> str:
        """The one log line of this call; ``why``: what the call was for (``reclaim``,
        ``exclusive job of comfy``), ``subject``: what it named (default the upstream)."""
        what = subject or self.upstream
        if self.status is Status.DONE:
            head = f"{_DONE[self.call]} {what} in {self.elapsed_s:.2f} s"
        elif self.status is Status.NOT_SUPPORTED:
            head = f"{self.call} of {what} {self.status}"
        else:
            head = f"{self.call} of {what} {self.status} after {self.elapsed_s:.2f} s"
        return f"{why}: {head}: {self.detail}" if self.detail else f"{why}: {head}"


class UpstreamCalls:
    """The controllers of every upstream that has one, and every call made to them.

    One per daemon, event-loop only. ``metrics``: the daemon's registry and counters, on
    which this registers ``vacancyd_upstream_calls`` and ``vacancyd_unload_duration_seconds``.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._controllers: dict[str, Controller] = {}
        self.metrics = metrics
        registry = metrics.registry
        self.m_calls = counter("vacancyd_upstream_calls", registry=registry)
        self.m_unload = histogram(
            "vacancyd_unload_duration_seconds",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )

    # -- which upstreams have a controller -----------------------------------------------

    def add(self, upstream: str, controller: Controller) -> None:
        """``upstream``'s server is controlled by ``controller`` (once, while building)."""
        self._controllers[upstream] = controller

    def controller(self, upstream: str) -> Controller | None:
        return self._controllers.get(upstream)

    def supports(self, upstream: str) -> bool:
        """True when ``upstream`` has a controller (unload, free, warm and resident)."""
        return upstream in self._controllers

    def waker(self, upstream: str) -> bool:
        """True when ``upstream``'s server can be put to sleep and must be woken."""
        return isinstance(self._controllers.get(upstream), Waker)

    # -- the calls -----------------------------------------------------------------------

    async def unload(self, upstream: str, admitted: frozenset[str], *, why: str) -> Outcome[None]:
        """A reclaim's unload (vLLM: sleep); ``admitted``: the job keys this lender admitted
        there (a server holding anyone else's work declines: ``skipped``). Bounded by
        :data:`UNLOAD_DEADLINE_S`; observed in ``vacancyd_unload_duration_seconds`` with the
        adapter's labels (``unloaded``, ``skipped``, ``failed``, ``timed_out``)."""
        outcome = await self._unload(Call.UNLOAD, upstream, admitted, UNLOAD_DEADLINE_S)
        if outcome.status is not Status.NOT_SUPPORTED:
            label = "unloaded" if outcome.done else outcome.status.value
            self.m_unload.labels(upstream, label).observe(outcome.elapsed_s)
        return self._ended(outcome, why)

    async def clear(self, upstream: str, deadline_s: float, *, why: str) -> Outcome[None]:
        """The unload before an exclusive job, within ``deadline_s`` seconds (the exclusive
        upstream's ``unload_timeout_s`` left); no job of this lender is spared."""
        return self._ended(await self._unload(Call.CLEAR, upstream, frozenset(), deadline_s), why)

    async def free(self, upstream: str, admitted: frozenset[str], *, why: str) -> Outcome[None]:
        """An exclusive job's own server frees its memory after it (ComfyUI ``/free``),
        bounded by :data:`FREE_DEADLINE_S`; ``admitted`` as for :meth:`unload`."""
        return self._ended(await self._unload(Call.FREE, upstream, admitted, FREE_DEADLINE_S), why)

    async def _unload(
        self, call: Call, upstream: str, admitted: frozenset[str], deadline_s: float
    ) -> Outcome[None]:
        controller = self._controllers.get(upstream)
        if controller is None:
            why = "no unload API; its residency stays with the server"
            return Outcome(call, upstream, Status.NOT_SUPPORTED, why)

        async def go() -> tuple[Status, str]:
            said, detail = await controller.unload(admitted)
            return (Status.SKIPPED if said == "skipped" else Status.DONE), detail

        return await self._timed(call, upstream, deadline_s, go())

    async def warm(self, upstream: str, model: str, *, why: str) -> Outcome[None]:
        """Load ``model`` again on ``upstream``, bounded by :data:`WARM_DEADLINE_S`."""
        controller = self._controllers.get(upstream)
        if controller is None:
            outcome: Outcome[None] = Outcome(
                Call.WARM, upstream, Status.NOT_SUPPORTED, "no warm API"
            )
        else:

            async def go() -> tuple[Status, str]:
                return Status.DONE, await controller.warm(model)

            outcome = await self._timed(Call.WARM, upstream, WARM_DEADLINE_S, go())
        return self._ended(outcome, why, f"{model!r} on {upstream}")

    async def cancel(self, upstream: str, keys: list[str], *, why: str) -> Outcome[None]:
        """Cancel the tracked borrowed jobs ``keys`` in ``upstream``'s queue, bounded by
        :data:`CANCEL_DEADLINE_S`; each one cancelled is counted in
        ``vacancyd_reclaim_cancelled_jobs_total{kind="queued"}``."""
        controller = self._controllers.get(upstream)
        if controller is None:
            outcome: Outcome[None] = Outcome(
                Call.CANCEL, upstream, Status.NOT_SUPPORTED, "no cancel API"
            )
        else:

            async def go() -> tuple[Status, str]:
                return Status.DONE, await controller.cancel(keys)

            outcome = await self._timed(Call.CANCEL, upstream, CANCEL_DEADLINE_S, go())
        if outcome.done:
            self.metrics.cancelled_jobs.labels(upstream, "queued").inc(len(keys))
        return self._ended(outcome, why, f"{upstream} (borrowed jobs {', '.join(keys)})")

    async def resident(self, upstream: str, *, why: str) -> Outcome[list[str]]:
        """The models ``upstream``'s server holds now (``value``; None when it cannot
        tell), bounded by :data:`RESIDENT_DEADLINE_S`. Logged only when it fails."""
        controller = self._controllers.get(upstream)
        if controller is None:
            return Outcome(Call.RESIDENT, upstream, Status.NOT_SUPPORTED, "no residency API")
        models: list[list[str] | None] = []

        async def go() -> tuple[Status, str]:
            models.append(await controller.resident())
            return Status.DONE, ""

        outcome = await self._timed(Call.RESIDENT, upstream, RESIDENT_DEADLINE_S, go())
        if not outcome.done:
            self._ended(outcome, why)
            return Outcome(Call.RESIDENT, upstream, outcome.status, outcome.detail)
        return Outcome(Call.RESIDENT, upstream, Status.DONE, "", outcome.elapsed_s, models[0])

    async def wake(self, upstream: str, *, why: str) -> Outcome[float]:
        """Wake ``upstream``'s server if a reclaim put it to sleep, bounded by
        :data:`WAKE_DEADLINE_S`; ``value``: the seconds the wake took, None when it was
        awake (then nothing is counted or logged). Observed in
        ``vacancyd_wake_duration_seconds`` (``woken``, or ``failed`` for any other end)."""
        waker: object = self._controllers.get(upstream)
        if not isinstance(waker, Waker):
            return Outcome(Call.WAKE, upstream, Status.NOT_SUPPORTED, "no sleep mode")
        took: list[float | None] = []

        async def go() -> tuple[Status, str]:
            took.append(await waker.ensure_awake())
            return Status.DONE, ""

        outcome = await self._timed(Call.WAKE, upstream, WAKE_DEADLINE_S, go(), count=False)
        if not outcome.done:
            self.m_calls.labels(upstream, Call.WAKE, outcome.status).inc()
            self.metrics.wake_seconds.labels(upstream, "failed").observe(0)
            self._ended(outcome, why)
            return Outcome(Call.WAKE, upstream, outcome.status, outcome.detail, outcome.elapsed_s)
        seconds = took[0]
        if seconds is None:
            return Outcome(Call.WAKE, upstream, Status.DONE, "it was awake", outcome.elapsed_s)
        self.m_calls.labels(upstream, Call.WAKE, Status.DONE).inc()
        self.metrics.wake_seconds.labels(upstream, "woken").observe(seconds)
        self._ended(outcome, why)
        return Outcome(Call.WAKE, upstream, Status.DONE, "", outcome.elapsed_s, seconds)

    async def _timed(
        self,
        call: Call,
        upstream: str,
        deadline_s: float,
        work: Awaitable[tuple[Status, str]],
        *,
        count: bool = True,
    ) -> Outcome[None]:
        """Run one call within ``deadline_s`` seconds and count it (unless ``count`` is
        False: the caller counts, as a wake of an awake server is no call)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(max(0.0, deadline_s)):
                status, detail = await work
        except TimeoutError:
            status, detail = Status.TIMED_OUT, f"no answer within {deadline_s:g} s"
        except UpstreamError as exc:
            status, detail = Status.FAILED, str(exc)
        outcome: Outcome[None] = Outcome(call, upstream, status, detail, loop.time() - started)
        if count:
            self.m_calls.labels(upstream, call, status).inc()
        return outcome

    @staticmethod
    def _ended(outcome: Outcome[T], why: str, subject: str | None = None) -> Outcome[T]:
        """Log ``outcome``'s one line: done and not supported at INFO, the rest at WARNING."""
        level = (
            logging.INFO
            if outcome.status in (Status.DONE, Status.NOT_SUPPORTED)
            else logging.WARNING
        )
        log.log(level, "%s", outcome.line(why, subject), extra={"upstream": outcome.upstream})
        return outcome
