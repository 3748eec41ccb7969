"""The in-cluster companion: follows lenders over HTTP and publishes them.

``vacancyd companion --config companion.toml`` runs one :class:`LenderFollower` and one
:class:`~vacancyd.k8s.publisher.Publisher` per ``[[lender]]``. A follower

* reads ``GET /status`` every ``status_poll_s`` seconds (the resync) and at once whenever
  the lender's ``GET /events`` stream reports a transition;
* keeps the ``/events`` stream open, reconnecting with backoff when it breaks, stalls past
  ``lender_timeout_s`` (the lender sends a keepalive every few seconds) or sends something
  that is not a server-sent event;
* publishes the lender terminating the moment its stream says ``stopping`` (SIGTERM on
  the lender), so the cluster routes away before the lender's listeners close;
* publishes the lender as unreachable (every condition Unknown, every endpoint not ready)
  once no ``/status`` read has succeeded for ``lender_timeout_s`` seconds, so a powered-off
  PC never stays ready.

The lender needs no cluster credentials; the companion needs a read-scope token per lender.
An ``https://`` lender's certificate is verified against the system's CAs, or against the
``ca_file`` given for that lender or for all (a self-signed certificate or a private CA); a
certificate that does not verify is reported as such, naming the problem.
Its own listener serves ``/healthz`` and ``/metrics`` (``vacancyd_companion_*``).

Its background tasks are one ``follower NAME`` and one ``publisher NAME`` per lender, kept
by :class:`Companion`; every one is essential: one that ends stops the companion (exit 1),
so that its Deployment restarts it rather than it publishing nothing. A follower's own two
loops (``status NAME``, ``events NAME``) run in a task group inside its task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from vacancyd.config.model import CompanionSettings, LenderSettings, split_listen
from vacancyd.core.events import PER_JOB_EVENTS
from vacancyd.core.lender import LenderState, Phase, StatusFormatError, lender_from_status
from vacancyd.k8s.api import K8sApiError, KubeApi
from vacancyd.k8s.publisher import Publisher, PublishTarget, services_for, watch_uninstall
from vacancyd.web.access import AccessLogger
from vacancyd.web.catalogue import gauge
from vacancyd.web.metrics import exposition
from vacancyd.web.tls import TlsError, client_context, verify_failure

log = logging.getLogger(__name__)

EVENTS_BACKOFF_MAX_S = 30.0


class EventStreamError(ValueError):
    """The lender's /events stream sent something that is not a server-sent event."""


def parse_sse_line(line: str) -> tuple[str, str] | None:
    """One line of a ``text/event-stream``: (field, value), or None for a comment/blank line.

    Raises :class:`EventStreamError` for a line that is neither (the WHATWG format would
    ignore it, but a vacancyd lender never sends one, so it means the URL is wrong or the
    stream is corrupt).
    """
    if line == "" or line.startswith(":"):
        return None
    name, sep, value = line.partition(":")
    if not sep or name not in ("event", "data", "id", "retry"):
        raise EventStreamError(f"not a server-sent event line: {line[:80]!r}")
    return name, value.removeprefix(" ")


