"""Pure presence rules (vacancyd.core.presence): session parsing and classification, the
owner-signal decision, idle timing, which users' processes are scanned, the stale rule,
owner-process name validation and source resolution."""

from __future__ import annotations

from typing import Any

import pytest

from vacancyd.core import presence as p

NOW_US = 10_000_000_000  # host CLOCK_MONOTONIC, microseconds
POLICY = p.PresencePolicy()


def props(**over: object) -> dict[str, p.Property]:
    base: dict[str, p.Property] = {
        "Id": ("s", "1"),
        "User": ("(uo)", [1000, "/org/freedesktop/login1/user/_1000"]),
        "Name": ("s", "owner"),
        "Seat": ("(so)", ["seat0", "/org/freedesktop/login1/seat/seat0"]),
        "TTY": ("s", ""),
        "Remote": ("b", False),
        "Type": ("s", "wayland"),
        "Class": ("s", "user"),
        "Active": ("b", True),
        "State": ("s", "active"),
        "IdleHint": ("b", False),
        "IdleSinceHintMonotonic": ("t", 0),
        "LockedHint": ("b", False),
    }
    for key, value in over.items():
        if value is None:
            base.pop(key)
        else:
            assert isinstance(value, tuple)
            base[key] = value
    return base


def session(policy: p.PresencePolicy = POLICY, /, **over: Any) -> p.SessionFacts:
    return p.parse_session("1", 1000, "owner", props(**over), policy)


@pytest.mark.parametrize(
    ("over", "kind"),
    [
        ({}, p.SessionKind.GRAPHICAL),
        ({"Type": ("s", "x11")}, p.SessionKind.GRAPHICAL),
        ({"Type": ("s", "mir")}, p.SessionKind.GRAPHICAL),
        ({"Type": ("s", "tty")}, p.SessionKind.CONSOLE),
        ({"Type": ("s", "tty"), "Remote": ("b", True)}, p.SessionKind.REMOTE),
        ({"Type": ("s", "wayland"), "Remote": ("b", True)}, p.SessionKind.REMOTE),
        ({"Type": ("s", "unspecified")}, p.SessionKind.OTHER),
        ({"Class": ("s", "greeter")}, p.SessionKind.OTHER),
        ({"Class": ("s", "lock-screen")}, p.SessionKind.OTHER),
        ({"Class": ("s", "background")}, p.SessionKind.OTHER),
        ({"Class": ("s", "user-early")}, p.SessionKind.GRAPHICAL),
    ],
)
def test_classification(over: dict[str, object], kind: p.SessionKind) -> None:
    assert session(**over).kind is kind


def test_remote_graphical_counts_only_when_asked() -> None:
    remote_x11 = {"Type": ("s", "x11"), "Remote": ("b", True)}
    assert session(**remote_x11).kind is p.SessionKind.REMOTE
    asked = p.PresencePolicy(count_remote_graphical=True)
    assert session(asked, **remote_x11).kind is p.SessionKind.GRAPHICAL
    # SSH (a remote tty) never counts, even then.
    ssh = {"Type": ("s", "tty"), "Remote": ("b", True)}
    assert session(asked, **ssh).kind is p.SessionKind.REMOTE


@pytest.mark.parametrize(
    ("over", "problem"),
    [
        ({"LockedHint": ("s", "no")}, "LockedHint has D-Bus type 's', expected 'b'"),
        ({"IdleSinceHintMonotonic": ("u", 5)}, "IdleSinceHintMonotonic has D-Bus type 'u'"),
        ({"User": ("u", 1000)}, "User has D-Bus type 'u', expected '(uo)'"),
        ({"LockedHint": None}, "property LockedHint is missing"),
        ({"Type": None}, "property Type is missing"),
        ({"LockedHint": ("b", "yes")}, "property values malformed"),
        ({"IdleSinceHintMonotonic": ("t", True)}, "property values malformed"),
        ({"User": ("(uo)", [1000])}, "property values malformed"),
        ({"Name": ("s", "")}, "session has no user"),
        ({"User": ("(uo)", [0, "/"])}, "ListSessions says uid 1000, the session says uid 0"),
    ],
)
def test_unreadable_sessions_are_unknown(over: dict[str, object], problem: str) -> None:
    facts = session(**over)
    assert facts.kind is p.SessionKind.UNKNOWN
    assert facts.problem is not None and problem in facts.problem


