"""Write one lender's state to Kubernetes: Node conditions and EndpointSlices.

A :class:`Publisher` is fed :class:`~vacancyd.core.lender.LenderState` values through
:meth:`Publisher.update`, which only stores the value and wakes the publisher's own task: the
caller (the gate's side of the daemon, or the companion's follower) never waits for the API
server. The task writes

* the Node conditions, on every change and at least every ``heartbeat_s`` seconds, as a
  strategic-merge patch of ``nodes/NODE/status`` carrying only our condition types;
* one EndpointSlice per upstream and Service, by server-side apply, on every change and at
  least every ``resync_s`` seconds. Each pass reads this lender's slices from the server
  and applies only those that differ from what is wanted (so an outside edit is put back,
  and a flip costs one write), and deletes the slices of this lender no longer wanted.

Node conditions and slices are written side by side in one pass; the wake-up signal is
cleared before a pass, so an update that arrives while a pass waits on the API server is
written right after it. A return to lendable is published only after
``lendable_stable_s`` seconds of it (:class:`~vacancyd.core.lender.LendableDamper`);
not-lendable is published at once.

Failed writes are retried with exponential backoff (1 s doubling, capped at
``backoff_max_s``, with jitter); each distinct failure is logged once with what to do about it,
and recovery is logged. Nothing here raises out of :meth:`Publisher.run`.

At start every condition is Unknown (``Starting``) and no slice is written until the first
observation; :meth:`Publisher.shutdown` writes the lender terminating, then a last
not-lendable state (``Stopped``), before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vacancyd.core import endpoints, nodeconditions
from vacancyd.core.endpoints import SliceTarget
from vacancyd.core.lender import LendableDamper, LenderState, Phase
from vacancyd.k8s.api import K8sApiError, KubeApi

log = logging.getLogger(__name__)

FIELD_MANAGER = "vacancyd"
BACKOFF_INITIAL_S = 1.0


@dataclass(frozen=True, slots=True)
class PublishTarget:
    """Where one lender's state goes.

    ``lender``: its name in EndpointSlice names and labels. ``node``: its Node (None: no
    conditions). ``address``: the IP its proxy listeners are reached at (None: no
    EndpointSlices). ``services(upstream)``: the Services an upstream's endpoint joins.
    """

    lender: str
    namespace: str
    node: str | None
    address: str | None
    services: Callable[[str], tuple[SliceTarget, ...]]


def services_for(
    service_for: Callable[[str], str], *, direct: bool
) -> Callable[[str], tuple[SliceTarget, ...]]:
    """The usual mapping: the gated Service, plus ``NAME-direct`` when ``direct``."""

    def targets(upstream: str) -> tuple[SliceTarget, ...]:
        gated = SliceTarget(service_for(upstream))
        if not direct:
            return (gated,)
        return (gated, SliceTarget(f"{gated.service}-direct", direct=True))

    return targets


@dataclass
class _Part:
    """Retry bookkeeping for one kind of write (node conditions, or slices)."""

    name: str
    failures: int = 0
    retry_at: float | None = None
    last_error: str | None = None
    written_at: float | None = None
    written: Any = None

    def succeeded(self, now: float, what: Any, *, wrote: bool = True) -> None:
        """Record a pass that went through. One that only read (the server already held
        what was wanted) proves no write works again, so the backoff is kept."""
        self.written_at = now
        self.written = what
        self.retry_at = None
        if not wrote and self.failures:
            return
        if self.last_error is not None:
            log.info("%s: written again after %d failed attempt(s)", self.name, self.failures)
        self.failures = 0
        self.retry_at = None
        self.last_error = None
        self.written_at = now
        self.written = what

    def failed(self, exc: K8sApiError, now: float, backoff_max_s: float, initial_s: float) -> None:
        self.failures += 1
        delay = min(backoff_max_s, initial_s * 2 ** (self.failures - 1))
        delay *= random.uniform(0.5, 1.0)
        self.retry_at = now + delay
        text = str(exc)
        level = logging.WARNING if text != self.last_error else logging.DEBUG
        log.log(level, "%s failed: %s (%s); next try in %.1f s", self.name, text, exc.hint, delay)
        self.last_error = text


@dataclass
class Publisher:
    """Publishes one lender. Run :meth:`run` as a task; feed it with :meth:`update`.

    ``connect`` makes the API client (it may raise :class:`K8sApiError`, retried with
    backoff). ``wall`` is the clock for Kubernetes timestamps (epoch seconds).
    """

    connect: Callable[[], Awaitable[KubeApi]]
    target: PublishTarget
    heartbeat_s: float = 60.0
    resync_s: float = 30.0
    request_timeout_s: float = 10.0
    backoff_max_s: float = 60.0
    backoff_initial_s: float = BACKOFF_INITIAL_S
    wall: Callable[[], float] = time.time
    field_manager: str = FIELD_MANAGER
    #: Seconds an upstream must stay lendable before a return to lendable is published.
    lendable_stable_s: float = 0.0
    #: Monotonic clock (seconds); default: the running event loop's.
    clock: Callable[[], float] | None = None
    latest: LenderState = field(default_factory=LenderState.starting)
    #: Counts of API calls by kind ("apply", "delete", "patch_node", "read"), for metrics.
    calls: dict[str, int] = field(default_factory=dict)
    _api: KubeApi | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _damper: LendableDamper = field(init=False)
    _damped_until: float | None = None
    #: Set by :meth:`stand_down` (an uninstall is removing what we wrote): write nothing more.
    stood_down: bool = False
    _connect: _Part = field(init=False)
    _node: _Part = field(init=False)
    _slices: _Part = field(init=False)

    def __post_init__(self) -> None:
        who = self.target.lender
        self._connect = _Part(f"Kubernetes API client for {who}")
        self._node = _Part(f"Node {self.target.node} conditions for {who}")
        self._slices = _Part(f"EndpointSlices for {who} in {self.target.namespace}")
        self._damper = LendableDamper(self.lendable_stable_s)
        self._changed.set()

    def _now(self) -> float:
        return self.clock() if self.clock is not None else asyncio.get_running_loop().time()

    # -- input -----------------------------------------------------------------------------

    def update(self, lender: LenderState) -> None:
        """Store ``lender`` as the state to publish and wake the task when it differs from
        the last state stored or the last one written; never blocks, never raises."""
        self._damper.observe(lender, self._now())
        if lender != self.latest or any(
            p.written is not None and p.written != lender for p in (self._node, self._slices)
        ):
            self.latest = lender
            self._changed.set()

    @property
    def healthy(self) -> bool:
        """True when the last attempt of every write succeeded."""
        return all(p.last_error is None for p in (self._connect, self._node, self._slices))

    @property
    def last_errors(self) -> dict[str, str]:
        return {
            p.name: p.last_error
            for p in (self._connect, self._node, self._slices)
            if p.last_error is not None
        }

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish until cancelled. Never raises anything but CancelledError."""
        loop = asyncio.get_running_loop()
        while True:
            # Cleared before the pass, not after: an update that arrives while the pass
            # waits for the API server sets it again and is written on the next round.
            self._changed.clear()
            try:
                await self._pass(loop.time())
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not take the lender down: log and go on
                log.exception("publisher for %s failed unexpectedly", self.target.lender)
                self._slices.retry_at = loop.time() + self.backoff_max_s
            wake = self._next_wake(loop.time())
            try:
                async with asyncio.timeout(max(0.0, wake - loop.time())):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def stand_down(self) -> None:
        """Write nothing more, not even at shutdown: an uninstall is removing this lender's
        objects (see :func:`watch_uninstall`). For good; never raises."""
        if not self.stood_down:
            log.warning(
                "an uninstall is removing what vacancyd published: no more writes for %s",
                self.target.lender,
            )
        self.stood_down = True
        self._changed.set()

    def _next_wake(self, now: float) -> float:
        times = [now + 3600.0]
        if self.stood_down:
            return times[0]
        if self._damped_until is not None:
            times.append(self._damped_until)
        if self._api is None:
            times.append(self._connect.retry_at or now)
        for part, period, wanted in (
            (self._node, self.heartbeat_s, self.target.node is not None),
            (self._slices, self.resync_s, self.target.address is not None),
        ):
            if not wanted:
                continue
            if part.retry_at is not None:
                times.append(part.retry_at)
            elif part.written_at is not None:
                times.append(part.written_at + period)
            else:
                times.append(now)
        return min(times)

    async def _pass(self, now: float) -> None:
        if self.stood_down:
            return
        api = await self._ensure_api(now)
        if api is None:
            return
        lender = self._published(now)
        writes = []
        if self.target.node is not None and self._due(self._node, now, self.heartbeat_s, lender):
            writes.append(self._node_pass(api, now))
        if self.target.address is not None and self._due(self._slices, now, self.resync_s, lender):
            writes.append(self._slices_pass(api, now))
        # Routing (slices) and visibility (conditions) are written side by side, so a slow
        # API server delays neither behind the other.
        await asyncio.gather(*writes)

    def _published(self, now: float) -> LenderState:
        """The latest state as it is to be published at ``now`` (after damping)."""
        lender, self._damped_until = self._damper.apply(self.latest, now)
        return lender

    async def _node_pass(self, api: KubeApi, now: float) -> None:
        lender = self._published(now)
        try:
            await self._write_node(api, lender)
        except K8sApiError as exc:
            self._node.failed(exc, now, self.backoff_max_s, self.backoff_initial_s)
        else:
            self._node.succeeded(now, lender)

    async def _slices_pass(self, api: KubeApi, now: float) -> None:
        writes = self.calls.get("apply", 0) + self.calls.get("delete", 0)
        try:
            lender = await self._write_slices(api, None)
        except K8sApiError as exc:
            self._slices.failed(exc, now, self.backoff_max_s, self.backoff_initial_s)
        else:
            wrote = self.calls.get("apply", 0) + self.calls.get("delete", 0) > writes
            self._slices.succeeded(now, lender, wrote=wrote)

    @staticmethod
    def _due(part: _Part, now: float, period: float, lender: LenderState) -> bool:
        if part.retry_at is not None:
            return now >= part.retry_at
        if part.written_at is None or part.written != lender:
            return True
        return now >= part.written_at + period

    async def _ensure_api(self, now: float) -> KubeApi | None:
        if self._api is not None:
            return self._api
        if self._connect.retry_at is not None and now < self._connect.retry_at:
            return None
        try:
            async with asyncio.timeout(self.request_timeout_s):
                self._api = await self.connect()
        except TimeoutError:
            self._connect.failed(
                K8sApiError("connect", None, f"no answer within {self.request_timeout_s} s"),
                now,
                self.backoff_max_s,
                self.backoff_initial_s,
            )
            return None
        except K8sApiError as exc:
            self._connect.failed(exc, now, self.backoff_max_s, self.backoff_initial_s)
            return None
        self._connect.succeeded(now, None)
        return self._api

    async def _call(self, operation: str, call: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return await call
        except TimeoutError:
            raise K8sApiError(
                operation, None, f"no answer within {self.request_timeout_s} s"
            ) from None

    # -- writes ----------------------------------------------------------------------------

    def _count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1

    async def _write_node(
        self, api: KubeApi, lender: LenderState, *, only_existing: bool = False
    ) -> None:
        """Read the Node's conditions, then patch ours in (and retired ones of ours out).

        ``only_existing``: write nothing to a Node that carries none of our conditions (a
        last write at shutdown must not bring back what an uninstall removed)."""
        node = self.target.node
        assert node is not None
        self._count("read")
        current = await self._call(f"get node {node}", api.get_node_conditions(node))
        if only_existing and nodeconditions.cleanup_patch(current) is None:
            log.info("node %s has no vacancyd conditions (removed?): not writing them back", node)
            return
        desired = nodeconditions.node_conditions(lender)
        patch = nodeconditions.condition_patch(desired, current, self.wall())
        retired = nodeconditions.retired_conditions(current)
        if retired:
            log.info("node %s: removing conditions vacancyd no longer sets: %s", node, retired)
            patch["status"]["conditions"] += [
                {"type": kind, "$patch": "delete"} for kind in retired
            ]
        self._count("patch_node")
        await self._call(f"patch node {node} status", api.patch_node_status(node, patch))
        log.debug(
            "node %s: %s",
            node,
            ", ".join(f"{c.type}={c.status.value} ({c.reason})" for c in desired),
        )

    def desired_slices(self, lender: LenderState) -> list[dict[str, Any]]:
        """Every EndpointSlice this lender should have, given its last known upstreams."""
        target = self.target
        address = target.address
        if address is None:
            return []
        out = []
        for name, up in sorted(lender.upstreams.items()):
            if up.port is None:
                continue
            for service in target.services(name):
                flags = endpoints.endpoint_conditions(lender, name, direct=service.direct)
                out.append(
                    endpoints.endpoint_slice(
                        lender=target.lender,
                        upstream=name,
                        namespace=target.namespace,
                        target=service,
                        address=address,
                        port=up.port,
                        ready=flags.ready,
                        serving=flags.serving,
                        terminating=flags.terminating,
                        node_name=target.node,
                        headroom=None if service.direct else up,
                    )
                )
        return out

    async def _write_slices(
        self, api: KubeApi, lender: LenderState | None, *, only_existing: bool = False
    ) -> LenderState:
        """Read this lender's slices from the server; apply only those that differ from what
        is wanted, delete those no longer wanted. The comparison is with what the server
        holds, never with what was last written, so no needed write is skipped.

        ``lender`` None: the latest state as of the moment the server's copy arrived (so a
        change during the read is included). ``only_existing``: update slices the server
        still holds, create none (a last write at shutdown must not bring back what an
        uninstall deleted). Returns the state written.
        """
        namespace = self.target.namespace
        selector = (
            f"{endpoints.MANAGED_BY_LABEL}={endpoints.MANAGED_BY},"
            f"{endpoints.LENDER_LABEL}={endpoints.dns_name(self.target.lender)}"
        )
        self._count("read")
        existing = await self._call(
            f"list endpointslices in {namespace}",
            api.get_endpoint_slices(namespace, selector),
        )
        if lender is None:
            lender = self._published(self._now())
        desired = self.desired_slices(lender)
        errors: list[K8sApiError] = []
        for body in desired:
            name = body["metadata"]["name"]
            if endpoints.slice_up_to_date(body, existing.get(name)):
                continue
            if only_existing and name not in existing:
                continue
            try:
                self._count("apply")
                await self._call(
                    f"apply endpointslice {namespace}/{name}",
                    api.apply_endpoint_slice(body, self.field_manager),
                )
            except K8sApiError as exc:
                errors.append(exc)
        if lender.phase is not Phase.STARTING:
            # Before the first reading the upstream list is unknown: delete nothing yet.
            wanted = {b["metadata"]["name"] for b in desired}
            for name in sorted(set(existing) - wanted):
                log.info("deleting EndpointSlice %s/%s: no longer published", namespace, name)
                try:
                    self._count("delete")
                    await self._call(
                        f"delete endpointslice {namespace}/{name}",
                        api.delete_endpoint_slice(namespace, name),
                    )
                except K8sApiError as exc:
                    errors.append(exc)
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first = K8sApiError(
                    first.operation,
                    first.status,
                    f"{first.message} (and {len(errors) - 1} more failed write(s))",
                )
            raise first
        return lender

    # -- shutdown --------------------------------------------------------------------------

    async def announce_terminating(self, detail: str) -> bool:
        """Write the latest state marked terminating, now (bounded by ``request_timeout_s``
        per call): endpoints not ready, ``terminating`` true, ``serving`` as it was.

        Call after the :meth:`run` task has been cancelled. Failures are logged, not raised;
        returns whether the write went through.
        """
        lender = self.latest
        if lender.phase is Phase.STARTING:
            return True  # nothing observed: publish nothing new
        if not lender.terminating:
            lender = lender.as_terminating(detail)
        return await self._write_final(lender, "terminating")

    async def _write_final(self, lender: LenderState, what: str) -> bool:
        self.latest = lender
        if self.stood_down:
            return False
        api = self._api
        try:
            if api is None:
                self._connect.retry_at = None  # one last try, whatever the backoff said
                api = await self._ensure_api(asyncio.get_running_loop().time())
            if api is None:
                return False
            # Update what the server holds, create nothing: after an uninstall's cleanup, a
            # publisher that stops must not leave its objects behind again.
            if self.target.node is not None:
                await self._write_node(api, lender, only_existing=True)
            if self.target.address is not None:
                await self._write_slices(api, lender, only_existing=True)
            log.info("published %s as %s", self.target.lender, what)
            return True
        except K8sApiError as exc:
            log.warning(
                "could not publish %s as %s: %s (%s)", self.target.lender, what, exc, exc.hint
            )
            return False

    async def shutdown(self, detail: str) -> None:
        """Publish the lender terminating (unless already done), then stopped — every
        endpoint not ready, ``VacancyLendable`` False ``Stopped`` — and close the client.

        Each write is bounded by ``request_timeout_s`` per call. Call after the :meth:`run`
        task has been cancelled. Failures are logged, not raised.
        """
        try:
            written = True
            if not self.latest.terminating:
                written = await self.announce_terminating(detail)
            if written:  # an API server that did not take the first write gets no second
                await self._write_final(LenderState.stopped(detail, self.latest), "stopped")
        finally:
            api = self._api
            if api is not None:
                try:
                    await api.close()
                except Exception:  # closing must not fail a shutdown
                    log.debug("closing the Kubernetes client failed", exc_info=True)
            self._api = None


#: Seconds between two looks for the uninstall marker; ``vacancyd k8s cleanup`` waits longer
#: than this (``--stand-down-s``) before it removes anything.
UNINSTALL_POLL_S = 2.0


async def watch_uninstall(
    connect: Callable[[], Awaitable[KubeApi]],
    namespace: str,
    publishers: list[Publisher],
    *,
    poll_s: float = UNINSTALL_POLL_S,
    wall: Callable[[], float] = time.time,
) -> None:
    """Look for the uninstall marker in ``namespace`` every ``poll_s`` seconds (one list
    call); once it is there, :meth:`Publisher.stand_down` every publisher. Runs until
    cancelled (it idles after standing down); API failures are logged once and retried."""
    api: KubeApi | None = None
    last_error: str | None = None
    selector = f"{endpoints.UNINSTALL_LABEL}=true"
    try:
        while True:
            try:
                if api is None:
                    async with asyncio.timeout(30.0):
                        api = await connect()
                async with asyncio.timeout(30.0):
                    markers = await api.get_endpoint_slices(namespace, selector)
            except (K8sApiError, TimeoutError) as exc:
                text = str(exc) or "no answer within 30 s"
                if text != last_error:
                    log.debug("looking for the uninstall marker failed: %s", text)
                last_error = text
            else:
                last_error = None
                if endpoints.uninstall_in_progress(markers, wall()):
                    for publisher in publishers:
                        publisher.stand_down()
                    await asyncio.Event().wait()  # stood down for good: idle until cancelled
            await asyncio.sleep(poll_s)
    finally:
        if api is not None:
            try:
                await api.close()
            except Exception:  # closing must not fail a shutdown
                log.debug("closing the Kubernetes client failed", exc_info=True)
