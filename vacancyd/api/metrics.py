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

from vacancyd.api.status import read_status
from vacancyd.core.holds import HoldKind
from vacancyd.core.ledger import Phase
from vacancyd.core.observations import Quality
from vacancyd.core.sharing import CardState
from vacancyd.core.status import PresenceStatus, StatusDocument
from vacancyd.web.metrics import Metrics

if TYPE_CHECKING:
    from vacancyd.state import SharedState

MIB = 1024 * 1024


class StateCollector(Collector):
    """Renders every gauge of the lender from one status document per scrape (the same
    picture ``/status`` and the Kubernetes publisher render): :func:`render_gauges`."""

    def __init__(self, state: SharedState) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from render_gauges(read_status(self._state))


def render_gauges(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """Every lender gauge, read from ``doc`` alone (nothing from the live state beside it,
    so a scrape agrees with the ``/status`` and the publication of the same document)."""
    yield GaugeMetricFamily(
        "vacancyd_lending_enabled",
        "Global lending switch (1 on, 0 off).",
        value=1.0 if doc.lending_enabled else 0.0,
    )
    presence = doc.presence
    g = GaugeMetricFamily(
        "vacancyd_presence_sampled",
        "1 once owner presence has been sampled.",
        labels=["source"],
    )
    g.add_metric([presence.source], 1.0 if presence.sampled else 0.0)
    yield g
    if presence.age_s is not None:
        yield GaugeMetricFamily(
            "vacancyd_presence_age_seconds",
            "Age of the newest presence reading.",
            value=presence.age_s,
        )
    yield GaugeMetricFamily(
        "vacancyd_owner_veto_active",
        "Host policy veto engaged (1) or released (0).",
        value=1.0 if presence.veto.active else 0.0,
    )
    yield from _presence_families(presence)
    holds = GaugeMetricFamily(
        "vacancyd_owner_hold",
        "1 for each of the owner's holds in force (schedule, pause, battery, "
        "exclusive_app), 0 otherwise.",
        labels=["kind"],
    )
    in_force = {h.kind for h in doc.holds}
    for kind in HoldKind:
        holds.add_metric([kind.value], 1.0 if kind.value in in_force else 0.0)
    yield holds

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
    total = GaugeMetricFamily("vacancyd_resource_total_bytes", "Total bytes.", labels=["resource"])
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
    for name, res in sorted(doc.resources.items()):
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
    yield from (enabled, quality, age_g, free, total, used, util, lendable)
    yield from _pressure_metrics(doc)
    yield from _learned_metrics(doc)

    active = GaugeMetricFamily(
        "vacancyd_active_work",
        "Admission-ledger entries per upstream and phase.",
        labels=["upstream", "phase"],
    )
    for upstream, up in sorted(doc.upstreams.items()):
        counts = Tally(job.phase for job in up.active_work)
        for phase in Phase:
            active.add_metric([upstream, phase.value], float(counts.get(phase.value, 0)))
    yield active
    yield from _sharing_metrics(doc)

    listener = GaugeMetricFamily(
        "vacancyd_listener_up",
        "1 while the upstream's proxy listener is bound.",
        labels=["upstream"],
    )
    for upstream, up in sorted(doc.upstreams.items()):
        if up.listener is not None:
            listener.add_metric([upstream], 1.0 if up.listener.bound else 0.0)
    yield listener

    upstream_lendable = GaugeMetricFamily(
        "vacancyd_upstream_lendable",
        "1 when the gate would admit a borrowed request on the upstream now.",
        labels=["upstream"],
    )
    for name, up in sorted(doc.upstreams.items()):
        upstream_lendable.add_metric([name], 1.0 if up.lendable else 0.0)
    yield upstream_lendable
    reachable = GaugeMetricFamily(
        "vacancyd_upstream_reachable",
        "1 when the upstream's server accepted a connection when last checked (checked while "
        "the lendability probe is asked; absent without recent evidence).",
        labels=["upstream"],
    )
    for name, up in sorted(doc.upstreams.items()):
        if up.reachable is not None:
            reachable.add_metric([name], 1.0 if up.reachable.ok else 0.0)
    yield reachable
    yield from _headroom_metrics(doc)

    yield from _server_families(doc)

    yield GaugeMetricFamily("vacancyd_ready", "1 when /readyz answers 200.", value=float(doc.ready))
    yield GaugeMetricFamily(
        "vacancyd_state_unwritable_files",
        "Durable state files whose newest write failed.",
        value=float(len(doc.write_errors or {})),
    )
    if doc.kubernetes is not None:
        yield GaugeMetricFamily(
            "vacancyd_kubernetes_writes_ok",
            "1 when the last attempt of every Kubernetes write (host-side publishing) succeeded.",
            value=1.0 if doc.kubernetes.writes_ok else 0.0,
        )


def _headroom_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """What fits now: lendable bytes per resource and upstream, and the largest model."""
    resource = GaugeMetricFamily(
        "vacancyd_resource_lendable_bytes",
        "Free bytes the resource could lend now (free minus min_free_mib; 0 when not lendable).",
        labels=["resource"],
    )
    for name, r in sorted(doc.resources.items()):
        if r.lendable_mib is not None:
            resource.add_metric([name], r.lendable_mib * MIB)
    upstream = GaugeMetricFamily(
        "vacancyd_upstream_headroom_bytes",
        "Bytes a borrowed request on the upstream could use now (0 while it refuses all).",
        labels=["upstream"],
    )
    largest = GaugeMetricFamily(
        "vacancyd_upstream_largest_model_bytes",
        "Footprint of the largest configured model a request would be admitted for now "
        "(0 when none would be).",
        labels=["upstream"],
    )
    info = GaugeMetricFamily(
        "vacancyd_upstream_largest_model_info",
        "1 for the largest configured model a request would be admitted for now.",
        labels=["upstream", "model"],
    )
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
    waiting = GaugeMetricFamily(
        "vacancyd_waiting",
        "Borrowed requests waiting for a slot (busy = wait).",
        labels=["upstream"],
    )
    for upstream, up in sorted(doc.upstreams.items()):
        waiting.add_metric([upstream], float(up.sharing.waiting if up.sharing else 0))
    yield waiting
    jobs = GaugeMetricFamily(
        "vacancyd_resource_jobs",
        "Borrowed jobs holding each resource (more than one with max_concurrent).",
        labels=["resource"],
    )
    for name, res in sorted(doc.resources.items()):
        jobs.add_metric([name], float(res.jobs))
    yield jobs
    shared = sorted((name, res.card) for name, res in doc.resources.items() if res.card)
    if not shared:
        return
    card = GaugeMetricFamily(
        "vacancyd_exclusivity_state",
        "What a resource shared by exclusive upstreams is doing (1 for the current state): "
        "idle, shared (jobs that may run together) or exclusive (an exclusive job alone).",
        labels=["resource", "state"],
    )
    for name, now in shared:
        for each in CardState:
            card.add_metric([name, each.value], 1.0 if each.value == now else 0.0)
    yield card


def _server_families(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """The server observation the gate reads (llama-server ``/slots``): its quality against
    the upstream's freshness bound, its age, and whether the server was idle."""
    quality = GaugeMetricFamily(
        "vacancyd_server_observation_quality",
        "Server observation quality per upstream (1 for the current one).",
        labels=["upstream", "quality"],
    )
    age = GaugeMetricFamily(
        "vacancyd_server_observation_age_seconds",
        "Age of the newest good server observation.",
        labels=["upstream"],
    )
    idle = GaugeMetricFamily(
        "vacancyd_server_idle",
        "1 when the newest server observation showed no request in progress.",
        labels=["upstream"],
    )
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
    yield GaugeMetricFamily(
        "vacancyd_presence_owner_signal",
        "1 when the newest presence reading matched the owner policy.",
        value=1.0 if presence.owner_signal else 0.0,
    )
    yield GaugeMetricFamily(
        "vacancyd_presence_evidence_complete",
        "1 when every session in the newest presence reading could be read clearly.",
        value=1.0 if presence.sampled and presence.evidence_complete else 0.0,
    )
    sessions = GaugeMetricFamily(
        "vacancyd_presence_sessions",
        "Sessions in the newest presence reading, by kind.",
        labels=["kind"],
    )
    for kind, n in presence.session_counts.items():
        sessions.add_metric([kind], float(n))
    yield sessions


def _pressure_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """GPU pressure inputs the gate reads, one series per GPU."""
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
    unseen = GaugeMetricFamily(
        "vacancyd_upstream_unseen_gpu_work",
        "1 while an upstream has admitted work and none of its processes is seen on a GPU.",
        labels=["upstream"],
    )
    for upstream, up in sorted(doc.upstreams.items()):
        unseen.add_metric([upstream], 1.0 if up.unseen_gpu_work is not None else 0.0)
    yield from (quality, engaged, calibrated, threshold, owner, borrower, observed, unseen)


def _learned_metrics(doc: StatusDocument) -> Iterator[GaugeMetricFamily]:
    """Learned footprint priors, learned contexts, and resources refusing on unusable state."""
    priors = GaugeMetricFamily(
        "vacancyd_footprint_prior_bytes",
        "Learned footprint prior per model: the most memory loading it was seen to take.",
        labels=["upstream", "model"],
    )
    contexts = GaugeMetricFamily(
        "vacancyd_learned_contexts",
        "Entries in an upstream's learned context map (Ollama residency).",
        labels=["upstream"],
    )
    for upstream, up in sorted(doc.upstreams.items()):
        for model, mib in sorted((up.footprint_priors_mib or {}).items()):
            priors.add_metric([upstream, model], mib * MIB)
        if up.learned_contexts is not None:
            contexts.add_metric([upstream], float(len(up.learned_contexts.contexts)))
    broken = GaugeMetricFamily(
        "vacancyd_resource_state_unusable",
        "1 while a resource refuses because a durable state file it depends on is unusable.",
        labels=["resource"],
    )
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
        failures = CounterMetricFamily(
            "vacancyd_state_write_failures",
            "Durable state files that could not be written (read-only directory, full disk).",
        )
        failures.add_metric([], float(self._saver.failures))
        yield failures


def attach_state(metrics: Metrics, state: SharedState) -> None:
    """Render the state's gauges on ``metrics``' registry at every scrape."""
    metrics.registry.register(StateCollector(state))


def attach_saver(metrics: Metrics, saver: SaverHealth) -> None:
    """Render durable-state write health on ``metrics``' registry at every scrape."""
    metrics.registry.register(SaverCollector(saver))


__all__ = ["Metrics", "StateCollector", "attach_saver", "attach_state", "render_gauges"]
