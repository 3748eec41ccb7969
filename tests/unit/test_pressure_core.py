"""Pure GPU pressure math (core/pressure.py): attribution, threshold learning, hysteresis.

See docs/calibration.md and docs/reclaim.md.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vacancyd.core.gpu import GpuSelector, normalize_pci_bus_id
from vacancyd.core.pressure import (
    BINS,
    EdgeCause,
    LearnerSettings,
    PressureTracker,
    ProcessSample,
    ThresholdLearner,
    attribute_load,
    max_gap_s,
)

# -- attribution ----------------------------------------------------------------------------


def test_borrower_tree_is_subtracted_and_the_rest_is_the_owners() -> None:
    trees = {"llm": frozenset({(100, 5.0), (101, 6.0)})}
    result = attribute_load(
        [ProcessSample(100, 0.5), ProcessSample(101, 0.1), ProcessSample(200, 0.3)],
        trees,
        {100: 5.0, 101: 6.0},
    )
    assert result.error is None
    assert math.isclose(result.owner_load, 0.3)
    assert math.isclose(result.borrower_load, 0.6)
    assert result.seen == {"llm": True}


def test_a_reused_pid_is_the_owners() -> None:
    # pid 100 served the upstream when the tree was read; now another process has it.
    result = attribute_load([ProcessSample(100, 0.4)], {"llm": frozenset({(100, 5.0)})}, {100: 9.0})
    assert result.error is None
    assert math.isclose(result.owner_load, 0.4)
    assert result.seen == {"llm": False}


def test_a_tree_process_that_exited_makes_the_poll_an_error() -> None:
    result = attribute_load(
        [ProcessSample(100, 0.4)], {"llm": frozenset({(100, 5.0)})}, {100: None}
    )
    assert result.error is not None and "exited" in result.error


def test_listed_process_without_load_counts_as_seen() -> None:
    result = attribute_load(
        [ProcessSample(100, 0.0, listed=True)], {"llm": frozenset({(100, 5.0)})}, {100: 5.0}
    )
    assert result.seen == {"llm": True}
    assert result.owner_load == 0.0


def test_out_of_range_sample_is_an_error_not_a_number() -> None:
    assert attribute_load([ProcessSample(1, 1.5)], {}, {}).error is not None
    assert attribute_load([ProcessSample(1, float("nan"))], {}, {}).error is not None


@given(
    st.lists(st.tuples(st.integers(1, 50), st.floats(0, 1)), max_size=40),
    st.sets(st.integers(1, 50), max_size=10),
)
def test_attribution_loads_are_ratios(samples: list[tuple[int, float]], tree: set[int]) -> None:
    ids = frozenset((pid, 1.0) for pid in tree)
    result = attribute_load(
        [ProcessSample(p, s) for p, s in samples], {"u": ids}, dict.fromkeys(tree, 1.0)
    )
    assert result.error is None
    assert 0.0 <= result.owner_load <= 1.0
    assert 0.0 <= result.borrower_load <= 1.0


# -- GPU selection ------------------------------------------------------------------------------


def test_gpu_selectors() -> None:
    assert GpuSelector.parse(None) == GpuSelector("index", "0")
    assert GpuSelector.parse(2) == GpuSelector("index", "2")
    assert GpuSelector.parse("GPU-abc").kind == "uuid"
    assert GpuSelector.parse("01:00.0") == GpuSelector("pci", "00000000:01:00.0")
    assert GpuSelector.parse("0000:0A:00.0").matches(3, "x", "00000000:0a:00.0")
    assert normalize_pci_bus_id("zz:00.0") is None
    for bad in ("nonsense", "GPU-", "1:2:3:4"):
        try:
            GpuSelector.parse(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")


# -- threshold learning ---------------------------------------------------------------------


def feed(
    learner: ThresholdLearner, load: float, start: float, seconds: float, step: float = 2.0
) -> float:
    t = start
    while t < start + seconds:
        learner.observe(load, t)
        t += step
    return t


def test_uncalibrated_until_enough_observed_time() -> None:
    learner = ThresholdLearner(LearnerSettings(calibration_s=60))
    t = feed(learner, 0.02, 0, 50)
    assert not learner.ready and learner.current() is None
    feed(learner, 0.02, t, 20)
    assert learner.ready
    assert learner.current() is not None and 0.05 <= learner.current() <= 0.10


def test_calibration_learns_the_baseline_without_the_rise_limit() -> None:
    learner = ThresholdLearner(LearnerSettings(calibration_s=600, rise_per_hour=0.01))
    learner.observe(0.0, 0.0)
    feed(learner, 0.12, 2.0, 700)  # a desktop that idles at 12% busy
    assert learner.ready
    current = learner.current()
    assert current is not None and 0.17 <= current <= 0.19  # 12% + margin, not 0 + 0.01/h


def test_fixed_threshold_is_ready_at_once() -> None:
    learner = ThresholdLearner(LearnerSettings(fixed=0.2))
    assert learner.ready and learner.current() == 0.2


def test_unobserved_gaps_do_not_calibrate() -> None:
    learner = ThresholdLearner(LearnerSettings(calibration_s=60, max_step_s=20))
    for t in range(0, 1000, 100):  # samples 100 s apart: each gap is past the limit
        learner.observe(0.0, float(t))
    assert learner.observed_s == 0 and not learner.ready


def test_threshold_rises_slowly_and_falls_at_once() -> None:
    s = LearnerSettings(calibration_s=0, rise_per_hour=0.05, cap=0.5, half_life_s=600)
    learner = ThresholdLearner(s)
    t = feed(learner, 0.0, 0, 600)
    low = learner.current()
    assert low is not None
    t = feed(learner, 0.40, t, 3600)  # an hour of heavy owner load
    high = learner.current()
    assert high is not None and high <= low + 0.05 + 1e-9
    assert high is not None and high > low
    t = feed(learner, 0.0, t, 7200)  # the histogram forgets the load: the target falls
    later = learner.current()
    assert later is not None and later < high


def test_cap_is_never_exceeded_and_a_lower_cap_applies_to_a_cache() -> None:
    learner = ThresholdLearner(LearnerSettings(calibration_s=0, cap=0.3, rise_per_hour=1.0))
    feed(learner, 1.0, 0, 20000)
    assert learner.current() == 0.3
    data = learner.to_cache("GPU-x")
    lower = ThresholdLearner(LearnerSettings(calibration_s=0, cap=0.1))
    assert lower.load_cache(data, "GPU-x") is None
    assert lower.current() == 0.1


def test_cache_for_another_gpu_or_malformed_is_ignored() -> None:
    learner = ThresholdLearner(LearnerSettings())
    feed(learner, 0.1, 0, 100)
    data = learner.to_cache("GPU-a")
    fresh = ThresholdLearner(LearnerSettings())
    assert "GPU-a" in (fresh.load_cache(data, "GPU-b") or "")
    assert fresh.load_cache({**data, "weights": [1.0] * (BINS - 1)}, "GPU-a") is not None
    assert fresh.load_cache({**data, "observed_s": -1}, "GPU-a") is not None
    assert fresh.load_cache({**data, "version": 99}, "GPU-a") is not None
    assert fresh.observed_s == 0
    assert fresh.load_cache(data, "GPU-a") is None
    assert fresh.observed_s == learner.observed_s


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1), st.floats(0.01, 30)), min_size=1, max_size=200),
    st.floats(0.05, 1),
    st.floats(0, 0.5),
)
def test_learner_properties(steps: list[tuple[float, float]], cap: float, rise: float) -> None:
    learner = ThresholdLearner(
        LearnerSettings(cap=cap, rise_per_hour=rise, calibration_s=0, max_step_s=20)
    )
    t = 0.0
    previous: float | None = None
    for load, dt in steps:
        t += dt
        before_obs = learner.observed_s
        learner.observe(load, t)
        current = learner.current()
        assert current is not None and 0 <= current <= cap + 1e-12
        observed = learner.observed_s - before_obs
        assert observed <= 20 + 1e-9
        if previous is not None and current > previous:
            # rises at most rise_per_hour per observed hour
            assert current - previous <= rise * observed / 3600 + 1e-9
        previous = current


# -- hysteresis --------------------------------------------------------------------------------


def test_max_gap_is_three_polls_at_least_20_s() -> None:
    assert max_gap_s(1.0) == 20.0
    assert max_gap_s(10.0) == 30.0


def test_engage_and_release_timers_are_independent() -> None:
    tr = PressureTracker(engage_after_s=4, release_after_s=10, max_gap_s=20)
    assert tr.observe(0.5, 0.2, 0) is None
    assert tr.observe(0.5, 0.2, 2) is None and not tr.engaged
    edge = tr.observe(0.5, 0.2, 4)
    assert edge is not None and edge.cause is EdgeCause.ENGAGED and tr.engaged
    assert tr.observe(0.1, 0.2, 6) is None and tr.engaged
    assert tr.release_in_s(6) == 10
    tr.observe(0.5, 0.2, 8)  # load again: the release timer restarts
    tr.observe(0.1, 0.2, 10)
    tr.observe(0.1, 0.2, 18)
    assert tr.engaged
    tr.observe(0.1, 0.2, 20)
    assert not tr.engaged


def test_uncalibrated_never_engages() -> None:
    tr = PressureTracker(0, 0, 20)
    assert tr.observe(1.0, None, 0) is None
    assert not tr.engaged


def test_unknown_raises_the_edge_only_after_the_gap() -> None:
    tr = PressureTracker(4, 10, max_gap_s=20)
    tr.observe(0.0, 0.2, 0)
    assert tr.unknown(2) is None
    assert tr.unknown(19) is None
    edge = tr.unknown(20)
    assert edge is not None and edge.cause is EdgeCause.UNKNOWN
    assert edge.unknown_for_s == 18
    assert tr.unknown(22) is None  # once per episode
    assert tr.observe(0.0, 0.2, 24) is None  # the episode already reclaimed


def test_short_unknown_episode_ends_without_a_reclaim() -> None:
    tr = PressureTracker(4, 10, max_gap_s=20)
    tr.observe(0.0, 0.2, 0)
    tr.unknown(2)
    assert tr.observe(0.0, 0.2, 4) is None


def test_late_sample_reclaims_and_does_not_count_unobserved_quiet() -> None:
    tr = PressureTracker(0, 10, max_gap_s=20)
    tr.observe(0.9, 0.2, 0)
    assert tr.engaged
    tr.observe(0.1, 0.2, 2)  # quiet starts
    edge = tr.observe(0.1, 0.2, 40)  # 38 s later: late
    assert edge is not None and edge.cause is EdgeCause.LATE
    assert tr.engaged  # the 38 unobserved seconds did not count towards release
    tr.observe(0.1, 0.2, 45)
    assert tr.engaged
    tr.observe(0.1, 0.2, 50)
    assert not tr.engaged


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.floats(0, 1)), st.floats(0.1, 40)),
        min_size=1,
        max_size=120,
    ),
    st.floats(0, 10),
    st.floats(0, 60),
)
def test_tracker_properties(
    steps: list[tuple[float | None, float]], engage_after: float, release_after: float
) -> None:
    """Release needs release_after_s of observed quiet with no gap; engage needs engage_after_s
    of load; an unknown edge never rises before the gap limit."""
    gap = 20.0
    tr = PressureTracker(engage_after, release_after, gap)
    threshold = 0.5
    t = 0.0
    last_valid: float | None = None
    quiet_since: float | None = None
    load_since: float | None = None
    for load, dt in steps:
        t += dt
        was = tr.engaged
        if load is None:
            edge = tr.unknown(t)
            if edge is not None:
                since = last_valid if last_valid is not None else tr.started_at
                assert since is not None and t - since >= gap - 1e-9
            continue
        late = last_valid is not None and t - last_valid > gap
        if load > threshold:
            quiet_since = None
            load_since = t if load_since is None else load_since
        else:
            load_since = None
            quiet_since = t if quiet_since is None or late else quiet_since
        tr.observe(load, threshold, t)
        last_valid = t
        if was and not tr.engaged:
            assert quiet_since is not None and t - quiet_since >= release_after - 1e-9
        if not was and tr.engaged:
            assert load_since is not None and t - load_since >= engage_after - 1e-9
