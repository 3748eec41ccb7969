"""``GET /events``: state transitions as server-sent events.

The stream a dashboard or the Kubernetes companion follows. Wire format (the WHATWG
``text/event-stream`` format)::

    retry: 2000

    id: 0
    event: hello
    data: {"version": "0.1.0", "keepalive_s": 5.0}

    id: 1
    event: veto
    data: {"kind": "veto", "active": true, "detail": "...", "at_wall": 1764420000.5}

    : keepalive

``event`` is the ``kind`` of the typed transition (:mod:`vacancyd.core.events`) that
:class:`~vacancyd.state.SharedState` emitted (``lending``, ``resource_switch``,
``capacity``, ``pressure``, ``unseen_gpu_work``, ``presence``, ``veto``, ``edge``, ``hold``,
``job_hold``, ``reclaim``, ``listener``, ``stopping``, ``shutdown``, ``lendable``), and
``data`` its payload. ``job_hold`` (a borrowed job held, or its hold ended) is distinct from
``hold`` (the owner's controls). ``stopping`` is sent the moment the daemon begins to shut
down (its drain: ``grace_s``, the most seconds borrowed work in flight still has, and
``in_flight``, how many exchanges that is); ``shutdown`` when the drain is over and the
listeners close (``cut``: exchanges still in flight that were cut; ``hurried``: a second
signal ended the drain early), and it is the last event of every stream; ``lendable``
whenever what a borrowed request would get changes, transition or not (the lendability
watcher re-decides every 0.25 s: a reading going stale, free memory crossing a limit,
another model fitting). A comment line is sent every ``keepalive_s`` seconds, so a follower
that hears nothing for a few of those knows the lender is gone. Events are a hint to re-read
``/status``, not a replacement for it.

A client that falls ``QUEUE_MAX`` events behind is sent ``event: overflow`` and the stream
ends, so a slow reader costs the daemon a bounded queue and never delays a collector.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from vacancyd import __version__
from vacancyd.core.events import LendabilityChanged, Shutdown, StateEvent
from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

#: Seconds between keepalive comments.
KEEPALIVE_S = 5.0
#: Events queued per client before it is cut off.
QUEUE_MAX = 256
#: Seconds a single write may stall before the client is dropped.
WRITE_TIMEOUT_S = 30.0

#: Set on shutdown so open streams end instead of holding the runner's cleanup.
CLOSING = web.AppKey("events_closing", asyncio.Event)


def format_event(event_id: int, kind: str, data: Mapping[str, object]) -> bytes:
    """One SSE message. ``kind`` and the JSON are single-line by construction."""
    payload = json.dumps(dict(data), separators=(",", ":"), default=str)
    kind = "".join(ch for ch in kind if ch not in "\r\n") or "message"
    return f"id: {event_id}\nevent: {kind}\ndata: {payload}\n\n".encode()


#: Seconds of history ``GET /events/recent`` serves, and the most events it keeps.
HISTORY_S = 3600.0
HISTORY_MAX = 500


class EventLog:
    """The last hour of transitions (at most ``HISTORY_MAX``), for the status page to show
    what happened before it was opened: ``GET /events/recent`` (read scope) answers
    ``{"window_s": 3600, "events": [{"kind", ...payload, "at_wall"}, ...]}``, oldest first,
    each as ``/events`` streamed it. Kept in memory only (a restart starts it afresh).

    ``lendable`` events repeat whenever the published headroom moves; one is kept only when
    some upstream's verdict (lendable, reason) changed, so they cannot push the rest out.
    ``at_wall`` is wall-clock seconds (``time.time()``), as on the stream."""

    def __init__(self, state: SharedState, clock: Callable[[], float] = time.time) -> None:
        self._events: deque[dict[str, object]] = deque(maxlen=HISTORY_MAX)
        self._clock = clock
        self._verdicts: object = None
        self.unsubscribe = state.subscribe(self._record)

    def _record(self, event: StateEvent) -> None:
        data: dict[str, object] = {"kind": event.kind, **event.payload()}
        if isinstance(event, LendabilityChanged):
            verdicts = {
                name: (u.get("lendable"), u.get("reason")) for name, u in event.upstreams.items()
            }
            if verdicts == self._verdicts:
                return
            self._verdicts = verdicts
        data["at_wall"] = self._clock()
        self._events.append(data)

    def recent(self) -> list[dict[str, object]]:
        """The events of the last ``HISTORY_S`` seconds, oldest first."""
        cutoff = self._clock() - HISTORY_S
        while self._events and float(self._events[0]["at_wall"]) < cutoff:  # type: ignore[arg-type]
            self._events.popleft()
        return list(self._events)


def recent_handler(log_: EventLog) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``GET /events/recent``."""

    async def recent(_: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"window_s": HISTORY_S, "events": log_.recent()},
            headers={"Cache-Control": "no-store"},
            dumps=lambda doc: json.dumps(doc, default=str),
        )

    return recent


