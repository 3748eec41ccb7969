"""A systemd-logind look-alike served with dbus-fast on a private bus.

It owns ``org.freedesktop.login1`` and exports ``org.freedesktop.login1.Manager`` at
``/org/freedesktop/login1`` and one ``org.freedesktop.login1.Session`` object per session, with
the interface names, method signatures, signal signatures and property types that systemd
documents in its D-Bus reference, man page org.freedesktop.login1(5)
(systemd/systemd ``man/org.freedesktop.login1.xml``, sections "The Manager Object" and
"Session Objects"). Only the members vacancyd could touch are implemented: ListSessions
``a(susso)``, GetSession ``s -> o``, LockSession/UnlockSession ``s``, the SessionNew and
SessionRemoved ``(so)`` signals; on sessions every documented property with its documented type,
the methods Lock, Unlock, SetIdleHint ``b``, SetLockedHint ``b``, Activate and Terminate, and
the Lock and Unlock signals. Session object paths are escaped as sd-bus does
(``sd_bus_path_encode``: session "1" lives at ``/org/freedesktop/login1/session/_31``).

As in logind, SetLockedHint and SetIdleHint change the property and emit
``PropertiesChanged``, while the Lock/Unlock methods only emit the Lock/Unlock request signals.

Faults for tests: ``hang`` (member names whose calls are never answered), ``malformed``
(per-session property values served in place of the real ones, with any D-Bus type), and
``disappear()`` (the service drops off the bus).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import (
    DBusBool,
    DBusObjectPath,
    DBusSignature,
    DBusStr,
    DBusUInt32,
    DBusUInt64,
)
from dbus_fast.constants import PropertyAccess
from dbus_fast.service import (
    ServiceInterface,
    dbus_method,
    dbus_property,
    dbus_signal,
)

UidPath = Annotated[list[Any], DBusSignature("(uo)")]
IdPath = Annotated[list[Any], DBusSignature("(so)")]
SessionList = Annotated[list[list[Any]], DBusSignature("a(susso)")]

ROOT = "/org/freedesktop/login1"


def session_path(session_id: str) -> str:
    """``/org/freedesktop/login1/session/<id>`` escaped as sd_bus_path_encode does."""
    out = []
    for i, ch in enumerate(session_id):
        if (ch.isascii() and ch.isalpha()) or (ch.isascii() and ch.isdigit() and i > 0):
            out.append(ch)
        else:
            out.append(f"_{ord(ch):02x}")
    return f"{ROOT}/session/{''.join(out) or '_'}"


def monotonic_us() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


@dataclass
class SessionSpec:
    """A session as a test describes it; defaults are a local, unlocked wayland desktop."""

    id: str
    uid: int = 1000
    user: str = "owner"
    seat: str = "seat0"
    type: str = "wayland"
    klass: str = "user"
    remote: bool = False
    remote_host: str = ""
    tty: str = ""
    active: bool = True
    locked: bool = False
    idle: bool = False
    idle_since_us: int = field(default_factory=monotonic_us)


class FakeSession(ServiceInterface):
    def __init__(self, spec: SessionSpec) -> None:
        super().__init__("org.freedesktop.login1.Session")
        self.spec = spec
        self.created_us = monotonic_us()

    # -- properties (types from org.freedesktop.login1(5), "Session Objects") ----------
    @dbus_property(access=PropertyAccess.READ)
    def Id(self) -> DBusStr:
        return self.spec.id

    @dbus_property(access=PropertyAccess.READ)
    def User(self) -> UidPath:
        return [self.spec.uid, f"{ROOT}/user/_{self.spec.uid}"]

    @dbus_property(access=PropertyAccess.READ)
    def Name(self) -> DBusStr:
        return self.spec.user

    @dbus_property(access=PropertyAccess.READ)
    def Timestamp(self) -> DBusUInt64:
        return int(time.time() * 1e6)

    @dbus_property(access=PropertyAccess.READ)
    def TimestampMonotonic(self) -> DBusUInt64:
        return self.created_us

    @dbus_property(access=PropertyAccess.READ)
    def VTNr(self) -> DBusUInt32:
        return 2 if not self.spec.remote else 0

    @dbus_property(access=PropertyAccess.READ)
    def Seat(self) -> IdPath:
        seat = self.spec.seat
        return [seat, f"{ROOT}/seat/{seat}" if seat else "/"]

    @dbus_property(access=PropertyAccess.READ)
    def TTY(self) -> DBusStr:
        return self.spec.tty

    @dbus_property(access=PropertyAccess.READ)
    def Display(self) -> DBusStr:
        return ":0" if self.spec.type == "x11" else ""

    @dbus_property(access=PropertyAccess.READ)
    def Remote(self) -> DBusBool:
        return self.spec.remote

    @dbus_property(access=PropertyAccess.READ)
    def RemoteHost(self) -> DBusStr:
        return self.spec.remote_host

    @dbus_property(access=PropertyAccess.READ)
    def RemoteUser(self) -> DBusStr:
        return ""

    @dbus_property(access=PropertyAccess.READ)
    def Service(self) -> DBusStr:
        return "sshd" if self.spec.remote else "gdm-password"

    @dbus_property(access=PropertyAccess.READ)
    def Desktop(self) -> DBusStr:
        return "GNOME" if self.spec.type in ("x11", "wayland") else ""

    @dbus_property(access=PropertyAccess.READ)
    def Scope(self) -> DBusStr:
        return f"session-{self.spec.id}.scope"

    @dbus_property(access=PropertyAccess.READ)
    def Leader(self) -> DBusUInt32:
        return 1

    @dbus_property(access=PropertyAccess.READ)
    def Audit(self) -> DBusUInt32:
        return 0

    @dbus_property(access=PropertyAccess.READ)
    def Type(self) -> DBusStr:
        return self.spec.type

    @dbus_property(access=PropertyAccess.READ)
    def Class(self) -> DBusStr:
        return self.spec.klass

    @dbus_property(access=PropertyAccess.READ)
    def Active(self) -> DBusBool:
        return self.spec.active

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> DBusStr:
        return "active" if self.spec.active else "online"

    @dbus_property(access=PropertyAccess.READ)
    def IdleHint(self) -> DBusBool:
        return self.spec.idle

    @dbus_property(access=PropertyAccess.READ)
    def IdleSinceHint(self) -> DBusUInt64:
        return int(time.time() * 1e6) - (monotonic_us() - self.spec.idle_since_us)

    @dbus_property(access=PropertyAccess.READ)
    def IdleSinceHintMonotonic(self) -> DBusUInt64:
        return self.spec.idle_since_us

    @dbus_property(access=PropertyAccess.READ)
    def LockedHint(self) -> DBusBool:
        return self.spec.locked

    # -- methods -----------------------------------------------------------------------
    @dbus_method()
    def Lock(self):
        self.LockRequested()

    @dbus_method()
    def Unlock(self):
        self.UnlockRequested()

    @dbus_method()
    def Activate(self):
        self.spec.active = True
        self.emit_properties_changed({"Active": True, "State": "active"})

    @dbus_method()
    def Terminate(self):
        return None

    @dbus_method()
    def SetIdleHint(self, idle: DBusBool):
        self.set_idle(idle)

    @dbus_method()
    def SetLockedHint(self, locked: DBusBool):
        self.set_locked(locked)

    # -- signals (dbus-fast names the signal after ``name=``) ---------------------------
    @dbus_signal(name="Lock")
    def LockRequested(self):
        return None

    @dbus_signal(name="Unlock")
    def UnlockRequested(self):
        return None

    # -- what a desktop would do -------------------------------------------------------
    def set_locked(self, locked: bool) -> None:
        self.spec.locked = locked
        self.emit_properties_changed({"LockedHint": locked})

    def set_idle(self, idle: bool, since_us: int | None = None) -> None:
        self.spec.idle = idle
        self.spec.idle_since_us = monotonic_us() if since_us is None else since_us
        self.emit_properties_changed(
            {
                "IdleHint": idle,
                "IdleSinceHint": self.IdleSinceHint,
                "IdleSinceHintMonotonic": self.spec.idle_since_us,
            }
        )


class FakeManager(ServiceInterface):
    def __init__(self, logind: FakeLogind) -> None:
        super().__init__("org.freedesktop.login1.Manager")
        self._logind = logind

    @dbus_method()
    def ListSessions(self) -> SessionList:
        return [
            [s.spec.id, s.spec.uid, s.spec.user, s.spec.seat, session_path(s.spec.id)]
            for s in self._logind.sessions.values()
        ]

    @dbus_method()
    def GetSession(self, session_id: DBusStr) -> DBusObjectPath:
        return session_path(session_id)

    @dbus_method()
    def LockSession(self, session_id: DBusStr):
        self._logind.sessions[session_id].LockRequested()

    @dbus_method()
    def UnlockSession(self, session_id: DBusStr):
        self._logind.sessions[session_id].UnlockRequested()

    @dbus_signal()
    def SessionNew(self, session_id: str, path: str) -> Annotated[list[Any], DBusSignature("so")]:
        return [session_id, path]

    @dbus_signal()
    def SessionRemoved(
        self, session_id: str, path: str
    ) -> Annotated[list[Any], DBusSignature("so")]:
        return [session_id, path]


class FakeLogind:
    """The look-alike service. ``await FakeLogind.start(address, sessions)``."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.manager = FakeManager(self)
        self.sessions: dict[str, FakeSession] = {}
        self.hang: set[str] = set()
        self.malformed: dict[str, dict[str, Variant]] = {}
        self.calls: list[str] = []

    @classmethod
    async def start(cls, address: str, sessions: Sequence[SessionSpec] = ()) -> FakeLogind:
        bus = await MessageBus(bus_address=address).connect()
        logind = cls(bus)
        bus.add_message_handler(logind._intercept)
        bus.export(ROOT, logind.manager)
        for spec in sessions:
            logind._export(spec)
        await bus.request_name("org.freedesktop.login1")
        return logind

    def _export(self, spec: SessionSpec) -> FakeSession:
        session = FakeSession(spec)
        self.sessions[spec.id] = session
        self.bus.export(session_path(spec.id), session)
        return session

    def _intercept(self, msg: Message) -> Message | bool | None:
        """Fault injection ahead of dbus-fast's own dispatch."""
        if msg.message_type is not MessageType.METHOD_CALL:
            return None
        self.calls.append(msg.member or "")
        if msg.member in self.hang:
            return True  # handled: no reply, ever
        if msg.member == "GetAll" and msg.path:
            for sid, props in self.malformed.items():
                if msg.path == session_path(sid) and sid in self.sessions:
                    return Message.new_method_return(msg, "a{sv}", [props])
        return None

    def session(self, session_id: str) -> FakeSession:
        return self.sessions[session_id]

    def add(self, spec: SessionSpec) -> FakeSession:
        """A new login: export the session and emit SessionNew, as logind does."""
        session = self._export(spec)
        self.manager.SessionNew(spec.id, session_path(spec.id))
        return session

    def remove(self, session_id: str) -> None:
        self.sessions.pop(session_id)
        path = session_path(session_id)
        self.bus.unexport(path)
        self.manager.SessionRemoved(session_id, path)

    def serve_malformed(self, session_id: str, props: dict[str, Variant]) -> None:
        """Answer GetAll on ``session_id`` with exactly ``props`` from now on."""
        self.malformed[session_id] = props

    def proper_properties(self, session_id: str) -> dict[str, Variant]:
        """The session's properties as GetAll would serve them (to derive malformed sets)."""
        s = self.sessions[session_id].spec
        return {
            "Id": Variant("s", s.id),
            "User": Variant("(uo)", [s.uid, f"{ROOT}/user/_{s.uid}"]),
            "Name": Variant("s", s.user),
            "Seat": Variant("(so)", [s.seat, f"{ROOT}/seat/{s.seat}"]),
            "TTY": Variant("s", s.tty),
            "Remote": Variant("b", s.remote),
            "Type": Variant("s", s.type),
            "Class": Variant("s", s.klass),
            "Active": Variant("b", s.active),
            "State": Variant("s", "active" if s.active else "online"),
            "IdleHint": Variant("b", s.idle),
            "IdleSinceHintMonotonic": Variant("t", s.idle_since_us),
            "LockedHint": Variant("b", s.locked),
        }

    def disappear(self) -> None:
        """The service goes away: its connection closes and the name loses its owner."""
        self.bus.disconnect()

    async def stop(self) -> None:
        if self.bus.connected:
            self.bus.disconnect()
            await self.bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
