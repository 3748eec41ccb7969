"""What the proxy records about each request once it has been answered.

The proxy handler tags the aiohttp request with what it learned (:data:`ROUTE_CLASS`, the
:data:`REFUSAL` it answered with, the admitted :data:`JOB`); aiohttp calls
:class:`ProxyAccessLogger` after the response is fully written, which

* observes ``vacancyd_request_duration_seconds{upstream, route_class}`` (always), and
* writes the access line at INFO on ``vacancyd.access.UPSTREAM`` (client, request line,
  status, bytes sent, duration, route class, refusal reason and borrower, in the shape every
  listener shares: :mod:`vacancyd.web.access`), refusals summed up per reason and borrower
  under a flood.

Durations are wall-clock seconds measured by aiohttp from the first byte of the request to
the end of the response (streams included). Trace context injection for OpenTelemetry lives
here too so the forwarding code needs one call that does nothing while tracing is off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from vacancyd.core.lifecycle import JobState
from vacancyd.core.reasons import Refuse
from vacancyd.core.usage import borrower_label
from vacancyd.web import access
from vacancyd.web.access import RefusalLog
from vacancyd.web.auth import BORROWER

if TYPE_CHECKING:
    from vacancyd.web.metrics import HistogramSeries, LoopHistogram

#: Request keys the proxy handler sets (``request[ROUTE_CLASS] = "work"``).
ROUTE_CLASS = web.RequestKey("vacancyd.route_class", str)
REFUSAL: web.RequestKey[Refuse] = web.RequestKey("vacancyd.refusal")
JOB: web.RequestKey[JobState] = web.RequestKey("vacancyd.job")

#: Set by :mod:`vacancyd.runtime.telemetry` while tracing is on: writes the current span's
#: W3C ``traceparent`` (and ``tracestate``) into a header mapping.
_inject: Callable[[MutableMapping[str, str]], None] | None = None


def set_trace_injector(inject: Callable[[MutableMapping[str, str]], None] | None) -> None:
    """Install (or with None remove) the function that writes trace context headers."""
    global _inject
    _inject = inject


def inject_trace_context(headers: MutableMapping[str, str]) -> None:
    """Replace any borrower-sent trace headers with the current span's context (tracing on);
    leave ``headers`` as they are when tracing is off."""
    if _inject is not None:
        _inject(headers)


def refusal_of(request: web.BaseRequest) -> Refuse | None:
    return request.get(REFUSAL)


def job_of(request: web.BaseRequest) -> JobState | None:
    return request.get(JOB)


class ProxyAccessLogger(AbstractAccessLogger):
    """aiohttp access logger for a proxy listener: duration histogram plus the access line.

    aiohttp builds one per connection from ``access_log_class``; :meth:`bind` makes the class
    for one listener, holding the histogram's label children so a request costs one lookup.
    Lines have the shape of :func:`vacancyd.web.access.write_line`; a refusal's line goes
    through the listener's :class:`~vacancyd.web.access.RefusalLog` (one full line per
    reason and window, the rest counted in a summary line).
    """

    __slots__ = ()

    upstream: str = ""
    histogram: LoopHistogram | None = None
    children: dict[str, HistogramSeries] = {}
    refusals: RefusalLog = RefusalLog()

    @classmethod
    def bind(
        cls,
        upstream: str,
        histogram: LoopHistogram | None,
        refusals: RefusalLog | None = None,
    ) -> type[ProxyAccessLogger]:
        """A subclass for the listener ``upstream`` (an upstream's or a pool's name)
        observing ``histogram`` (labels: upstream, route_class; None: no histogram) and
        summing refusals up in ``refusals`` (None: a log of its own)."""
        attrs: dict[str, object] = {
            "upstream": upstream,
            "histogram": histogram,
            "children": {},
            "refusals": refusals if refusals is not None else RefusalLog(),
            "__slots__": (),
        }
        return type("ProxyAccessLogger", (cls,), attrs)

    @property
    def enabled(self) -> bool:
        return True  # the histogram is observed even when the access log is quiet

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        klass: str = request.get(ROUTE_CLASS, "unauthenticated")
        if self.histogram is not None:
            child = self.children.get(klass)
            if child is None:
                child = self.children[klass] = self.histogram.labels(self.upstream, klass)
            child.observe(time)
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        refusal = request.get(REFUSAL)
        reason = None
        who = request.get(BORROWER)
        borrower = None if who is None else borrower_label(who)
        if refusal is not None:
            reason = refusal.reason.value
            if not logger.isEnabledFor(logging.DEBUG) and not self.refusals.first(
                logger, self.upstream, reason, response.status, request.remote, borrower or "-"
            ):
                return
        access.write_line(logger, self.upstream, request, response, time, klass, reason, borrower)
