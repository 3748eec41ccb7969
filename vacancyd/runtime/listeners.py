"""Binding the listeners: the API and one proxy per upstream or pool, with the TLS context
they share, their connection budgets, and the HTTP sessions the proxies and vacancyd's own
calls to each upstream use; and, at the stop, closing them.

:class:`Listeners` owns every runner, guard, proxy and session; :mod:`vacancyd.runtime.daemon`
decides when to bind, cut and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from vacancyd.adapters.base import Controller
from vacancyd.config.model import Settings, is_loopback, split_listen
from vacancyd.control.admission import Admission
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.proxy.app import Proxy, Upstream, make_server
from vacancyd.proxy.client import UpstreamClient
from vacancyd.proxy.observe import ProxyAccessLogger
from vacancyd.proxy.probe import ProbeEndpoint
from vacancyd.proxy.tunnel import TunnelLimits
from vacancyd.runtime.tasks import Supervisor, hold_listener
from vacancyd.state import SharedState
from vacancyd.web.access import AccessLogger, RefusalLog
from vacancyd.web.auth import Authenticator
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

#: Once the drain is over, how long requests still being answered (refusals, pass-through
#: reads) and WebSocket closing handshakes get before their connections close (seconds).
CLOSE_TIMEOUT_S = 1.0
#: After a second SIGTERM/SIGINT, how long requests still being answered get before their
#: connections are reset (seconds), instead of CLOSE_TIMEOUT_S.
HURRIED_CLOSE_S = 0.2


class StartupError(Exception):
    """The daemon could not start (a listener could not bind, a secret could not be read)."""


class AddressBusyError(StartupError):
    """A listener's address is held by another socket or not on this host yet (EADDRINUSE,
    EADDRNOTAVAIL): often passing at boot, so the exit status asks for a restart."""


#: Exit status when a listener's address is busy or not yet on this host (``EX_TEMPFAIL`` of
#: sysexits.h): systemd restarts it after the unit's ``RestartSec`` (docs/install.md).
EXIT_ADDRESS_BUSY = 75


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


@dataclass
class Listeners:
    """Every listener of one daemon: bound by :meth:`serve`, cut and closed at the stop."""

    settings: Settings
    state: SharedState
    metrics: Metrics
    supervisor: Supervisor
    #: address per listener name ("api" and each upstream's or pool's name), once bound
    bound: dict[str, str] = field(default_factory=dict)
    #: runner per listener name
    runners: dict[str, web.BaseRunner] = field(default_factory=dict)
    #: connection budgets per listener name, and the proxies (tunnels) per upstream or pool
    guards: dict[str, ConnectionGuard] = field(default_factory=dict)
    proxies: dict[str, Proxy] = field(default_factory=dict)
    #: the proxy listeners' refusal lines, summed up per (listener, reason) under a flood
    refusal_log: RefusalLog = field(default_factory=RefusalLog)
    #: the listeners' shared TLS context (None: plain HTTP) and the files it was loaded from
    tls: ssl.SSLContext | None = None
    tls_files: TlsFiles | None = None
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)
    clients: list[UpstreamClient] = field(default_factory=list)

    def load_tls(self) -> None:
        """Load ``[server]``'s certificate and key, when set. Raises StartupError."""
        server = self.settings.server
        if server.tls_cert_file is None or server.tls_key_file is None:
            return
        self.tls_files = TlsFiles(
            server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file
        )
        try:
            self.tls = server_context(self.tls_files)
        except TlsError as exc:
            raise StartupError(str(exc)) from exc

    async def reload_tls(self) -> bool:
        """Load renewed TLS files into the running context (SIGHUP). Returns False, logging
        why, when they cannot be loaded; the running certificate stays in use then."""
        if self.tls is None or self.tls_files is None:
            return True
        try:
            await asyncio.to_thread(reload_context, self.tls, self.tls_files)
        except TlsError as exc:
            log.error("SIGHUP: %s; the running certificate stays in use", exc)
            return False
        log.info("SIGHUP: TLS certificate reloaded from %s", self.tls_files.cert)
        return True

    async def serve(
        self,
        name: str,
        app: web.Application | Proxy,
        listen: str,
        *,
        probe: Probe | None = None,
        access_log_class: type[AbstractAccessLogger] | None = None,
        trace: Any = None,
    ) -> str:
        """Bind ``listen`` for the API application or a proxy (an aiohttp low-level server:
        the proxy routes every request itself; ``trace``: the tracing middleware of its
        requests, or None). Returns the bound address. Raises StartupError when it cannot
        bind (AddressBusyError when the address is busy or not on this host yet)."""
        runner = await self._runner(name, app, access_log_class, trace)
        self.runners[name] = runner
        host, port = split_listen(listen)
        guard = self._guard(name, probe)
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
        self.guards[name] = guard
        address = f"{host}:{site.port}" if ":" not in host else f"[{host}]:{site.port}"
        self.bound[name] = address
        log.info("%s listening on %s://%s", name, "https" if self.tls else "http", address)
        server = site.listening
        assert server is not None
        task_name = f"api@{address}" if name == "api" else f"listener {name}@{address}"
        self.supervisor.spawn(hold_listener(task_name, server), name=task_name, essential=True)
        return address

    async def serve_upstream(
        self,
        upstream: Upstream,
        *,
        auth: Authenticator,
        admission: Admission,
        controller: Controller | None,
        calls: UpstreamCalls,
        probes: dict[str, ProbeEndpoint],
        trace: Any = None,
    ) -> Proxy:
        """Build one upstream's proxy, add its lendability probe to ``probes`` (the API's)
        and bind its listener. Raises StartupError when it cannot bind."""
        up = upstream.settings
        proxy = Proxy(
            upstream,
            admission=admission,
            auth=auth,
            metrics=self.metrics,
            limits=self.settings.server.limits,
            session=self.proxy_session(),
            controller=controller,
            calls=calls,
            tunnels=TunnelLimits(up.websocket_max_tunnels, up.websocket_idle_timeout_s),
        )
        self.clients.append(proxy.client)
        probes[up.name] = ProbeEndpoint(up.public_probe, proxy.probe)
        self.state.set_listener(up.name, up.listen, bound=False)
        address = await self.serve(
            up.name,
            proxy,
            up.listen,
            access_log_class=ProxyAccessLogger.bind(
                up.name, self.metrics.request_duration, self.refusal_log
            ),
            trace=trace,
        )
        self.state.set_listener(up.name, address, bound=True)
        self.proxies[up.name] = proxy
        return proxy

    async def serve_pool(
        self,
        name: str,
        listen: str,
        members: Sequence[str],
        proxies: Mapping[str, Proxy],
        *,
        auth: Authenticator,
        admission: Admission,
    ) -> None:
        """Bind a pool's listener: a proxy in front of its members' proxies (``proxies``,
        by upstream name). Raises StartupError when it cannot bind."""
        first = proxies[members[0]]
        pool_proxy = Proxy(
            replace(first.upstream, alias=name),
            admission=admission,
            auth=auth,
            metrics=self.metrics,
            limits=self.settings.server.limits,
            session=first.session,
            upstream_client=first.client,
            tunnels=TunnelLimits(
                first.upstream.settings.websocket_max_tunnels,
                first.upstream.settings.websocket_idle_timeout_s,
            ),
            members={m: proxies[m] for m in members},
        )
        self.proxies[name] = pool_proxy
        self.state.pools[name] = tuple(members)
        self.state.set_listener(name, listen, bound=False)
        address = await self.serve(
            name,
            pool_proxy,
            listen,
            access_log_class=ProxyAccessLogger.bind(name, None, self.refusal_log),
        )
        self.state.set_listener(name, address, bound=True)

    async def _runner(
        self,
        name: str,
        app: web.Application | Proxy,
        access_log_class: type[AbstractAccessLogger] | None,
        trace: Any,
    ) -> web.BaseRunner:
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
        return runner

    def _guard(self, name: str, probe: Probe | None) -> ConnectionGuard:
        limits = self.settings.server.limits
        metrics = self.metrics
        return ConnectionGuard(
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

    def proxy_session(self) -> aiohttp.ClientSession:
        """A pooled session for one upstream's borrowed requests (closed at the stop)."""
        limits = self.settings.server.limits
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
        self.sessions.append(session)
        return session

    def control_session(self, credential: str | None) -> aiohttp.ClientSession:
        """A session for vacancyd's own calls to an upstream (unload, cancel, queue reads)."""
        session = aiohttp.ClientSession(
            trust_env=False,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.settings.server.limits.upstream_connect_timeout_s
            ),
            headers={"Authorization": f"Bearer {credential}"} if credential else None,
        )
        self.sessions.append(session)
        return session

    def observer_session(self, credential: str | None) -> aiohttp.ClientSession:
        """A session for reading an upstream's own state (each call within the probe
        deadline, ``[collectors] probe_timeout_s``)."""
        session = aiohttp.ClientSession(
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=self.settings.collectors.probe_timeout_s),
            headers={"Authorization": f"Bearer {credential}"} if credential else None,
        )
        self.sessions.append(session)
        return session

    async def close(self, runners: Mapping[str, web.BaseRunner], hurry: asyncio.Event) -> None:
        """Close ``runners`` together: requests still being answered get up to
        ``CLOSE_TIMEOUT_S``, unless the stop is hurried (``hurry`` set by a second
        SIGTERM/SIGINT, before or during the close): then they get ``HURRIED_CLOSE_S`` and
        their connections are reset, so the daemon exits at once instead of waiting out the
        close timeout."""
        closing: asyncio.Future[Any] = asyncio.gather(
            *(runner.cleanup() for runner in runners.values())
        )
        hurried: asyncio.Future[Any] = asyncio.get_running_loop().create_task(
            hurry.wait(), name="hurry"
        )
        try:
            await asyncio.wait({closing, hurried}, return_when=asyncio.FIRST_COMPLETED)
            if not closing.done():
                with contextlib.suppress(TimeoutError):
                    # a moment for what is about to end on its own (/events' last event)
                    async with asyncio.timeout(HURRIED_CLOSE_S):
                        await asyncio.shield(closing)
            if not closing.done():
                reset = sum(
                    guard.reset_busy() for name, guard in self.guards.items() if name in runners
                )
                log.info("closing: %d connection(s) still answering were reset", reset)
            await closing
        finally:
            hurried.cancel()

    async def cut_proxies(self) -> int:
        """End the tunnels with 1001, then reset the proxy connections still answering a
        request. Returns how many connections were cut."""
        closed = await asyncio.gather(
            *(proxy.tunnels.close_all(CLOSE_TIMEOUT_S) for proxy in self.proxies.values())
        )
        reset = sum(guard.reset_busy() for name, guard in self.guards.items() if name != "api")
        return sum(closed) + reset

    async def close_sessions(self) -> None:
        """Close every HTTP session and pooled upstream client (the last step of a stop)."""
        for session in self.sessions:
            await session.close()
        for upstream_client in self.clients:
            await upstream_client.close()
