"""A GPU's ``max_temperature_c`` through shared state, the gate, a reclaim's stand-down,
the status document and the configuration: ``gpu_too_hot`` with hysteresis, the thermal
reclaim edge after ``hot_yield_after_s``, and the keys' validation; and the pure rules and
configuration key of ``lend_power_limit_w``."""

from __future__ import annotations

import textwrap

import pytest

from tests.support.config import daemon_toml, gpu, upstream
from vacancyd.api.status import read_status
from vacancyd.config import ConfigError, parse_config
from vacancyd.config.policies import thermal_policy
from vacancyd.core import gate, reclaim
from vacancyd.core.events import EdgeRaised, StateEvent, ThermalChanged
from vacancyd.core.observations import CapacityReading
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.powerlimit import PowerLimits, check_lend_limit, to_mw, wants_lend_limit
from vacancyd.core.reasons import RETRY_AFTER_S, Admit, Reason, Refuse
from vacancyd.core.reclaim import Edge, ReclaimPolicy, Trigger
from vacancyd.core.snapshot import RequestFacts
from vacancyd.core.thermal import ThermalPolicy
from vacancyd.state import PresenceReading, SharedState

UP = UpstreamPolicy("llm", "openai", "gpu0")


def make_state(policy: ThermalPolicy | None) -> tuple[SharedState, list[StateEvent]]:
    state = SharedState(
        {"gpu0": ResourcePolicy("gpu0", ResourceKind.GPU, stale_after_s=1e9)},
        {"llm": UP},
        presence_source="headless",
        clock=lambda: 0.0,
        thermal=None if policy is None else {"gpu0": policy},
    )
    state.record_presence(PresenceReading(False, True), 0.0)
    events: list[StateEvent] = []
    state.subscribe(events.append)
    return state, events


def sample(state: SharedState, celsius: float | None, now: float) -> None:
    reading = CapacityReading(
        free_mib=20_000, total_mib=24_000, utilization=0.1, temperature_c=celsius
    )
    state.record_capacity("gpu0", reading, now)


def decide(state: SharedState, now: float) -> Admit | Refuse:
    return gate.decide(RequestFacts(), state.snapshot(now), UP)


def test_too_hot_refuses_until_below_the_resume_temperature() -> None:
    state, events = make_state(ThermalPolicy(max_c=80, resume_c=75))
    sample(state, 70, 1)
    assert isinstance(decide(state, 1), Admit)
    sample(state, 83, 2)
    refusal = decide(state, 2)
    assert isinstance(refusal, Refuse)
    assert refusal.reason is Reason.GPU_TOO_HOT
    assert refusal.retry_after_s == RETRY_AFTER_S[Reason.GPU_TOO_HOT] == 60
    assert refusal.resource == "gpu0"
    assert "83 °C" in refusal.detail and "below 75 °C" in refusal.detail
    sample(state, 78, 3)  # below the maximum, above the resume temperature: still refused
    refusal = decide(state, 3)
    assert isinstance(refusal, Refuse) and refusal.reason is Reason.GPU_TOO_HOT
    sample(state, 74, 4)
    assert isinstance(decide(state, 4), Admit)
    thermal = [e for e in events if isinstance(e, ThermalChanged)]
    assert [(e.change, e.hot, e.temperature_c) for e in thermal] == [
        ("hot", True, 83),
        ("cooled", False, 74),
    ]
    assert thermal[0].payload()["resource"] == "gpu0"
    assert not any(isinstance(e, EdgeRaised) for e in events)  # no yield configured


def test_status_shows_the_guard_and_why_the_gpu_does_not_lend() -> None:
    state, _ = make_state(ThermalPolicy(max_c=80, resume_c=75, hot_yield_after_s=120))
    state.clock = lambda: 12.0
    sample(state, 81.5, 2)
    doc = read_status(state)
    res = doc.resources["gpu0"]
    assert res.temperature_c == 81.5
    assert res.thermal is not None and res.thermal.hot
    assert res.thermal.hot_for_s == 10.0 and res.thermal.above_for_s == 10.0
    assert res.thermal.hot_yield_after_s == 120
    assert res.why_not is not None and "81.5 °C" in res.why_not
    refusal = doc.upstreams["llm"].refusal
    assert refusal is not None and refusal.reason == "gpu_too_hot"
    back = type(doc).from_json(doc.to_json())
    assert back.resources["gpu0"].thermal == res.thermal


def test_a_guarded_gpu_without_temperature_is_unmeasured() -> None:
    state, _ = make_state(ThermalPolicy(max_c=80, resume_c=75))
    sample(state, None, 1)
    refusal = decide(state, 1)
    assert isinstance(refusal, Refuse) and refusal.reason is Reason.RESOURCE_UNMEASURED
    assert "temperature" in refusal.detail


