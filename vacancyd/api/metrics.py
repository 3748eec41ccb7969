"""Prometheus metrics (spec "API and metrics"; product map O3).

Gauges are rendered from one state snapshot per scrape by a custom collector on a private
registry (no global registry: tests stay independent). Counters are incremented by the proxy
and the authenticator. Names follow Prometheus conventions: base units in the name (bytes,
seconds), 0–1 ratios named ``_ratio``. CPU has no byte capacity, so it has no ``_bytes``
series (not a collector failure).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vacancyd.core import gate
from vacancyd.core import presence as presence_rules
from vacancyd.core.ledger import Phase
from vacancyd.core.observations import Quality
from vacancyd.core.reasons import Refuse
from vacancyd.core.snapshot import RequestFacts

if TYPE_CHECKING:
    from vacancyd.state import SharedState

MIB = 1024 * 1024


class StateCollector(Collector):
    """Renders every gauge the gate consults from one snapshot."""

    def __init__(self, state: SharedState) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state
        now = state.clock()
        snap = state.snapshot(now)

        yield GaugeMetricFamily(
            "vacancyd_lending_enabled",
            "Global lending switch (1 on, 0 off).",
            value=1.0 if snap.lending_enabled else 0.0,
        )
        presence = snap.presence
        g = GaugeMetricFamily(
            "vacancyd_presence_sampled",
            "1 once owner presence has been sampled.",
            labels=["source"],
        )
        g.add_metric([presence.source], 1.0 if presence.sampled else 0.0)
        yield g
        age = presence.age_s(now)
        if age is not None:
            yield GaugeMetricFamily(
                "vacancyd_presence_age_seconds", "Age of the newest presence reading.", value=age
            )
        yield GaugeMetricFamily(
            "vacancyd_owner_veto_active",
            "Host policy veto engaged (1) or released (0).",
            value=1.0 if presence.veto_active else 0.0,
        )
        yield from _presence_families(state, presence.sampled, presence.evidence_complete)

        enabled = GaugeMetricFamily(
            "vacancyd_resource_enabled", "Runtime switch per resource.", labels=["resource"]
        )
        quality = GaugeMetricFamily(
            "vacancyd_resource_quality",
            "Capacity observation quality (1 for the current one).",
            labels=["resource", "quality"],
        )
        age_g = GaugeMetricFamily(
            "vacancyd_resource_observation_age_seconds",
            "Age of the newest good capacity sample.",
            labels=["resource"],
        )
        free = GaugeMetricFamily(
            "vacancyd_resource_free_bytes", "Free (available) bytes.", labels=["resource"]
        )
        total = GaugeMetricFamily(
            "vacancyd_resource_total_bytes", "Total bytes.", labels=["resource"]
        )
        util = GaugeMetricFamily(
            "vacancyd_resource_utilization_ratio", "Utilization, 0-1.", labels=["resource"]
        )
        used = GaugeMetricFamily(
            "vacancyd_resource_used_bytes",
            "Used bytes as the device reports them.",
            labels=["resource"],
        )
        lendable = GaugeMetricFamily(
            "vacancyd_resource_lendable",
            "1 when the resource passes its switch, quality and probe policy checks.",
            labels=["resource"],
        )
        for name, view in sorted(snap.resources.items()):
            enabled.add_metric([name], 1.0 if view.switch_on else 0.0)
            q = view.quality(now)
            for each in Quality:
                quality.add_metric([name, each.value], 1.0 if each is q else 0.0)
            obs_age = view.capacity.age_s(now)
            if obs_age is not None:
                age_g.add_metric([name], obs_age)
            reading = view.capacity.value
            ok = view.switch_on and q is Quality.READY
            if reading is not None:
                if view.policy.has_bytes and reading.free_mib is not None:
                    free.add_metric([name], reading.free_mib * MIB)
                if view.policy.has_bytes and reading.total_mib is not None:
                    total.add_metric([name], reading.total_mib * MIB)
                if reading.utilization is not None:
                    util.add_metric([name], reading.utilization)
                if view.policy.has_bytes and reading.used_mib is not None:
                    used.add_metric([name], reading.used_mib * MIB)
                ok = ok and view.policy.evaluate(reading) is None
            lendable.add_metric([name], 1.0 if ok else 0.0)
        yield from (enabled, quality, age_g, free, total, used, util, lendable)
        yield from _pressure_metrics(state, now)

        active = GaugeMetricFamily(
            "vacancyd_active_work",
            "Admission-ledger entries per upstream and phase.",
            labels=["upstream", "phase"],
        )
        counts = state.ledger.counts()
        for upstream in sorted(state.upstreams):
            for phase in Phase:
                active.add_metric([upstream, phase.value], float(counts.get((upstream, phase), 0)))
        yield active

        listener = GaugeMetricFamily(
            "vacancyd_listener_up",
            "1 while the upstream's proxy listener is bound.",
            labels=["upstream"],
        )
        for upstream, ls in sorted(state.listeners.items()):
            listener.add_metric([upstream], 1.0 if ls.bound else 0.0)
        yield listener

        upstream_lendable = GaugeMetricFamily(
            "vacancyd_upstream_lendable",
            "1 when the gate would admit a borrowed request on the upstream now.",
            labels=["upstream"],
        )
        for name, policy in sorted(state.upstreams.items()):
            ok_now = not isinstance(gate.decide(RequestFacts(), snap, policy), Refuse)
            upstream_lendable.add_metric([name], 1.0 if ok_now else 0.0)
        yield upstream_lendable

        ready, _ = state.ready(now)
        yield GaugeMetricFamily("vacancyd_ready", "1 when /readyz answers 200.", value=float(ready))


def _presence_families(
    state: SharedState, sampled: bool, evidence_complete: bool
) -> Iterator[GaugeMetricFamily]:
    """Presence detail: the newest reading's owner signal, evidence and sessions by kind."""
    reading = state.presence.reading.value
    if reading is None:
        return
    yield GaugeMetricFamily(
        "vacancyd_presence_owner_signal",
        "1 when the newest presence reading matched the owner policy.",
        value=1.0 if reading.owner_signal else 0.0,
    )
    yield GaugeMetricFamily(
        "vacancyd_presence_evidence_complete",
        "1 when every session in the newest presence reading could be read clearly.",
        value=1.0 if sampled and evidence_complete else 0.0,
    )
    sessions = GaugeMetricFamily(
        "vacancyd_presence_sessions",
        "Sessions in the newest presence reading, by kind.",
        labels=["kind"],
    )
    for kind, n in presence_rules.count_kinds(reading.sessions).items():
        sessions.add_metric([kind], float(n))
    yield sessions


