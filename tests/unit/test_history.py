"""History samples (vacancyd.core.history): their rows round-trip, a bad row is skipped,
edges coalesce, and retention is bounded."""

from __future__ import annotations

import json

import pytest

from vacancyd.core.history import (
    MAX_SAMPLES,
    MIN_GAP_S,
    RETENTION_S,
    SAMPLE_INTERVAL_S,
    HistorySample,
    ResourceSample,
    from_row,
    next_due,
    retention_cutoff,
    to_row,
)


def test_a_sample_round_trips_through_its_row() -> None:
    sample = HistorySample(
        1_780_000_000.5,
        True,
        False,
        {"gpu0": ResourceSample(2048.0, 24576.0, 61.0), "gpu1": ResourceSample()},
        {"alice": 2, "": 1},
    )
    row = to_row(sample)
    assert row[:3] == (1_780_000_000.5, 1, 0)
    assert from_row(row) == sample
    assert sample.jobs == 3


def test_a_borrower_without_jobs_is_not_written() -> None:
    row = to_row(HistorySample(1.0, False, True, {}, {"alice": 0}))
    assert json.loads(row[3])["borrowers"] == {}


@pytest.mark.parametrize(
    "row",
    [
        (1.0, 0, 1),  # a column short
        ("yesterday", 0, 1, "{}"),
        (float("nan"), 0, 1, "{}"),
        (1.0, None, 1, "{}"),
        (1.0, 0, 1, "not json"),
        (1.0, 0, 1, "[1, 2]"),
        (1.0, 0, 1, None),
        (1.0, 0, 1, "[" * 100_000),
    ],
)
def test_an_unreadable_row_is_skipped_not_fatal(row: tuple[object, ...]) -> None:
    assert from_row(row) is None


def test_odd_values_inside_a_row_are_dropped_one_by_one() -> None:
    detail = json.dumps(
        {
            "resources": {
                "gpu0": {"used_mib": "lots", "total_mib": 100, "temperature_c": True},
                "gpu1": [1],
            },
            "borrowers": {"alice": 1, "bob": -1, "carol": 1.5, "dave": True},
            "from_a_newer_version": 1,
        }
    )
    sample = from_row((5.0, 1, 1, detail))
    assert sample == HistorySample(
        5.0, True, True, {"gpu0": ResourceSample(None, 100.0)}, {"alice": 1}
    )


def test_samples_are_due_every_minute_and_edges_coalesce() -> None:
    assert next_due(None, 100.0, edge=False) == 100.0
    assert next_due(100.0, 130.0, edge=False) == 100.0 + SAMPLE_INTERVAL_S
    assert next_due(100.0, 130.0, edge=True) == 130.0
    # an edge right after a sample waits for the gap: a flapping switch writes one row
    assert next_due(100.0, 100.2, edge=True) == 100.0 + MIN_GAP_S


def test_retention_is_two_days_and_bounded_in_rows() -> None:
    assert retention_cutoff(1_000_000.0) == 1_000_000.0 - 48 * 3600
    assert RETENTION_S == 48 * 3600
    assert MAX_SAMPLES == 4 * 48 * 60