def test_listed_without_a_user_is_unknown() -> None:
    facts = p.parse_session("7", 1000, "", props(), POLICY)
    assert facts.kind is p.SessionKind.UNKNOWN and facts.problem == "session has no user"


@pytest.mark.parametrize(
    ("over", "owner", "why"),
    [
        ({}, True, "unlocked and in use"),
        ({"LockedHint": ("b", True)}, False, "locked"),
        ({"IdleHint": ("b", True), "IdleSinceHintMonotonic": ("t", 1)}, False, "idle"),
        ({"Type": ("s", "tty")}, True, "unlocked and in use"),
        ({"Type": ("s", "tty"), "Remote": ("b", True)}, False, "remote session; does not count"),
        ({"Class": ("s", "greeter")}, False, "greeter wayland session; does not count"),
        # Active (foreground) does not matter: an unlocked, non-idle local session counts.
        ({"Active": ("b", False)}, True, "unlocked and in use"),
    ],
)
def test_decision_per_session(over: dict[str, object], owner: bool, why: str) -> None:
    decision = p.decide_presence([session(**over)], POLICY, NOW_US)
    assert decision.owner_signal is owner
    assert decision.evidence_complete
    assert decision.sessions[0]["why"] == why
    assert decision.sessions[0]["owner"] is owner


def test_no_sessions_is_away_with_complete_evidence() -> None:
    decision = p.decide_presence([], POLICY, NOW_US)
    assert (decision.owner_signal, decision.evidence_complete, decision.detail) == (
        False,
        True,
        "no sessions",
    )


def test_one_unknown_session_refuses_among_clear_ones() -> None:
    locked = session(LockedHint=("b", True))
    bad = session(LockedHint=("s", "no"))
    decision = p.decide_presence([locked, bad], POLICY, NOW_US)
    assert decision.owner_signal and not decision.evidence_complete
    assert "LockedHint has D-Bus type 's'" in decision.detail
    assert decision.counts["unknown"] == 1 and decision.counts["graphical"] == 1


def test_status_entries_are_redacted() -> None:
    decision = p.decide_presence([session(Remote=("b", True), Type=("s", "tty"))], POLICY, NOW_US)
    entry = decision.sessions[0]
    assert "owner" in entry and "user" not in entry and "uid" not in entry
    assert all("owner" != v for v in entry.values())  # no user name anywhere


@pytest.mark.parametrize(
    ("idle_after_s", "idle_since_us", "away"),
    [
        (0, NOW_US - 1_000, True),  # the hint alone is trusted
        (0, 0, False),  # ... but only with a timestamp: one without is no evidence
        (60, NOW_US - 61_000_000, True),
        (60, NOW_US - 59_000_000, False),
        (60, 0, False),  # no stamp: cannot prove a long enough absence
        (60, NOW_US + 5_000_000, False),  # a stamp from the future reads as "just now"
    ],
)
def test_idle_after(idle_after_s: float, idle_since_us: int, away: bool) -> None:
    policy = p.PresencePolicy(idle_after_s=idle_after_s)
    facts = session(policy, IdleHint=("b", True), IdleSinceHintMonotonic=("t", idle_since_us))
    assert p.is_away(facts, policy, NOW_US) is away
    assert p.decide_presence([facts], policy, NOW_US).owner_signal is (not away)


def test_an_idle_hint_without_a_timestamp_is_not_evidence_of_absence() -> None:
    """Some desktops set IdleHint but never IdleSinceHintMonotonic: under the default
    ``idle_after_s = 0`` that session must still count as the owner, and say why."""
    facts = session(IdleHint=("b", True), IdleSinceHintMonotonic=("t", 0))
    assert not p.is_away(facts, POLICY, NOW_US)
    decision = p.decide_presence([facts], POLICY, NOW_US)
    assert decision.owner_signal and decision.evidence_complete
    (entry,) = decision.sessions
    assert entry["owner"] is True and entry["idle"] is True and entry["idle_for_s"] is None
    assert "without a timestamp" in str(entry["why"])
    assert "without a timestamp" in decision.detail
    # Its user's processes are not scanned: the session already counts as the owner.
    scanning = p.PresencePolicy(owner_processes=frozenset({"game"}))
    assert p.users_to_scan([facts], scanning, NOW_US) == frozenset()


