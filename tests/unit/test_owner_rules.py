"""Pure rules of the owner's controls: pauses, the battery rule, exclusive-app timers, holds
in the gate and in reclaim planning."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.core import gate
from vacancyd.core.exclusive import ExclusiveTracker
from vacancyd.core.holds import Hold, HoldKind, decide_holds, retry_after_s
from vacancyd.core.pause import (
    Pause,
    PauseKind,
    advance,
    parse_duration,
    parse_until,
)
from vacancyd.core.policy import OwnerScope, UpstreamPolicy
from vacancyd.core.power import PowerPolicy, PowerReading, power_hold
from vacancyd.core.reasons import Reason, Refuse
from vacancyd.core.reclaim import (
    Edge,
    OnOwnerReturn,
    Proceed,
    ReclaimPolicy,
    StandDown,
    Trigger,
    affected_upstreams,
    open_reclaim,
    plan,
    trigger_cleared,
)
from vacancyd.core.snapshot import PresenceView, RequestFacts, Snapshot

BERLIN = ZoneInfo("Europe/Berlin")
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=BERLIN).timestamp()

# -- pauses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("5m", 300), ("2h", 7200), ("1h30m", 5400), ("1d", 86400), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-5m", "must be positive and unsigned"),
        ("5", "NUMBER\\+UNIT"),
        ("5 minutes", "NUMBER\\+UNIT"),
        ("0m", "is zero"),
        ("400d", "longer than a year"),
        ("", "NUMBER\\+UNIT"),
        # other scripts' digits: \\d and float() take them, a duration does not
        ("\u0663h", "ASCII digits 0-9"),  # Arabic-Indic three
        ("1\u0665m", "ASCII digits 0-9"),  # Arabic-Indic five
        ("\uff13h", "ASCII digits 0-9"),  # fullwidth three
    ],
)
def test_bad_durations(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_duration(text)


def test_until_time_of_day_is_its_next_occurrence() -> None:
    assert parse_until("18:00", NOW, BERLIN) == NOW + 6 * 3600
    assert parse_until("11:00", NOW, BERLIN) == NOW + 23 * 3600  # tomorrow


def test_until_iso_local_and_with_offset() -> None:
    assert parse_until("2026-12-01T18:00", NOW, BERLIN) == NOW + 6 * 3600
    assert parse_until("2026-12-01T18:00+00:00", NOW, BERLIN) == NOW + 7 * 3600


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("2026-12-01T11:00", "is in the past"),
        ("2020-01-01T00:00+00:00", "is in the past"),
        ("25:00", "not a time of day"),
        ("tomorrow", "neither HH:MM nor an ISO 8601"),
        ("2028-01-01T00:00", "more than a year away"),
        ("\u0661\u0668:00", "neither HH:MM nor an ISO 8601"),  # Arabic-Indic 18:00
    ],
)
def test_bad_until(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_until(text, NOW, BERLIN)


@given(length=st.floats(1, 86400), step=st.floats(0, 2 * 86400))
def test_timed_pause_ends_exactly_at_its_time(length: float, step: float) -> None:
    until, now = NOW + length, NOW + step
    pause = Pause(PauseKind.UNTIL, NOW, until)
    after = advance(pause, now, owner_present=False)
    # compare the wall times themselves: NOW + step and NOW + length round on their own, so
    # step >= length can differ from them in the last bit
    assert (after is None) == (now >= until)


def test_indefinite_pause_never_ends_by_itself() -> None:
    pause = Pause(PauseKind.INDEFINITE, NOW)
    assert advance(pause, NOW + 10**8, owner_present=False) is pause


def test_until_idle_ends_when_the_owner_has_come_and_gone() -> None:
    pause = Pause(PauseKind.UNTIL_IDLE, NOW)
    # Away at first (paused from elsewhere): it waits for the owner to be seen.
    assert advance(pause, NOW + 1, owner_present=False) is pause
    seen = advance(pause, NOW + 2, owner_present=True)
    assert seen is not None and seen.seen_owner
    assert advance(seen, NOW + 3, owner_present=True) is seen
    assert advance(seen, NOW + 4, owner_present=False) is None


def test_saved_pause_round_trip_and_bad_files() -> None:
    pause = Pause(PauseKind.UNTIL, NOW, NOW + 60, reason="film night")
    assert Pause.from_json(pause.to_json()) == pause
    for bad in (
        {},
        {"kind": "forever", "set_at": 1},
        {"kind": "until", "set_at": 1},
        {"kind": "indefinite", "set_at": "x"},
        {"kind": "indefinite", "set_at": 1, "until": 5},
        # numbers that are no time (json.loads reads NaN and Infinity): these crashed the
        # daemon's start when it described the restored pause
        {"kind": "until", "set_at": 1, "until": 1e308},
        {"kind": "until", "set_at": 1, "until": float("nan")},
        {"kind": "until", "set_at": 1, "until": float("-inf")},
        {"kind": "indefinite", "set_at": float("nan")},
        {"kind": "until", "set_at": 1, "until": 1e20},
    ):
        with pytest.raises(ValueError, match="not a saved pause"):
            Pause.from_json(bad)


def test_pause_describe_says_until_when() -> None:
    pause = Pause(PauseKind.UNTIL, NOW, NOW + 6 * 3600)
    assert pause.describe(BERLIN) == "paused by the owner until 2026-12-01 18:00:00 +0100"


# -- battery -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reading", "policy", "held"),
    [
        (PowerReading(False), PowerPolicy(), None),  # a desktop: unknown state is mains
        (PowerReading(True, True, 80), PowerPolicy(), None),
        (PowerReading(True, False, 80), PowerPolicy(), "running on battery (80% charged)"),
        (PowerReading(True, None, 80), PowerPolicy(), "power source is unknown"),
        (PowerReading(None, error="no sysfs"), PowerPolicy(), "cannot tell whether"),
        (PowerReading(True, False, 80), PowerPolicy(lend_on_battery=True), None),
        (PowerReading(True, True, 30), PowerPolicy(min_battery_percent=50), "below"),
        (PowerReading(True, True, None), PowerPolicy(min_battery_percent=50), "charge is unknown"),
        (PowerReading(True, False, 90), PowerPolicy(True, 50), None),
        (PowerReading(None), PowerPolicy(lend_on_battery=True), None),  # nothing to check
    ],
)
def test_battery_rule(reading: PowerReading, policy: PowerPolicy, held: str | None) -> None:
    why = power_hold(reading, policy)
    if held is None:
        assert why is None
    else:
        assert why is not None and held in why


# -- exclusive apps ----------------------------------------------------------------------


def test_exclusive_app_engages_after_grace_and_releases_after_resume_delay() -> None:
    t = ExclusiveTracker(frozenset({"blender"}), grace_s=5, resume_after_s=60)
    assert not t.observe({"blender"}, 0)
    assert t.engage_in_s(1) == 4
    assert not t.observe({"blender"}, 4.9)
    assert t.observe({"blender", "unrelated"}, 5)  # edge
    assert t.engaged and t.holding == {"blender"}
    assert not t.observe(set(), 10)
    assert t.release_in_s(30) == 35
    assert not t.observe(set(), 64.9)
    assert t.observe(set(), 65)  # edge
    assert not t.engaged


def test_a_short_lived_helper_does_not_flap() -> None:
    t = ExclusiveTracker(frozenset({"game"}), grace_s=5, resume_after_s=60)
    for now in range(0, 40, 2):
        seen = {"game"} if now % 8 == 0 else set()  # seen for one scan, then gone
        assert not t.observe(seen, now)
    assert not t.engaged


def test_a_returning_app_restarts_the_resume_delay() -> None:
    t = ExclusiveTracker(frozenset({"game"}), grace_s=0, resume_after_s=10)
    assert t.observe({"game"}, 0)
    assert not t.observe(set(), 9)
    assert not t.observe({"game"}, 9.5)
    assert not t.observe(set(), 19)
    assert t.observe(set(), 19.5)


def test_failed_scans_count_as_seen() -> None:
    t = ExclusiveTracker(frozenset({"game"}), grace_s=5, resume_after_s=10)
    assert not t.observe(None, 0)
    assert t.observe(None, 5)  # failures for longer than the grace engage
    assert not t.observe(None, 100)  # and keep it engaged


# -- holds in the gate and in reclaim ----------------------------------------------------

PRESENCE = PresenceView("headless", True, 0.0, True, False, 15.0)
CPU = UpstreamPolicy("cpu-only", "openai", "cpu")
GPU = UpstreamPolicy("on-gpu", "openai", "gpu0", owner_scope=OwnerScope.RESOURCE)
UPSTREAMS = {"cpu-only": CPU, "on-gpu": GPU}


def snap(*holds: Hold) -> Snapshot:
    return Snapshot(1.0, True, PRESENCE, {}, holds=holds)


def test_a_host_hold_refuses_every_upstream_whatever_its_scope() -> None:
    hold = Hold(HoldKind.PAUSE, "paused by the owner until 18:00", ends_in_s=120, until=NOW)
    for up in (CPU, GPU):
        refusal = gate.decide(RequestFacts(), snap(hold), up)
        assert isinstance(refusal, Refuse)
        assert refusal.reason is Reason.OWNER_ACTIVE
        assert refusal.detail == "paused by the owner until 18:00"
        assert refusal.retry_after_s == 121
        assert refusal.extra == {"hold": "pause", "until": NOW}


def test_a_gpu_hold_refuses_only_gpu_upstreams() -> None:
    hold = Hold(HoldKind.EXCLUSIVE_APP, "GPU-exclusive", resources=frozenset({"gpu0"}))
    assert decide_holds([hold], CPU.resources) is None
    assert decide_holds([hold], GPU.resources) is not None


def test_hold_retry_after_bounds() -> None:
    assert retry_after_s(Hold(HoldKind.PAUSE, "x")) == 300
    assert retry_after_s(Hold(HoldKind.BATTERY, "x")) == 120
    assert retry_after_s(Hold(HoldKind.PAUSE, "x", ends_in_s=0.2)) == 5
    assert retry_after_s(Hold(HoldKind.PAUSE, "x", ends_in_s=10**6)) == 3600


def test_hold_edges_reclaim_every_upstream_or_the_gpu_ones() -> None:
    assert affected_upstreams(Edge(Trigger.HOLD, 0.0), UPSTREAMS, veto_active=True) == [
        "cpu-only",
        "on-gpu",
    ]
    gpu_edge = Edge(Trigger.HOLD, 0.0, resource="gpu0")
    assert affected_upstreams(gpu_edge, UPSTREAMS, veto_active=False) == ["on-gpu"]
    assert Edge(Trigger.HOLD, 0.0).reason is Reason.OWNER_ACTIVE


@pytest.mark.parametrize("policy", list(OnOwnerReturn))
def test_a_hold_reclaim_follows_the_policy_and_stands_down_when_the_hold_ends(
    policy: OnOwnerReturn,
) -> None:
    hold = Hold(HoldKind.SCHEDULE, "outside the schedule")
    reclaim, _ = open_reclaim(None, Edge(Trigger.HOLD, 0.0), "on-gpu", ReclaimPolicy(policy, 30.0))
    held, released = snap(hold), snap()
    assert not trigger_cleared(reclaim, held, GPU)
    assert trigger_cleared(reclaim, released, GPU)
    action = plan(reclaim, trigger_cleared=False, active_work=1, now=31.0)
    if policy is OnOwnerReturn.FINISH:
        assert action == plan(reclaim, trigger_cleared=False, active_work=1, now=0.0)
    else:
        assert isinstance(action, Proceed) and action.cut
    cleared = plan(reclaim, trigger_cleared=True, active_work=1, now=1.0)
    assert isinstance(cleared, StandDown) == (policy is not OnOwnerReturn.CANCEL)
