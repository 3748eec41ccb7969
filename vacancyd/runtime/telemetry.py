"""OpenTelemetry tracing, on when ``[telemetry] otlp_endpoint`` is set (``otel`` extra).

Spans:

* ``vacancyd.request`` (SERVER) — one per request on a proxy listener, child of the
  borrower's W3C ``traceparent`` when it sent one. Attributes: ``http.request.method``,
  ``url.path``, ``http.response.status_code``, ``vacancyd.upstream``,
  ``vacancyd.route_class``, ``vacancyd.decision`` (``admitted`` / ``refused``),
  ``vacancyd.reason`` and ``vacancyd.resource`` (refusals), ``vacancyd.resources`` and
  ``vacancyd.job`` (admitted work), ``vacancyd.borrower`` (who borrows: a ``[[borrower]]``
  name or ``default``; absent for a request not allowed to borrow). The forwarded request
  carries this span's ``traceparent``, so the inference server's own spans join the trace.
* ``vacancyd.post_release_sample`` — after admitted work ends and its resources are
  released, the wait for the fresh capacity sample the next borrower's admission needs;
  child of the request span. ``vacancyd.sampled`` says whether one arrived.
* ``vacancyd.reclaim`` — one per reclaim of an upstream, from its first edge to its end,
  with ``vacancyd.reclaim.trigger``, ``.policy``, ``.outcome`` and one event per phase.

Spans are exported in batches from a background thread, so tracing never blocks the event
loop; an unreachable collector only loses spans (the exporter logs it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vacancyd import __version__
from vacancyd.config.model import TelemetrySettings
from vacancyd.core.events import ReclaimChanged, StateEvent
from vacancyd.core.observations import SampleKey
from vacancyd.core.usage import borrower_label
from vacancyd.proxy import observe
from vacancyd.runtime.tasks import Supervisor
from vacancyd.web.auth import BORROWER

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from vacancyd.state import SharedState

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: How long the post-release span waits for the fresh sample (seconds).
POST_RELEASE_WAIT_S = 5.0
OPEN_RECLAIM = frozenset({"waiting", "proceeding"})


class Tracing:
    """The tracer provider, the proxy middleware and the state subscriptions."""

    def __init__(
        self, provider: TracerProvider, state: SharedState, supervisor: Supervisor | None = None
    ) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("vacancyd", __version__)
        self.state = state
        self._propagator = TraceContextTextMapPropagator()
        self._supervisor = supervisor
        self._tasks: set[asyncio.Task[None]] = set()
        self._reclaims: dict[str, Span] = {}
        self._unsubscribe = state.subscribe(self._on_event)
        observe.set_trace_injector(self.inject)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Write the current span's ``traceparent``/``tracestate`` over the borrower's."""
        for name in ("traceparent", "tracestate"):
            headers.pop(name, None)
        self._propagator.inject(headers)

    def middleware(self, upstream: str) -> Any:
        from opentelemetry.trace import SpanKind, set_span_in_context

        tracer = self.tracer

        @web.middleware
        async def trace(request: web.Request, handler: Handler) -> web.StreamResponse:
            parent = self._propagator.extract(_Headers(request.headers))
            with tracer.start_as_current_span(
                "vacancyd.request",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": request.method,
                    "url.path": request.path,
                    "vacancyd.upstream": upstream,
                },
            ) as span:
                response = await handler(request)
                span.set_attribute("http.response.status_code", response.status)
                span.set_attribute(
                    "vacancyd.route_class", request.get(observe.ROUTE_CLASS, "unauthenticated")
                )
                borrower = request.get(BORROWER)
                if borrower is not None:
                    span.set_attribute("vacancyd.borrower", borrower_label(borrower))
                refusal = observe.refusal_of(request)
                job = observe.job_of(request)
                if refusal is not None:
                    span.set_attribute("vacancyd.decision", "refused")
                    span.set_attribute("vacancyd.reason", refusal.reason.value)
                    if refusal.resource is not None:
                        span.set_attribute("vacancyd.resource", refusal.resource)
                elif job is not None:
                    span.set_attribute("vacancyd.decision", "admitted")
                    span.set_attribute("vacancyd.job", job.id)
                    span.set_attribute("vacancyd.resources", list(job.resources))
                if job is not None and self.state.ledger.get(job.id) is None:
                    self._spawn(self._post_release(job.resources, set_span_in_context(span)))
                return response

        return trace

    async def _post_release(self, resources: tuple[str, ...], parent: Any) -> None:
        with self.tracer.start_as_current_span(
            "vacancyd.post_release_sample",
            context=parent,
            attributes={"vacancyd.resources": list(resources)},
        ) as span:
            sampled = True
            for name in resources:
                key = SampleKey.capacity(name)
                sampled = await self.state.samples.fresh(key, POST_RELEASE_WAIT_S) and sampled
            span.set_attribute("vacancyd.sampled", sampled)

    def _spawn(self, coro: Any) -> None:
        """Run the post-release span on its own task (not essential): through the daemon's
        supervisor when there is one, else on a task this object keeps a reference to."""
        name = "trace post-release sample"
        if self._supervisor is not None:
            self._supervisor.spawn(coro, name=name, essential=False)
            return
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_event(self, event: StateEvent) -> None:
        if not isinstance(event, ReclaimChanged):
            return
        upstream = event.upstream
        phase = event.phase.value
        reclaim = self.state.reclaims.get(upstream)
        view = reclaim.view() if reclaim is not None else {}
        span = self._reclaims.get(upstream)
        if span is None and phase in OPEN_RECLAIM:
            span = self._reclaims[upstream] = self.tracer.start_span(
                "vacancyd.reclaim",
                attributes={
                    "vacancyd.upstream": upstream,
                    "vacancyd.reclaim.trigger": str(view.get("trigger")),
                    "vacancyd.reclaim.policy": str(view.get("policy")),
                },
            )
            if view.get("resource"):
                span.set_attribute("vacancyd.resource", str(view["resource"]))
        if span is None:
            return
        span.add_event(phase)
        if phase not in OPEN_RECLAIM:
            span.set_attribute("vacancyd.reclaim.outcome", str(view.get("outcome") or phase))
            span.end()
            del self._reclaims[upstream]

    async def shutdown(self) -> None:
        """End open spans, stop background work and flush what is left (in a thread)."""
        self._unsubscribe()
        observe.set_trace_injector(None)
        for task in list(self._tasks):
            task.cancel()
        for span in self._reclaims.values():
            span.end()
        self._reclaims.clear()
        await asyncio.to_thread(self.provider.shutdown)


