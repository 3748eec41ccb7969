"""The daemon's sampling loops: one capacity collector per resource, one pressure loop per
GPU with pressure, the owner's presence, each observable upstream's server observer and
connection check, the sockets serving each target, and the calibration saver.

:class:`Loops` spawns each under the supervisor (task names in
:mod:`vacancyd.runtime.daemon`); every sample goes into the store.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import aiohttp
from yarl import URL

from vacancyd.collectors import exposure, logind, presence, reach, system
from vacancyd.collectors.base import (
    run_async_probe_loop,
    run_inline_probe_loop,
    run_probe_loop,
    sample_now,
)
from vacancyd.collectors.nvidia import GpuPressureProbe, NvmlGpu
from vacancyd.config.model import Settings
from vacancyd.control.owner import OwnerControls
from vacancyd.control.reclaim import Reclaimer
from vacancyd.core import presence as presence_rules
from vacancyd.core.exposure import Exposure, ListenerExposure
from vacancyd.core.gpu import GpuSelector
from vacancyd.core.observations import CapacityReading, SampleKey
from vacancyd.core.snapshot import ServerState
from vacancyd.proxy.app import Upstream
from vacancyd.runtime import calibration
from vacancyd.runtime.build import capacity_probe
from vacancyd.runtime.learned import Learner
from vacancyd.runtime.tasks import Supervisor
from vacancyd.state import REACH_DEMAND_S, PressureSample, SharedState
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)

#: How often the sockets serving each upstream's target are read (seconds).
TARGET_WATCH_S = 15.0

#: How often learned calibrations are written to the state directory (seconds).
CALIBRATION_SAVE_INTERVAL_S = 300.0


@dataclass
class Loops:
    """Starts the sampling loops of one daemon under its supervisor. Each capacity or
    server sample goes, in this order, to the learner, the store, then ``sampled``."""

    def capacity_sampled(self, name: str, reading: CapacityReading, now: float) -> None:
        """A capacity sample of resource ``name`` taken at ``now`` (monotonic s)."""
        self.learner.capacity_sampled(name, reading, now)
        self.reclaimer.record_capacity(name, reading, now)  # records it, answers its edge
        self._sampled()

    def server_sampled(self, upstream: str, server: ServerState, now: float) -> None:
        """A server observation of ``upstream`` taken at ``now`` (monotonic s)."""
        self.learner.server_sampled(upstream, server, now)
        self.state.record_server(upstream, server, now)
        self._sampled()

    def _sampled(self) -> None:
        try:
            self.sampled()
        except Exception:  # a broken hook must not break a collector
            log.exception("serving the wait queues after a sample failed")

    settings: Settings
    state: SharedState
    metrics: Metrics
    supervisor: Supervisor
    #: takes the presence readings (the owner's return starts there)
    owner: OwnerControls
    #: takes the GPU pressure readings (a pressure edge reclaims)
    reclaimer: Reclaimer
    #: learns from each capacity and server sample, before it is recorded in the store
    learner: Learner
    #: called after each capacity or server sample is recorded (the wait queues re-decide)
    sampled: Callable[[], None]
    #: one NVML handle per GPU resource, shared by its capacity and pressure probes
    gpus: dict[str, NvmlGpu] = field(default_factory=dict)
    #: the logind presence source, once started (``presence = "auto"`` or ``"logind"``)
    presence: logind.LogindPresence | None = None

    def start_reach_check(self, upstream: Upstream) -> None:
        """While the lendability probe is asked (within the last minute), check on the
        collectors' cadence (at most every 2 s) that the upstream's server accepts
        connections (vacancyd.core.reach)."""
        name = upstream.name
        state = self.state
        cfg = self.settings.collectors
        interval = min(cfg.poll_s, 2.0)
        state.reach_max_age_s = max(state.reach_max_age_s, 5 * (interval + cfg.probe_timeout_s))
        host, port = reach.target_address(upstream.target)

        def wanted() -> bool:
            asked = state.reach_asked_at.get(name)
            return asked is not None and state.clock() - asked <= REACH_DEMAND_S

        self.supervisor.spawn(
            reach.run_reach_loop(
                host,
                port,
                interval_s=interval,
                timeout_s=cfg.probe_timeout_s,
                wanted=wanted,
                wake=state.samples.wanted(SampleKey.reach(name)),
                on_result=lambda ok, t, error: state.record_reach(name, ok, t, error),
            ),
            name=f"connection check {name}",
            essential=False,
        )

    def start_observer(self, upstream: Upstream, session: aiohttp.ClientSession) -> None:
        """Observe an observable upstream's server (loaded models, busy slots) through
        ``session``, on the collectors' cadence (at most every 2 s)."""
        adapter = upstream.adapter
        name = upstream.name
        state = self.state
        poll = min(self.settings.collectors.poll_s, 2.0)
        probe: Callable[[], Awaitable[ServerState]]
        if adapter.make_observer is not None:

            def known() -> Mapping[str, int | None]:
                learned = state.learning.get(name)
                return {} if learned is None else learned.modelfile_num_ctx

            probe = adapter.make_observer(session, upstream.target, known)
        else:
            observe = adapter.observe
            assert observe is not None
            probe = lambda: observe(session, upstream.target)  # noqa: E731

        self.supervisor.spawn(
            run_async_probe_loop(
                f"observer {name}",
                probe,
                interval_s=poll,
                timeout_s=self.settings.collectors.probe_timeout_s,
                on_sample=lambda s, t: self.server_sampled(name, s, t),
                on_error=lambda e, t: state.record_server_failure(name, e, t),
                wake=state.samples.wanted(SampleKey.server(name)),
                count=self.metrics.collector_failures(f"server:{name}"),
            ),
            name=f"observer {name}",
            essential=True,
        )

    def start_collectors(self) -> None:
        """One capacity loop per enabled resource, then the GPU pressure loops."""
        cfg = self.settings.collectors
        state = self.state
        for res in self.settings.resource:
            if not res.enabled:
                continue
            name = res.name
            probe = capacity_probe(res, self.settings, self.gpus)
            on_sample = partial(self.capacity_sampled, name)
            on_error = partial(state.record_capacity_failure, name)
            count = self.metrics.collector_failures(f"capacity:{name}")
            if probe is system.sample_memory:
                # /proc/meminfo is kernel memory, not a disk or a driver: every sample,
                # the one a release asks for included, is taken on the loop, not handed to a
                # thread and back (and one source keeps the samples in the order taken).
                sample = sample_now(
                    name, probe, on_sample=on_sample, on_error=on_error, count=count
                )
                state.samples.inline(SampleKey.capacity(name), sample)
                self.supervisor.spawn(
                    run_inline_probe_loop(sample, interval_s=cfg.poll_s),
                    name=f"collector {name}",
                    essential=True,
                )
                continue
            self.supervisor.spawn(
                run_probe_loop(
                    name,
                    probe,
                    interval_s=cfg.poll_s,
                    timeout_s=cfg.probe_timeout_s,
                    on_sample=on_sample,
                    on_error=on_error,
                    wake=state.samples.wanted(SampleKey.capacity(name)),
                    count=count,
                ),
                name=f"collector {name}",
                essential=True,
            )
        self._start_pressure()

    def start_presence(self) -> None:
        """The owner's presence source: logind, headless sessions, or none (logged)."""
        cfg = self.settings.collectors
        state = self.state
        source = presence_rules.resolve_source(self.settings.owner.presence, sys.platform)
        if source is presence_rules.PresenceSource.LOGIND:
            self._start_logind()
        elif source is presence_rules.PresenceSource.UNSUPPORTED:
            log.warning(
                "no owner-presence backend on %s: presence is unknown and does not refuse; "
                "lending here depends on capacity alone",
                sys.platform,
            )
            self.owner.record_presence(logind.unsupported_reading(sys.platform), state.clock())
        elif source is presence_rules.PresenceSource.HEADLESS:
            self.supervisor.spawn(
                run_probe_loop(
                    "presence",
                    presence.sample_headless,
                    interval_s=cfg.poll_s,
                    timeout_s=cfg.probe_timeout_s,
                    on_sample=self.owner.record_presence,
                    on_error=self.owner.record_presence_failure,
                    count=self.metrics.collector_failures("presence"),
                ),
                name="collector presence",
                essential=True,
            )
        else:
            log.warning(
                "no owner presence source is configured ([owner] presence); host-scoped "
                "upstreams refuse with owner_active until one is"
            )

    def _start_logind(self) -> None:
        owner = self.settings.owner
        cfg = self.settings.collectors
        wake = self.state.samples.wanted(SampleKey.presence())
        client = logind.LogindClient(
            owner.bus_address,
            signals=owner.signals,
            on_signal=lambda _member: wake.set(),
            spawn=lambda coro, name: self.supervisor.spawn(coro, name=name, essential=False),
        )
        policy = presence_rules.PresencePolicy(
            owner_processes=frozenset(owner.processes),
            idle_after_s=owner.idle_after_s,
            count_remote_graphical=owner.remote_graphical == "count",
        )
        self.presence = logind.LogindPresence(client, policy)
        self.supervisor.spawn(
            logind.run_logind_loop(
                self.presence,
                on_sample=self.owner.record_presence,
                on_error=self.owner.record_presence_failure,
                interval_s=cfg.poll_s,
                timeout_s=cfg.probe_timeout_s,
                wake=wake,
                count=self.metrics.collector_failures("presence"),
            ),
            name="collector presence",
            essential=True,
        )

    def _start_pressure(self) -> None:
        """One pressure loop per GPU with pressure, and the calibration saver."""
        state = self.state
        targets = {}
        for up in self.settings.upstream:
            url = URL(str(up.target))
            if url.host is not None and url.port is not None:
                targets[up.name] = (url.host, url.port)
        for res in self.settings.resource:
            ps = state.pressure.get(res.name)
            if ps is None:
                continue
            gpu = self.gpus.setdefault(res.name, NvmlGpu(GpuSelector.parse(res.device)))
            name = res.name
            self.supervisor.spawn(
                run_probe_loop(
                    f"pressure {name}",
                    GpuPressureProbe(gpu, targets),
                    interval_s=ps.policy.poll_s,
                    timeout_s=self.settings.collectors.probe_timeout_s,
                    on_sample=lambda r, t, n=name: self.reclaimer.record_pressure(  # type: ignore[misc]
                        n, PressureSample(r.attribution, r.gpu), t
                    ),
                    on_error=lambda e, t, n=name: self.reclaimer.record_pressure_failure(n, e, t),  # type: ignore[misc]
                    wake=state.samples.wanted(SampleKey.pressure(name)),
                    count=self.metrics.collector_failures(f"pressure:{name}"),
                ),
                name=f"pressure {name}",
                essential=True,
            )
        if state.pressure:
            self.supervisor.spawn(
                self.save_calibrations_forever(), name="calibration saver", essential=False
            )

    async def save_calibrations_forever(self) -> None:
        """Write the calibrations every ``CALIBRATION_SAVE_INTERVAL_S`` seconds."""
        while True:
            await asyncio.sleep(CALIBRATION_SAVE_INTERVAL_S)
            await self.save_calibrations()

    async def save_calibrations(self) -> None:
        """Write every identified GPU's calibration to the state directory; logs failures."""
        for name, ps in self.state.pressure.items():
            if ps.gpu is None or ps.learner.settings.fixed is not None:
                continue
            data = ps.learner.to_cache(ps.gpu)
            try:
                await asyncio.to_thread(
                    calibration.save_calibration, self.settings.state_dir, name, data
                )
            except OSError as exc:
                log.warning("resource %s: cannot save calibration: %s", name, exc)

    async def watch_targets(self) -> None:
        """Every TARGET_WATCH_S, read which sockets serve each upstream's target (in a
        thread: the socket table can be large) and warn when one listens on the network."""
        targets = []
        for up in self.settings.upstream:
            url = URL(str(up.target))
            if url.host is not None and url.port is not None:
                targets.append((up.name, url.host, url.port))
        state = self.state
        while True:
            try:
                async with asyncio.timeout(self.settings.collectors.probe_timeout_s * 5):
                    found = await asyncio.to_thread(exposure.observe_targets, targets)
            except TimeoutError:
                found = {
                    name: Exposure(ListenerExposure.UNKNOWN, "reading the socket table timed out")
                    for name, _, _ in targets
                }
            for name, verdict in found.items():
                before = state.target_exposure.get(name)
                network = ListenerExposure.LISTENS_ON_NETWORK
                if verdict.state is network and (before is None or before.state is not network):
                    log.warning(
                        "upstream %s: %s; bind it to 127.0.0.1 so borrowers must pass the gate",
                        name,
                        verdict.detail,
                    )
                state.target_exposure[name] = verdict
            await asyncio.sleep(TARGET_WATCH_S)


async def warn_if_headless_at_a_desk(settings: Settings) -> str | None:
    """Log (and return) a warning when presence is ``headless`` on a machine where logind
    lists a local graphical session. Never raises: no logind means nothing to warn about."""
    if settings.owner.presence != "headless":
        return None
    from vacancyd.collectors.logind import LogindError, local_sessions

    try:
        sessions = await local_sessions(settings.owner.bus_address)
    except LogindError as exc:
        log.debug("headless check: %s", exc)
        return None
    warning = presence_rules.headless_warning(sessions)
    if warning:
        log.warning("%s", warning)
    return warning
