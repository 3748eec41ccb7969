"""The daemon's private Prometheus registry and the counters the listeners increment.

Names follow Prometheus conventions (see :mod:`vacancyd.api.metrics` for the gauges that
render the state). A private registry, not the global one, keeps tests independent.
"""

from __future__ import annotations

import bisect
import math
import platform
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vacancyd import __version__
from vacancyd.core.observations import ProbeFailure
from vacancyd.core.reasons import Credit, CreditCode
from vacancyd.core.usage import UsageRow, borrower_label
from vacancyd.web.catalogue import MetricType, counter, histogram, info, spec

#: Request-duration buckets (seconds): refusals answer in milliseconds, generations take
#: seconds to minutes.
REQUEST_BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, Content-Type) of a scrape of ``registry`` in the format the ``Accept`` header
    asks for: OpenMetrics 1.0 (``application/openmetrics-text``) when it is asked for, else
    the Prometheus text format 0.0.4 (prometheus_client's own negotiation)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type


class BuildCollector(Collector):
    """``vacancyd_build_info``: a constant 1 labelled with the version and Python."""

    def collect(self) -> Iterator[InfoMetricFamily]:
        yield info(
            "vacancyd_build",
            value={
                "version": __version__,
                "python": platform.python_version(),
                "implementation": platform.python_implementation(),
            },
        )


class LoopCounter(Collector):
    """A labelled counter that the request path increments: a plain count per label tuple,
    exported as a Prometheus counter (``NAME_total``) when the registry is collected.

    prometheus_client's ``Counter`` validates the labels and takes a lock on every increment;
    these counters are written only from the event loop (and scraped from it), so a dict
    does. Every label here has a small closed set of values (config names, enums, HTTP
    status codes), so the dict stays small.
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._counts: dict[tuple[str, ...], int] = {}

    @classmethod
    def declared(cls, name: str) -> LoopCounter:
        """The counter ``name`` as :mod:`vacancyd.web.catalogue` declares it."""
        s = spec(name, MetricType.COUNTER)
        return cls(s.name, s.help, s.labels)

    def inc(self, *labels: str) -> None:
        """Count one event for ``labels`` (one value per label name, in order)."""
        counts = self._counts
        counts[labels] = counts.get(labels, 0) + 1

    def touch(self, *labels: str) -> None:
        """Export ``labels``' series at 0 before its first event, so that ``rate()`` and
        ``increase()`` see the first one."""
        self._counts.setdefault(labels, 0)

    def value(self, *labels: str) -> int:
        """The count for ``labels`` so far (0 when never counted)."""
        return self._counts.get(labels, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, count in list(self._counts.items()):
            family.add_metric(labels, float(count))
        yield family


class LoopSum(LoopCounter):
    """A :class:`LoopCounter` of amounts (seconds, joules, tokens) rather than events."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        super().__init__(name, documentation, labelnames)
        self._sums: dict[tuple[str, ...], float] = {}

    @classmethod
    def declared(cls, name: str) -> LoopSum:
        """The counter ``name`` as :mod:`vacancyd.web.catalogue` declares it."""
        s = spec(name, MetricType.COUNTER)
        return cls(s.name, s.help, s.labels)

    def add(self, amount: float, *labels: str) -> None:
        """Add ``amount`` (not negative) to ``labels``' series."""
        sums = self._sums
        sums[labels] = sums.get(labels, 0.0) + max(0.0, amount)

    def total(self, *labels: str) -> float:
        """The sum for ``labels`` so far (0 when never added to)."""
        return self._sums.get(labels, 0.0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, amount in list(self._sums.items()):
            family.add_metric(labels, amount)
        yield family


class HistogramSeries:
    """One label combination of a :class:`LoopHistogram`: a count per bucket and the sum."""

    __slots__ = ("counts", "sum", "upper")

    def __init__(self, upper: tuple[float, ...]) -> None:
        self.upper = upper
        self.counts = [0] * len(upper)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (in the histogram's unit, here seconds)."""
        self.sum += value
        self.counts[bisect.bisect_left(self.upper, value)] += 1  # a bucket holds <= its bound


class LoopHistogram(Collector):
    """A labelled histogram that the request path observes: plain counts per label tuple,
    exported as a Prometheus histogram (``NAME_bucket{le}``, ``NAME_count``, ``NAME_sum``)
    exactly as prometheus_client's ``Histogram`` exposes it.

    Like :class:`LoopCounter`, written only from the event loop (and scraped from it), so it
    takes no lock per observation. ``labels()`` returns the series to keep and observe.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        bounds = tuple(sorted(float(b) for b in buckets))
        self._upper = bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)
        self._le = tuple(floatToGoString(b) for b in self._upper)  # type: ignore[no-untyped-call]
        self._series: dict[tuple[str, ...], HistogramSeries] = {}

    @classmethod
    def declared(cls, name: str, buckets: tuple[float, ...]) -> LoopHistogram:
        """The histogram ``name`` as :mod:`vacancyd.web.catalogue` declares it, with
        ``buckets`` (seconds)."""
        s = spec(name, MetricType.HISTOGRAM)
        return cls(s.name, s.help, s.labels, buckets)

    def labels(self, *labels: str) -> HistogramSeries:
        """The series for ``labels`` (one value per label name, in order), made on first use."""
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = HistogramSeries(self._upper)
        return series

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in list(self._series.items()):
            cumulative, buckets = 0, []
            for le, count in zip(self._le, series.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(labels), buckets, series.sum)
        yield family


class Metrics:
    """The daemon's private registry and its counters."""

    def __init__(self) -> None:
        # ``*_created`` series only add cardinality for our always-running counters.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = LoopCounter.declared("vacancyd_admission_decisions")
        self.auth_decisions = LoopCounter.declared("vacancyd_auth")
        self.proxied = LoopCounter.declared("vacancyd_proxy_requests")
        self.upstream_errors = LoopCounter.declared("vacancyd_upstream_errors")
        self.jobs = LoopCounter.declared("vacancyd_jobs")
        self.collector_errors = LoopCounter.declared("vacancyd_collector_errors")
        #: Per borrower (docs/borrowers.md): its work requests, busy seconds, tokens, energy.
        self.borrower_requests = LoopCounter.declared("vacancyd_borrower_requests")
        self.borrower_busy = LoopSum.declared("vacancyd_borrower_busy_seconds")
        self.borrower_tokens = LoopSum.declared("vacancyd_borrower_tokens")
        self.borrower_energy = LoopSum.declared("vacancyd_borrower_energy_joules")
        for loop_counter in (
            self.borrower_requests,
            self.borrower_busy,
            self.borrower_tokens,
            self.borrower_energy,
            self.decisions,
            self.auth_decisions,
            self.proxied,
            self.upstream_errors,
            self.jobs,
            self.collector_errors,
        ):
            self.registry.register(loop_counter)
        self.wake_seconds = histogram(
            "vacancyd_wake_duration_seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.wait_seconds = histogram(
            "vacancyd_wait_seconds",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        #: Borrowed jobs a reclaim cancelled (control.work: streams; control.upstreamcalls:
        #: queued jobs cancelled on the server).
        self.cancelled_jobs = counter("vacancyd_reclaim_cancelled_jobs", registry=self.registry)
        self.connections_refused = counter("vacancyd_connections_refused", registry=self.registry)
        self.malformed_requests = counter("vacancyd_malformed_requests", registry=self.registry)
        self.request_guard = counter("vacancyd_request_guard_refusals", registry=self.registry)
        self.residency_credits = LoopCounter.declared("vacancyd_residency_credits")
        self.registry.register(self.residency_credits)
        self.request_duration = LoopHistogram.declared(
            "vacancyd_request_duration_seconds", REQUEST_BUCKETS_S
        )
        self.registry.register(self.request_duration)
        self.registry.register(BuildCollector())
        # process_* (CPU seconds, resident memory, open fds, start time) and python_info,
        # the series every Prometheus client exposes.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def auth(self, scope: str, outcome: str) -> None:
        self.auth_decisions.inc(scope, outcome)

    def decision(self, upstream: str, outcome: str, reason: str = "") -> None:
        self.decisions.inc(upstream, outcome, reason)

    def borrower_request(self, borrower: str, upstream: str, admitted: bool) -> None:
        """One work request of ``borrower`` ("" unnamed: shown as ``default``) on
        ``upstream``, admitted or refused (``vacancyd_borrower_requests``)."""
        outcome = "admitted" if admitted else "refused"
        self.borrower_requests.inc(borrower_label(borrower), upstream, outcome)

    def borrower_job(self, row: UsageRow, energy_j: Mapping[str, float]) -> None:
        """Count a finished job's busy seconds (under its primary resource), tokens and
        energy (J per GPU resource with an energy counter, ``energy_j``) under its borrower
        (``vacancyd_borrower_busy_seconds``, ``_tokens``, ``_energy_joules``); tokens and
        energy only where they were reported."""
        who = borrower_label(row.borrower)
        self.borrower_busy.add(max(0.0, row.ended_at - row.started_at), who, row.resource)
        if row.prompt_tokens is not None:
            self.borrower_tokens.add(row.prompt_tokens, who, row.upstream, "prompt")
        if row.completion_tokens is not None:
            self.borrower_tokens.add(row.completion_tokens, who, row.upstream, "completion")
        for resource, joules in energy_j.items():
            self.borrower_energy.add(joules, who, resource)

    def request(self, upstream: str, route_class: str, code: str) -> None:
        """One request answered by ``upstream``'s listener (``vacancyd_proxy_requests``)."""
        self.proxied.inc(upstream, route_class, code)

    def collector_error(self, collector: str, error: str) -> None:
        """One failed sample of ``collector`` (``vacancyd_collector_errors_total``); ``error``
        is a :class:`~vacancyd.core.observations.ProbeFailure` value."""
        self.collector_errors.inc(collector, error)

    def collector_failures(self, collector: str) -> Callable[[ProbeFailure], None]:
        """What a probe loop calls to count ``collector``'s failed samples; every kind's
        series is exported (at 0) from now on."""
        for kind in ProbeFailure:
            self.collector_errors.touch(collector, kind.value)
        return lambda kind: self.collector_errors.inc(collector, kind.value)

    def upstream_error(self, upstream: str, stage: str) -> None:
        """A forwarded request that failed at ``stage`` (``vacancyd_upstream_errors``)."""
        self.upstream_errors.inc(upstream, stage)

    def job_ended(self, upstream: str, outcome: str) -> None:
        """One borrowed job of ``upstream`` ended with ``outcome`` (``vacancyd_jobs``)."""
        self.jobs.inc(upstream, outcome)

    def residency(self, upstream: str, credit: Credit) -> None:
        """Count one residency proof's outcome (admitted or refused at the per-model step)."""
        outcome = "applied" if credit.applied else "denied"
        self.residency_credits.inc(upstream, outcome, credit.code or CreditCode.UNKNOWN)
