"""Owner presence from systemd-logind over D-Bus (docs/architecture.md).

One connection to the bus logind is on (the system bus, or ``[owner] bus_address``) is kept
open between polls; no subprocess is spawned. Each sample calls
``org.freedesktop.login1.Manager.ListSessions`` and then
``org.freedesktop.DBus.Properties.GetAll("org.freedesktop.login1.Session")`` on every listed
session, concurrently, and hands the values to the pure rules in
:mod:`vacancyd.core.presence`.

Signals: the connection subscribes to logind's ``SessionNew``/``SessionRemoved``,
``PropertiesChanged`` on session objects, the session ``Lock``/``Unlock`` requests and
``NameOwnerChanged`` for ``org.freedesktop.login1``. A signal never changes the reading by
itself; it wakes the loop to take a full sample at once, so a forged signal costs one extra
sample and cannot fake a reading. Polling every general poll stays as the backstop and resync.

Failure is never "absent": a bus that cannot be reached, a service that is gone, an error
reply or a call past its deadline is recorded as a presence failure, which refuses host-scoped
work at once and, once the last good reading is past its freshness bound, engages the owner
veto (``SharedState.record_presence_failure``). A single session that cannot be read clearly
is an unknown session inside an otherwise good reading, which refuses as well.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from vacancyd.collectors.base import CountFailure, ProbeError, ProbeFailure
from vacancyd.collectors.processes import scan_owner_processes
from vacancyd.core import presence as rules
from vacancyd.state import PresenceReading

log = logging.getLogger(__name__)

LOGIND = "org.freedesktop.login1"
MANAGER_PATH = "/org/freedesktop/login1"
MANAGER_IFACE = "org.freedesktop.login1.Manager"
SESSION_IFACE = "org.freedesktop.login1.Session"
SESSION_PATH_PREFIX = "/org/freedesktop/login1/session/"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"

#: AddMatch rules for the signals that wake the presence loop.
MATCH_RULES = (
    f"type='signal',sender='{LOGIND}',interface='{MANAGER_IFACE}',member='SessionNew'",
    f"type='signal',sender='{LOGIND}',interface='{MANAGER_IFACE}',member='SessionRemoved'",
    f"type='signal',sender='{LOGIND}',interface='{PROPERTIES_IFACE}',"
    f"member='PropertiesChanged',path_namespace='/org/freedesktop/login1/session'",
    f"type='signal',sender='{LOGIND}',interface='{SESSION_IFACE}'",
    f"type='signal',sender='{DBUS}',interface='{DBUS}',member='NameOwnerChanged',arg0='{LOGIND}'",
)

ScanFn = Callable[[Iterable[tuple[int, str]], frozenset[str]], rules.ProcessScan]


class LogindError(ProbeError):
    """logind could not be read; the message names the call and what went wrong."""


def _host_now_us() -> int:
    """CLOCK_MONOTONIC in microseconds: the clock of logind's ``*Monotonic`` properties."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class LogindClient:
    """The kept-open D-Bus connection to logind and the two calls presence needs.

    ``bus_address`` None means the system bus. ``on_signal(member)`` is called (on the event
    loop) for each subscribed signal and when the connection drops, when ``signals`` is on.
    """

    def __init__(
        self,
        bus_address: str | None,
        *,
        signals: bool = True,
        on_signal: Callable[[str], None] | None = None,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]] | None = None,
    ) -> None:
        """``spawn(coro, name)`` starts the connection's watch task (the daemon passes its
        supervisor, not essential); default: a task this client keeps a reference to."""
        self.bus_address = bus_address
        self._spawn = spawn
        self.signals = signals
        self._on_signal = on_signal or (lambda _member: None)
        self._bus: MessageBus | None = None
        self.signals_seen = 0
        self.connects = 0
        self._watches: set[asyncio.Task[None]] = set()

    async def _watch_disconnect(self, bus: MessageBus) -> None:
        try:
            await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
        except Exception as exc:  # an abnormal end is still just "disconnected"
            log.debug("presence bus ended: %r", exc)
        if self._bus is bus:
            log.warning("presence: the connection to %s dropped", self.where)
            self._on_signal("disconnected")

    @property
    def where(self) -> str:
        return self.bus_address or "the system bus"

    async def _ensure(self) -> MessageBus:
        bus = self._bus
        if bus is not None and bus.connected:
            return bus
        self._bus = None
        try:
            if self.bus_address is None:
                bus = MessageBus(bus_type=BusType.SYSTEM)
            else:
                bus = MessageBus(bus_address=self.bus_address)
        except Exception as exc:  # an address dbus-fast cannot parse
            raise LogindError(f"cannot connect to {self.where}: {exc}") from exc
        try:
            await bus.connect()
        except BaseException as exc:
            bus.disconnect()  # a connect cut short (deadline) must not leave a socket open
            if isinstance(exc, OSError | ValueError | EOFError):
                raise LogindError(f"cannot connect to {self.where}: {exc}") from exc
            if isinstance(exc, Exception):  # dbus-fast's own errors for authentication
                raise LogindError(f"cannot connect to {self.where}: {exc!r}") from exc
            raise
        self._bus = bus
        self.connects += 1
        # Notice a dropped connection between polls too, not only at the next call.
        if self._spawn is not None:
            watch = self._spawn(self._watch_disconnect(bus), "presence bus watch")
        else:
            watch = asyncio.get_running_loop().create_task(
                self._watch_disconnect(bus), name="presence bus watch"
            )
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)
        if self.signals:
            bus.add_message_handler(self._message)
            for rule in MATCH_RULES:
                await self._call(
                    bus,
                    Message(
                        destination=DBUS,
                        path="/org/freedesktop/DBus",
                        interface=DBUS,
                        member="AddMatch",
                        signature="s",
                        body=[rule],
                    ),
                    "AddMatch",
                )
        log.info("presence: connected to %s (signals %s)", self.where, self.signals)
        return bus

    def _message(self, msg: Message) -> None:
        """Wake the loop on a subscribed signal. Returns None so nothing is marked handled."""
        if msg.message_type is not MessageType.SIGNAL:
            return None
        member = msg.member or ""
        if (
            msg.interface in (MANAGER_IFACE, SESSION_IFACE)
            or (
                msg.interface == PROPERTIES_IFACE
                and (msg.path or "").startswith(SESSION_PATH_PREFIX)
            )
            or (msg.interface == DBUS and member == "NameOwnerChanged" and msg.body[:1] == [LOGIND])
        ):
            self.signals_seen += 1
            self._on_signal(member)
        return None

    async def _call(self, bus: MessageBus, msg: Message, what: str) -> Message:
        try:
            reply = await bus.call(msg)
        except (OSError, EOFError, ConnectionError) as exc:
            raise LogindError(f"lost the connection to {self.where} during {what}: {exc}") from exc
        except Exception as exc:
            if not bus.connected:
                raise LogindError(
                    f"lost the connection to {self.where} during {what}: {exc!r}"
                ) from exc
            raise
        if reply is None:
            raise LogindError(f"{what}: no reply")
        if reply.message_type is MessageType.ERROR:
            detail = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            raise LogindError(f"{what} failed: {reply.error_name}{': ' + detail if detail else ''}")
        return reply

    async def list_sessions(self) -> list[tuple[str, int, str, str, str]]:
        """``ListSessions() -> a(susso)``: (id, uid, user, seat, object path) per session."""
        bus = await self._ensure()
        reply = await self._call(
            bus,
            Message(
                destination=LOGIND,
                path=MANAGER_PATH,
                interface=MANAGER_IFACE,
                member="ListSessions",
            ),
            "ListSessions",
        )
        if reply.signature != "a(susso)":
            raise LogindError(
                f"ListSessions answered with D-Bus type {reply.signature!r}, expected 'a(susso)'"
            )
        return [tuple(entry) for entry in reply.body[0]]

    async def session_properties(self, path: str) -> dict[str, rules.Property]:
        """``Properties.GetAll("org.freedesktop.login1.Session") -> a{sv}`` on ``path``."""
        bus = await self._ensure()
        reply = await self._call(
            bus,
            Message(
                destination=LOGIND,
                path=path,
                interface=PROPERTIES_IFACE,
                member="GetAll",
                signature="s",
                body=[SESSION_IFACE],
            ),
            f"GetAll on {path}",
        )
        if reply.signature != "a{sv}":
            raise LogindError(f"GetAll on {path} answered with D-Bus type {reply.signature!r}")
        return {name: (v.signature, v.value) for name, v in reply.body[0].items()}

    def reset(self) -> None:
        """Drop the connection (after a deadline overrun); the next call reconnects."""
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()

    async def close(self) -> None:
        """Disconnect and wait (at most 1 s) for the connection to finish closing."""
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()
        if self._watches:
            await asyncio.wait(set(self._watches), timeout=1.0)
            for watch in list(self._watches):
                watch.cancel()


