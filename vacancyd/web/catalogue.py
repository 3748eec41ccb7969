"""Every metric vacancyd exposes, declared once: name, type, help and label names.

The code that renders or increments a metric builds it from its entry here (:func:`gauge`,
:func:`counter`, :func:`histogram`, ...), and the tests that check the docs, dashboards and
alert rules read this table too, so a name, a label or a help text lives in one place.
Names are as registered: a counter ``vacancyd_jobs`` is exposed as ``vacancyd_jobs_total``,
the info ``vacancyd_build`` as ``vacancyd_build_info``, a histogram as its ``_bucket``,
``_sum`` and ``_count`` series.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)


class MetricType(StrEnum):
    """A metric's type, as the exposition's ``# TYPE`` line names it."""

    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    INFO = "info"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its registered ``name``, ``type``, ``help`` text and ``labels`` (names,
    in the order values are given)."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()


CATALOGUE: tuple[MetricSpec, ...] = (
    # Counters and histograms the listeners increment (vacancyd.web.metrics).
    MetricSpec(
        "vacancyd_admission_decisions",
        MetricType.COUNTER,
        "Gate and ledger decisions on borrowed work, by outcome and reason.",
        ("upstream", "outcome", "reason"),
    ),
    MetricSpec(
        "vacancyd_borrower_requests",
        MetricType.COUNTER,
        (
            "Borrowed work requests per borrower (its [[borrower]] name, or default) and "
            "upstream, by outcome (admitted, refused)."
        ),
        ("borrower", "upstream", "outcome"),
    ),
    MetricSpec(
        "vacancyd_borrower_busy_seconds",
        MetricType.COUNTER,
        "Seconds of borrowed jobs that ended, per borrower and primary resource.",
        ("borrower", "resource"),
    ),
    MetricSpec(
        "vacancyd_borrower_tokens",
        MetricType.COUNTER,
        (
            "Tokens the servers reported for borrowed jobs, per borrower, upstream and "
            "direction (prompt, completion)."
        ),
        ("borrower", "upstream", "direction"),
    ),
    MetricSpec(
        "vacancyd_borrower_energy_joules",
        MetricType.COUNTER,
        (
            "GPU energy attributed to borrowed jobs, per borrower and resource, shared "
            "between concurrent jobs by time (absent where the GPU has no energy counter)."
        ),
        ("borrower", "resource"),
    ),
    MetricSpec(
        "vacancyd_auth",
        MetricType.COUNTER,
        (
            "Authentication decisions by scope and outcome (allowed, missing, "
            "invalid, forbidden, host_not_allowed, duplicate)."
        ),
        ("scope", "outcome"),
    ),
    MetricSpec(
        "vacancyd_proxy_requests",
        MetricType.COUNTER,
        "Requests answered by a proxy listener, by route class and status code.",
        ("upstream", "route_class", "code"),
    ),
    MetricSpec(
        "vacancyd_upstream_errors",
        MetricType.COUNTER,
        ("Forwarded requests that failed to reach the upstream or broke mid-response."),
        ("upstream", "stage"),
    ),
    MetricSpec(
        "vacancyd_jobs",
        MetricType.COUNTER,
        (
            "Borrowed jobs that ended, by how: completed, borrower_disconnected, "
            "upstream_failed, cut, not_forwarded."
        ),
        ("upstream", "outcome"),
    ),
    MetricSpec(
        "vacancyd_collector_errors",
        MetricType.COUNTER,
        (
            "Failed samples of the collectors and probes, by collector "
            "(capacity:RESOURCE, pressure:RESOURCE, server:UPSTREAM, presence) and "
            "error (timeout, stuck, failed, unexpected)."
        ),
        ("collector", "error"),
    ),
    MetricSpec(
        "vacancyd_wake_duration_seconds",
        MetricType.HISTOGRAM,
        (
            "Time a sleeping upstream (vLLM sleep mode) took to wake before a "
            "borrowed request was forwarded, by outcome (woken, failed)."
        ),
        ("upstream", "outcome"),
    ),
    MetricSpec(
        "vacancyd_wait_seconds",
        MetricType.HISTOGRAM,
        (
            "Time borrowed requests spent waiting for a slot (busy = wait), by how "
            "the wait ended: admitted, refused (another reason), timeout, queue_full, "
            "disconnected."
        ),
        ("upstream", "outcome"),
    ),
    MetricSpec(
        "vacancyd_connections_refused",
        MetricType.COUNTER,
        (
            "Connections refused by a listener's budgets, by listener and budget "
            "(connections, unauthenticated, peer)."
        ),
        ("listener", "limit"),
    ),
    MetricSpec(
        "vacancyd_malformed_requests",
        MetricType.COUNTER,
        ("Requests a listener could not parse (bad request line or headers), by listener."),
        ("listener",),
    ),
    MetricSpec(
        "vacancyd_request_guard_refusals",
        MetricType.COUNTER,
        ("Requests refused for their Host, Origin, Sec-Fetch-Site or Content-Type, by reason."),
        ("reason",),
    ),
    MetricSpec(
        "vacancyd_residency_credits",
        MetricType.COUNTER,
        (
            "Residency proofs at the per-model step, by outcome (applied, denied) and "
            "reason code (resident, allocator, not_loaded, stale, expiring, "
            "context_unknown, ...)."
        ),
        ("upstream", "outcome", "reason"),
    ),
    MetricSpec(
        "vacancyd_request_duration_seconds",
        MetricType.HISTOGRAM,
        (
            "Time from a request's arrival to the end of its response (streams "
            "included), per upstream and route class."
        ),
        ("upstream", "route_class"),
    ),
    MetricSpec(
        "vacancyd_build",
        MetricType.INFO,
        "vacancyd build information.",
        (),
    ),
    # The lender gauges, rendered from the status document at each scrape (vacancyd.api.metrics).
    MetricSpec(
        "vacancyd_presence_sampled",
        MetricType.GAUGE,
        "1 once owner presence has been sampled.",
        ("source",),
    ),
    MetricSpec(
        "vacancyd_owner_hold",
        MetricType.GAUGE,
        (
            "1 for each of the owner's holds in force (schedule, pause, battery, "
            "exclusive_app), 0 otherwise."
        ),
        ("kind",),
    ),
    MetricSpec(
        "vacancyd_resource_enabled",
        MetricType.GAUGE,
        "Runtime switch per resource.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_quality",
        MetricType.GAUGE,
        "Capacity observation quality (1 for the current one).",
        ("resource", "quality"),
    ),
    MetricSpec(
        "vacancyd_resource_observation_age_seconds",
        MetricType.GAUGE,
        "Age of the newest good capacity sample.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_free_bytes",
        MetricType.GAUGE,
        "Free (available) bytes.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_total_bytes",
        MetricType.GAUGE,
        "Total bytes.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_utilization_ratio",
        MetricType.GAUGE,
        "Utilization, 0-1.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_used_bytes",
        MetricType.GAUGE,
        "Used bytes as the device reports them.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_temperature_celsius",
        MetricType.GAUGE,
        "The GPU's temperature in the newest capacity sample (absent where it reports none).",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_energy_joules",
        MetricType.COUNTER,
        (
            "The GPU's cumulative energy counter since its driver loaded (absent where the "
            "card has no counter)."
        ),
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_resource_lendable",
        MetricType.GAUGE,
        ("1 when the resource passes its switch, quality and probe policy checks."),
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_active_work",
        MetricType.GAUGE,
        "Admission-ledger entries per upstream and phase.",
        ("upstream", "phase"),
    ),
    MetricSpec(
        "vacancyd_listener_up",
        MetricType.GAUGE,
        "1 while the upstream's proxy listener is bound.",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_upstream_lendable",
        MetricType.GAUGE,
        "1 when the gate would admit a borrowed request on the upstream now.",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_upstream_reachable",
        MetricType.GAUGE,
        (
            "1 when the upstream's server accepted a connection when last checked "
            "(checked while the lendability probe is asked; absent without recent "
            "evidence)."
        ),
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_resource_lendable_bytes",
        MetricType.GAUGE,
        ("Free bytes the resource could lend now (free minus min_free_mib; 0 when not lendable)."),
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_upstream_headroom_bytes",
        MetricType.GAUGE,
        ("Bytes a borrowed request on the upstream could use now (0 while it refuses all)."),
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_upstream_largest_model_bytes",
        MetricType.GAUGE,
        (
            "Footprint of the largest configured model a request would be admitted "
            "for now (0 when none would be)."
        ),
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_upstream_largest_model_info",
        MetricType.GAUGE,
        ("1 for the largest configured model a request would be admitted for now."),
        ("upstream", "model"),
    ),
    MetricSpec(
        "vacancyd_waiting",
        MetricType.GAUGE,
        "Borrowed requests waiting for a slot (busy = wait).",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_resource_jobs",
        MetricType.GAUGE,
        ("Borrowed jobs holding each resource (more than one with max_concurrent)."),
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_exclusivity_state",
        MetricType.GAUGE,
        (
            "What a resource shared by exclusive upstreams is doing (1 for the "
            "current state): idle, shared (jobs that may run together) or exclusive "
            "(an exclusive job alone)."
        ),
        ("resource", "state"),
    ),
    MetricSpec(
        "vacancyd_server_observation_quality",
        MetricType.GAUGE,
        "Server observation quality per upstream (1 for the current one).",
        ("upstream", "quality"),
    ),
    MetricSpec(
        "vacancyd_server_observation_age_seconds",
        MetricType.GAUGE,
        "Age of the newest good server observation.",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_server_idle",
        MetricType.GAUGE,
        "1 when the newest server observation showed no request in progress.",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_presence_sessions",
        MetricType.GAUGE,
        "Sessions in the newest presence reading, by kind.",
        ("kind",),
    ),
    MetricSpec(
        "vacancyd_gpu_pressure_quality",
        MetricType.GAUGE,
        "GPU pressure reading quality (1 for the current one).",
        ("resource", "quality"),
    ),
    MetricSpec(
        "vacancyd_gpu_pressure_engaged",
        MetricType.GAUGE,
        "1 while the owner's GPU work presses the GPU (hysteresis engaged).",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_pressure_calibrated",
        MetricType.GAUGE,
        "1 once the GPU's threshold is calibrated (or fixed).",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_pressure_threshold_ratio",
        MetricType.GAUGE,
        "Owner-load threshold in force, 0-1 (absent while uncalibrated).",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_owner_load_ratio",
        MetricType.GAUGE,
        "Owner's attributed GPU load in the newest pressure sample, 0-1.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_borrower_load_ratio",
        MetricType.GAUGE,
        "GPU load of the processes serving local upstreams, 0-1.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_gpu_calibration_observed_seconds",
        MetricType.GAUGE,
        "Observed seconds of owner load in the GPU's calibration.",
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_upstream_unseen_gpu_work",
        MetricType.GAUGE,
        ("1 while an upstream has admitted work and none of its processes is seen on a GPU."),
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_footprint_prior_bytes",
        MetricType.GAUGE,
        ("Learned footprint prior per model: the most memory loading it was seen to take."),
        ("upstream", "model"),
    ),
    MetricSpec(
        "vacancyd_learned_contexts",
        MetricType.GAUGE,
        "Entries in an upstream's learned context map (Ollama residency).",
        ("upstream",),
    ),
    MetricSpec(
        "vacancyd_resource_state_unusable",
        MetricType.GAUGE,
        ("1 while a resource refuses because a durable state file it depends on is unusable."),
        ("resource",),
    ),
    MetricSpec(
        "vacancyd_lending_enabled",
        MetricType.GAUGE,
        "Global lending switch (1 on, 0 off).",
        (),
    ),
    MetricSpec(
        "vacancyd_owner_veto_active",
        MetricType.GAUGE,
        "Host policy veto engaged (1) or released (0).",
        (),
    ),
    MetricSpec(
        "vacancyd_ready",
        MetricType.GAUGE,
        "1 when /readyz answers 200.",
        (),
    ),
    MetricSpec(
        "vacancyd_state_unwritable_files",
        MetricType.GAUGE,
        "Durable state files whose newest write failed.",
        (),
    ),
    MetricSpec(
        "vacancyd_presence_owner_signal",
        MetricType.GAUGE,
        "1 when the newest presence reading matched the owner policy.",
        (),
    ),
    MetricSpec(
        "vacancyd_presence_evidence_complete",
        MetricType.GAUGE,
        ("1 when every session in the newest presence reading could be read clearly."),
        (),
    ),
    MetricSpec(
        "vacancyd_state_write_failures",
        MetricType.COUNTER,
        ("Durable state files that could not be written (read-only directory, full disk)."),
        (),
    ),
    MetricSpec(
        "vacancyd_presence_age_seconds",
        MetricType.GAUGE,
        "Age of the newest presence reading.",
        (),
    ),
    MetricSpec(
        "vacancyd_kubernetes_writes_ok",
        MetricType.GAUGE,
        ("1 when the last attempt of every Kubernetes write (host-side publishing) succeeded."),
        (),
    ),
    # Calls to the upstream servers' own APIs (vacancyd.control.upstreamcalls).
    MetricSpec(
        "vacancyd_upstream_calls",
        MetricType.COUNTER,
        (
            "Calls to an upstream server's own API, by call (unload, clear, free, warm, "
            "cancel, wake, resident) and outcome (done, skipped, failed, timed_out)."
        ),
        ("upstream", "call", "outcome"),
    ),
    # Job execution (vacancyd.control.work, vacancyd.control.upstreamcalls).
    MetricSpec(
        "vacancyd_reclaim_cancelled_jobs",
        MetricType.COUNTER,
        (
            "Borrowed jobs a reclaim cancelled, by kind (stream: a cut connection; "
            "queued: a job cancelled through the server's queue API)."
        ),
        ("upstream", "kind"),
    ),
    # Reclaim (vacancyd.control.reclaim; its unload: vacancyd.control.upstreamcalls).
    MetricSpec(
        "vacancyd_reclaims",
        MetricType.COUNTER,
        (
            "Reclaims by upstream, the trigger of their first edge, and outcome "
            "(stood_down, work_ended, cancelled, timed_out)."
        ),
        ("upstream", "trigger", "outcome"),
    ),
    MetricSpec(
        "vacancyd_unload_duration_seconds",
        MetricType.HISTOGRAM,
        ("Time an upstream's unload took, by outcome (unloaded, skipped, failed, timed_out)."),
        ("upstream", "outcome"),
    ),
    # Card sharing (vacancyd.control.sharing).
    MetricSpec(
        "vacancyd_exclusive_unload_seconds",
        MetricType.HISTOGRAM,
        (
            "Time from asking the servers an exclusive job shares the card with to "
            "unload until their models were confirmed gone (or the unload timed out)."
        ),
        ("upstream", "outcome"),
    ),
    # The in-cluster companion's own gauges (vacancyd.k8s.companion), on its registry.
    MetricSpec(
        "vacancyd_companion_lender_up",
        MetricType.GAUGE,
        "1 while the lender's /status answers within lender_timeout_s.",
        ("lender",),
    ),
    MetricSpec(
        "vacancyd_companion_kubernetes_writes_ok",
        MetricType.GAUGE,
        ("1 when the last attempt of every Kubernetes write for the lender succeeded."),
        ("lender",),
    ),
    MetricSpec(
        "vacancyd_companion_upstream_lendable",
        MetricType.GAUGE,
        ("1 while the lender reports the upstream lendable (what the gated Service sees)."),
        ("lender", "upstream"),
    ),
)