def install(app: web.Application) -> None:
    """Add the closing flag and shutdown hook that :func:`make_handler` streams rely on."""
    closing = asyncio.Event()
    app[CLOSING] = closing

    async def on_shutdown(_: web.Application) -> None:
        closing.set()

    app.on_shutdown.append(on_shutdown)


def make_handler(
    state: SharedState, *, keepalive_s: float = KEEPALIVE_S, max_subscribers: int = 32
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The ``/events`` handler. At most ``max_subscribers`` streams are open at once (each
    holds a connection for as long as it lasts); the next subscriber gets 503 with
    Retry-After, so subscribers can never fill the API listener. On shutdown every stream
    gets a ``shutdown`` event before it ends."""
    open_streams = 0

    async def events(request: web.Request) -> web.StreamResponse:
        nonlocal open_streams
        if open_streams >= max_subscribers:
            return web.json_response(
                error_body(
                    f"too many /events subscribers (at most {max_subscribers}); retry later",
                    ErrorType.NO_VACANCY,
                    ErrorCode.TOO_MANY_SUBSCRIBERS,
                ),
                status=503,
                headers={"Retry-After": "5"},
            )
        open_streams += 1
        state.event_followers += 1
        try:
            return await stream(request)
        finally:
            open_streams -= 1
            state.event_followers -= 1

    async def stream(request: web.Request) -> web.StreamResponse:
        closing = request.app[CLOSING]
        queue: asyncio.Queue[tuple[str, dict[str, object]]] = asyncio.Queue(QUEUE_MAX)
        overflowed = asyncio.Event()

        def on_change(event: StateEvent) -> None:
            if overflowed.is_set():
                return
            kind = event.kind
            try:
                queue.put_nowait((kind, {"kind": kind, **event.payload(), "at_wall": time.time()}))
            except asyncio.QueueFull:
                overflowed.set()

        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        unsubscribe = state.subscribe(on_change)
        event_id = 0
        try:
            await _write(
                resp,
                b"retry: 2000\n\n"
                + format_event(0, "hello", {"version": __version__, "keepalive_s": keepalive_s}),
            )
            while not closing.is_set():
                if overflowed.is_set() and queue.empty():
                    await _write(resp, format_event(event_id + 1, "overflow", {}))
                    log.warning("/events client %s fell behind; stream closed", request.remote)
                    break
                item = await _next(queue, closing, keepalive_s)
                if item is None:
                    await _write(resp, b": keepalive\n\n")
                    continue
                event_id += 1
                await _write(resp, format_event(event_id, *item))
                if item[0] == Shutdown.kind:
                    return resp  # the daemon's last word: the listeners close now
            # Stopped without the daemon's own shutdown event (the application alone shut
            # down): the stream still ends with one, so a follower can tell it from a cut.
            if closing.is_set():
                last = Shutdown()
                data = {"kind": last.kind, **last.payload(), "at_wall": time.time()}
                await _write(resp, format_event(event_id + 1, last.kind, data))
        except (ConnectionResetError, TimeoutError) as exc:
            log.debug("/events client %s gone: %r", request.remote, exc)
        finally:
            unsubscribe()
        return resp

    return events


async def _next(
    queue: asyncio.Queue[tuple[str, dict[str, object]]], closing: asyncio.Event, wait_s: float
) -> tuple[str, dict[str, object]] | None:
    """The next queued event, or None after ``wait_s`` seconds or when closing."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.get_running_loop().create_task(queue.get(), name="events queue")
    closer = asyncio.get_running_loop().create_task(closing.wait(), name="events closing")
    try:
        await asyncio.wait({getter, closer}, timeout=wait_s, return_when="FIRST_COMPLETED")
    finally:
        closer.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return None


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await resp.write(data)