async def local_sessions(
    bus_address: str | None, timeout_s: float = 2.0
) -> list[rules.SessionFacts]:
    """Every session logind lists, read once within ``timeout_s`` seconds (for the
    ``headless`` warning of check-config and the daemon's start). Raises LogindError (also
    on the deadline) when logind cannot be asked: no system bus, no logind."""
    client = LogindClient(bus_address, signals=False)
    try:
        async with asyncio.timeout(timeout_s):
            listed = await client.list_sessions()
            facts = []
            for sid, uid, user, _seat, path in listed:
                try:
                    props = await client.session_properties(path)
                except LogindError:  # it closed between the two calls
                    continue
                facts.append(rules.parse_session(sid, uid, user, props, rules.PresencePolicy()))
            return facts
    except TimeoutError:
        raise LogindError(f"{client.where} did not answer within {timeout_s:g} s") from None
    finally:
        await client.close()


class LogindPresence:
    """Takes one presence sample from logind (plus the owner-process scan)."""

    def __init__(
        self,
        client: LogindClient,
        policy: rules.PresencePolicy,
        *,
        scan: ScanFn = scan_owner_processes,
    ) -> None:
        self.client = client
        self.policy = policy
        self._scan = scan
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="owner-scan")
        self._scan_future: asyncio.Future[rules.ProcessScan] | None = None
        self.step = "idle"
        self._problems: dict[str, str] = {}
        #: user names of the sessions seen so far, for redaction (never published)
        self.seen_users: set[str] = set()

    async def sample(self) -> PresenceReading:
        """One full sample. Raises :class:`LogindError` when logind cannot be read at all."""
        self.step = "ListSessions"
        listed = await self.client.list_sessions()
        self.step = "GetAll"
        results = await asyncio.gather(
            *(self.client.session_properties(path) for (_i, _u, _n, _s, path) in listed),
            return_exceptions=True,
        )
        facts: list[rules.SessionFacts] = []
        failed: list[tuple[str, str]] = []
        self.seen_users.update(entry[2] for entry in listed if entry[2])
        for (sid, uid, user, _seat, _path), result in zip(listed, results, strict=True):
            if isinstance(result, LogindError):
                failed.append((sid, str(result)))
            elif isinstance(result, BaseException):
                raise result
            else:
                facts.append(rules.parse_session(sid, uid, user, result, self.policy))
        if failed:
            # A session closing between the two calls is normal; only one still listed counts.
            self.step = "ListSessions (recheck)"
            still = {entry[0] for entry in await self.client.list_sessions()}
            for sid, why in failed:
                if sid in still:
                    facts.append(rules.SessionFacts(sid, rules.SessionKind.UNKNOWN, problem=why))
        problems = {
            f"session {f.id} is unreadable": str(f.problem)
            for f in facts
            if f.kind is rules.SessionKind.UNKNOWN
        }
        now_us = _host_now_us()
        scan = None
        users = rules.users_to_scan(facts, self.policy, now_us)
        if users:
            self.step = "owner-process scan"
            scan = await self._run_scan(users)
            for uid, why in scan.problems.items():
                problems[f"owner processes of uid {uid} unchecked"] = why
        self._log_problems(problems)
        self.step = "idle"
        decision = rules.decide_presence(facts, self.policy, now_us, scan)
        return PresenceReading(
            owner_signal=decision.owner_signal,
            evidence_complete=decision.evidence_complete,
            detail=decision.detail,
            sessions=decision.sessions,
        )

    def _log_problems(self, problems: dict[str, str]) -> None:
        """Warn once per distinct problem (a persistent one would otherwise log every poll)."""
        for what, why in problems.items():
            if self._problems.get(what) != why:
                log.warning("presence: %s: %s; it counts as the owner", what, why)
        for what in self._problems.keys() - problems.keys():
            log.info("presence: %s no more", what)
        self._problems = problems

    async def _run_scan(self, users: frozenset[tuple[int, str]]) -> rules.ProcessScan:
        if self._scan_future is not None and not self._scan_future.done():
            why = "the previous owner-process scan is still running past its deadline"
            return rules.ProcessScan(problems={uid: why for uid, _ in users})
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            self._executor, self._scan, users, self.policy.owner_processes
        )
        self._scan_future = future
        # The caller's deadline bounds this; shield so a timeout leaves the thread's future
        # for the next sample to see as still running.
        return await asyncio.shield(future)

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.client.close()