def test_idle_for_reports_seconds() -> None:
    facts = session(IdleHint=("b", True), IdleSinceHintMonotonic=("t", NOW_US - 90_000_000))
    assert p.idle_for_s(facts, NOW_US) == pytest.approx(90.0)
    assert p.idle_for_s(session(), NOW_US) is None


def test_users_to_scan_only_unlocked_idle_counting_sessions() -> None:
    policy = p.PresencePolicy(owner_processes=frozenset({"game"}))
    idle = session(policy, IdleHint=("b", True), IdleSinceHintMonotonic=("t", NOW_US - 1_000))
    locked_idle = p.parse_session(
        "2",
        1001,
        "b",
        props(
            User=("(uo)", [1001, "/"]),
            Name=("s", "b"),
            IdleHint=("b", True),
            LockedHint=("b", True),
        ),
        policy,
    )
    busy = p.parse_session(
        "3", 1002, "c", props(User=("(uo)", [1002, "/"]), Name=("s", "c")), policy
    )
    ssh = p.parse_session(
        "4",
        1003,
        "d",
        props(
            User=("(uo)", [1003, "/"]),
            Name=("s", "d"),
            Remote=("b", True),
            Type=("s", "tty"),
            IdleHint=("b", True),
        ),
        policy,
    )
    assert p.users_to_scan([idle, locked_idle, busy, ssh], policy, NOW_US) == {(1000, "owner")}
    assert p.users_to_scan([idle], POLICY, NOW_US) == frozenset()  # no list configured


def test_owner_process_and_scan_problems_hold_an_idle_desktop() -> None:
    policy = p.PresencePolicy(owner_processes=frozenset({"game"}))
    idle = session(policy, IdleHint=("b", True), IdleSinceHintMonotonic=("t", NOW_US - 1_000))
    matched = p.decide_presence(
        [idle], policy, NOW_US, p.ProcessScan(matches={1000: frozenset({"game"})})
    )
    assert matched.owner_signal and matched.evidence_complete
    assert matched.sessions[0]["owner_processes"] == ["game"]
    failed = p.decide_presence(
        [idle], policy, NOW_US, p.ProcessScan(problems={1000: "user 'x' does not resolve"})
    )
    assert failed.owner_signal and not failed.evidence_complete
    assert "does not resolve" in failed.detail
    clear = p.decide_presence([idle], policy, NOW_US, p.ProcessScan())
    assert not clear.owner_signal and clear.evidence_complete


@pytest.mark.parametrize(
    ("observed_at", "now", "engages"),
    [(None, 100.0, False), (100.0, 110.0, False), (100.0, 115.0, False), (100.0, 115.1, True)],
)
def test_stale_rule(observed_at: float | None, now: float, engages: bool) -> None:
    assert p.stale_engages_veto(observed_at, now, 15.0) is engages


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("steam", None),
        ("vacancyd-owner-game-with-a-long-name", None),
        ("", "is empty"),
        (" steam", "leading or trailing whitespace"),
        ("/usr/bin/steam", "is a path"),
        ("ste\x00am", "control characters"),
        ("x" * 256, "longer than 255"),
    ],
)
def test_process_name_validation(name: str, problem: str | None) -> None:
    why = p.validate_process_name(name)
    assert (why is None) if problem is None else (why is not None and problem in why)


@pytest.mark.parametrize(
    ("setting", "platform", "source"),
    [
        (None, "linux", p.PresenceSource.NONE),
        ("headless", "darwin", p.PresenceSource.HEADLESS),
        ("logind", "linux", p.PresenceSource.LOGIND),
        ("auto", "linux", p.PresenceSource.LOGIND),
        ("auto", "darwin", p.PresenceSource.UNSUPPORTED),
        ("auto", "win32", p.PresenceSource.UNSUPPORTED),
    ],
)
def test_resolve_source(setting: str | None, platform: str, source: p.PresenceSource) -> None:
    assert p.resolve_source(setting, platform) is source
