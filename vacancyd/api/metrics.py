"""Prometheus metrics (docs/architecture.md).

Gauges are rendered from one status document per scrape by a custom collector on a private
registry (no global registry: tests stay independent). Counters are incremented by the proxy
and the authenticator. Names follow Prometheus conventions: base units in the name (bytes,
seconds), 0–1 ratios named ``_ratio``. CPU has no byte capacity, so it has no ``_bytes``
series (not a collector failure).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vacancyd.api.status import StatusViews, read_status
from vacancyd.core.holds import HoldKind
from vacancyd.core.ledger import Phase
from vacancyd.core.observations import Quality
from vacancyd.core.sharing import CardState
from vacancyd.core.status import PresenceStatus, StatusDocument
from vacancyd.web.catalogue import counter_family, gauge
from vacancyd.web.metrics import Metrics

if TYPE_CHECKING:
    from vacancyd.state import SharedState

MIB = 1024 * 1024


class StateCollector(Collector):
    """Renders every gauge of the lender from one status document per scrape (the same
    picture ``/status`` and the Kubernetes publisher render): :func:`render_gauges`."""

    def __init__(self, state: SharedState, views: StatusViews | None = None) -> None:
        self._state = state
        self._views = views

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from render_gauges(read_status(self._state, views=self._views))


def render_gauges(doc: StatusDocument) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Every lender gauge, read from ``doc`` alone (nothing from the live state beside it,
    so a scrape agrees with the ``/status`` and the publication of the same document). The
    GPU's energy counter is a counter family: the card's own cumulative counter, read in
    each capacity sample."""
    yield gauge("vacancyd_lending_enabled", value=1.0 if doc.lending_enabled else 0.0)
    presence = doc.presence
    g = gauge("vacancyd_presence_sampled")
    g.add_metric([presence.source], 1.0 if presence.sampled else 0.0)
    yield g
    if presence.age_s is not None:
        yield gauge("vacancyd_presence_age_seconds", value=presence.age_s)
    yield gauge("vacancyd_owner_veto_active", value=1.0 if presence.veto.active else 0.0)
    yield from _presence_families(presence)
    holds = gauge("vacancyd_owner_hold")
    in_force = {h.kind for h in doc.holds}
    for kind in HoldKind:
        holds.add_metric([kind.value], 1.0 if kind.value in in_force else 0.0)
    yield holds

    enabled = gauge("vacancyd_resource_enabled")
    quality = gauge("vacancyd_resource_quality")
    age_g = gauge("vacancyd_resource_observation_age_seconds")
    free = gauge("vacancyd_resource_free_bytes")
    total = gauge("vacancyd_resource_total_bytes")
    util = gauge("vacancyd_resource_utilization_ratio")
    used = gauge("vacancyd_resource_used_bytes")
    lendable = gauge("vacancyd_resource_lendable")
    temperature = gauge("vacancyd_gpu_temperature_celsius")
    energy = counter_family("vacancyd_gpu_energy_joules")
    for name, res in sorted(doc.resources.items()):
        if res.temperature_c is not None:
            temperature.add_metric([name], res.temperature_c)
        if res.energy_j is not None:
            energy.add_metric([name], res.energy_j)
        enabled.add_metric([name], 1.0 if res.enabled else 0.0)
        for each in Quality:
            quality.add_metric([name, each.value], 1.0 if each is res.quality else 0.0)
        if res.age_s is not None:
            age_g.add_metric([name], res.age_s)
        if res.has_bytes and res.free_mib is not None:
            free.add_metric([name], res.free_mib * MIB)
        if res.has_bytes and res.total_mib is not None:
            total.add_metric([name], res.total_mib * MIB)
        if res.utilization_ratio is not None:
            util.add_metric([name], res.utilization_ratio)
        if res.has_bytes and res.used_mib is not None:
            used.add_metric([name], res.used_mib * MIB)
        lendable.add_metric([name], 1.0 if res.lendable else 0.0)
    yield from (enabled, quality, age_g, free, total, used, util, lendable, temperature, energy)
    yield from _pressure_metrics(doc)
    yield from _learned_metrics(doc)

    active = gauge("vacancyd_active_work")
    for upstream, up in sorted(doc.upstreams.items()):
        counts = Tally(job.phase for job in up.active_work)
        for phase in Phase:
            active.add_metric([upstream, phase.value], float(counts.get(phase.value, 0)))
    yield active
    yield from _sharing_metrics(doc)

    listener = gauge("vacancyd_listener_up")
    for upstream, up in sorted(doc.upstreams.items()):
        if up.listener is not None:
            listener.add_metric([upstream], 1.0 if up.listener.bound else 0.0)
    yield listener

    upstream_lendable = gauge("vacancyd_upstream_lendable")
    for name, up in sorted(doc.upstreams.items()):
        upstream_lendable.add_metric([name], 1.0 if up.lendable else 0.0)
    yield upstream_lendable
    reachable = gauge("vacancyd_upstream_reachable")
    for name, up in sorted(doc.upstreams.items()):
        if up.reachable is not None:
            reachable.add_metric([name], 1.0 if up.reachable.ok else 0.0)
    yield reachable
    yield from _headroom_metrics(doc)

    yield from _server_families(doc)

    yield gauge("vacancyd_ready", value=float(doc.ready))
    yield gauge("vacancyd_state_unwritable_files", value=float(len(doc.write_errors or {})))
    if doc.kubernetes is not None:
        yield gauge("vacancyd_kubernetes_writes_ok", value=1.0 if doc.kubernetes.writes_ok else 0.0)