class LenderFollower:
    """Follows one lender; publishes through ``publisher``. Run :meth:`run` as a task."""

    def __init__(
        self,
        settings: LenderSettings,
        publisher: Publisher,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        poll_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self._session = session
        #: What an https:// lender's certificate is verified with (True: the system's CAs).
        self._ssl: ssl.SSLContext | bool = tls if tls is not None else True
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._base = str(settings.url).rstrip("/")
        self._refresh = asyncio.Event()
        self.last_seen: float | None = None
        self.started_at: float | None = None
        self.lender: LenderState = LenderState.starting()
        self._status_error: str | None = None
        self._events_error: str | None = None
        self.events_received = 0
        #: The lender's keepalive period (seconds), from its hello event.
        self._keepalive_s = 5.0

    @property
    def name(self) -> str:
        return self.settings.name

    def _headers(self) -> dict[str, str]:
        try:
            token = self.settings.secret()
        except ValueError as exc:
            log.error("lender %s: cannot use token_file: %s", self.name, exc)
            token = None
        return {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def reachable(self) -> bool:
        return self.lender.alive

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._poll_status(), name=f"status {self.name}")
            group.create_task(self._follow_events(), name=f"events {self.name}")

    def _publish(self, lender: LenderState) -> None:
        if lender.phase is not self.lender.phase:
            log.info(
                "lender %s is %s%s",
                self.name,
                lender.phase.value,
                f": {lender.detail}" if lender.detail else "",
            )
        self.lender = lender
        self.publisher.update(lender)

    # -- /status ---------------------------------------------------------------------------

    async def _poll_status(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._refresh.clear()
            await self.read_status()
            now = loop.time()
            since = self.last_seen if self.last_seen is not None else self.started_at
            assert since is not None
            overdue = since + self._timeout_s
            unreachable = self.lender.phase is Phase.UNREACHABLE
            if now >= overdue and not unreachable:
                self._publish(
                    LenderState.unreachable(
                        f"no answer from {self._base} for {self._timeout_s:.0f} s"
                        + (f" ({self._status_error})" if self._status_error else ""),
                        self.lender,
                    )
                )
                unreachable = True
            # Wake for the next poll, a pushed event, or the moment the lender times out.
            wait = self._poll_s if unreachable else min(self._poll_s, max(0.05, overdue - now))
            try:
                async with asyncio.timeout(wait):
                    await self._refresh.wait()
            except TimeoutError:
                pass

    async def read_status(self) -> None:
        """Read /status once; publish it on success, log (once per distinct error) if not."""
        loop = asyncio.get_running_loop()
        url = f"{self._base}/status"
        try:
            async with self._session.get(
                url,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=min(self._timeout_s, 10.0)),
                ssl=self._ssl,
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise ValueError(f"HTTP {resp.status}: {text}")
                doc = await resp.json(content_type=None)
            lender = lender_from_status(doc)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            if isinstance(exc, StatusFormatError):
                error = f"{url} is not a vacancyd /status: {exc}"
            refused = verify_failure(exc)
            if refused is not None:
                error = self._certificate_problem(refused)
            if error != self._status_error:
                log.warning("lender %s: cannot read %s: %s", self.name, url, error)
            self._status_error = error
        else:
            if self._status_error is not None:
                log.info("lender %s: %s answers again", self.name, url)
            self._status_error = None
            self.last_seen = loop.time()
            self._publish(lender)

    def _certificate_problem(self, why: str) -> str:
        trusted = "its ca_file" if self.settings.ca_file is not None else None
        if trusted is None and isinstance(self._ssl, ssl.SSLContext):
            trusted = "the companion's ca_file"
        return f"the TLS certificate of {self._base} cannot be verified: {why}" + (
            f" (checked against {trusted})"
            if trusted
            else "; for a self-signed certificate or a private CA, set ca_file (for this "
            "lender or for all) to the certificate or CA that signed it"
        )

    # -- /events ---------------------------------------------------------------------------

    async def _follow_events(self) -> None:
        failures = 0
        while True:
            try:
                await self._read_events()
                error = "the stream ended"
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                refused = verify_failure(exc)
                if refused is not None:
                    error = self._certificate_problem(refused)
            failures += 1
            delay = min(EVENTS_BACKOFF_MAX_S, 0.5 * 2 ** min(failures - 1, 10))
            delay *= random.uniform(0.5, 1.0)
            level = logging.WARNING if error != self._events_error else logging.DEBUG
            log.log(
                level, "lender %s: /events: %s; reconnecting in %.1f s", self.name, error, delay
            )
            self._events_error = error
            self._refresh.set()  # something changed, or the lender is gone: read /status now
            await asyncio.sleep(delay)
            if self.events_received:
                failures = 0
                self.events_received = 0

    async def _read_events(self) -> None:
        url = f"{self._base}/events"
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self._timeout_s, sock_connect=self._timeout_s, sock_read=None
        )
        async with self._session.get(
            url,
            headers={**self._headers(), "Accept": "text/event-stream"},
            timeout=timeout,
            ssl=self._ssl,
        ) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            kind = resp.headers.get("Content-Type", "")
            if not kind.startswith("text/event-stream"):
                raise EventStreamError(f"{url} answered {kind or 'no content type'}")
            if self._events_error is not None:
                log.info("lender %s: /events connected", self.name)
                self._events_error = None
            event: str | None = None
            data: list[str] = []
            try:
                while True:
                    # Silence longer than a few keepalives (the period the hello event
                    # announced) means the stream is dead.
                    read_timeout_s = max(self._timeout_s, 3 * self._keepalive_s)
                    try:
                        async with asyncio.timeout(read_timeout_s):
                            raw = await resp.content.readline()
                    except TimeoutError:
                        raise EventStreamError(
                            f"nothing received for {read_timeout_s:.0f} s (not even a keepalive)"
                        ) from None
                    if not raw:
                        return
                    line = raw.decode("utf-8", "strict").rstrip("\r\n")
                    parsed = parse_sse_line(line)
                    if parsed is None:
                        if line == "" and (event is not None or data):
                            self._on_event(event or "message", "\n".join(data))
                            event, data = None, []
                        continue
                    field, value = parsed
                    if field == "event":
                        event = value
                    elif field == "data":
                        data.append(value)
            except BaseException:
                # Close, not release: leaving the response context would otherwise wait for
                # the end of a stream the lender may never end (a stalled or garbled one).
                resp.close()
                raise

    def _on_event(self, event: str, data: str) -> None:
        try:
            json.loads(data or "{}")
        except ValueError as exc:
            raise EventStreamError(f"event {event!r} carries data that is not JSON") from exc
        self.events_received += 1
        log.debug("lender %s: event %s %s", self.name, event, data)
        if event == "overflow":
            raise EventStreamError("the lender dropped this stream because it fell behind")
        if event == "stopping":
            # Told, not inferred: publish the lender terminating now, before its listeners
            # close; the /status read that follows confirms it (or shows it came back).
            if self.lender.alive and not self.lender.terminating:
                self._publish(
                    self.lender.as_terminating(f"{self._base} is shutting down", refusing=True)
                )
            self._refresh.set()
        elif event == "hello":
            try:
                hello = json.loads(data or "{}")
                self._keepalive_s = float(hello.get("keepalive_s", self._keepalive_s))
            except (TypeError, ValueError, AttributeError):
                pass
        elif event not in PER_JOB_EVENTS:
            # a borrowed job's start or end says nothing of lendability, and reading /status
            # after each would catch the lender between a release and its fresh sample
            self._refresh.set()


class CompanionCollector(Collector):
    """``vacancyd_companion_*`` gauges, one series per lender."""

    def __init__(self, followers: list[LenderFollower]) -> None:
        self._followers = followers

    def collect(self) -> Any:
        up = gauge("vacancyd_companion_lender_up")
        ok = gauge("vacancyd_companion_kubernetes_writes_ok")
        lendable = gauge("vacancyd_companion_upstream_lendable")
        for f in self._followers:
            up.add_metric([f.name], 1.0 if f.reachable else 0.0)
            ok.add_metric([f.name], 1.0 if f.publisher.healthy else 0.0)
            for name, upstream in sorted(f.lender.upstreams.items()):
                lendable.add_metric(
                    [f.name, name], 1.0 if f.lender.alive and upstream.lendable else 0.0
                )
        yield up
        yield ok
        yield lendable


def make_followers(
    settings: CompanionSettings,
    session: aiohttp.ClientSession,
    connect: Callable[[], Any],
) -> list[LenderFollower]:
    cluster = settings.kubernetes
    followers = []
    contexts: dict[Path, ssl.SSLContext] = {}
    for lender in settings.lender:
        tls = None
        ca_file = lender.ca_file or settings.ca_file
        if ca_file is not None:
            if ca_file not in contexts:
                try:
                    contexts[ca_file] = client_context(ca_file)
                except TlsError as exc:
                    which = "ca_file" if lender.ca_file is None else f"lender {lender.name} ca_file"
                    raise TlsError(f"{which}: {exc}") from exc
            tls = contexts[ca_file]
        address = lender.endpoint_address
        if address is None:
            log.warning(
                "lender %s: url host %r is not an IP and no address is set; no EndpointSlices",
                lender.name,
                lender.url.host,
            )
        publisher = Publisher(
            connect=connect,
            target=PublishTarget(
                lender=lender.name,
                namespace=cluster.namespace,
                node=lender.node,
                address=address,
                services=services_for(cluster.service_for, direct=cluster.direct_services),
            ),
            heartbeat_s=cluster.heartbeat_s,
            resync_s=cluster.resync_s,
            request_timeout_s=cluster.request_timeout_s,
            backoff_max_s=cluster.backoff_max_s,
            lendable_stable_s=cluster.lendable_stable_s,
        )
        followers.append(
            LenderFollower(
                lender,
                publisher,
                session,
                timeout_s=settings.lender_timeout_s,
                poll_s=settings.status_poll_s,
                tls=tls,
            )
        )
    return followers


def make_health_app(followers: list[LenderFollower]) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CompanionCollector(followers))
    app = web.Application()

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def status(_: web.Request) -> web.Response:
        return web.json_response(
            {
                f.name: {
                    "lender": f.lender.phase.value,
                    "detail": f.lender.detail,
                    "upstreams": {n: u.lendable for n, u in sorted(f.lender.upstreams.items())},
                    "kubernetes_errors": f.publisher.last_errors,
                }
                for f in followers
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = exposition(registry, request.headers.get("Accept"))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


class Companion:
    """Everything ``vacancyd companion`` runs; :meth:`start`, :meth:`wait`, :meth:`stop`."""

    def __init__(
        self, settings: CompanionSettings, *, connect: Callable[[], Any] | None = None
    ) -> None:
        self.settings = settings
        self._connect = connect or self._default_connect
        self.session: aiohttp.ClientSession | None = None
        self.followers: list[LenderFollower] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: web.AppRunner | None = None
        self.address: str | None = None
        self._stop = asyncio.Event()
        #: Why the companion stopped on its own (None: it was asked to).
        self.failure: str | None = None

    async def _default_connect(self) -> KubeApi:
        from vacancyd.k8s.client import KubeClient

        cluster = self.settings.kubernetes
        return await KubeClient.connect(cluster.kubeconfig, cluster.context)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(trust_env=False)
        self.followers = make_followers(self.settings, self.session, self._connect)
        loop = asyncio.get_running_loop()
        for f in self.followers:
            for coro, name in ((f.publisher.run(), "publisher"), (f.run(), "follower")):
                task = loop.create_task(coro, name=f"{name} {f.name}")
                task.add_done_callback(self._task_done)
                self._tasks.append(task)
        # An uninstall (the chart's pre-delete hook) announces itself before it removes
        # anything: every publisher then stops writing, so nothing removed comes back.
        watcher = loop.create_task(
            watch_uninstall(
                self._connect,
                self.settings.kubernetes.namespace,
                [f.publisher for f in self.followers],
            ),
            name="uninstall watcher",
        )
        watcher.add_done_callback(self._task_done)
        self._tasks.append(watcher)
        self._runner = web.AppRunner(
            make_health_app(self.followers),
            handle_signals=False,
            # the daemon's access-line shape (vacancyd/web/access.py), route class api
            access_log=logging.getLogger("vacancyd.access.companion"),
            access_log_class=AccessLogger.bind("companion"),
        )
        await self._runner.setup()
        host, port = split_listen(self.settings.listen)
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound_port = self._runner.addresses[0][1]
        self.address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        log.info(
            "companion following %d lender(s); health and metrics on http://%s",
            len(self.followers),
            self.address,
        )

    def request_stop(self) -> None:
        self._stop.set()

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A follower or publisher must run until stop: if one ends, so does the companion
        (exit 1), so that its Deployment restarts it rather than it publishing nothing."""
        if self._stop.is_set() or task.cancelled():
            return
        exc = task.exception()
        self.failure = f"task {task.get_name()!r} " + (
            f"failed: {exc!r}" if exc is not None else "exited"
        )
        log.critical("%s; the companion stops", self.failure, exc_info=exc)
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *(f.publisher.shutdown("the vacancyd companion is stopping") for f in self.followers),
            return_exceptions=True,
        )
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()


async def run_companion(settings: CompanionSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    from vacancyd.k8s.client import available

    missing = available()
    if missing is not None:
        log.error("%s", missing)
        return 2
    companion = Companion(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, companion.request_stop)
    try:
        try:
            await companion.start()
        except TlsError as exc:
            log.error("%s", exc)
            return 2
        except OSError as exc:
            log.error("cannot listen on %s: %s", settings.listen, exc)
            return 2
        await companion.wait()
        if companion.failure is not None:
            return 1
        log.info("stopping on signal")
        return 0
    finally:
        await companion.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


__all__ = ["Companion", "K8sApiError", "LenderFollower", "run_companion"]
