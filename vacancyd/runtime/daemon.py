"""The daemon: builds state, listeners and collectors from settings and runs until stopped.

Task tree (names as they appear in logs):

* ``api@ADDR`` — the API listener (essential)
* ``listener NAME@ADDR`` — one proxy listener per upstream (essential)
* ``collector RESOURCE`` — one capacity loop per enabled resource (essential)
* ``pressure RESOURCE`` — one GPU pressure loop per enabled GPU with pressure (essential)
* ``calibration saver`` — writes learned thresholds to the state directory (not essential)
* ``state saver`` — writes learned contexts and footprint priors as they change (not
  essential; see vacancyd.runtime.learned)
* ``collector presence`` — the presence loop (headless or logind), when one is configured
  (essential); logind's signals wake it through ``state.sample_wanted("presence")``
* ``observer NAME`` — server observation for adapters that need it (essential)
* ``owner controls`` — the lending schedule, pauses, the battery rule and exclusive apps
  (essential; ``vacancyd.control.owner``)
* ``reclaim NAME`` — one per reclaim of an upstream, started by an edge (not essential)
* ``track NAME job N`` — follows a tracked borrowed job (ComfyUI prompt) to its end (not
  essential)
* ``hold NAME job N`` — watches a held job's server for idleness (not essential)
* ``reclaim cancel NAME`` / ``warm NAME`` — a reclaim's server calls (not essential)
* ``target listeners`` — which sockets serve each upstream's target, for /status (not
  essential)
* ``free NAME job N`` — an exclusive job's server frees its memory before the card is
  released (not essential)
* ``lendability watcher`` — announces each change of what a borrowed request would get on
  ``/events`` (not essential)
* ``save pause`` — writes a pause that ended by itself (not essential; awaited at shutdown)
* ``presence bus watch`` — notices a dropped logind connection between polls (not essential)
* ``trace post-release sample`` — the span of a post-release fresh sample, with
  ``[telemetry]`` (not essential)
* ``SIGHUP config check`` — re-reads the configuration on SIGHUP (not essential)
* ``headless check`` — with ``presence = "headless"``, asks logind once whether someone sits
  at a local desktop and warns if so (not essential)
* ``service status`` — under systemd, keeps ``STATUS=`` current (not essential)
* ``watchdog`` — ``WATCHDOG=1`` pings when the unit sets ``WatchdogSec=`` (not essential)
* ``kubernetes feeder`` / ``kubernetes publisher`` / ``kubernetes uninstall watcher`` —
  host-side publishing when ``[kubernetes]`` is configured (not essential: the API server
  cannot stop the daemon)

Every one goes through the supervisor (``vacancyd.runtime.tasks``), which holds its
reference and its essential flag; ``tests/component/test_supervision.py`` checks that no
daemon task runs outside it.

Stops on SIGTERM/SIGINT (exit 0) or when an essential task ends (exit 1), after a drain
(:meth:`Daemon.shutdown`): listeners keep answering, with refusals for new work, while
borrowed work in flight finishes for at most ``[server] shutdown_grace_s`` seconds; a second
SIGTERM/SIGINT ends the drain at once (still exit 0). SIGHUP re-reads and validates the
configuration file and logs the verdict; it never stops the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from yarl import URL

from vacancyd.adapters import ADAPTERS
from vacancyd.api.app import health_probe, make_api
from vacancyd.api.metrics import attach_saver, attach_state
from vacancyd.api.ops import Diagnostics
from vacancyd.api.status import read_status
from vacancyd.collectors import exposure, logind, presence, reach, system
from vacancyd.collectors.base import (
    run_async_probe_loop,
    run_inline_probe_loop,
    run_probe_loop,
    sample_now,
)
from vacancyd.collectors.nvidia import GpuCapacityProbe, GpuPressureProbe, NvmlGpu, SmiProbe
from vacancyd.config.load import ConfigError, load_config
from vacancyd.config.model import (
    FOLLOWED_SHUTDOWN_DELAY_S,
    ResourceSettings,
    Settings,
    is_loopback,
    split_listen,
)
from vacancyd.config.policies import (
    pressure_policy,
    reclaim_policy,
    resource_policy,
    thermal_policy,
    upstream_policy,
)
from vacancyd.config.secrets import Secrets, credentials_directory, read_secrets
from vacancyd.config.zone import resolve_zone
from vacancyd.control.owner import PAUSE_FILE, OwnerControls, OwnerControlsConfig
from vacancyd.control.reclaim import Reclaimer
from vacancyd.control.sharing import CardSharing, ExclusiveSettings
from vacancyd.control.waiting import WaitRooms
from vacancyd.control.work import Work
from vacancyd.core import presence as presence_rules
from vacancyd.core.exclusive import ExclusiveScope, ExclusiveTracker
from vacancyd.core.exposure import Exposure, ListenerExposure
from vacancyd.core.gpu import GpuSelector
from vacancyd.core.lifecycle import JobPhase, JobRules, JobState, ReleaseBy
from vacancyd.core.observations import CapacityReading
from vacancyd.core.power import PowerPolicy
from vacancyd.core.sharing import UnloadTimeout
from vacancyd.core.snapshot import ServerState
from vacancyd.core.status import service_status_line
from vacancyd.k8s.host import HostPublisher
from vacancyd.proxy.app import Proxy, Upstream, make_server
from vacancyd.proxy.client import UpstreamClient
from vacancyd.proxy.observe import ProxyAccessLogger
from vacancyd.proxy.probe import ProbeEndpoint
from vacancyd.proxy.tunnel import TunnelLimits
from vacancyd.runtime import calibration, durable, learned, lendability, memory, sdnotify
from vacancyd.runtime.tasks import Supervisor, hold_listener
from vacancyd.runtime.telemetry import Tracing, start_tracing
from vacancyd.state import REACH_DEMAND_S, PressureSample, SharedState
from vacancyd.web.access import AccessLogger, RefusalLog
from vacancyd.web.auth import Authenticator, Token
from vacancyd.web.framing import lenient_parser_problem
from vacancyd.web.logins import Logins
from vacancyd.web.metrics import Metrics
from vacancyd.web.site import (
    SERVER_HEADER,
    ConnectionGuard,
    ConnectionLimits,
    GuardedTCPSite,
    Probe,
)
from vacancyd.web.tls import TlsError, TlsFiles, reload_context, server_context

log = logging.getLogger(__name__)


#: The default ``[server] shutdown_grace_s``: seconds borrowed work in flight gets to finish
#: after SIGTERM/SIGINT (the drain), within systemd's ``TimeoutStopSec=30``.
SHUTDOWN_GRACE_S = 20.0
#: Once the drain is over, how long requests still being answered (refusals, pass-through
#: reads) and WebSocket closing handshakes get before their connections close (seconds).
CLOSE_TIMEOUT_S = 1.0
#: After a second SIGTERM/SIGINT, how long requests still being answered get before their
#: connections are reset (seconds), instead of CLOSE_TIMEOUT_S.
HURRIED_CLOSE_S = 0.2
#: How often the drain looks whether the borrowed work in flight has finished (seconds).
DRAIN_POLL_S = 0.05
#: At the end of a stop, how long writing the state directory (held jobs first) may take
#: before the daemon stops without waiting for it (seconds; logged).
SAVE_AT_STOP_S = 5.0


class StartupError(Exception):
    """The daemon could not start (a listener could not bind, a secret could not be read)."""


class AddressBusyError(StartupError):
    """A listener's address is held by another socket or not on this host yet (EADDRINUSE,
    EADDRNOTAVAIL): often passing at boot, so the exit status asks for a restart."""


#: Exit status of ``vacancyd run`` for what a restart cannot fix: an invalid configuration,
#: an unreadable secret, a refused TLS file. The systemd unit's ``RestartPreventExitStatus``.
EXIT_CONFIG = 2

#: Exit status when a listener's address is busy or not yet on this host (``EX_TEMPFAIL`` of
#: sysexits.h): systemd restarts it after the unit's ``RestartSec`` (docs/install.md).
EXIT_ADDRESS_BUSY = 75


#: How often the sockets serving each upstream's target are read (seconds).
TARGET_WATCH_S = 15.0

#: How often learned calibrations are written to the state directory (seconds).
CALIBRATION_SAVE_INTERVAL_S = 300.0


def _capacity_probe(
    res: ResourceSettings, settings: Settings, gpus: dict[str, NvmlGpu]
) -> Callable[[], CapacityReading]:
    if res.kind == "memory":
        return system.sample_memory
    if res.kind == "cpu":
        return system.CpuProbe()
    selector = GpuSelector.parse(res.device)
    gpu = gpus.setdefault(res.name, NvmlGpu(selector))
    # nvidia-smi must finish inside the probe deadline, leaving the loop time to kill it.
    smi_deadline = max(0.1, settings.collectors.probe_timeout_s * 0.8)
    return GpuCapacityProbe(gpu, SmiProbe(selector, smi_deadline))


def build_state(settings: Settings) -> SharedState:
    resources = {r.name: resource_policy(settings, r) for r in settings.resource}
    upstreams = {
        u.name: upstream_policy(
            settings,
            u,
            needs_model_observation=ADAPTERS[u.adapter].needs_model_observation,
            canonical_model=ADAPTERS[u.adapter].canonical_model,
        )
        for u in settings.upstream
    }
    source = presence_rules.resolve_source(settings.owner.presence, sys.platform)
    pressure = {
        r.name: policy
        for r in settings.resource
        if r.enabled and (policy := pressure_policy(r)) is not None
    }
    state = SharedState(
        resources,
        upstreams,
        presence_source=source.value,
        presence_refuses=source is not presence_rules.PresenceSource.UNSUPPORTED,
        presence_max_age_s=settings.presence_max_age_s,
        release_after_s=settings.owner.release_after_s,
        pressure=pressure,
        thermal={
            r.name: limits
            for r in settings.resource
            if r.enabled and (limits := thermal_policy(r)) is not None
        },
    )
    saved = calibration.load_calibrations(settings.state_dir, pressure)
    for name, data in saved.items():
        state.pressure[name].pending_cache = data
    learned.load_learned(state, settings.state_dir)
    return state


def reply_headers(
    state: SharedState, keepalive_s: float
) -> Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]:
    """The hook every listener runs on each reply: it names vacancyd, never the Python or
    aiohttp version (nor the upstream's own ``Server``, which the proxy drops); a reply that
    keeps its connection says for how long an idle connection stays open
    (``Keep-Alive: timeout=N``, ``keepalive_s`` in whole seconds, rounded down), so a client
    pool retires it before the listener closes it; and while the daemon drains it says
    ``Connection: close``, so a client's pool moves off this lender instead of reusing a
    connection that is about to close."""
    keep_alive = f"timeout={max(1, int(keepalive_s))}"

    async def hook(request: web.BaseRequest, response: web.StreamResponse) -> None:
        response.headers["Server"] = SERVER_HEADER
        if response.status == 101:  # an upgrade keeps its Connection and has no idle timer
            return
        if state.stopping:
            response.force_close()
            response.headers["Connection"] = "close"  # the hook runs after aiohttp set it
        elif response.keep_alive is not False and request.keep_alive:
            response.headers["Keep-Alive"] = keep_alive

    return hook


def owner_controls_config(settings: Settings) -> OwnerControlsConfig:
    """The owner-controls loop's settings; raises ConfigError when the zone is unknown."""
    owner = settings.owner
    zone_name = settings.schedule.timezone if settings.schedule else None
    try:
        tz, zone = resolve_zone(zone_name)
    except ValueError as exc:
        raise ConfigError("configuration", [f"schedule.timezone: {exc}"]) from exc
    exclusive = {}
    for scope in ExclusiveScope:
        names = frozenset(a.name for a in owner.exclusive_apps if a.scope == scope.value)
        if names:
            exclusive[scope] = ExclusiveTracker(
                names, owner.exclusive_grace_s, owner.exclusive_resume_after_s
            )
    source = presence_rules.resolve_source(owner.presence, sys.platform)
    return OwnerControlsConfig(
        state_dir=settings.state_dir,
        tz=tz,
        zone=zone,
        schedule=None if settings.schedule is None else settings.schedule.build(tz, zone),
        power=PowerPolicy(owner.lend_on_battery, owner.min_battery_percent),
        exclusive=exclusive,
        gpu_resources=frozenset(r.name for r in settings.resource if r.kind == "gpu"),
        presence_evidence=source is presence_rules.PresenceSource.LOGIND,
        poll_s=settings.collectors.poll_s,
        probe_timeout_s=settings.collectors.probe_timeout_s,
    )


#: The saved pause's format version in ``STATE_DIR/pause.json``.
PAUSE_VERSION = 1


class DurablePauseStore:
    """The owner's pause as a versioned durable-state file (:mod:`vacancyd.runtime.durable`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Mapping[str, object] | None:
        try:
            return durable.read_state(self.path, {PAUSE_VERSION})
        except durable.StateFileError as exc:
            raise ValueError(str(exc)) from exc

    def save(self, data: Mapping[str, object] | None) -> None:
        if data is None:
            durable.remove_state(self.path)
        else:
            durable.write_state(self.path, {"version": PAUSE_VERSION, **data})


def read_tokens(secrets: Secrets) -> list[Token]:
    return [Token(name, secret, scopes) for name, secret, scopes in secrets.tokens]


@dataclass
class Daemon:
    settings: Settings
    state: SharedState = field(init=False)
    metrics: Metrics = field(init=False)
    supervisor: Supervisor = field(init=False)
    work: Work = field(init=False)
    reclaimer: Reclaimer = field(init=False)
    owner: OwnerControls = field(init=False)
    bound: dict[str, str] = field(default_factory=dict)
    #: runner per listener name ("api" and each upstream's name)
    _runners: dict[str, web.BaseRunner] = field(default_factory=dict)
    #: the listeners' shared TLS context (None: plain HTTP) and the files it was loaded from
    tls: ssl.SSLContext | None = None
    _tls_files: TlsFiles | None = None
    _sessions: list[aiohttp.ClientSession] = field(default_factory=list)
    _clients: list[UpstreamClient] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by a second SIGTERM/SIGINT: the drain ends now.
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)
    #: connection budgets per listener name, and the proxies (tunnels) per upstream or pool
    _guards: dict[str, ConnectionGuard] = field(default_factory=dict)
    _proxies: dict[str, Proxy] = field(default_factory=dict)
    #: the proxy listeners' refusal lines, summed up per (listener, reason) under a flood
    _refusal_log: RefusalLog = field(default_factory=RefusalLog)
    _gpus: dict[str, NvmlGpu] = field(default_factory=dict)
    presence: logind.LogindPresence | None = None
    kubernetes: HostPublisher | None = None
    saver: learned.LearnedSaver = field(init=False)
    _saved_holds: list[learned.SavedHold] = field(init=False)
    #: replaces the OTLP exporter when set (tests pass an in-memory one)
    span_exporter: Any = None
    tracing: Tracing | None = None
    diagnostics: Diagnostics | None = None

    def __post_init__(self) -> None:
        self.state = build_state(self.settings)
        self._saved_holds = learned.load_holds(self.state, self.settings.state_dir)
        self.metrics = Metrics()
        attach_state(self.metrics, self.state)
        self.supervisor = Supervisor()
        self.saver = learned.LearnedSaver(self.state, self.settings.state_dir)
        attach_saver(self.metrics, self.saver)
        self.work = Work(self.state, supervisor=self.supervisor, metrics=self.metrics)
        self.saver.holds = self.work.held
        if not self.saver.holds_frozen:  # else never written: every resource refuses anyway
            self.work.on_holds = lambda _held: self.saver.mark("holds", "")
            self.saver.holds_written = self.work.holds_saved
            self.saver.holds_failed = self.work.holds_unsaved
        for up in self.settings.upstream:
            if up.busy == "wait":
                self.work.enable_wait(
                    up.name, max_waiting=up.waiting_limit, timeout_s=up.wait_timeout
                )
        self.reclaimer = Reclaimer(
            self.state,
            policies={u.name: reclaim_policy(u) for u in self.settings.upstream},
            controllers={},
            warm_models={u.name: u.warm_model for u in self.settings.upstream if u.warm_model},
            supervisor=self.supervisor,
            metrics=self.metrics,
            work=self.work,
        )
        self.owner = OwnerControls(
            self.state,
            owner_controls_config(self.settings),
            DurablePauseStore(self.settings.state_dir / PAUSE_FILE),
            supervisor=self.supervisor,
        )

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: the first starts the stop (and its drain); another one, once
        the stop is under way, ends the drain now (:meth:`hurry`)."""
        if self._stop.is_set() or self.state.stopping:
            self.hurry()
        self._stop.set()

    def hurry(self) -> None:
        """End the drain now: what is still in flight is cut, then the daemon stops as
        usual (same exit code)."""
        if self._hurry.is_set():
            return
        self._hurry.set()
        left = len(self.in_flight())
        log.warning(
            "second stop signal: ending the drain now%s",
            f"; cutting {left} borrowed exchange(s) still in flight" if left else "",
        )

    def in_flight(self) -> list[JobState]:
        """Borrowed jobs whose exchange with their borrower is still going on (admitted or
        forwarding); tracked and held jobs no longer have a borrower connection to wait for."""
        return [j for j in self.work if j.phase in (JobPhase.ADMITTED, JobPhase.FORWARDING)]

    def service_status(self) -> str:
        """The line ``systemctl status`` shows: lendable or why not, and the jobs running."""
        _, why = self.state.ready(self.state.clock())
        jobs = [j for j in self.work if j.phase.live]
        held = sum(1 for j in jobs if j.phase is JobPhase.HELD)
        return service_status_line(
            lendability.summary(self.state),
            running=len(jobs) - held,
            held=held,
            not_ready=why,
        )

    async def start(self) -> None:
        """Bind every listener and start every loop. Raises StartupError / ConfigError."""
        settings = self.settings
        started_at = self.state.clock()
        secrets = read_secrets(settings, credentials=credentials_directory())
        tokens = read_tokens(secrets)
        server = settings.server
        if server.tls_cert_file is not None and server.tls_key_file is not None:
            self._tls_files = TlsFiles(
                server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file
            )
            try:
                self.tls = server_context(self._tls_files)
            except TlsError as exc:
                raise StartupError(str(exc)) from exc
        auth = Authenticator(
            tokens,
            trust_loopback=server.trust_loopback,
            metrics=self.metrics,
            allow_unauthenticated_remote=server.allow_unauthenticated_remote,
            server_names=server.server_names,
            allowed_origins=server.allowed_origins,
            logins=Logins(),
            trusted_proxies=server.trusted_proxies,
        )
        limits = server.limits
        self.tracing = start_tracing(
            settings.telemetry, self.state, self.span_exporter, supervisor=self.supervisor
        )

        # The owner's holds (a restored pause, the schedule, the battery) are in force
        # before the first borrower can connect.
        await self.owner.sample()
        self.diagnostics = Diagnostics(
            self.state,
            settings,
            started_at=started_at,
            secrets=lambda: [t[1] for t in secrets.tokens] + list(secrets.credentials.values()),
            users=lambda: self.presence.seen_users if self.presence is not None else (),
        )
        probes: dict[str, ProbeEndpoint] = {}
        api = make_api(
            self.state,
            auth,
            self.metrics,
            started_at=started_at,
            release=self.work.admin_release,
            max_event_subscribers=limits.max_event_subscribers,
            controls=self.owner,
            probes=probes,
            extra_routes=self.diagnostics.install,
        )
        state = self.state
        await self._serve("api", api, server.listen, probe=lambda path: health_probe(state, path))

        self._restore_holds()
        proxies: dict[str, Proxy] = {}
        for up in settings.upstream:
            credential = secrets.credentials.get(up.name)
            adapter = ADAPTERS[up.adapter]
            upstream = Upstream(
                settings=up,
                policy=self.state.upstreams[up.name],
                adapter=adapter,
                target=URL(str(up.target)),
                credential=credential,
            )
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=limits.upstream_connect_timeout_s,
                sock_connect=limits.upstream_connect_timeout_s,
            )
            session = aiohttp.ClientSession(
                trust_env=False,
                auto_decompress=False,
                timeout=timeout,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                connector=aiohttp.TCPConnector(limit=0),
                # A proxy must not keep one borrower's cookies for the next (and storing
                # them costs a jar lookup per request): Set-Cookie passes through untouched.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._sessions.append(session)
            controller = None
            if adapter.make_controller is not None:
                controller = adapter.make_controller(
                    self._control_session(credential), upstream.target
                )
                self.reclaimer.controllers[up.name] = controller
                view = getattr(controller, "view", None)
                if callable(view):
                    self.state.upstream_views[up.name] = view
            self.work.add_upstream(
                up.name,
                JobRules(
                    tracked=controller is not None,
                    cut_is_uncertain=adapter.cut_is_uncertain,
                    idle_evidence=adapter.observable,
                    silence_s=up.silence_limit,
                    detached_s=up.detached_work_timeout
                    if adapter.detached_work and adapter.observable
                    else None,
                ),
                controller,
            )
            proxy = Proxy(
                upstream,
                state=self.state,
                auth=auth,
                metrics=self.metrics,
                limits=limits,
                session=session,
                work=self.work,
                controller=controller,
                tunnels=TunnelLimits(up.websocket_max_tunnels, up.websocket_idle_timeout_s),
            )
            self._clients.append(proxy.client)
            probes[up.name] = ProbeEndpoint(up.public_probe, proxy.probe)
            self.state.set_listener(up.name, up.listen, bound=False)
            address = await self._serve(
                up.name,
                proxy,
                up.listen,
                access_log_class=ProxyAccessLogger.bind(
                    up.name, self.metrics.request_duration, self._refusal_log
                ),
                traced=True,
            )
            self.state.set_listener(up.name, address, bound=True)
            self._start_reach_check(upstream)
            if adapter.observable:
                self._start_observer(upstream, credential)
            proxies[up.name] = proxy
            self._proxies[up.name] = proxy

        for pool in settings.pool:
            first = proxies[pool.members[0]]
            pool_proxy = Proxy(
                replace(first.upstream, alias=pool.name),
                state=self.state,
                auth=auth,
                metrics=self.metrics,
                limits=limits,
                session=first.session,
                upstream_client=first.client,
                work=self.work,
                tunnels=TunnelLimits(
                    first.upstream.settings.websocket_max_tunnels,
                    first.upstream.settings.websocket_idle_timeout_s,
                ),
                members={m: proxies[m] for m in pool.members},
            )
            self._proxies[pool.name] = pool_proxy
            self.state.pools[pool.name] = tuple(pool.members)
            self.state.set_listener(pool.name, pool.listen, bound=False)
            address = await self._serve(
                pool.name,
                pool_proxy,
                pool.listen,
                access_log_class=ProxyAccessLogger.bind(pool.name, None, self._refusal_log),
            )
            self.state.set_listener(pool.name, address, bound=True)

        self.work.watch_restored()
        self._share_cards()
        self._start_collectors()
        self._check_state_dir()
        self.supervisor.spawn(self.saver.run(), name="state saver", essential=False)
        self.supervisor.spawn(self._watch_targets(), name="target listeners", essential=False)
        self.supervisor.spawn(
            lendability.watch(self.state), name="lendability watcher", essential=False
        )
        self.supervisor.spawn(
            warn_if_headless_at_a_desk(settings), name="headless check", essential=False
        )
        self._start_kubernetes(started_at)

    def _restore_holds(self) -> None:
        """Hold again what was held when vacancyd last stopped, before any proxy listens."""
        for saved in self._saved_holds:
            resources = tuple(r for r in saved.resources if r in self.state.resources)
            if not resources:
                log.warning(
                    "a hold saved for job %d on %s names no resource declared now; dropped",
                    saved.job,
                    ", ".join(saved.resources),
                )
                continue
            job = self.work.restore_hold(
                saved.upstream,
                resources,
                model=saved.model,
                charged_mib=saved.charged_mib,
                reason=saved.reason,
                release_by=saved.release_by,
                detail=saved.detail,
            )
            log.warning(
                "%s: job %d was held (%s) when vacancyd stopped; it is job %d now and holds %s "
                "until %s",
                saved.upstream,
                saved.job,
                saved.reason.value,
                job.id,
                ", ".join(resources),
                "an observation shows the server idle"
                if saved.release_by is ReleaseBy.SERVER_IDLE
                else f"an administrator releases it (POST /admin/jobs/{job.id}/release)",
            )
        if self._saved_holds:
            self.saver.mark("holds", "")  # the restored jobs have new ids
        self._saved_holds = []

    def _check_state_dir(self) -> None:
        """Say at startup, not at the first save, when the state directory is unusable."""
        path = self.settings.state_dir
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".vacancyd-write-check"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log.error(
                "state directory %s is not writable (%s): learned calibration, contexts, "
                "footprint priors and held jobs will not survive a restart",
                path,
                exc.strerror or exc,
            )
            self.saver.errors[str(path)] = f"not writable: {exc.strerror or exc}"

    @property
    def waiting(self) -> WaitRooms[JobState]:
        """The wait queues of upstreams with ``busy = "wait"``."""
        return self.work.rooms

    def _share_cards(self) -> None:
        """Exclusivity effects for upstreams with ``exclusive_of`` (Ollama + ComfyUI)."""
        exclusive = {
            u.name: ExclusiveSettings(
                u.unload_timeout, UnloadTimeout(u.on_unload_timeout or UnloadTimeout.FORWARD)
            )
            for u in self.settings.upstream
            if u.exclusive_of
        }
        if not exclusive:
            return
        self.work.share_cards(
            CardSharing(
                self.state.upstreams,
                exclusive,
                self.reclaimer.controllers,
                warm_models={u.name: u.warm_model for u in self.settings.upstream if u.warm_model},
                clock=self.state.clock,
                registry=self.metrics.registry,
            )
        )

    async def _watch_targets(self) -> None:
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

    def _start_kubernetes(self, started_at: float) -> None:
        settings = self.settings.kubernetes
        if settings is None:
            return
        from vacancyd.k8s.client import available

        missing = available()
        if missing is not None:
            log.error("[kubernetes] is configured but cannot be used: %s", missing)
            return
        state = self.state
        self.kubernetes = HostPublisher(settings, state, lambda: read_status(state, started_at))
        self.kubernetes.start(
            lambda coro, name: self.supervisor.spawn(coro, name=name, essential=False)
        )

    async def _serve(
        self,
        name: str,
        app: web.Application | Proxy,
        listen: str,
        *,
        probe: Probe | None = None,
        access_log_class: type[AbstractAccessLogger] | None = None,
        traced: bool = False,
    ) -> str:
        """Bind ``listen`` for the API application or a proxy (an aiohttp low-level server:
        the proxy routes every request itself; ``traced``: its requests get spans while
        tracing is on). Raises StartupError when it cannot bind."""
        limits = self.settings.server.limits
        handler_settings: dict[str, Any] = {
            "handler_cancellation": True,
            "keepalive_timeout": limits.keepalive_timeout_s,
            "lingering_time": 0,
            "access_log": logging.getLogger(f"vacancyd.access.{name}"),
            "access_log_class": access_log_class or AccessLogger.bind(name),
        }
        # Borrowed work had its drain before the runner is cleaned up (Daemon.shutdown):
        # what is still being answered then gets CLOSE_TIMEOUT_S, then is cancelled.
        hook = reply_headers(self.state, limits.keepalive_timeout_s)
        runner: web.BaseRunner
        if isinstance(app, Proxy):
            trace = None
            if traced and self.tracing is not None:
                trace = self.tracing.middleware(app.upstream.name)
            runner = web.ServerRunner(
                make_server(app, trace=trace, reply_hook=hook, **handler_settings),
                handle_signals=False,
                shutdown_timeout=CLOSE_TIMEOUT_S,
            )
        else:
            app.on_response_prepare.append(hook)
            runner = web.AppRunner(
                app, handle_signals=False, shutdown_timeout=CLOSE_TIMEOUT_S, **handler_settings
            )
        await runner.setup()
        self._runners[name] = runner
        host, port = split_listen(listen)
        metrics = self.metrics
        guard = ConnectionGuard(
            ConnectionLimits(
                max_connections=limits.max_connections,
                max_unauthenticated=limits.unauthenticated_cap,
                max_unauthenticated_per_peer=limits.max_unauthenticated_per_peer,
                unauthenticated_timeout_s=limits.unauthenticated_timeout_s,
                header_read_timeout_s=limits.header_read_timeout_s,
            ),
            probe=probe,
            on_refused=lambda why: metrics.connections_refused.labels(name, why).inc(),
            on_malformed=lambda: metrics.malformed_requests.labels(name).inc(),
        )
        site = GuardedTCPSite(runner, host, port, guard=guard, ssl_context=self.tls)
        if self.tls is None and not is_loopback(host):
            log.warning(
                "%s listens on %s without TLS: bearer tokens and prompts cross the network in "
                "clear text; set [server] tls_cert_file and tls_key_file (THREAT_MODEL.md)",
                name,
                listen,
            )
        try:
            await site.start()
        except OSError as exc:
            problem = f"cannot listen on {listen} for {name}: {exc.strerror or exc}"
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise AddressBusyError(
                    f"{problem}; exiting with status {EXIT_ADDRESS_BUSY} so that a service "
                    "manager tries again"
                ) from exc
            raise StartupError(problem) from exc
        self._guards[name] = guard
        address = f"{host}:{site.port}" if ":" not in host else f"[{host}]:{site.port}"
        self.bound[name] = address
        log.info("%s listening on %s://%s", name, "https" if self.tls else "http", address)
        server = site.listening
        assert server is not None
        task_name = f"api@{address}" if name == "api" else f"listener {name}@{address}"
        self.supervisor.spawn(hold_listener(task_name, server), name=task_name, essential=True)
        return address

    def _control_session(self, credential: str | None) -> aiohttp.ClientSession:
        """A session for vacancyd's own calls to an upstream (unload, cancel, queue reads)."""
        session = aiohttp.ClientSession(
            trust_env=False,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.settings.server.limits.upstream_connect_timeout_s
            ),
            headers={"Authorization": f"Bearer {credential}"} if credential else None,
        )
        self._sessions.append(session)
        return session

    def _start_reach_check(self, upstream: Upstream) -> None:
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
                wake=state.sample_wanted(f"reach:{name}"),
                on_result=lambda ok, t, error: state.record_reach(name, ok, t, error),
            ),
            name=f"connection check {name}",
            essential=False,
        )

    def _start_observer(self, upstream: Upstream, credential: str | None) -> None:
        adapter = upstream.adapter
        session = aiohttp.ClientSession(
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=self.settings.collectors.probe_timeout_s),
            headers={"Authorization": f"Bearer {credential}"} if credential else None,
        )
        self._sessions.append(session)
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
                on_sample=lambda s, t: state.record_server(name, s, t),
                on_error=lambda e, t: state.record_server_failure(name, e, t),
                wake=state.sample_wanted(f"server:{name}"),
                count=self.metrics.collector_failures(f"server:{name}"),
            ),
            name=f"observer {name}",
            essential=True,
        )

    def _start_collectors(self) -> None:
        cfg = self.settings.collectors
        state = self.state
        for res in self.settings.resource:
            if not res.enabled:
                continue
            name = res.name
            probe = _capacity_probe(res, self.settings, self._gpus)
            on_sample = partial(state.record_capacity, name)
            on_error = partial(state.record_capacity_failure, name)
            count = self.metrics.collector_failures(f"capacity:{name}")
            if probe is system.sample_memory:
                # /proc/meminfo is kernel memory, not a disk or a driver: every sample,
                # the one a release asks for included, is taken on the loop, not handed to a
                # thread and back (and one source keeps the samples in the order taken).
                sample = sample_now(
                    name, probe, on_sample=on_sample, on_error=on_error, count=count
                )
                state.sample_inline(name, sample)
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
                    wake=state.sample_wanted(name),
                    count=count,
                ),
                name=f"collector {name}",
                essential=True,
            )
        self._start_pressure()
        self.supervisor.spawn(self.owner.run(), name="owner controls", essential=True)
        source = presence_rules.resolve_source(self.settings.owner.presence, sys.platform)
        if source is presence_rules.PresenceSource.LOGIND:
            self._start_logind()
        elif source is presence_rules.PresenceSource.UNSUPPORTED:
            log.warning(
                "no owner-presence backend on %s: presence is unknown and does not refuse; "
                "lending here depends on capacity alone",
                sys.platform,
            )
            state.record_presence(logind.unsupported_reading(sys.platform), state.clock())
        elif source is presence_rules.PresenceSource.HEADLESS:
            self.supervisor.spawn(
                run_probe_loop(
                    "presence",
                    presence.sample_headless,
                    interval_s=cfg.poll_s,
                    timeout_s=cfg.probe_timeout_s,
                    on_sample=state.record_presence,
                    on_error=state.record_presence_failure,
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
        wake = self.state.sample_wanted("presence")
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
                self.state,
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
            gpu = self._gpus.setdefault(res.name, NvmlGpu(GpuSelector.parse(res.device)))
            name = res.name
            self.supervisor.spawn(
                run_probe_loop(
                    f"pressure {name}",
                    GpuPressureProbe(gpu, targets),
                    interval_s=ps.policy.poll_s,
                    timeout_s=self.settings.collectors.probe_timeout_s,
                    on_sample=lambda r, t, n=name: state.record_pressure(  # type: ignore[misc]
                        n, PressureSample(r.attribution, r.gpu), t
                    ),
                    on_error=lambda e, t, n=name: state.record_pressure_failure(n, e, t),  # type: ignore[misc]
                    wake=state.sample_wanted(f"pressure:{name}"),
                    count=self.metrics.collector_failures(f"pressure:{name}"),
                ),
                name=f"pressure {name}",
                essential=True,
            )
        if state.pressure:
            self.supervisor.spawn(
                self._save_calibrations_forever(), name="calibration saver", essential=False
            )

    async def _save_calibrations_forever(self) -> None:
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

    async def wait(self) -> int:
        """Wait for a stop request (returns 0) or an essential task's failure (returns 1)."""
        loop = asyncio.get_running_loop()
        stop = loop.create_task(self._stop.wait(), name="wait for stop")
        failed = loop.create_task(self.supervisor.failed.wait(), name="wait for failure")
        try:
            await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            failed.cancel()
        return 1 if self.supervisor.failed.is_set() else 0

    async def shutdown(self) -> None:
        """Drain, then stop: the order balancers and clients expect.

        1. From the first moment new work is refused (503 ``shutting_down`` with
           Retry-After), ``/readyz`` answers 503, ``/events`` followers get ``stopping``,
           and every reply says ``Connection: close``; every listener keeps accepting and
           answering, so a borrower that has not noticed yet gets a refusal, never a
           refused connection.
        2. With ``[kubernetes]``, the lender is published terminating (endpoints not
           ready, not serving) before anything closes.
        3. The drain: borrowed work in flight may finish, for at most
           ``[server] shutdown_grace_s``; the listeners stay up for at least
           ``shutdown_delay_s`` even when nothing is in flight, and at least
           ``FOLLOWED_SHUTDOWN_DELAY_S`` whenever an ``/events`` follower (the companion)
           heard ``stopping``, so it publishes the lender not ready before a listener
           closes. A second SIGTERM/SIGINT ends it at once (:meth:`hurry`).
        4. What is left is cut unmistakably: WebSocket tunnels get a 1001 (Going Away)
           close frame on both legs; replies still streaming have their connections reset.
           ``/events`` followers get ``shutdown`` as the last event of their stream.
        5. The proxy listeners close, then (host-side Kubernetes) the lender is published
           stopped, then the API listener closes; loops stop and state is saved.
        """
        settings = self.settings
        grace_s = settings.server.shutdown_grace_s
        delay_s = settings.shutdown_delay_s
        followers = self.state.event_followers
        if followers and delay_s < FOLLOWED_SHUTDOWN_DELAY_S:
            # A follower (the companion) publishes this lender not ready when it hears
            # `stopping`: the listeners outlast that, whatever the configuration says.
            delay_s = min(FOLLOWED_SHUTDOWN_DELAY_S, grace_s)
            log.info(
                "%d /events follower(s) hear `stopping` first: the listeners keep answering "
                "for %g s (a second SIGTERM ends that now)",
                followers,
                delay_s,
            )
        in_flight = self.in_flight()
        self.state.set_stopping(grace_s, len(in_flight))
        self.supervisor.stopping()  # listeners closing from here on are not failures
        loop = asyncio.get_running_loop()
        began = loop.time()
        if in_flight:
            log.warning(
                "stopping with %d borrowed job(s) in flight (%s); they have %g s to finish "
                "before their connections are cut (a second SIGTERM cuts them now)",
                len(in_flight),
                ", ".join(f"{j.upstream} job {j.id}" for j in in_flight),
                grace_s,
            )
        if self.kubernetes is not None:
            # Terminating first (endpoints not ready, terminating), so the cluster routes
            # away while in-flight work finishes; stopped once the listeners are closed.
            await self.kubernetes.announce_terminating()
        await self._drain(began, grace_s, delay_s)
        cut = await self._cut_what_is_left()
        self.state.announce_shutdown(cut, hurried=self._hurry.is_set())
        log.info(
            "drain over after %.1f s%s; closing the listeners",
            loop.time() - began,
            f" ({cut} connection(s) cut)" if cut else "",
        )
        # The proxy listeners close together; the API listener goes last so /healthz and
        # /readyz answer until the end (and /events followers have their last event).
        api = self._runners.pop("api", None)
        await self._close_listeners(self._runners)
        self._hold_what_is_unwatched()
        self._refusal_log.flush()  # the last window's refusal counts are not lost
        if self.kubernetes is not None:
            await self.kubernetes.stop()
        if api is not None:
            await self._close_listeners({"api": api})
        await self.owner.flush()  # a pause save in flight is written, not cancelled
        await self.supervisor.stop()
        if self.tracing is not None:
            await self.tracing.shutdown()
        await self.save_calibrations()
        await self._save_at_stop()
        for session in self._sessions:
            await session.close()
        for upstream_client in self._clients:
            await upstream_client.close()
        log.info("stopped %.3f s after the stop began", loop.time() - began)

    async def _drain(self, began: float, grace_s: float, delay_s: float) -> None:
        """Wait (loop time ``began`` + at most ``grace_s`` s, at least ``delay_s`` s) until
        no borrowed exchange is in flight, or until :meth:`hurry`."""
        loop = asyncio.get_running_loop()
        while not self._hurry.is_set():
            elapsed = loop.time() - began
            if elapsed >= grace_s:
                left = self.in_flight()
                if left:
                    log.warning(
                        "the %g s shutdown grace is over; cutting %d borrowed exchange(s) "
                        "still in flight",
                        grace_s,
                        len(left),
                    )
                return
            if elapsed >= delay_s and not self.in_flight():
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(DRAIN_POLL_S, grace_s - elapsed)):
                    await self._hurry.wait()

    async def _close_listeners(self, runners: Mapping[str, web.BaseRunner]) -> None:
        """Close ``runners`` together: requests still being answered get up to
        ``CLOSE_TIMEOUT_S``, unless the stop is hurried (a second SIGTERM/SIGINT, before or
        during the close): then they get ``HURRIED_CLOSE_S`` and their connections are
        reset, so the daemon exits at once instead of waiting out the close timeout."""
        closing: asyncio.Future[Any] = asyncio.gather(
            *(runner.cleanup() for runner in runners.values())
        )
        hurry: asyncio.Future[Any] = asyncio.get_running_loop().create_task(
            self._hurry.wait(), name="hurry"
        )
        try:
            await asyncio.wait({closing, hurry}, return_when=asyncio.FIRST_COMPLETED)
            if not closing.done():
                with contextlib.suppress(TimeoutError):
                    # a moment for what is about to end on its own (/events' last event)
                    async with asyncio.timeout(HURRIED_CLOSE_S):
                        await asyncio.shield(closing)
            if not closing.done():
                reset = sum(
                    guard.reset_busy() for name, guard in self._guards.items() if name in runners
                )
                log.info("closing: %d connection(s) still answering were reset", reset)
            await closing
        finally:
            hurry.cancel()

    def _hold_what_is_unwatched(self) -> None:
        """Once no exchange runs: hold every job whose completion is still uncertain (a
        llama-server still generating for a borrower who left, a queued ComfyUI prompt), so
        it is written out with the other holds and refused again after the restart."""
        for job in self.work.stop_watching():
            hold = job.hold
            assert hold is not None
            log.warning(
                "%s: job %d may still be running on the server as vacancyd stops; held (%s), "
                "so its resources lend nothing after the restart until %s",
                job.upstream,
                job.id,
                hold.reason.value,
                "an observation shows the server idle"
                if hold.release_by is ReleaseBy.SERVER_IDLE
                else "an administrator releases it",
            )

    async def _save_at_stop(self) -> None:
        """Write what is left to write (held jobs first), for at most ``SAVE_AT_STOP_S``;
        a held job that is not on disk then is logged, as its hold is lost on the restart."""
        try:
            async with asyncio.timeout(SAVE_AT_STOP_S):
                await self.saver.flush()
        except TimeoutError:
            log.error(
                "writing to the state directory %s took over %g s; stopping without it",
                self.settings.state_dir,
                SAVE_AT_STOP_S,
            )
        unsaved = self.work.unsaved()
        if unsaved:
            log.error(
                "held job(s) %s could not be written to the state directory before stopping; "
                "the restarted daemon will not hold their resources",
                ", ".join(str(i) for i in unsaved),
            )

    async def _cut_what_is_left(self) -> int:
        """End the tunnels with 1001, then reset the proxy connections still answering a
        request (their jobs end as cut, not as borrower disconnects). Returns how many
        connections were cut."""
        self.work.cut_for_stop()
        closed = await asyncio.gather(
            *(proxy.tunnels.close_all(CLOSE_TIMEOUT_S) for proxy in self._proxies.values())
        )
        reset = sum(guard.reset_busy() for name, guard in self._guards.items() if name != "api")
        return sum(closed) + reset

    async def reload_tls(self) -> bool:
        """Load renewed TLS files into the running context (SIGHUP). Returns False, logging
        why, when they cannot be loaded; the running certificate stays in use then."""
        if self.tls is None or self._tls_files is None:
            return True
        try:
            await asyncio.to_thread(reload_context, self.tls, self._tls_files)
        except TlsError as exc:
            log.error("SIGHUP: %s; the running certificate stays in use", exc)
            return False
        log.info("SIGHUP: TLS certificate reloaded from %s", self._tls_files.cert)
        return True


async def recheck_config(path: Path | None) -> bool:
    """SIGHUP: read and validate the configuration file again (secrets included) and log the
    result. Returns whether it is valid. Never raises: the running configuration is kept
    either way, because vacancyd applies a configuration only at start (listeners, budgets
    and policies are built from it once); a restart applies a changed file."""
    if path is None:
        log.info("SIGHUP: running on the embedded default configuration; nothing to re-read")
        return True

    def check() -> None:
        read_secrets(load_config(path), str(path), credentials_directory())

    try:
        await asyncio.to_thread(check)
    except ConfigError as exc:
        log.error("SIGHUP: %s\nthe running configuration is kept", exc)
        return False
    except Exception as exc:
        log.error("SIGHUP: cannot check %s (%r); the running configuration is kept", path, exc)
        return False
    log.info(
        "SIGHUP: %s is valid; configuration changes take effect when vacancyd is restarted "
        "(systemctl restart vacancyd); the running configuration is kept",
        path,
    )
    return True


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


async def run_daemon(settings: Settings, config_path: Path | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code.

    SIGHUP re-reads and validates ``config_path`` and logs the verdict
    (:func:`recheck_config`); it never stops the daemon.
    """
    parser_problem = lenient_parser_problem()
    if parser_problem is not None:
        log.error("%s", parser_problem)
        return EXIT_CONFIG
    memory.pin_malloc_thresholds()  # request bodies' memory goes back after a storm
    daemon = Daemon(settings)
    loop = asyncio.get_running_loop()
    # The first SIGTERM/SIGINT starts the drain; a second one (either) ends it now.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)

    async def hangup() -> bool:
        await daemon.reload_tls()
        return await recheck_config(config_path)

    def on_hangup() -> None:
        daemon.supervisor.spawn(hangup(), name="SIGHUP config check", essential=False)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        try:
            await daemon.start()
        except AddressBusyError as exc:
            log.error("%s", exc)
            return EXIT_ADDRESS_BUSY
        except (StartupError, ConfigError) as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        line = daemon.service_status()
        sdnotify.notify(f"READY=1\nSTATUS={line}")
        if sdnotify.enabled():
            daemon.supervisor.spawn(
                sdnotify.status_updates(daemon.service_status, sent=line),
                name="service status",
                essential=False,
            )
        ping_s = sdnotify.watchdog_interval_s()
        if ping_s is not None:
            daemon.supervisor.spawn(sdnotify.watchdog(ping_s), name="watchdog", essential=False)
        code = await daemon.wait()
        if code:
            log.error("%s", daemon.supervisor.failure)
        else:
            log.info("stopping on signal")
        return code
    finally:
        sdnotify.notify("STOPPING=1")
        await daemon.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