def _headroom_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """What fits now: lendable bytes per resource and upstream, and the largest model."""
    resource = gauge("vacancyd_resource_lendable_bytes")
    for name, r in sorted(doc.resources.items()):
        if r.lendable_mib is not None:
            resource.add_metric([name], r.lendable_mib * MIB)
    upstream = gauge("vacancyd_upstream_headroom_bytes")
    largest = gauge("vacancyd_upstream_largest_model_bytes")
    info = gauge("vacancyd_upstream_largest_model_info")
    for name, up in sorted(doc.upstreams.items()):
        room = up.headroom
        if room is None:
            continue
        if room.lendable_mib is not None:
            upstream.add_metric([name], room.lendable_mib * MIB)
        largest.add_metric([name], float(room.largest_model_mib or 0) * MIB)
        if room.largest_model is not None:
            info.add_metric([name, room.largest_model], 1.0)
    yield from (resource, upstream, largest, info)


def _sharing_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """Slots, wait queues and exclusivity (docs/architecture.md "Sharing the card")."""
    waiting = gauge("vacancyd_waiting")
    for upstream, up in sorted(doc.upstreams.items()):
        waiting.add_metric([upstream], float(up.sharing.waiting if up.sharing else 0))
    yield waiting
    jobs = gauge("vacancyd_resource_jobs")
    for name, res in sorted(doc.resources.items()):
        jobs.add_metric([name], float(res.jobs))
    yield jobs
    shared = sorted((name, res.card) for name, res in doc.resources.items() if res.card)
    if not shared:
        return
    card = gauge("vacancyd_exclusivity_state")
    for name, now in shared:
        for each in CardState:
            card.add_metric([name, each.value], 1.0 if each.value == now else 0.0)
    yield card


