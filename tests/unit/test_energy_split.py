"""vacancyd.core.energy: a GPU's energy counter split between the jobs on it by time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.core.energy import split_energy


def test_one_job_gets_what_the_counter_rose_while_it_ran() -> None:
    readings = [(0.0, 1000.0), (10.0, 3000.0), (20.0, 3500.0)]
    split = split_energy(readings, {"a": (0.0, 10.0)})
    assert split.shares["a"].joules == pytest.approx(2000.0)
    assert split.shares["a"].covered_s == pytest.approx(10.0)
    assert split.unattributed_j == pytest.approx(500.0)


def test_partial_intervals_are_shared_by_time_at_constant_power() -> None:
    # 100 W from 0 to 10 s: a job from 2.5 s to 7.5 s used 500 J.
    split = split_energy([(0.0, 0.0), (10.0, 1000.0)], {"a": (2.5, 7.5)})
    assert split.shares["a"].joules == pytest.approx(500.0)
    assert split.unattributed_j == pytest.approx(500.0)


def test_concurrent_jobs_share_the_overlap_evenly() -> None:
    # 100 W over 0..30 s; a runs 0..20, b runs 10..30: each alone for 10 s, both for 10 s.
    split = split_energy([(0.0, 0.0), (30.0, 3000.0)], {"a": (0.0, 20.0), "b": (10.0, 30.0)})
    assert split.shares["a"].joules == pytest.approx(1500.0)
    assert split.shares["b"].joules == pytest.approx(1500.0)
    assert split.unattributed_j == pytest.approx(0.0)


def test_a_counter_that_restarts_is_skipped_not_guessed() -> None:
    readings = [(0.0, 5000.0), (10.0, 6000.0), (20.0, 100.0), (30.0, 1100.0)]
    split = split_energy(readings, {"a": (0.0, 30.0)})
    assert split.shares["a"].joules == pytest.approx(2000.0)
    assert split.shares["a"].covered_s == pytest.approx(20.0)
    assert split.unknown_s == pytest.approx(10.0)


def test_jobs_outside_the_readings_and_empty_inputs() -> None:
    split = split_energy([(10.0, 0.0), (20.0, 100.0)], {"before": (0.0, 5.0), "back": (9, 3)})
    assert split.shares["before"].joules == 0.0 and split.shares["before"].covered_s == 0.0
    assert split.shares["back"].joules == 0.0
    assert split_energy([], {"a": (0.0, 1.0)}).shares["a"].joules == 0.0
    assert split_energy([(0.0, 1.0)], {}).shares == {}
    # unsorted readings and duplicate times
    split = split_energy([(10.0, 100.0), (0.0, 0.0), (10.0, 999.0)], {"a": (0.0, 10.0)})
    assert split.shares["a"].joules == pytest.approx(100.0)


times = st.integers(0, 1000).map(float)
increasing_counter = st.lists(
    st.tuples(st.integers(1, 50), st.integers(0, 10_000)), min_size=1, max_size=12
).map(
    lambda steps: [
        (float(sum(dt for dt, _ in steps[:i])), float(sum(de for _, de in steps[:i])))
        for i in range(len(steps) + 1)
    ]
)
job_spans = st.dictionaries(
    st.integers(0, 20),
    st.tuples(times, times).map(lambda ab: (min(ab), max(ab))),
    max_size=6,
)


@given(increasing_counter, job_spans)
def test_energy_is_conserved(
    readings: list[tuple[float, float]], jobs: dict[int, tuple[float, float]]
) -> None:
    split = split_energy(readings, jobs)
    total = readings[-1][1] - readings[0][1]
    attributed = sum(s.joules for s in split.shares.values())
    assert attributed + split.unattributed_j == pytest.approx(total, rel=1e-9, abs=1e-6)
    assert split.unknown_s == 0.0
    for key, (start, end) in jobs.items():
        share = split.shares[key]
        assert share.joules >= 0.0
        assert share.covered_s <= end - start + 1e-9
        # a job never gets more than all the energy used while it ran
        alone = split_energy(readings, {key: (start, end)}).shares[key]
        assert share.joules <= alone.joules + 1e-6
        assert share.covered_s == pytest.approx(alone.covered_s)


@given(increasing_counter, times, times)
def test_identical_jobs_get_identical_shares(
    readings: list[tuple[float, float]], a: float, b: float
) -> None:
    span = (min(a, b), max(a, b))
    split = split_energy(readings, {1: span, 2: span, 3: span})
    alone = split_energy(readings, {1: span}).shares[1].joules
    for key in (1, 2, 3):
        assert split.shares[key].joules == pytest.approx(alone / 3, rel=1e-9, abs=1e-9)