def test_without_a_guard_temperature_is_only_shown() -> None:
    state, _ = make_state(None)
    sample(state, 99, 1)
    assert isinstance(decide(state, 1), Admit)
    assert read_status(state).resources["gpu0"].thermal is None


def test_staying_hot_raises_one_thermal_edge_that_yields_like_pressure() -> None:
    state, events = make_state(ThermalPolicy(max_c=80, resume_c=75, hot_yield_after_s=30))
    sample(state, 85, 100)
    sample(state, 86, 120)
    assert not [e for e in events if isinstance(e, EdgeRaised)]
    sample(state, 86, 130)
    sample(state, 87, 140)
    edges = [e for e in events if isinstance(e, EdgeRaised)]
    assert len(edges) == 1
    edge = edges[0]
    assert (edge.trigger, edge.resource, edge.at) == (Trigger.THERMAL, "gpu0", 130)
    assert "above 80 °C for 30 s" in edge.detail
    answered = Edge(edge.trigger, edge.at, edge.resource, edge.detail)
    assert answered.reason is Reason.GPU_TOO_HOT
    assert reclaim.affected_upstreams(answered, state.upstreams, veto_active=True) == ["llm"]
    # A drain waiting on it stands down only once the card has cooled below resume.
    r, _ = reclaim.open_reclaim(None, answered, "llm", ReclaimPolicy())
    state.record_presence(PresenceReading(False, True), 140)  # fresh: the owner is away
    assert not reclaim.trigger_cleared(r, state.snapshot(140), UP)
    assert not reclaim.lending_resumed(state.snapshot(140), UP)
    sample(state, 77, 150)
    state.record_presence(PresenceReading(False, True), 150)
    assert not reclaim.trigger_cleared(r, state.snapshot(150), UP)
    assert not reclaim.lending_resumed(state.snapshot(150), UP)
    sample(state, 70, 160)
    state.record_presence(PresenceReading(False, True), 160)
    assert reclaim.trigger_cleared(r, state.snapshot(160), UP)
    assert reclaim.lending_resumed(state.snapshot(160), UP)


def gpu_toml(**keys: object) -> str:
    return daemon_toml(
        upstream("llm", "http://127.0.0.1:2", resource="gpu0"),
        resources=(gpu("gpu0", 0, **keys),),
    )


def test_config_keys_and_their_defaults() -> None:
    settings = parse_config(gpu_toml(max_temperature_c=83, hot_yield_after_s=120))
    res = settings.resource[0]
    assert thermal_policy(res) == ThermalPolicy(83, 78, 120)
    settings = parse_config(gpu_toml(max_temperature_c=83, temperature_resume_c=70))
    assert thermal_policy(settings.resource[0]) == ThermalPolicy(83, 70, None)
    assert thermal_policy(parse_config(gpu_toml()).resource[0]) is None


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ({"max_temperature_c": 80, "temperature_resume_c": 80}, "must be above 0 and below"),
        ({"temperature_resume_c": 70}, "needs max_temperature_c"),
        ({"hot_yield_after_s": 10}, "needs max_temperature_c"),
        ({"max_temperature_c": 0}, "max_temperature_c"),
        ({"max_temperature_c": 80, "hot_yield_after_s": -1}, "hot_yield_after_s"),
    ],
)
def test_bad_thermal_keys_are_refused(keys: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_config(gpu_toml(**keys))


def test_thermal_keys_apply_to_gpus_only() -> None:
    text = textwrap.dedent(
        """
        [[resource]]
        name = "ram"
        kind = "memory"
        max_temperature_c = 80
        """
    )
    with pytest.raises(ConfigError, match="applies only to kind = 'gpu'"):
        parse_config(text)


def test_power_limit_rules() -> None:
    limits = PowerLimits(current_mw=250_000, default_mw=300_000, min_mw=100_000, max_mw=350_000)
    assert to_mw(150) == 150_000 and to_mw(87.5) == 87_500
    assert check_lend_limit(100_000, limits) is None
    assert check_lend_limit(350_000, limits) is None
    why = check_lend_limit(50_000, limits)
    assert why is not None and "outside this card's range 100-350 W" in why
    assert wants_lend_limit(jobs=1, owner_back=False, stopping=False)
    assert not wants_lend_limit(jobs=0, owner_back=False, stopping=False)
    assert not wants_lend_limit(jobs=2, owner_back=True, stopping=False)
    assert not wants_lend_limit(jobs=2, owner_back=False, stopping=True)


def test_lend_power_limit_is_a_gpu_key() -> None:
    assert parse_config(gpu_toml(lend_power_limit_w=180)).resource[0].lend_power_limit_w == 180
    with pytest.raises(ConfigError, match="lend_power_limit_w"):
        parse_config(gpu_toml(lend_power_limit_w=0))
    text = '[[resource]]\nname = "ram"\nkind = "memory"\nlend_power_limit_w = 100\n'
    with pytest.raises(ConfigError, match="applies only to kind = 'gpu'"):
        parse_config(text)