class _Headers(dict[str, str]):
    """Request headers as the propagator's getter wants them (lower-case keys)."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__((k.lower(), v) for k, v in headers.items())


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a collector base URL (``/v1/traces`` when no path)."""
    base = endpoint.rstrip("/")
    scheme_sep = base.find("://")
    path_start = base.find("/", scheme_sep + 3 if scheme_sep >= 0 else 0)
    return base if path_start >= 0 else base + "/v1/traces"


def start_tracing(
    settings: TelemetrySettings,
    state: SharedState,
    exporter: SpanExporter | None = None,
    *,
    supervisor: Supervisor | None = None,
) -> Tracing | None:
    """Tracing for these settings, or None when it is off or the ``otel`` extra is missing
    (logged). ``exporter`` replaces the OTLP exporter (tests pass an in-memory one);
    ``supervisor`` runs its background spans' tasks."""
    if settings.otlp_endpoint is None and exporter is None:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        log.error(
            "[telemetry] otlp_endpoint is set but OpenTelemetry is not installed "
            "(pip install 'vacancyd[otel]'); tracing is off"
        )
        return None
    resource = Resource.create(
        {"service.name": settings.service_name, "service.version": __version__}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio))
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )
        except ImportError:
            log.error(
                "[telemetry] needs the OTLP exporter (pip install 'vacancyd[otel]'); tracing is off"
            )
            return None
        url = traces_url(str(settings.otlp_endpoint))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        log.info("tracing to %s (sample ratio %g)", url, settings.sample_ratio)
    return Tracing(provider, state, supervisor)