def _pressure_metrics(state: SharedState, now: float) -> Iterator[GaugeMetricFamily]:
    """GPU pressure inputs the gate reads (product map R1–R6), one series per GPU."""
    quality = GaugeMetricFamily(
        "vacancyd_gpu_pressure_quality",
        "GPU pressure reading quality (1 for the current one).",
        labels=["resource", "quality"],
    )
    engaged = GaugeMetricFamily(
        "vacancyd_gpu_pressure_engaged",
        "1 while the owner's GPU work presses the GPU (hysteresis engaged).",
        labels=["resource"],
    )
    calibrated = GaugeMetricFamily(
        "vacancyd_gpu_pressure_calibrated",
        "1 once the GPU's threshold is calibrated (or fixed).",
        labels=["resource"],
    )
    threshold = GaugeMetricFamily(
        "vacancyd_gpu_pressure_threshold_ratio",
        "Owner-load threshold in force, 0-1 (absent while uncalibrated).",
        labels=["resource"],
    )
    owner = GaugeMetricFamily(
        "vacancyd_gpu_owner_load_ratio",
        "Owner's attributed GPU load in the newest pressure sample, 0-1.",
        labels=["resource"],
    )
    borrower = GaugeMetricFamily(
        "vacancyd_gpu_borrower_load_ratio",
        "GPU load of the processes serving local upstreams, 0-1.",
        labels=["resource"],
    )
    observed = GaugeMetricFamily(
        "vacancyd_gpu_calibration_observed_seconds",
        "Observed seconds of owner load in the GPU's calibration.",
        labels=["resource"],
    )
    for name, ps in sorted(state.pressure.items()):
        view = state.pressure_view(name, now)
        assert view is not None
        for each in Quality:
            quality.add_metric([name, each.value], 1.0 if each is view.quality else 0.0)
        engaged.add_metric([name], 1.0 if view.engaged else 0.0)
        calibrated.add_metric([name], 1.0 if view.calibrated else 0.0)
        current = ps.learner.current()
        if current is not None:
            threshold.add_metric([name], current)
        if ps.reading.value is not None:
            owner.add_metric([name], ps.reading.value.owner_load)
            borrower.add_metric([name], ps.reading.value.borrower_load)
        observed.add_metric([name], ps.learner.observed_s)
    unseen = GaugeMetricFamily(
        "vacancyd_upstream_unseen_gpu_work",
        "1 while an upstream has admitted work and none of its processes is seen on a GPU.",
        labels=["upstream"],
    )
    for upstream in sorted(state.upstreams):
        unseen.add_metric([upstream], 1.0 if upstream in state.unseen_gpu_work else 0.0)
    yield from (quality, engaged, calibrated, threshold, owner, borrower, observed, unseen)


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

    def inc(self, *labels: str) -> None:
        """Count one event for ``labels`` (one value per label name, in order)."""
        counts = self._counts
        counts[labels] = counts.get(labels, 0) + 1

    def value(self, *labels: str) -> int:
        """The count for ``labels`` so far (0 when never counted)."""
        return self._counts.get(labels, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, count in list(self._counts.items()):
            family.add_metric(labels, float(count))
        yield family


class Metrics:
    """The daemon's private registry and its counters."""

    def __init__(self) -> None:
        # ``*_created`` series only add cardinality for our always-running counters.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = LoopCounter(
            "vacancyd_admission_decisions",
            "Gate and ledger decisions on borrowed work, by outcome and reason.",
            ("upstream", "outcome", "reason"),
        )
        self.auth_decisions = LoopCounter(
            "vacancyd_auth",
            "Authentication decisions by scope and outcome (allowed, missing, invalid, forbidden).",
            ("scope", "outcome"),
        )
        self.proxied = LoopCounter(
            "vacancyd_proxy_requests",
            "Requests answered by a proxy listener, by route class and status code.",
            ("upstream", "route_class", "code"),
        )
        self.upstream_errors = LoopCounter(
            "vacancyd_upstream_errors",
            "Forwarded requests that failed to reach the upstream or broke mid-response.",
            ("upstream", "stage"),
        )
        for counter in (self.decisions, self.auth_decisions, self.proxied, self.upstream_errors):
            self.registry.register(counter)

    def attach(self, state: SharedState) -> None:
        self.registry.register(StateCollector(state))

    def auth(self, scope: str, outcome: str) -> None:
        self.auth_decisions.inc(scope, outcome)

    def decision(self, upstream: str, outcome: str, reason: str = "") -> None:
        self.decisions.inc(upstream, outcome, reason)

    def request(self, upstream: str, route_class: str, code: str) -> None:
        """One request answered by ``upstream``'s listener (``vacancyd_proxy_requests``)."""
        self.proxied.inc(upstream, route_class, code)

    def upstream_error(self, upstream: str, stage: str) -> None:
        """A forwarded request that failed at ``stage`` (``vacancyd_upstream_errors``)."""
        self.upstream_errors.inc(upstream, stage)
