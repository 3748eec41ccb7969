"""The daemon: builds state, listeners and collectors from settings and runs until stopped.
Its tasks, all under the supervisor, are listed in :mod:`vacancyd.runtime`.

Stops on SIGTERM/SIGINT (exit 0) or when an essential task ends (exit 1), after a drain
(:meth:`Daemon.shutdown`): listeners keep answering, with refusals for new work, while
borrowed work in flight finishes for at most ``[server] shutdown_grace_s`` seconds; a second
SIGTERM/SIGINT ends the drain at once (still exit 0). SIGHUP re-reads and validates the
configuration file and logs the verdict; it never stops the daemon.

This module is the lifecycle (start, wait, drain, shutdown, SIGHUP); what the daemon is made
of is built in :mod:`vacancyd.runtime.build`, its listeners bound and closed by
:mod:`vacancyd.runtime.listeners`, its loops started by :mod:`vacancyd.runtime.loops`.
The names tests and the command line import from here are re-exported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from yarl import URL

from vacancyd.adapters import ADAPTERS
from vacancyd.api.app import Handler as ApiHandler
from vacancyd.api.app import health_probe, make_api
from vacancyd.api.metrics import attach_state
from vacancyd.api.ops import Diagnostics
from vacancyd.api.overview import Overview
from vacancyd.api.status import StatusViews, read_status
from vacancyd.api.usage import UsageReport
from vacancyd.collectors import logind
from vacancyd.config.model import FOLLOWED_SHUTDOWN_DELAY_S, Settings, UpstreamSettings
from vacancyd.config.secrets import Secrets, credentials_directory, read_secrets
from vacancyd.control.accounting import Accounting
from vacancyd.control.admission import Admission
from vacancyd.control.borrowers import Borrowers
from vacancyd.control.owner import OwnerControls
from vacancyd.control.reclaim import Reclaimer
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.control.waiting import WaitRooms
from vacancyd.control.work import Work
from vacancyd.core.events import Shutdown
from vacancyd.core.lifecycle import JobPhase, JobRules, JobState, ReleaseBy
from vacancyd.core.status import service_status_line
from vacancyd.k8s.host import HostPublisher
from vacancyd.proxy.app import Proxy, Upstream
from vacancyd.proxy.probe import ProbeEndpoint
from vacancyd.runtime import learned, lendability
from vacancyd.runtime.build import (
    PAUSE_VERSION,
    Collaborators,
    ControllerViews,
    DurablePauseStore,
    build,
    build_state,
    capacity_probe,
    card_sharing,
    check_state_dir,
    make_authenticator,
    owner_controls_config,
    read_tokens,
)
from vacancyd.runtime.history import HistoryRecorder
from vacancyd.runtime.listeners import (
    CLOSE_TIMEOUT_S,
    EXIT_ADDRESS_BUSY,
    HURRIED_CLOSE_S,
    AddressBusyError,
    Listeners,
    StartupError,
    reply_headers,
)
from vacancyd.runtime.loops import (
    CALIBRATION_SAVE_INTERVAL_S,
    TARGET_WATCH_S,
    Loops,
    warn_if_headless_at_a_desk,
)
from vacancyd.runtime.powerlimit import PowerLimiter
from vacancyd.runtime.tasks import Supervisor
from vacancyd.runtime.telemetry import Tracing, start_tracing
from vacancyd.runtime.usage import LedgerUnreadable, UsageStore
from vacancyd.state import SharedState
from vacancyd.web.auth import Authenticator
from vacancyd.web.metrics import Metrics

__all__ = [
    "CALIBRATION_SAVE_INTERVAL_S",
    "CLOSE_TIMEOUT_S",
    "DRAIN_POLL_S",
    "EXIT_ADDRESS_BUSY",
    "EXIT_CONFIG",
    "HURRIED_CLOSE_S",
    "PAUSE_VERSION",
    "SAVE_AT_STOP_S",
    "SHUTDOWN_GRACE_S",
    "TARGET_WATCH_S",
    "AddressBusyError",
    "Collaborators",
    "Daemon",
    "DurablePauseStore",
    "StartupError",
    "build_state",
    "capacity_probe",
    "owner_controls_config",
    "read_tokens",
    "reply_headers",
    "warn_if_headless_at_a_desk",
]

log = logging.getLogger(__name__)

#: The default ``[server] shutdown_grace_s``: seconds borrowed work in flight gets to finish
#: after SIGTERM/SIGINT (the drain), within systemd's ``TimeoutStopSec=30``.
SHUTDOWN_GRACE_S = 20.0
#: How often the drain looks whether the borrowed work in flight has finished (seconds).
DRAIN_POLL_S = 0.05
#: At the end of a stop, how long writing the state directory (held jobs first) may take
#: before the daemon stops without waiting for it (seconds; logged).
SAVE_AT_STOP_S = 5.0

#: Exit status of ``vacancyd run`` for what a restart cannot fix: an invalid configuration,
#: an unreadable secret, a refused TLS file. The systemd unit's ``RestartPreventExitStatus``.
EXIT_CONFIG = 2


@dataclass
class Daemon:
    settings: Settings
    state: SharedState = field(init=False)
    metrics: Metrics = field(init=False)
    supervisor: Supervisor = field(init=False)
    calls: UpstreamCalls = field(init=False)
    work: Work = field(init=False)
    admission: Admission = field(init=False)
    reclaimer: Reclaimer = field(init=False)
    owner: OwnerControls = field(init=False)
    power: PowerLimiter = field(init=False)
    saver: learned.LearnedSaver = field(init=False)
    learner: learned.Learner = field(init=False)
    listeners: Listeners = field(init=False)
    loops: Loops = field(init=False)
    _saved_holds: list[learned.SavedHold] = field(init=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by a second SIGTERM/SIGINT: the drain ends now.
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)
    kubernetes: HostPublisher | None = None
    #: replaces the OTLP exporter when set (tests pass an in-memory one)
    span_exporter: Any = None
    tracing: Tracing | None = None
    diagnostics: Diagnostics | None = None
    #: The usage ledger: built here so what records into it can be handed ``usage.record``
    #: before the start; opened by :meth:`start`, closed at the end of :meth:`shutdown`.
    usage: UsageStore = field(init=False)
    #: The named borrowers' limits and what each used today (docs/borrowers.md).
    borrowers: Borrowers = field(init=False)
    #: What each borrowed job used, written to the ledger when it ends.
    accounting: Accounting = field(init=False)
    #: what their owners render for /status and /metrics (controllers, owner, publisher)
    views: StatusViews = field(init=False)

    def __post_init__(self) -> None:
        parts = build(self.settings)
        self.state = parts.state
        self._saved_holds = parts.saved_holds
        self.metrics = parts.metrics
        self.supervisor = parts.supervisor
        self.saver = parts.saver
        self.calls = parts.calls
        self.learner = parts.learner
        self.work = parts.work
        self.admission = parts.admission
        self.reclaimer = parts.reclaimer
        self.owner = parts.owner
        self.power = parts.power
        self.listeners = Listeners(self.settings, self.state, self.metrics, self.supervisor)
        self.loops = Loops(
            self.settings,
            self.state,
            self.metrics,
            self.supervisor,
            self.owner,
            self.reclaimer,
            learner=parts.learner,
            sampled=self._sampled,
        )
        self.usage = parts.usage
        self.accounting = parts.accounting
        self.borrowers = parts.accounting.borrowers
        usage = self.usage
        self.views = StatusViews(
            sleep=ControllerViews(self.calls, [u.name for u in self.settings.upstream]),
            owner=self.owner.view,
            kubernetes=lambda: None if self.kubernetes is None else self.kubernetes.status(),
            usage_error=lambda: usage.error,
            job_holds=self.work.holds.shown,
            job_borrowers=self.work.borrowers,
        )
        attach_state(self.metrics, self.state, self.views)

    def _sampled(self) -> None:
        """After every capacity or server sample: the wait queues decide again, and the jobs
        that waited for their last energy reading are written."""
        self.work.rooms.serve()
        self.accounting.sampled(self.state.capacity)

    @property
    def bound(self) -> dict[str, str]:
        """The bound address per listener name ("api", each upstream's and pool's name)."""
        return self.listeners.bound

    @property
    def _runners(self) -> dict[str, web.BaseRunner]:
        return self.listeners.runners

    @property
    def presence(self) -> logind.LogindPresence | None:
        """The logind presence source, once started (None with any other source)."""
        return self.loops.presence

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
        self.listeners.load_tls()
        auth = make_authenticator(settings, read_tokens(secrets), self.metrics)
        self.tracing = start_tracing(
            settings.telemetry, self.state, self.span_exporter, supervisor=self.supervisor
        )
        # The owner's holds (a restored pause, the schedule, the battery) are in force
        # before the first borrower can connect.
        await self.owner.sample()
        # A power limit a crash left applied is restored as the daemon starts.
        self.supervisor.spawn(self.power.run(), name="power limits", essential=False)
        await self._open_usage()
        probes: dict[str, ProbeEndpoint] = {}
        await self._serve_api(auth, secrets, started_at, probes)
        self._restore_holds()
        proxies: dict[str, Proxy] = {}
        for up in settings.upstream:
            credential = secrets.credentials.get(up.name)
            proxies[up.name] = await self._serve_upstream(up, credential, auth, probes)
        for pool in settings.pool:
            await self.listeners.serve_pool(
                pool.name, pool.listen, pool.members, proxies, auth=auth, admission=self.admission
            )
        self.work.watch_restored()
        self._share_cards()
        self.loops.start_collectors()
        self.supervisor.spawn(self.owner.run(), name="owner controls", essential=True)
        self.loops.start_presence()
        check_state_dir(self.settings.state_dir, self.saver)
        self.supervisor.spawn(self.saver.run(), name="state saver", essential=False)
        self.supervisor.spawn(self.loops.watch_targets(), name="target listeners", essential=False)
        self.supervisor.spawn(
            lendability.watch(self.state), name="lendability watcher", essential=False
        )
        self.supervisor.spawn(
            warn_if_headless_at_a_desk(settings), name="headless check", essential=False
        )
        recorder = HistoryRecorder(self.state, self.usage, borrowers=self.work.borrowers)
        self.supervisor.spawn(recorder.run(), name="history recorder", essential=False)
        self._start_kubernetes(started_at)

    async def _open_usage(self) -> None:
        """Open the usage ledger (off the loop; a failure is its error in /status, never
        fatal), show its error in /status and run its hourly upkeep."""
        store = self.usage
        await store.open()
        if any(b.daily_busy_s is not None for b in self.settings.borrower):
            # A restart must not hand a borrower a fresh quota: today's busy time so far.
            day = self.borrowers.day
            try:
                used = await store.busy_between(day.start, day.end)
            except LedgerUnreadable as exc:
                log.warning("daily quotas start from 0: the usage ledger cannot be read: %s", exc)
            else:
                self.borrowers.restore(used, day)
        self.supervisor.spawn(store.upkeep(), name="usage ledger upkeep", essential=False)

    def _extra_routes(
        self,
        app: web.Application,
        scoped: Callable[[str, ApiHandler], ApiHandler],
        mutation: Callable[[ApiHandler], ApiHandler],
    ) -> None:
        """The API routes beyond make_api's: the debug window and diagnostics, and the
        status page's overview (timeline and today's totals, vacancyd.api.overview)."""
        if self.diagnostics is not None:
            self.diagnostics.install(app, scoped, mutation)
        tz, zone = self.owner.config.tz, self.owner.config.zone
        Overview(self.usage, self.usage, tz, zone).install(app, scoped)

    async def _serve_api(
        self,
        auth: Authenticator,
        secrets: Secrets,
        started_at: float,
        probes: dict[str, ProbeEndpoint],
    ) -> None:
        """Bind the API listener (``probes``: filled in as the proxies are built)."""
        settings = self.settings
        self.diagnostics = Diagnostics(
            self.state,
            settings,
            started_at=started_at,
            secrets=secrets.all_secrets,
            users=lambda: self.presence.seen_users if self.presence is not None else (),
            views=self.views,
        )
        api = make_api(
            self.state,
            auth,
            self.metrics,
            started_at=started_at,
            release=self.work.admin_release,
            reclaim=self.reclaimer.reclaim,
            switched=lambda: self.reclaimer.answer(()),
            max_event_subscribers=settings.server.limits.max_event_subscribers,
            controls=self.owner,
            probes=probes,
            views=self.views,
            usage=UsageReport(self.usage, settings.energy_price_per_kwh, settings.energy_currency),
            extra_routes=self._extra_routes,
        )
        state = self.state
        await self.listeners.serve(
            "api", api, settings.server.listen, probe=lambda path: health_probe(state, path)
        )

    async def _serve_upstream(
        self,
        up: UpstreamSettings,
        credential: str | None,
        auth: Authenticator,
        probes: dict[str, ProbeEndpoint],
    ) -> Proxy:
        """Build one upstream's proxy (and its controller, when its adapter has one), bind
        its listener, and start its connection check and server observer."""
        adapter = ADAPTERS[up.adapter]
        upstream = Upstream(
            settings=up,
            policy=self.state.upstreams[up.name],
            adapter=adapter,
            target=URL(str(up.target)),
            credential=credential,
        )
        controller = None
        if adapter.make_controller is not None:
            controller = adapter.make_controller(
                self.listeners.control_session(credential), upstream.target
            )
            self.calls.add(up.name, controller)
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
        proxy = await self.listeners.serve_upstream(
            upstream,
            auth=auth,
            admission=self.admission,
            controller=controller,
            calls=self.calls,
            probes=probes,
            trace=None if self.tracing is None else self.tracing.middleware(up.name),
        )
        self.loops.start_reach_check(upstream)
        if adapter.observable:
            self.loops.start_observer(upstream, self.listeners.observer_session(credential))
        return proxy

    def _restore_holds(self) -> None:
        """Hold again what was held when vacancyd last stopped, before any proxy listens."""
        learned.restore_holds(self.work, self._saved_holds, self.state.resources)
        if self._saved_holds and not self.saver.holds_frozen:
            # the restored jobs have new ids, and a dropped hold leaves the file
            self.saver.write_holds(self.work.holds)
        self._saved_holds = []

    @property
    def waiting(self) -> WaitRooms[JobState]:
        """The wait queues of upstreams with ``busy = "wait"``."""
        return self.work.rooms

    def _share_cards(self) -> None:
        """Exclusivity effects for upstreams with ``exclusive_of`` (Ollama + ComfyUI)."""
        sharing = card_sharing(self.settings, self.state, self.calls, self.metrics)
        if sharing is not None:
            self.work.share_cards(sharing)

    def _start_kubernetes(self, started_at: float) -> None:
        settings = self.settings.kubernetes
        if settings is None:
            return
        from vacancyd.k8s.client import available

        missing = available()
        if missing is not None:
            log.error("[kubernetes] is configured but cannot be used: %s", missing)
            return
        state, views, at = self.state, self.views, started_at
        self.kubernetes = HostPublisher(settings, state, lambda: read_status(state, at, views))
        self.kubernetes.start(
            lambda coro, name: self.supervisor.spawn(coro, name=name, essential=False)
        )

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
        # /events followers get `shutdown` as the last event of their stream
        self.state.events.emit(Shutdown(cut, self._hurry.is_set()))
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
        self.listeners.refusal_log.flush()  # the last window's refusal counts are not lost
        if self.kubernetes is not None:
            await self.kubernetes.stop()
        if api is not None:
            await self._close_listeners({"api": api})
        await self.owner.flush()  # a pause save in flight is written, not cancelled
        await self.supervisor.stop()
        await self.power.restore_at_stop()
        if self.tracing is not None:
            await self.tracing.shutdown()
        await self.loops.save_calibrations()
        await self._save_at_stop()
        self.accounting.flush()  # the jobs that wait for their last energy sample
        await self.usage.close()  # after the listeners: every finished job is written
        await self.listeners.close_sessions()
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
        """Close ``runners`` together (:meth:`Listeners.close`): a hurried stop resets what
        is still answering instead of waiting out the close timeout."""
        await self.listeners.close(runners, self._hurry)

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
        unsaved = self.work.holds.unsaved()
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
        return await self.listeners.cut_proxies()

    async def reload_tls(self) -> bool:
        """Load renewed TLS files into the running context (SIGHUP). Returns False, logging
        why, when they cannot be loaded; the running certificate stays in use then."""
        return await self.listeners.reload_tls()
