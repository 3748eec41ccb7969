"""Owner presence from login sessions: pure rules (docs/architecture.md, "Gate" step 2–4).

The logind collector (``vacancyd.collectors.logind``) reads sessions from systemd-logind and
hands this module plain values: each session's ``ListSessions`` entry and its properties as
``{name: (dbus_signature, value)}``. Everything here is a function of those values and of
numbers passed in (monotonic microseconds of the host clock); nothing here does I/O or reads a
clock.

The rules:

* A session *counts* when it is a local user session of a graphical type (x11, wayland, mir)
  or a text console (tty). Remote sessions (SSH) never count; remote graphical sessions count
  only when the owner asks for it (``remote_graphical = "count"``).
* A counting session that is not locked (``LockedHint``) and not idle (``IdleHint``, idle for
  at least ``idle_after_s`` by ``IdleSinceHintMonotonic``) is the owner at the machine. An
  idle hint without a timestamp (``IdleSinceHintMonotonic`` 0: the desktop never said when
  idleness began) is not evidence of absence: that session is the owner too.
* An unlocked, counting session whose user runs a configured owner process is the owner too;
processes are scanned only for such sessions.
* A session vacancyd cannot read clearly (a property missing or of the wrong D-Bus type, no
  user, a user that does not resolve, a process scan that failed) is an *unknown* session: it
  counts as the owner and marks the evidence incomplete, so the gate refuses (never "absent").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

#: Graphical session types logind reports (org.freedesktop.login1.Session.Type).
GRAPHICAL_TYPES = frozenset({"x11", "wayland", "mir"})
#: Text console session type.
CONSOLE_TYPE = "tty"

#: Properties of org.freedesktop.login1.Session that the decision reads, with the D-Bus type
#: systemd documents for each (man page org.freedesktop.login1(5), "Session Objects").
SESSION_PROPERTIES: Mapping[str, str] = {
    "Id": "s",
    "User": "(uo)",
    "Name": "s",
    "Seat": "(so)",
    "TTY": "s",
    "Remote": "b",
    "Type": "s",
    "Class": "s",
    "Active": "b",
    "State": "s",
    "IdleHint": "b",
    "IdleSinceHintMonotonic": "t",
    "LockedHint": "b",
}

#: A D-Bus property as the collector passes it: (signature, unwrapped value).
Property = tuple[str, object]


class SessionKind(StrEnum):
    """How a session is classified; the values appear in /status and metric labels."""

    GRAPHICAL = "graphical"
    CONSOLE = "console"
    REMOTE = "remote"
    OTHER = "other"
    UNKNOWN = "unknown"


class PresenceSource(StrEnum):
    """The presence backend the daemon runs (``[owner] presence`` resolved for a platform)."""

    NONE = "none"
    HEADLESS = "headless"
    LOGIND = "logind"
    UNSUPPORTED = "unsupported"


def resolve_source(setting: str | None, platform: str) -> PresenceSource:
    """Resolve ``[owner] presence`` for ``platform`` (``sys.platform``).

    ``"auto"`` means logind on Linux and :attr:`PresenceSource.UNSUPPORTED` elsewhere: an
    unknown reading that does not refuse. Unset means no source at all, which
    refuses host-scoped work as never sampled.
    """
    if setting is None:
        return PresenceSource.NONE
    if setting == "auto":
        return PresenceSource.LOGIND if platform.startswith("linux") else PresenceSource.UNSUPPORTED
    return PresenceSource(setting)


@dataclass(frozen=True, slots=True)
class PresencePolicy:
    """The owner settings the decision needs.

    ``owner_processes``: process names that mean the owner is using the machine.
    ``idle_after_s``: seconds a session must have been idle (by IdleSinceHintMonotonic) before
    its idle hint counts; 0 trusts the hint at once.
    ``count_remote_graphical``: remote x11/wayland/mir sessions count like local ones.
    """

    owner_processes: frozenset[str] = frozenset()
    idle_after_s: float = 0.0
    count_remote_graphical: bool = False


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """One session as read, or why it could not be read (``problem`` set, kind UNKNOWN)."""

    id: str
    kind: SessionKind
    uid: int | None = None
    user: str = ""
    seat: str = ""
    type: str = ""
    klass: str = ""
    remote: bool = False
    active: bool = False
    locked: bool = False
    idle: bool = False
    idle_since_us: int = 0
    problem: str | None = None

    @property
    def counts(self) -> bool:
        """A local (or accepted remote graphical) user session at a screen or console."""
        return self.kind in (SessionKind.GRAPHICAL, SessionKind.CONSOLE)


def _typed(props: Mapping[str, Property], name: str) -> object:
    """The value of ``name`` if it has the documented D-Bus type; raises ValueError if not."""
    if name not in props:
        raise ValueError(f"property {name} is missing")
    signature, value = props[name]
    expected = SESSION_PROPERTIES[name]
    if signature != expected:
        raise ValueError(f"property {name} has D-Bus type {signature!r}, expected {expected!r}")
    return value


def parse_session(
    session_id: str,
    listed_uid: int,
    listed_user: str,
    props: Mapping[str, Property],
    policy: PresencePolicy,
) -> SessionFacts:
    """Turn one session's ListSessions entry and GetAll properties into :class:`SessionFacts`.

    Never raises: a session that cannot be read clearly comes back as
    ``SessionKind.UNKNOWN`` with ``problem`` saying what was wrong.
    """
    try:
        user = _typed(props, "User")
        name = _typed(props, "Name")
        seat = _typed(props, "Seat")
        remote = _typed(props, "Remote")
        type_ = _typed(props, "Type")
        klass = _typed(props, "Class")
        active = _typed(props, "Active")
        idle = _typed(props, "IdleHint")
        idle_since = _typed(props, "IdleSinceHintMonotonic")
        locked = _typed(props, "LockedHint")
    except ValueError as exc:
        return SessionFacts(session_id, SessionKind.UNKNOWN, problem=str(exc))
    # Signatures were checked; the values still come from a peer, so check their shapes too.
    if (
        not isinstance(user, list | tuple)
        or len(user) != 2
        or type(user[0]) is not int
        or not isinstance(name, str)
        or not isinstance(seat, list | tuple)
        or len(seat) != 2
        or not isinstance(seat[0], str)
        or not all(isinstance(v, bool) for v in (remote, active, idle, locked))
        or type(idle_since) is not int
        or not isinstance(type_, str)
        or not isinstance(klass, str)
    ):
        return SessionFacts(session_id, SessionKind.UNKNOWN, problem="property values malformed")
    uid = user[0]
    if not name or not listed_user:
        return SessionFacts(session_id, SessionKind.UNKNOWN, uid=uid, problem="session has no user")
    if uid != listed_uid or name != listed_user:
        return SessionFacts(
            session_id,
            SessionKind.UNKNOWN,
            uid=uid,
            problem=f"ListSessions says uid {listed_uid}, the session says uid {uid}",
        )
    assert isinstance(remote, bool) and isinstance(locked, bool)
    assert isinstance(active, bool) and isinstance(idle, bool)
    return SessionFacts(
        id=session_id,
        kind=classify_session(type_, klass, remote, policy),
        uid=uid,
        user=name,
        seat=seat[0],
        type=type_,
        klass=klass,
        remote=remote,
        active=active,
        locked=locked,
        idle=idle,
        idle_since_us=idle_since,
    )


def classify_session(type_: str, klass: str, remote: bool, policy: PresencePolicy) -> SessionKind:
    """Classify by logind's Type, Class and Remote properties.

    Only user-class sessions (``user`` and its ``user-*`` variants) can count: greeters,
    lock-screen and background sessions are not a person at the machine.
    """
    if klass != "user" and not klass.startswith("user-"):
        return SessionKind.OTHER
    graphical = type_ in GRAPHICAL_TYPES
    if remote:
        return (
            SessionKind.GRAPHICAL
            if graphical and policy.count_remote_graphical
            else SessionKind.REMOTE
        )
    if graphical:
        return SessionKind.GRAPHICAL
    if type_ == CONSOLE_TYPE:
        return SessionKind.CONSOLE
    return SessionKind.OTHER


def idle_for_s(session: SessionFacts, host_now_us: int) -> float | None:
    """Seconds the session has been idle by IdleSinceHintMonotonic, or None when not idle.

    ``host_now_us`` is CLOCK_MONOTONIC in microseconds, the clock logind stamps with. A
    future stamp reads as "idle since now" (0 s); a missing (zero) stamp gives None too, since
    how long the session has been idle is unknown (see :func:`idle_unstamped`).
    """
    if not session.idle or idle_unstamped(session):
        return None
    return max(0.0, (host_now_us - session.idle_since_us) / 1e6)


def idle_unstamped(session: SessionFacts) -> bool:
    """The session says it is idle but not since when (``IdleSinceHintMonotonic`` is 0).

    Desktops that set ``IdleHint`` without a timestamp exist (and a stale hint left by a
    crashed idle monitor looks the same), so such a hint is not evidence of absence.
    """
    return session.idle and session.idle_since_us <= 0


def is_away(session: SessionFacts, policy: PresencePolicy, host_now_us: int) -> bool:
    """True when a counting session's idle hint says nobody is at it (long enough).

    A hint without a timestamp never does, whatever ``idle_after_s``: when the owner left is
    unknown, so nothing says they left at all (:func:`idle_unstamped`).
    """
    idle = idle_for_s(session, host_now_us)
    if idle is None:
        return False
    return policy.idle_after_s <= 0 or idle >= policy.idle_after_s


def users_to_scan(
    sessions: Sequence[SessionFacts], policy: PresencePolicy, host_now_us: int
) -> frozenset[tuple[int, str]]:
    """(uid, user) pairs whose processes could change the decision.

    Only users of an unlocked counting session that is otherwise away: at a session that is
    in use, the owner is present whatever runs, and behind a lock screen a running program is
    not the owner at the machine. Empty when no owner processes are configured.
    """
    if not policy.owner_processes:
        return frozenset()
    return frozenset(
        (s.uid, s.user)
        for s in sessions
        if s.counts and not s.locked and s.uid is not None and is_away(s, policy, host_now_us)
    )


@dataclass(frozen=True, slots=True)
class ProcessScan:
    """What the process scan found: matched owner-process names per uid, or problems per uid
    (a user that does not resolve, a scan that failed or overran its deadline)."""

    matches: Mapping[int, frozenset[str]] = field(default_factory=dict)
    problems: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PresenceDecision:
    """The outcome for one sample.

    ``owner_signal`` feeds the host policy veto; ``evidence_complete`` is False when any
    session was unknown; ``sessions`` are redacted descriptions for /status (no user names,
    no remote hosts); ``counts`` has one entry per :class:`SessionKind`.
    """

    owner_signal: bool
    evidence_complete: bool
    detail: str
    sessions: tuple[Mapping[str, object], ...]
    counts: Mapping[str, int]


def decide_presence(
    sessions: Sequence[SessionFacts],
    policy: PresencePolicy,
    host_now_us: int,
    scan: ProcessScan | None = None,
) -> PresenceDecision:
    """Decide the owner signal from every session logind listed (docs/architecture.md)."""
    scan = scan or ProcessScan()
    present: list[str] = []
    unknown: list[str] = []
    described: list[Mapping[str, object]] = []
    counts = {kind.value: 0 for kind in SessionKind}
    for s in sessions:
        counts[s.kind.value] += 1
        why: str
        signal = False
        matched: frozenset[str] = frozenset()
        if s.kind is SessionKind.UNKNOWN:
            signal = True
            why = f"unreadable ({s.problem}); counts as the owner"
            unknown.append(f"session {s.id}: {s.problem}")
        elif not s.counts:
            why = (
                "remote session; does not count"
                if s.kind is SessionKind.REMOTE
                else f"{s.klass or 'unclassed'} {s.type or 'unspecified'} session; does not count"
            )
        elif s.locked:
            why = "locked"
        elif not is_away(s, policy, host_now_us):
            signal = True
            if not s.idle:
                why = "unlocked and in use"
            elif idle_unstamped(s):
                why = (
                    "idle hint without a timestamp (the desktop has not reported when "
                    "idleness began); not evidence of absence"
                )
            else:
                why = "idle for less than idle_after_s"
        elif s.uid is not None and s.uid in scan.problems:
            signal = True
            why = f"idle, but its processes could not be checked ({scan.problems[s.uid]})"
            unknown.append(f"session {s.id}: {scan.problems[s.uid]}")
        elif s.uid is not None and scan.matches.get(s.uid):
            matched = scan.matches[s.uid]
            signal = True
            why = f"idle, but runs owner process {', '.join(sorted(matched))}"
        else:
            why = "idle"
        if signal and s.kind is not SessionKind.UNKNOWN:
            present.append(f"session {s.id} ({s.kind.value}, {why})")
        described.append(_describe(s, why, signal, matched, host_now_us))
    evidence_complete = not unknown
    if unknown:
        detail = "unreadable session evidence: " + "; ".join(unknown)
    elif present:
        detail = "owner present: " + "; ".join(present)
    elif not sessions:
        detail = "no sessions"
    else:
        n = sum(counts[k.value] for k in (SessionKind.GRAPHICAL, SessionKind.CONSOLE))
        detail = f"owner away ({n} local session(s) locked or idle, {len(sessions)} in all)"
    return PresenceDecision(
        owner_signal=bool(present or unknown),
        evidence_complete=evidence_complete,
        detail=detail,
        sessions=tuple(described),
        counts=counts,
    )


def unknown_session(problem: str) -> SessionFacts:
    """A session that stands for "logind could not be read" in a decision."""
    return SessionFacts("?", SessionKind.UNKNOWN, problem=problem)


def _describe(
    s: SessionFacts, why: str, signal: bool, matched: frozenset[str], host_now_us: int
) -> Mapping[str, object]:
    """A /status entry: what the read scope may see (no user names or remote addresses)."""
    doc: dict[str, object] = {"id": s.id, "kind": s.kind.value, "owner": signal, "why": why}
    if s.kind is SessionKind.UNKNOWN:
        return doc
    idle = idle_for_s(s, host_now_us)
    doc.update(
        type=s.type,
        **{"class": s.klass},
        seat=s.seat,
        remote=s.remote,
        active=s.active,
        locked=s.locked,
        idle=s.idle,
        idle_for_s=None if idle is None else round(idle, 1),
    )
    if matched:
        doc["owner_processes"] = sorted(matched)
    return doc


def stale_engages_veto(observed_at: float | None, now: float, max_age_s: float) -> bool:
    """The gate's step 2 (docs/architecture.md): a presence reading older than ``max_age_s``
    (monotonic seconds)
    that no fresh reading has replaced engages the owner veto. A never-sampled source does
    not (the gate already refuses it as never sampled)."""
    return observed_at is not None and now - observed_at > max_age_s


def validate_process_name(name: str) -> str | None:
    """Why ``name`` cannot be an owner-process name, or None when it can.

    Names are matched exactly against a process's name and the base name of its first
    command-line argument, so paths, padding and control characters could never match.
    """
    if not name:
        return "is empty"
    if name != name.strip():
        return f"{name!r} has leading or trailing whitespace"
    if "/" in name:
        return (
            f"{name!r} is a path; give the program's name (for example {name.rsplit('/', 1)[-1]!r})"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"{name!r} contains control characters"
    if len(name) > 255:
        return "is longer than 255 characters"
    return None


def count_kinds(sessions: Iterable[Mapping[str, object]]) -> dict[str, int]:
    """Sessions per :class:`SessionKind` value, from /status session descriptions (every kind
    present, zero when none)."""
    counts = {kind.value: 0 for kind in SessionKind}
    for s in sessions:
        kind = s.get("kind")
        if isinstance(kind, str) and kind in counts:
            counts[kind] += 1
    return counts


def headless_warning(sessions: Iterable[SessionFacts]) -> str | None:
    """Why ``presence = "headless"`` is wrong on this machine, or None.

    ``headless`` means nobody ever sits at this machine, so it lends whoever is at the desk;
    a local graphical session (the only kind ``headless`` could wrongly ignore that logind
    can prove) says someone does.
    """
    desks = [s for s in sessions if s.kind is SessionKind.GRAPHICAL and not s.remote]
    if not desks:
        return None
    listed = ", ".join(f"session {s.id} of {s.user} ({s.type})" for s in desks)
    return (
        'presence is "headless", which lends while someone sits at this machine, but logind '
        f'lists a local graphical session ({listed}); set [owner] presence = "auto" so '
        "lending stops while the owner is at the desk (docs/presence.md)"
    )


@dataclass(frozen=True, slots=True)
class PresenceReading:
    """One presence sample from a collector.

    ``owner_signal``: this sample matches the owner policy (a local unlocked, non-idle
    session or an owner process); it feeds the veto's hysteresis.
    ``evidence_complete``: every session could be read clearly.
    ``sessions``: a redacted description per session for /status.
    """

    owner_signal: bool
    evidence_complete: bool
    detail: str = ""
    sessions: tuple[Mapping[str, object], ...] = ()


def matched_owner_process(reading: PresenceReading) -> bool:
    """True when one of ``reading``'s sessions ran an owner process."""
    return any(s.get("owner_processes") for s in reading.sessions)
