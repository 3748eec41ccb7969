"""Host-side publishing: the daemon writes its own state, given a kubeconfig (``[kubernetes]``).

The feeder builds this daemon's typed status document (in-process, no HTTP, no JSON) on
every state transition and every ``resync_s`` seconds, reads it into the lender's state
(:func:`~vacancyd.core.lender.lender_from_document`, which for every document equals the
companion's reading of its ``/status`` JSON, so both modes publish the same thing) and hands
the result to a :class:`Publisher`. A transition only sets an event, so the collectors and
the gate never wait on the API server; the feeder and the publisher are supervised as
non-essential tasks, so no Kubernetes failure can stop the daemon. The publisher's own health
goes back onto the status document (``kubernetes`` in ``/status``,
``vacancyd_kubernetes_writes_ok`` on ``/metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from vacancyd.config.model import KubernetesSettings
from vacancyd.core import endpoints
from vacancyd.core.events import PER_JOB_EVENTS, StateEvent
from vacancyd.core.lender import LenderState, lender_from_document
from vacancyd.core.status import PublisherStatus, StatusDocument
from vacancyd.k8s.api import KubeApi
from vacancyd.k8s.publisher import Publisher, PublishTarget, services_for, watch_uninstall
from vacancyd.state import SharedState

log = logging.getLogger(__name__)


def lender_name(settings: KubernetesSettings) -> str:
    """This host's name in EndpointSlices: ``lender``, else ``node``, else the host name."""
    return endpoints.dns_name(settings.lender or settings.node or socket.gethostname())


def _connect(settings: KubernetesSettings) -> Callable[[], Any]:
    async def connect() -> KubeApi:
        from vacancyd.k8s.client import KubeClient

        return await KubeClient.connect(settings.kubeconfig, settings.context)

    return connect


class HostPublisher:
    """Feeds the daemon's own state to a publisher. :meth:`start`, then :meth:`stop`."""

    def __init__(
        self,
        settings: KubernetesSettings,
        state: SharedState,
        build_status: Callable[[], StatusDocument],
        *,
        connect: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self._state = state
        self._build = build_status
        self._poke = asyncio.Event()
        self._connect = connect or _connect(settings)
        self.publisher = Publisher(
            connect=self._connect,
            target=PublishTarget(
                lender=lender_name(settings),
                namespace=settings.namespace,
                node=settings.node,
                address=settings.address,
                services=services_for(settings.service_for, direct=settings.direct_services),
            ),
            heartbeat_s=settings.heartbeat_s,
            resync_s=settings.resync_s,
            request_timeout_s=settings.request_timeout_s,
            backoff_max_s=settings.backoff_max_s,
            lendable_stable_s=settings.lendable_stable_s,
        )
        self._unsubscribe: Callable[[], None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    def status(self) -> PublisherStatus:
        """This publisher on the status document: where it publishes, whether writes work."""
        target = self.publisher.target
        return PublisherStatus(
            lender=target.lender,
            namespace=target.namespace,
            node=target.node,
            address=target.address,
            writes_ok=self.publisher.healthy,
            errors=self.publisher.last_errors,
        )

    def lender(self) -> LenderState:
        """The state to publish, read from one typed status document (no JSON): the same
        state the companion reads from that document's ``/status`` JSON."""
        return lender_from_document(self._build())

    def _on_event(self, event: StateEvent) -> None:
        """Publish again on a change of the lender's state. A borrowed job's start or end is
        not one: it lands between a release and the fresh sample the release asks for, so
        reading then would publish "waiting for a sample" and hold the lender back for
        ``lendable_stable_s`` after every job it serves."""
        if event.kind not in PER_JOB_EVENTS:
            self._poke.set()

    def start(self, spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[Any]]) -> None:
        """Start the feeder and the publisher with ``spawn(coro, name)`` (non-essential)."""
        target = self.publisher.target
        if target.node is None and target.address is None:
            log.warning("[kubernetes] sets neither node nor address: nothing to publish")
            return
        self._unsubscribe = self._state.subscribe(self._on_event)
        self._tasks = [
            spawn(self._feed(), "kubernetes feeder"),
            spawn(self.publisher.run(), "kubernetes publisher"),
            spawn(
                watch_uninstall(self._connect, target.namespace, [self.publisher]),
                "kubernetes uninstall watcher",
            ),
        ]
        log.info(
            "publishing to Kubernetes as lender %s (node %s, address %s, namespace %s)",
            target.lender,
            target.node or "-",
            target.address or "-",
            target.namespace,
        )

    async def _feed(self) -> None:
        while True:
            self._poke.clear()
            self.publisher.update(self.lender())
            try:
                async with asyncio.timeout(self.settings.resync_s):
                    await self._poke.wait()
            except TimeoutError:
                pass

    async def _halt(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def announce_terminating(
        self, detail: str = "vacancyd on this host is shutting down"
    ) -> None:
        """Stop feeding and publish this lender terminating now (bounded): its endpoints
        turn not ready while in-flight work finishes. :meth:`stop` follows."""
        if not self._tasks:
            return
        await self._halt()
        self.publisher.update(self.lender())
        await self.publisher.announce_terminating(detail)

    async def stop(self, detail: str = "vacancyd on this host is stopping") -> None:
        """Stop feeding, then publish the lender as stopped (bounded), then close."""
        if not self._tasks:
            return  # never started: nothing was published
        await self._halt()
        await self.publisher.shutdown(detail)
