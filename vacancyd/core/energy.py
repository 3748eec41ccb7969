"""Splitting a GPU's energy between the borrowed jobs that ran on it (issue 23: energy per
job, shared between concurrent jobs by time).

Pure: no clock, no I/O. The input is what the collector reads with each capacity sample:
the GPU's cumulative energy counter (joules since the driver loaded, NVML
``nvmlDeviceGetTotalEnergyConsumption`` / 1000) at monotonic times (seconds), and the jobs'
intervals on that GPU in the same monotonic seconds.

Between two consecutive readings the card's power is taken as constant (the counter's
increase over the interval's length), and at every instant that energy is shared evenly by
the jobs running then; an instant with no job running belongs to nobody (the owner, or the
idle card). An interval over which the counter went down (the driver reloaded and the
counter restarted) is skipped: what was used then is unknown, never guessed.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class EnergyShare:
    """One job's part: ``joules``, and ``covered_s``, the seconds of its interval that lay
    between two usable readings (less than its length: the rest of its energy is unknown)."""

    joules: float
    covered_s: float


@dataclass(frozen=True, slots=True)
class EnergySplit(Generic[K]):
    """``shares`` per job key; ``unattributed_j``: energy used while no job ran;
    ``unknown_s``: seconds between readings that were skipped (the counter went down)."""

    shares: Mapping[K, EnergyShare]
    unattributed_j: float
    unknown_s: float


def split_energy(
    readings: Sequence[tuple[float, float]], jobs: Mapping[K, tuple[float, float]]
) -> EnergySplit[K]:
    """Share the energy of ``readings`` between ``jobs``.

    ``readings``: (monotonic s, cumulative joules), in any order (sorted here; readings at
    the same time after the first are ignored). ``jobs``: key -> (start, end) in monotonic
    seconds; an end before its start is an empty interval. Every job gets a share, 0 J when
    it overlaps no interval between readings. Never raises for finite inputs.
    """
    points: list[tuple[float, float]] = []
    for t, e in sorted(readings):
        if not points or t > points[-1][0]:
            points.append((t, e))
    joules = dict.fromkeys(jobs, 0.0)
    covered = dict.fromkeys(jobs, 0.0)
    unattributed = 0.0
    unknown = 0.0
    spans = {k: (start, max(start, end)) for k, (start, end) in jobs.items()}
    for (t0, e0), (t1, e1) in itertools.pairwise(points):
        length = t1 - t0
        if e1 < e0:
            unknown += length
            continue
        power = (e1 - e0) / length
        inside = {
            k: (max(start, t0), min(end, t1))
            for k, (start, end) in spans.items()
            if start < t1 and end > t0
        }
        cuts = sorted({t0, t1, *(a for a, _ in inside.values()), *(b for _, b in inside.values())})
        for a, b in itertools.pairwise(cuts):
            running = [k for k, (s, e) in inside.items() if s <= a and e >= b]
            energy = power * (b - a)
            if not running:
                unattributed += energy
                continue
            for k in running:
                joules[k] += energy / len(running)
                covered[k] += b - a
    return EnergySplit({k: EnergyShare(joules[k], covered[k]) for k in jobs}, unattributed, unknown)
