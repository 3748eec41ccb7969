"""vacancyd.core.thermal: a GPU's temperature hysteresis and its hot-yield timer."""

from __future__ import annotations

import pytest

from vacancyd.core.thermal import ThermalChange, ThermalPolicy, ThermalTracker

HOT, COOLED, YIELD = ThermalChange.HOT, ThermalChange.COOLED, ThermalChange.YIELD


def test_hot_above_max_until_below_resume() -> None:
    t = ThermalTracker(ThermalPolicy(max_c=80, resume_c=75))
    assert t.observe(80, 0) == ()  # at the maximum is not above it
    assert not t.hot
    assert t.observe(81, 1) == (HOT,)
    assert t.hot and t.hot_since == 1
    assert t.observe(85, 2) == ()
    assert t.observe(78, 3) == ()  # between resume and max: still hot
    assert t.observe(75, 4) == ()  # at resume is not below it
    assert t.hot
    assert t.observe(74, 5) == (COOLED,)
    assert not t.hot and t.hot_since is None
    assert t.observe(79, 6) == ()  # below max again: lending goes on
    assert t.view().temperature_c == 79


def test_unknown_readings_change_nothing() -> None:
    t = ThermalTracker(ThermalPolicy(max_c=80, resume_c=75, hot_yield_after_s=10))
    assert t.observe(90, 0) == (HOT,)
    assert t.observe(None, 5) == ()
    assert t.hot and t.view().temperature_c is None
    assert t.observe(90, 10) == (YIELD,)  # the run above max was not broken by the gap


def test_yield_after_staying_above_max_once_per_run() -> None:
    t = ThermalTracker(ThermalPolicy(max_c=80, resume_c=70, hot_yield_after_s=30))
    assert t.observe(85, 100) == (HOT,)
    assert t.observe(85, 129) == ()
    assert t.observe(85, 130) == (YIELD,)
    assert t.observe(86, 140) == ()  # once
    assert t.observe(79, 150) == ()  # at or below max re-arms it, still hot
    assert t.hot and t.above_since is None
    assert t.observe(81, 160) == ()
    assert t.above_since == 160
    assert t.observe(81, 189) == ()
    assert t.observe(81, 190) == (YIELD,)


def test_yield_at_once_and_never() -> None:
    now = ThermalTracker(ThermalPolicy(max_c=80, resume_c=70, hot_yield_after_s=0))
    assert now.observe(81, 0) == (HOT, YIELD)
    never = ThermalTracker(ThermalPolicy(max_c=80, resume_c=70))
    assert never.observe(99, 0) == (HOT,)
    assert never.observe(99, 1e9) == ()


def test_resume_must_be_below_max() -> None:
    with pytest.raises(ValueError, match="below the maximum"):
        ThermalPolicy(max_c=80, resume_c=80)