def _server_families(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """The server observation the gate reads (llama-server ``/slots``): its quality against
    the upstream's freshness bound, its age, and whether the server was idle."""
    quality = gauge("vacancyd_server_observation_quality")
    age = gauge("vacancyd_server_observation_age_seconds")
    idle = gauge("vacancyd_server_idle")
    for name, up in sorted(doc.upstreams.items()):
        server = up.server
        if server is None:
            continue
        for each in Quality:
            quality.add_metric([name, each.value], 1.0 if each is server.quality else 0.0)
        if server.age_s is not None:
            age.add_metric([name], server.age_s)
        if server.idle is not None:
            idle.add_metric([name], 1.0 if server.idle else 0.0)
    yield from (quality, age, idle)


def _presence_families(presence: PresenceStatus) -> Iterator[GaugeMetricFamily]:
    """Presence detail: the newest reading's owner signal, evidence and sessions by kind."""
    if presence.owner_signal is None:
        return
    yield gauge("vacancyd_presence_owner_signal", value=1.0 if presence.owner_signal else 0.0)
    yield gauge(
        "vacancyd_presence_evidence_complete",
        value=1.0 if presence.sampled and presence.evidence_complete else 0.0,
    )
    sessions = gauge("vacancyd_presence_sessions")
    for kind, n in presence.session_counts.items():
        sessions.add_metric([kind], float(n))
    yield sessions


def _pressure_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """GPU pressure inputs the gate reads, one series per GPU."""
    quality = gauge("vacancyd_gpu_pressure_quality")
    engaged = gauge("vacancyd_gpu_pressure_engaged")
    calibrated = gauge("vacancyd_gpu_pressure_calibrated")
    threshold = gauge("vacancyd_gpu_pressure_threshold_ratio")
    owner = gauge("vacancyd_gpu_owner_load_ratio")
    borrower = gauge("vacancyd_gpu_borrower_load_ratio")
    observed = gauge("vacancyd_gpu_calibration_observed_seconds")
    for name, res in sorted(doc.resources.items()):
        p = res.pressure
        if p is None:
            continue
        for each in Quality:
            quality.add_metric([name, each.value], 1.0 if each is p.quality else 0.0)
        engaged.add_metric([name], 1.0 if p.engaged else 0.0)
        calibrated.add_metric([name], 1.0 if p.calibrated else 0.0)
        if p.threshold_ratio is not None:
            threshold.add_metric([name], p.threshold_ratio)
        if p.owner_load_ratio is not None:
            owner.add_metric([name], p.owner_load_ratio)
        if p.borrower_load_ratio is not None:
            borrower.add_metric([name], p.borrower_load_ratio)
        observed.add_metric([name], p.calibration_observed_s)
    unseen = gauge("vacancyd_upstream_unseen_gpu_work")
    for upstream, up in sorted(doc.upstreams.items()):
        unseen.add_metric([upstream], 1.0 if up.unseen_gpu_work is not None else 0.0)
    yield from (quality, engaged, calibrated, threshold, owner, borrower, observed, unseen)


def _learned_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """Learned footprint priors, learned contexts, and resources refusing on unusable state."""
    priors = gauge("vacancyd_footprint_prior_bytes")
    contexts = gauge("vacancyd_learned_contexts")
    for upstream, up in sorted(doc.upstreams.items()):
        for model, mib in sorted((up.footprint_priors_mib or {}).items()):
            priors.add_metric([upstream, model], mib * MIB)
        if up.learned_contexts is not None:
            contexts.add_metric([upstream], float(len(up.learned_contexts.contexts)))
    broken = gauge("vacancyd_resource_state_unusable")
    for name, res in sorted(doc.resources.items()):
        broken.add_metric([name], 1.0 if res.state_error is not None else 0.0)
    yield from (priors, contexts, broken)


class SaverHealth(Protocol):
    """What the durable-state saver reports: failed writes so far, failing files -> why."""

    @property
    def failures(self) -> int: ...

    @property
    def errors(self) -> Mapping[str, str]: ...


class SaverCollector(Collector):
    """Durable-state write failures so far (a counter; the gauge of files failing now,
    ``vacancyd_state_unwritable_files``, is rendered from the status document)."""

    def __init__(self, saver: SaverHealth) -> None:
        self._saver = saver

    def collect(self) -> Iterator[CounterMetricFamily]:
        failures = counter_family("vacancyd_state_write_failures")
        failures.add_metric([], float(self._saver.failures))
        yield failures


def attach_state(metrics: Metrics, state: SharedState, views: StatusViews | None = None) -> None:
    """Render the state's gauges on ``metrics``' registry at every scrape (``views``: see
    :class:`vacancyd.api.status.StatusViews`)."""
    metrics.registry.register(StateCollector(state, views))


def attach_saver(metrics: Metrics, saver: SaverHealth) -> None:
    """Render durable-state write health on ``metrics``' registry at every scrape."""
    metrics.registry.register(SaverCollector(saver))


__all__ = ["Metrics", "StateCollector", "attach_saver", "attach_state", "render_gauges"]