async def run_logind_loop(
    presence: LogindPresence,
    *,
    on_sample: Callable[[PresenceReading, float], object],
    on_error: Callable[[str, float], object],
    interval_s: float,
    timeout_s: float,
    wake: asyncio.Event,
    count: CountFailure | None = None,
) -> None:
    """Sample on every wake-up (a logind signal) and at least every ``interval_s`` seconds.

    Each reading goes to ``on_sample(reading, at)``, each failure to ``on_error(error, at)``
    (``at``: monotonic s when the sample began; the daemon passes the owner controls').
    Each sample has ``timeout_s`` seconds; past it the connection is dropped (a late reply is
    discarded with it) and the attempt is a failure. Every failure is also counted by kind
    (``count``). Never returns; cancel to stop.
    """
    try:
        while True:
            wake.clear()  # a signal that arrives during the sample wakes the next one
            started = time.monotonic()  # the state's clock (vacancyd.state)
            try:
                async with asyncio.timeout(timeout_s):
                    reading = await presence.sample()
            except TimeoutError:
                step = presence.step
                presence.client.reset()
                on_error(f"logind did not answer {step} within {timeout_s:g} s", started)
                if count is not None:
                    count(ProbeFailure.TIMEOUT)
            except ProbeError as exc:
                presence.client.reset()
                on_error(str(exc), started)
                if count is not None:
                    count(ProbeFailure.FAILED)
            except Exception as exc:  # a bug here must not read as an absent owner
                log.exception("presence sample failed unexpectedly")
                presence.client.reset()
                on_error(f"presence sample failed: {exc!r}", started)
                if count is not None:
                    count(ProbeFailure.UNEXPECTED)
            else:
                on_sample(reading, started)
            try:
                async with asyncio.timeout(interval_s):
                    await wake.wait()
            except TimeoutError:
                pass
    finally:
        await presence.close()


def unsupported_reading(platform: str) -> PresenceReading:
    """The reading on a platform without a presence backend."""
    return PresenceReading(
        owner_signal=False,
        evidence_complete=False,
        detail=f"no owner-presence backend on {platform}; presence is unknown and does not refuse",
    )
