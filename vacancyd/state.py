"""SharedState: the daemon's only mutable store (docs/architecture.md).

Collectors write timestamped observations; the admin API flips switches; the proxy and the
gate read a frozen :class:`~vacancyd.core.snapshot.Snapshot`; borrowed work
(:mod:`vacancyd.control.work`) is the only writer of the ledger. All times are monotonic
seconds from :func:`time.monotonic` (``SharedState.clock``), which is what the standard
event loop's clock reads too. Not uvloop's loop clock: it is cached per loop iteration at
millisecond resolution, so a release and the capacity sample it asks for would often carry
the same stamp and the ledger's "sample after the last release" rule could not be met. The
rules (veto hysteresis, pressure learning and its pause, unseen GPU work, readiness) are pure
code in :mod:`vacancyd.core`; this module only stores their inputs and tells subscribers
about each transition with a typed event from :mod:`vacancyd.core.events`. The event bus is
for observers (``/events``, the Kubernetes publisher, telemetry): the writers that can start
a reclaim return the reclaim :class:`~vacancyd.core.reclaim.Edge` they raised, and their
caller in :mod:`vacancyd.control` hands it on (see ARCHITECTURE.md, "The owner's return").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from vacancyd.bus import EventBus, Listener
from vacancyd.core import presence as presence_rules
from vacancyd.core import residency
from vacancyd.core.events import (
    CapacityChanged,
    EdgeRaised,
    HoldChanged,
    JobChanged,
    JobHoldChanged,
    LendingSwitched,
    ListenerChanged,
    PresenceSampled,
    PressureEdgeRaised,
    PressureReleased,
    ReclaimChanged,
    ResourceSwitched,
    Stopping,
    ThermalChanged,
    UnseenGpuWorkChanged,
    VetoChanged,
)
from vacancyd.core.exposure import Exposure
from vacancyd.core.holds import Hold
from vacancyd.core.ledger import Ledger
from vacancyd.core.lifecycle import Hold as JobHold
from vacancyd.core.observations import (
    CapacityReading,
    Observation,
    Quality,
    SampleKey,
    SampleKind,
)
from vacancyd.core.policy import ResourcePolicy, UpstreamPolicy
from vacancyd.core.presence import PresenceReading
from vacancyd.core.pressure import (
    Attribution,
    PressureEdge,
    PressurePolicy,
    PressureSample,
    PressureState,
    UnseenGpuWork,
)
from vacancyd.core.reach import Reach
from vacancyd.core.readiness import not_ready
from vacancyd.core.reclaim import Edge, Reclaim, Trigger
from vacancyd.core.snapshot import (
    PresenceView,
    ResourceView,
    ServerState,
    Snapshot,
    presence_view_of,
    pressure_view,
)
from vacancyd.core.status import PowerLimitStatus
from vacancyd.core.thermal import ThermalChange, ThermalPolicy, ThermalTracker
from vacancyd.core.usage import UNNAMED, borrower_label
from vacancyd.core.veto import VetoTracker
from vacancyd.samples import OnDemandSamples

__all__ = [
    "REACH_DEMAND_S",
    "ListenerState",
    "PresenceReading",
    "PresenceState",
    "PressureSample",
    "PressureState",
    "SharedState",
]

log = logging.getLogger(__name__)


@dataclass
class PresenceState:
    source: str
    refuses: bool = True
    reading: Observation[PresenceReading] = field(default_factory=Observation)


@dataclass
class ListenerState:
    address: str
    bound: bool = False
    error: str | None = None


class _ReclaimViews(Mapping[str, dict[str, object]]):
    __slots__ = ("_reclaims",)

    def __init__(self, reclaims: Mapping[str, Reclaim]) -> None:
        self._reclaims = reclaims

    def __getitem__(self, name: str) -> dict[str, object]:
        return self._reclaims[name].view()

    def __iter__(self) -> Iterator[str]:
        return iter(self._reclaims)

    def __len__(self) -> int:
        return len(self._reclaims)


#: Seconds after the last lendability probe during which an upstream's connection check
#: keeps running; without probes it idles (it would only open connections nobody reads).
REACH_DEMAND_S = 60.0


class SharedState:
    """Mutable daemon state. Not thread-safe: touch it only from the event loop."""

    def __init__(
        self,
        resources: Mapping[str, ResourcePolicy],
        upstreams: Mapping[str, UpstreamPolicy],
        *,
        presence_source: str,
        presence_refuses: bool = True,
        presence_max_age_s: float = 15.0,
        release_after_s: float = 60.0,
        clock: Callable[[], float] | None = None,
        pressure: Mapping[str, PressurePolicy] | None = None,
        thermal: Mapping[str, ThermalPolicy] | None = None,
    ) -> None:
        self.resources = dict(resources)
        self.upstreams = dict(upstreams)
        self.clock = clock or time.monotonic
        self.lending_enabled = True
        #: Set once by the daemon's shutdown: refuse new work, report not ready.
        self.stopping = False
        #: ``GET /events`` streams open now (the Kubernetes companion follows one): at a
        #: stop they are told ``stopping`` before the listeners close (Daemon.shutdown).
        self.event_followers = 0
        self.switches = {name: p.enabled for name, p in resources.items()}
        self.capacity: dict[str, Observation[CapacityReading]] = {
            name: Observation() for name in resources
        }
        self.servers: dict[str, Observation[ServerState]] = {}
        #: Per upstream: whether its server accepts connections (vacancyd.core.reach).
        self.reach: dict[str, Reach] = {}
        #: Evidence of reachability older than this (seconds) no longer counts.
        self.reach_max_age_s = 30.0
        #: Per upstream: when the lendability probe last asked (monotonic s); the connection
        #: check runs only while someone probes (vacancyd.collectors.reach).
        self.reach_asked_at: dict[str, float] = {}
        self.presence = PresenceState(presence_source, refuses=presence_refuses)
        self.presence_max_age_s = presence_max_age_s
        self.veto = VetoTracker(release_after_s)
        self.ledger = Ledger(self.upstreams)
        self.listeners: dict[str, ListenerState] = {}
        #: per upstream: what kind of socket serves its target (vacancyd.core.exposure)
        self.target_exposure: dict[str, Exposure] = {}
        #: Samples on demand: collectors wake for them, admission waits for them.
        self.samples = OnDemandSamples(self.clock, self._observed_at)
        self._presence_view: PresenceView | None = None
        self._presence_view_of: Observation[PresenceReading] | None = None
        #: The event bus beside the store: every transition as a typed event.
        self.events = EventBus()
        #: Pool name -> its member upstreams, first member first (``[[pool]]``).
        self.pools: dict[str, tuple[str, ...]] = {}
        self.pressure: dict[str, PressureState] = {
            name: PressureState(p, p.new_learner(), p.new_tracker())
            for name, p in (pressure or {}).items()
        }
        self.unseen = UnseenGpuWork()
        #: Upstreams whose admitted work is not seen on their GPU -> why (a live view).
        self.unseen_gpu_work: Mapping[str, str] = self.unseen.flagged
        #: Per GPU with ``max_temperature_c``: its temperature guard (vacancyd.core.thermal),
        #: fed by each capacity sample.
        self.thermal: dict[str, ThermalTracker] = {
            name: ThermalTracker(p) for name, p in (thermal or {}).items()
        }
        #: Each upstream's latest reclaim as published by vacancyd.control.reclaim.
        self.reclaims: dict[str, Reclaim] = {}
        #: Each upstream's latest reclaim as plain JSON values (see ``Reclaim.view``); a
        #: live view of :attr:`reclaims`.
        self.reclaim_views: Mapping[str, dict[str, object]] = _ReclaimViews(self.reclaims)
        #: Per resource, when a reclaim last unloaded an upstream depending on it (monotonic).
        self.yielded_at: dict[str, float] = {}
        #: Per upstream, how many times a reclaim unloaded it: after one, its server's next
        #: observation says nothing of the borrowed jobs before (vacancyd.runtime.learned).
        self.unloads: dict[str, int] = {}
        #: Per upstream, what it learned of its models' contexts (Ollama; persisted; written
        #: by vacancyd.runtime.learned.Learner).
        self.learning: dict[str, residency.ContextLearning] = {}
        #: Per upstream, per model: learned footprint priors in MiB (persisted; written by
        #: vacancyd.runtime.learned.Learner).
        self.priors: dict[str, dict[str, int]] = {}
        #: Per resource, why a durable state file it depends on could not be used.
        self.state_errors: dict[str, str] = {}
        #: Per durable state file (or the directory), why its newest write failed.
        self.write_errors: dict[str, str] = {}
        #: Resources with a held job not yet on disk -> why its write failed (None: under
        #: way). Kept by vacancyd.control.work; such a resource lends nothing.
        self.unsaved_holds: dict[str, str | None] = {}
        #: The owner's holds in force (vacancyd.control.owner writes them; core/holds.py).
        self.holds: tuple[Hold, ...] = ()
        #: Per GPU with a lending power limit, what the power limiter last did (written by
        #: vacancyd.runtime.powerlimit, shown in /status).
        self.power_limits: dict[str, PowerLimitStatus] = {}

    # -- change notification -------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` on each state transition; returns an unsubscribe
        (:meth:`EventBus.subscribe` of :attr:`events`)."""
        return self.events.subscribe(listener)

    # -- writers -------------------------------------------------------------------------

    def set_stopping(self, grace_s: float | None = None, in_flight: int = 0) -> None:
        """Mark the daemon as shutting down: new work is refused, /readyz turns 503, and
        followers of ``/events`` are told at once (event ``stopping``, with the drain's
        ``grace_s`` in seconds and the ``in_flight`` borrowed exchanges when given)."""
        if not self.stopping:
            self.stopping = True
            self.events.emit(Stopping(grace_s, in_flight))

    def set_lending(self, enabled: bool) -> bool:
        """Flip the global lending switch; returns True when it changed."""
        changed = self.lending_enabled != enabled
        self.lending_enabled = enabled
        if changed:
            log.info("lending switched %s", "on" if enabled else "off")
            self.events.emit(LendingSwitched(enabled))
        return changed

    def set_resource_switch(self, name: str, enabled: bool) -> bool:
        """Flip one resource's runtime switch. Raises KeyError for an undeclared resource."""
        if name not in self.switches:
            raise KeyError(name)
        changed = self.switches[name] != enabled
        self.switches[name] = enabled
        if changed:
            log.info("resource %s switched %s", name, "on" if enabled else "off")
            self.events.emit(ResourceSwitched(name, enabled))
        return changed

    def free_mib(self, resource: str) -> float | None:
        """The newest free-memory reading of ``resource`` in MiB, or None."""
        capacity = self.capacity.get(resource)
        value = capacity.value if capacity is not None else None
        return value.free_mib if value is not None else None

    def record_capacity(self, name: str, reading: CapacityReading, now: float) -> tuple[Edge, ...]:
        """A capacity sample of ``name`` at ``now`` (monotonic s); returns the thermal edge a
        GPU that stayed too hot raises (none otherwise)."""
        before = self.capacity[name].quality(now, self.resources[name].stale_after_s)
        self.capacity[name] = self.capacity[name].succeeded(reading, now)
        if before is not Quality.READY:
            log.info("resource %s measured", name)
            self.events.emit(CapacityChanged(name, Quality.READY))
        tracker = self.thermal.get(name)
        raised: tuple[Edge, ...] = ()
        if tracker is not None:
            raised = self._observe_thermal(name, tracker, reading.temperature_c, now)
        self.samples.observed(SampleKey.capacity(name))
        return raised

    def _observe_thermal(
        self, name: str, tracker: ThermalTracker, temperature_c: float | None, now: float
    ) -> tuple[Edge, ...]:
        """Feed GPU ``name``'s temperature guard; a ``yield`` change raises a ``thermal``
        reclaim edge (returned), answered by each affected upstream's reclaim policy as
        pressure is."""
        raised: tuple[Edge, ...] = ()
        for change in tracker.observe(temperature_c, now):
            assert temperature_c is not None  # observe changes nothing without a reading
            policy = tracker.policy
            if change is ThermalChange.HOT:
                log.warning(
                    "resource %s: %g °C, above its %g °C limit: no new borrowed work until "
                    "it is below %g °C",
                    name,
                    temperature_c,
                    policy.max_c,
                    policy.resume_c,
                )
            elif change is ThermalChange.COOLED:
                log.info("resource %s: cooled to %g °C; lending may resume", name, temperature_c)
            else:
                log.warning(
                    "resource %s: above %g °C for %g s; yielding its borrowed work",
                    name,
                    policy.max_c,
                    policy.hot_yield_after_s,
                )
            self.events.emit(ThermalChanged(name, change.value, tracker.hot, temperature_c, now))
            if change is ThermalChange.YIELD:
                raised += self.raise_edge(
                    Trigger.THERMAL,
                    now,
                    resource=name,
                    detail=f"{temperature_c:g} °C, above {policy.max_c:g} °C for "
                    f"{policy.hot_yield_after_s:g} s",
                )
        return raised

    def record_capacity_failure(self, name: str, error: str, now: float) -> None:
        previous = self.capacity[name]
        self.capacity[name] = previous.failed(error, now)
        if (
            previous.error != error
            or previous.failed_at is None
            or (previous.observed_at is not None and previous.failed_at < previous.observed_at)
        ):
            log.warning("resource %s unmeasured: %s", name, error)
            self.events.emit(CapacityChanged(name, Quality.UNKNOWN, error))

    def record_pressure(self, name: str, sample: PressureSample, now: float) -> tuple[Edge, ...]:
        """A valid pressure poll of GPU ``name`` (docs/architecture.md, "Yield").

        Feeds the learner (paused while a presence source is configured but stale: the
        gate's step 2) and the hysteresis; emits ``pressure`` events on a rising edge
        (``edge=True``) and on release (``edge=False``). Returns the reclaim edge a rising
        edge raises (none otherwise).
        """
        ps = self.pressure[name]
        if ps.pending_cache is not None:
            why = ps.learner.load_cache(ps.pending_cache, sample.gpu)
            if why is None:
                log.info(
                    "resource %s: calibration restored (%.0f s observed)",
                    name,
                    ps.learner.observed_s,
                )
            else:
                log.warning("resource %s: saved calibration ignored: %s", name, why)
            ps.pending_cache = None
        ps.gpu = sample.gpu
        load = sample.attribution.owner_load
        if self.presence_view(now).allows_learning(now):
            ps.learner.observe(load, now)
        was_engaged = ps.tracker.engaged
        was_ready = ps.reading.quality(now, ps.policy.stale_after_s) is Quality.READY
        edge = ps.tracker.observe(load, ps.learner.current(), now)
        ps.reading = ps.reading.succeeded(sample.attribution, now)
        if not was_ready:
            log.info("resource %s: GPU pressure measured", name)
        raised: tuple[Edge, ...] = ()
        if edge is not None:
            raised = self._pressure_edge(name, ps, edge)
        elif was_engaged and not ps.tracker.engaged:
            log.info("resource %s: GPU pressure released", name)
            self.events.emit(PressureReleased(name))
        self._track_unseen(name, sample.attribution)
        return raised

    def record_pressure_failure(self, name: str, error: str, now: float) -> tuple[Edge, ...]:
        """A pressure poll without a valid reading: unknown at once, an edge after the gap
        (returned, as by :meth:`record_pressure`)."""
        ps = self.pressure[name]
        previous = ps.reading
        ps.reading = previous.failed(error, now)
        if (
            previous.error != error
            or previous.failed_at is None
            or (previous.observed_at is not None and previous.failed_at < previous.observed_at)
        ):
            log.warning("resource %s: GPU pressure unknown: %s", name, error)
        edge = ps.tracker.unknown(now)
        return () if edge is None else self._pressure_edge(name, ps, edge)

    def _pressure_edge(self, name: str, ps: PressureState, edge: PressureEdge) -> tuple[Edge, ...]:
        ps.last_edge = edge
        threshold = ps.learner.current()
        load = ps.reading.value.owner_load if ps.reading.value is not None else None
        log.warning(
            "resource %s: GPU pressure edge (%s%s)",
            name,
            edge.cause.value,
            f", unknown for {edge.unknown_for_s:.0f} s" if edge.unknown_for_s else "",
        )
        self.events.emit(
            PressureEdgeRaised(
                name, ps.tracker.engaged, edge.cause, edge.at, edge.unknown_for_s, load, threshold
            )
        )
        # The same edge starts a reclaim of the affected upstreams (docs/reclaim.md).
        return self.raise_edge(
            Trigger.PRESSURE,
            edge.at,
            resource=name,
            detail=f"GPU pressure on {name} ({edge.cause.value})",
        )

    def _track_unseen(self, name: str, attribution: Attribution) -> None:
        running = {job.upstream for job in self.ledger.jobs()}
        gpu_of = {u: self._unseen_resource(p) for u, p in self.upstreams.items()}
        for change in self.unseen.observe(name, attribution.seen, running, gpu_of):
            if change.active:
                log.warning("upstream %s: unseen GPU work: %s", change.upstream, change.detail)
            else:
                log.info("upstream %s: its processes are seen on the GPU again", change.upstream)
            self.events.emit(UnseenGpuWorkChanged(change.upstream, change.active, change.detail))

    def _unseen_resource(self, policy: UpstreamPolicy) -> str | None:
        for name in policy.resources:
            if name in self.pressure:
                return name
        return None

    def record_server(self, upstream: str, state: ServerState, now: float) -> None:
        """A server observation of ``upstream`` at ``now`` (monotonic s); what it teaches
        is learned by :class:`vacancyd.runtime.learned.Learner` first."""
        self.servers[upstream] = self.servers.get(upstream, Observation()).succeeded(state, now)
        self.samples.observed(SampleKey.server(upstream))

    def yielded(self, upstream: str, now: float) -> None:
        """A reclaim unloaded (or tried to unload) ``upstream`` at ``now`` (monotonic s): no
        residency is credited on its resources from an observation older than this."""
        policy = self.upstreams.get(upstream)
        if policy is None:
            return
        for name in policy.resources:
            self.yielded_at[name] = now
        self.unloads[upstream] = self.unloads.get(upstream, 0) + 1

    def record_reach(self, upstream: str, ok: bool, now: float, error: str = "") -> None:
        """Record whether ``upstream``'s server accepted a connection at ``now`` (monotonic
        s); logs each change once."""
        before = self.reach.get(upstream, Reach())
        after = before.learned(ok, now, error)
        if after is before:
            return
        self.reach[upstream] = after
        if after.ok is not before.ok:
            if not ok:
                log.warning("upstream %s does not answer: %s", upstream, error or "unreachable")
            elif before.ok is False:
                log.info("upstream %s answers again", upstream)

    def upstream_unreachable(self, upstream: str) -> bool:
        """True while the newest (recent) evidence says ``upstream``'s server is down.

        Also records that someone asked, which keeps ``upstream``'s connection check
        running (and wakes it when it was idle)."""
        first = upstream not in self.reach_asked_at or (
            self.clock() - self.reach_asked_at[upstream] > REACH_DEMAND_S
        )
        self.reach_asked_at[upstream] = self.clock()
        if first:
            self.samples.wanted(SampleKey.reach(upstream)).set()
        reach = self.reach.get(upstream)
        return reach is not None and reach.unreachable(self.clock(), self.reach_max_age_s)

    def record_server_failure(self, upstream: str, error: str, now: float) -> None:
        previous = self.servers.get(upstream, Observation())
        if previous.error != error:
            log.warning("upstream %s server observation failed: %s", upstream, error)
        self.servers[upstream] = previous.failed(error, now)

    def record_presence(self, reading: PresenceReading, now: float) -> tuple[Edge, ...]:
        """Record a presence reading at ``now`` (monotonic s); returns the owner edge it
        raises: the veto engaging, or an owner program starting while the owner is present
        and some upstream lends while present (none otherwise)."""
        first = self.presence.reading.observed_at is None
        before = self.presence.reading.value
        was_engaged = self.veto.engaged
        self.presence.reading = self.presence.reading.succeeded(reading, now)
        if first:
            log.info("owner presence sampled (%s)", self.presence.source)
            self.events.emit(PresenceSampled())
        if self.veto.observe(reading.owner_signal, now):
            log.info(
                "host policy veto %s%s",
                "engaged" if self.veto.engaged else "released",
                f": {reading.detail}" if reading.detail else "",
            )
            self.events.emit(VetoChanged(self.veto.engaged, reading.detail, now))
            if self.veto.engaged:
                return (Edge(Trigger.OWNER, now, detail=reading.detail),)
        elif (
            was_engaged
            and presence_rules.matched_owner_process(reading)
            and not (before is not None and presence_rules.matched_owner_process(before))
            and any(u.lend_while_present for u in self.upstreams.values())
        ):
            # An owner program now holds a machine whose owner was already present: the
            # upstreams that lend while present hand their small jobs back too.
            return self.raise_edge("owner", now, detail=f"owner program running: {reading.detail}")
        return ()

    def record_presence_failure(self, error: str, now: float) -> tuple[Edge, ...]:
        """Record that presence could not be read at ``now`` (monotonic s); returns the owner
        edge when the failure engages the veto (none otherwise).

        The gate refuses host-scoped work at once (evidence incomplete). Once the last good
        reading is older than the freshness bound and nothing replaced it, the failure also
        engages the owner veto (docs/architecture.md step 2), so release needs ``release_after_s``
        of
        fresh clear readings after presence is readable again.
        """
        previous = self.presence.reading
        self.presence.reading = previous.failed(error, now)
        if (
            previous.error != error
            or previous.failed_at is None
            or (previous.observed_at is not None and previous.failed_at < previous.observed_at)
        ):
            log.warning("owner presence unreadable: %s", error)
        if presence_rules.stale_engages_veto(previous.observed_at, now, self.presence_max_age_s):
            detail = f"presence stale and unreadable: {error}"
            if self.veto.observe(True, now):
                log.warning("host policy veto engaged: %s", detail)
                self.events.emit(VetoChanged(True, detail, now))
                return (Edge(Trigger.OWNER, now, detail=detail),)
        return ()

    def raise_edge(
        self, trigger: Trigger | str, now: float, *, resource: str | None = None, detail: str = ""
    ) -> tuple[Edge, ...]:
        """Announce a reclaim edge (docs/reclaim.md): ``trigger`` owner, pressure, admin or
        hold, at ``now`` (monotonic s). Emits ``edge`` for observers and returns the edge;
        answering it is the caller's (:mod:`vacancyd.control.reclaim`). An unknown trigger
        is logged and ignored (no edge).
        """
        try:
            kind = Trigger(trigger)
        except ValueError:
            log.error("ignoring a reclaim edge with unknown trigger %r", trigger)
            return ()
        self.events.emit(EdgeRaised(kind, now, resource, detail))
        return (Edge(kind, now, resource, detail),)

    def set_holds(self, holds: tuple[Hold, ...], now: float) -> tuple[Edge, ...]:
        """Replace the owner's holds (monotonic ``now``). A hold that was not in force before
        raises a ``hold`` reclaim edge (per GPU resource for a GPU-only hold), so it hands
        borrowed work back exactly as the owner's return does; every change emits ``hold``.
        Returns the edges raised, in order.
        """
        before = {h.key for h in self.holds}
        after = {h.key for h in holds}
        self.holds = holds
        raised: list[Edge] = []
        for hold in holds:
            if hold.key in before:
                continue
            log.warning("owner hold %s engaged: %s", hold.key, hold.detail)
            self.events.emit(HoldChanged(hold.key, True, hold.detail, now))
            for resource in sorted(hold.resources) if hold.resources is not None else [None]:
                raised += self.raise_edge("hold", now, resource=resource, detail=hold.detail)
        for key in sorted(before - after):
            log.info("owner hold %s released", key)
            self.events.emit(HoldChanged(key, False, "", now))
        return tuple(raised)

    def note_job_hold(
        self, job: int, upstream: str, hold: JobHold, *, held: bool, borrower: str = UNNAMED
    ) -> None:
        """Tell subscribers that borrowed job ``job`` of ``upstream`` was held under
        ``hold`` (``held``) or that this hold ended (event ``job_hold``). ``borrower``: the
        job's borrower while it is still a live job ("": unnamed, also once it ended)."""
        self.events.emit(
            JobHoldChanged(
                job,
                upstream,
                held,
                hold.reason.value,
                hold.release_by.value,
                hold.detail,
                self.clock(),
                borrower_label(borrower),
            )
        )

    def note_job(
        self,
        job: int,
        upstream: str,
        borrower: str,
        model: str | None,
        *,
        outcome: str | None = None,
    ) -> None:
        """Borrowed job ``job`` of ``borrower`` ("": unnamed) started (``outcome`` None) or
        ended with ``outcome``: sent as a ``job`` event (who borrows each running job is
        read from its record, ``vacancyd.control.work.Work.borrowers``)."""
        change = "started" if outcome is None else "ended"
        label = borrower_label(borrower)
        self.events.emit(JobChanged(job, upstream, label, change, model, outcome, self.clock()))

    def publish_reclaim(self, reclaim: Reclaim) -> None:
        """Record an upstream's reclaim for /status and tell subscribers."""
        self.reclaims[reclaim.upstream] = reclaim
        self.events.emit(ReclaimChanged(reclaim.upstream, reclaim.phase))

    def set_listener(
        self, upstream: str, address: str, bound: bool, error: str | None = None
    ) -> None:
        self.listeners[upstream] = ListenerState(address, bound, error)
        self.events.emit(ListenerChanged(upstream, bound))

    def _observed_at(self, key: SampleKey) -> float | None:
        if key.kind is SampleKind.SERVER:
            obs = self.servers.get(key.name)
            return None if obs is None else obs.observed_at
        if key.kind is SampleKind.CAPACITY:
            capacity = self.capacity.get(key.name)
            return None if capacity is None else capacity.observed_at
        return None

    # -- readers -------------------------------------------------------------------------

    def presence_view(self, now: float) -> PresenceView:
        """The gate's view of owner presence. It changes only with the reading (each one a
        new immutable Observation) and the veto, so the view of the last ones is kept."""
        obs = self.presence.reading
        kept = self._presence_view
        if (
            kept is not None
            and self._presence_view_of is obs
            and kept.veto_active is self.veto.engaged
            and kept.refuses is self.presence.refuses
            and kept.source == self.presence.source
        ):
            return kept
        view = presence_view_of(
            obs,
            source=self.presence.source,
            veto_active=self.veto.engaged,
            max_age_s=self.presence_max_age_s,
            refuses=self.presence.refuses,
        )
        self._presence_view, self._presence_view_of = view, obs
        return view

    def snapshot(self, now: float | None = None) -> Snapshot:
        """Freeze everything the gate reads at ``now`` (default: the loop clock)."""
        at = self.clock() if now is None else now
        return Snapshot(
            now=at,
            lending_enabled=self.lending_enabled,
            presence=self.presence_view(at),
            resources={
                name: ResourceView(
                    policy=policy,
                    switch_on=self.switches[name],
                    capacity=self.capacity[name],
                    released_at=self.ledger.released_at(name),
                    pressure=None
                    if (ps := self.pressure.get(name)) is None
                    else pressure_view(ps, at),
                    yielded_at=self.yielded_at.get(name),
                    state_error=self.state_errors.get(name),
                    charged_mib=self.ledger.charged_mib(name),
                    hold_unsaved=name in self.unsaved_holds,
                    hold_write_error=self.unsaved_holds.get(name),
                    thermal=tracker.view() if (tracker := self.thermal.get(name)) else None,
                )
                for name, policy in self.resources.items()
            },
            servers=dict(self.servers),
            stopping=self.stopping,
            learning=dict(self.learning),
            priors={k: dict(v) for k, v in self.priors.items()},
            holds=self.holds,
            active_jobs=self.ledger.active_per_upstream(),
        )

    def ready(self, now: float) -> tuple[bool, list[str]]:
        """/readyz: listeners bound, presence sampled, every required resource fresh.

        Returns (ready, reasons-not-ready) — the reasons are for /status, never /readyz.
        """
        why = not_ready(
            self.snapshot(now),
            listeners={name: ls.bound for name, ls in self.listeners.items()},
            required={r for up in self.upstreams.values() for r in up.resources},
        )
        return not why, why
