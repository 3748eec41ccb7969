"""The lender's durable history (issue 23, item 7): one sample a minute and one at each
presence or lending edge, drawn as the status page's 24-hour timeline
(:mod:`vacancyd.core.timeline`).

Pure: the sample record, its row form for the usage database (``history`` table, written by
:mod:`vacancyd.runtime.history`), and the retention rule. Times are wall-clock seconds
since the epoch (``time.time()``), because history outlives restarts and is drawn in local
time; nothing here reads a clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

#: One sample a minute while nothing changes (seconds).
SAMPLE_INTERVAL_S = 60.0
#: History older than this is deleted (seconds): 48 hours, twice what the page draws.
RETENTION_S = 48 * 3600.0
#: At most this many samples are kept whatever their times: four per minute over the
#: retention, so edges cannot grow the table without bound (a flapping switch).
MAX_SAMPLES = int(4 * RETENTION_S / SAMPLE_INTERVAL_S)
#: Edges closer together than this (seconds) share one sample: the later state is written
#: when the gap has passed, so a switch flipped a thousand times a second writes one row.
MIN_GAP_S = 1.0
#: A sample stands for the lender's state for at most this long (seconds); a longer gap
#: between samples (the daemon was stopped) is drawn as no data, never as the last state.
VALID_FOR_S = 3 * SAMPLE_INTERVAL_S

#: The name of the borrower who presents the single shared borrow token (or a trusted
#: loopback peer): the unnamed borrower.
UNNAMED = ""


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """One GPU resource at a sample: ``used_mib`` and ``total_mib`` in MiB, ``temperature_c``
    in °C; each None where it was not measured (no reading yet, a failed probe, a card with
    no temperature sensor)."""

    used_mib: float | None = None
    total_mib: float | None = None
    temperature_c: float | None = None


@dataclass(frozen=True, slots=True)
class HistorySample:
    """The lender at one wall-clock instant.

    ``at_wall``: seconds since the epoch. ``owner_present``: the owner veto is engaged (the
    owner is here and lending stops). ``lending``: the owner lets the machine lend (the
    lending switch is on and no pause, schedule or battery hold is in force); whether a
    request would be admitted depends on more than this. ``resources``: per GPU resource.
    ``borrowers``: borrowed jobs running, counted by borrower name (:data:`UNNAMED` for the
    shared borrow token); borrowers with none are absent.
    """

    at_wall: float
    owner_present: bool
    lending: bool
    resources: Mapping[str, ResourceSample] = field(default_factory=dict)
    borrowers: Mapping[str, int] = field(default_factory=dict)

    @property
    def jobs(self) -> int:
        """Borrowed jobs running, all borrowers together."""
        return sum(self.borrowers.values())


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def to_row(sample: HistorySample) -> tuple[float, int, int, str]:
    """The ``history`` table's columns: (at_wall, owner_present 0/1, lending 0/1, detail),
    where detail is JSON ``{"resources": {NAME: {"used_mib", "total_mib", "temperature_c"}},
    "borrowers": {NAME: count}}``."""
    detail = {
        "resources": {
            name: {
                "used_mib": r.used_mib,
                "total_mib": r.total_mib,
                "temperature_c": r.temperature_c,
            }
            for name, r in sorted(sample.resources.items())
        },
        "borrowers": {name: n for name, n in sorted(sample.borrowers.items()) if n > 0},
    }
    return (
        sample.at_wall,
        int(sample.owner_present),
        int(sample.lending),
        json.dumps(detail, separators=(",", ":"), allow_nan=False),
    )


def from_row(row: tuple[object, ...]) -> HistorySample | None:
    """A sample read back from its row (:func:`to_row`), or None for a row this cannot
    read (a wrong type, unreadable JSON): one bad row is skipped, never fatal. Unknown keys
    in the detail are ignored, so a newer vacancyd's rows still read."""
    if len(row) != 4:
        return None
    at, present, lending, detail = row
    at_wall = _num(at)
    if at_wall is None or not isinstance(present, int) or not isinstance(lending, int):
        return None
    if not isinstance(detail, str):
        return None
    try:
        doc = json.loads(detail)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    resources: dict[str, ResourceSample] = {}
    raw_resources = doc.get("resources")
    if isinstance(raw_resources, dict):
        for name, r in raw_resources.items():
            if isinstance(r, dict):
                resources[name] = ResourceSample(
                    _num(r.get("used_mib")), _num(r.get("total_mib")), _num(r.get("temperature_c"))
                )
    borrowers: dict[str, int] = {}
    raw_borrowers = doc.get("borrowers")
    if isinstance(raw_borrowers, dict):
        for name, n in raw_borrowers.items():
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                borrowers[name] = n
    return HistorySample(at_wall, bool(present), bool(lending), resources, borrowers)


def retention_cutoff(now_wall: float, retention_s: float = RETENTION_S) -> float:
    """Samples taken before this wall time (seconds since the epoch) are deleted."""
    return now_wall - retention_s


def next_due(
    last_at: float | None, now: float, *, edge: bool, interval_s: float = SAMPLE_INTERVAL_S
) -> float:
    """When the next sample is due, in the clock of ``last_at`` and ``now`` (seconds).

    Without a sample yet: now. After an edge: now, or :data:`MIN_GAP_S` after the last
    sample when that is later (edges coalesce). Otherwise ``interval_s`` after the last.
    """
    if last_at is None:
        return now
    if edge:
        return max(now, last_at + MIN_GAP_S)
    return last_at + interval_s