#: The catalogue by name.
METRICS: Mapping[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}


def spec(name: str, kind: MetricType) -> MetricSpec:
    """The entry for ``name``; raises KeyError when it is not declared, ValueError when it
    is declared with another type."""
    found = METRICS[name]
    if found.type is not kind:
        raise ValueError(f"metric {name} is declared a {found.type}, not a {kind}")
    return found


def gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    """A gauge family for ``name`` (``value``: the single sample of an unlabelled gauge)."""
    s = spec(name, MetricType.GAUGE)
    if value is not None:
        return GaugeMetricFamily(s.name, s.help, value=value)
    return GaugeMetricFamily(s.name, s.help, labels=list(s.labels) or None)


def counter_family(name: str) -> CounterMetricFamily:
    """A counter family for ``name``, for a collector that renders it at each scrape."""
    s = spec(name, MetricType.COUNTER)
    return CounterMetricFamily(s.name, s.help, labels=list(s.labels) or None)


def histogram_family(name: str) -> HistogramMetricFamily:
    """A histogram family for ``name``, for a collector that renders it at each scrape."""
    s = spec(name, MetricType.HISTOGRAM)
    return HistogramMetricFamily(s.name, s.help, labels=list(s.labels) or None)


def info(name: str, value: Mapping[str, str]) -> InfoMetricFamily:
    """The info family ``name`` with its one labelled sample ``value``."""
    s = spec(name, MetricType.INFO)
    return InfoMetricFamily(s.name, s.help, value=dict(value))


def counter(name: str, registry: CollectorRegistry) -> Counter:
    """prometheus_client's Counter for ``name``, registered on ``registry``."""
    s = spec(name, MetricType.COUNTER)
    return Counter(s.name, s.help, list(s.labels), registry=registry)


def histogram(name: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> Histogram:
    """prometheus_client's Histogram for ``name`` with ``buckets`` (seconds), registered on
    ``registry``."""
    s = spec(name, MetricType.HISTOGRAM)
    return Histogram(s.name, s.help, list(s.labels), buckets=buckets, registry=registry)
