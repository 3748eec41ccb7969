"""Owner GPU pressure: attribution, threshold learning and hysteresis.

Pure code: no clocks, no I/O. Times are monotonic seconds passed in by the caller; loads are
0–1 ratios of one GPU's streaming-multiprocessor time (NVML process utilization samples are
percentages; the collector divides by 100).

Three pieces, each usable on its own:

* :func:`attribute_load` splits one poll's per-process samples into the owner's load and the
  borrowers' (docs/architecture.md: the processes serving local upstream targets and their
  descendants are subtracted by (pid, start time) identity).
* :class:`ThresholdLearner` learns the load level above which the owner counts as pressing the
  card from a decaying histogram of that load (docs/calibration.md).
* :class:`PressureTracker` applies hysteresis with independent engage and release timers and
  the gap rules of docs/reclaim.md, and says when a reclaim edge rises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vacancyd.core.observations import Observation

#: Histogram resolution: 100 bins of 0.01 load each.
BINS = 100
CACHE_VERSION = 1


def max_gap_s(poll_s: float) -> float:
    """The tracker's gap limit: three polls, at least 20 s (docs/reclaim.md)."""
    return max(3.0 * poll_s, 20.0)


# -- attribution -------------------------------------------------------------


Identity = tuple[int, float]  # (pid, process start time in seconds since the epoch)


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One process's GPU use in one poll. ``sm_ratio`` is 0–1 (NVML ``smUtil`` / 100)."""

    pid: int
    sm_ratio: float
    listed: bool = False  # in NVML's running compute or graphics process list


@dataclass(frozen=True, slots=True)
class Attribution:
    """What one poll attributes to whom.

    ``owner_load``: the owner's share, 0–1 (capped at 1). ``borrower_load``: the subtracted
    share. ``seen``: upstream name → whether a process of its tree was on the GPU (listed, or
    a sample above zero). ``error``: set when the poll cannot be attributed honestly; the
    reading is then unknown and the loads are meaningless.
    """

    owner_load: float
    borrower_load: float
    seen: Mapping[str, bool]
    error: str | None = None


def attribute_load(
    samples: Iterable[ProcessSample],
    trees: Mapping[str, frozenset[Identity]],
    start_times: Mapping[int, float | None],
) -> Attribution:
    """Split one poll's process samples between the owner and the upstreams' process trees.

    ``trees``: upstream → the (pid, start time) identities serving it on this machine.
    ``start_times``: pid → its start time read *after* the samples (None when the process
    had exited by then). A sampled pid that belongs to a tree by number but now has another
    start time was reused by a new process: it is the owner's. A tree pid that exited between
    listing and reading cannot be attributed, so the poll is an error, not a guess.
    """
    by_pid: dict[int, frozenset[str]] = {}
    for upstream, ids in trees.items():
        for pid, started in ids:
            current = start_times.get(pid, started)
            if current is None:
                return Attribution(
                    0.0, 0.0, {}, f"process {pid} of upstream {upstream!r} exited while read"
                )
            if math.isclose(current, started, abs_tol=0.01):
                by_pid[pid] = by_pid.get(pid, frozenset()) | {upstream}
    owner = 0.0
    borrower = 0.0
    seen = dict.fromkeys(trees, False)
    merged: dict[int, ProcessSample] = {}
    for s in samples:
        if not 0.0 <= s.sm_ratio <= 1.0 or math.isnan(s.sm_ratio):
            return Attribution(0.0, 0.0, {}, f"process {s.pid} reported utilization {s.sm_ratio}")
        prev = merged.get(s.pid)
        merged[s.pid] = (
            s
            if prev is None
            else ProcessSample(s.pid, max(prev.sm_ratio, s.sm_ratio), prev.listed or s.listed)
        )
    for s in merged.values():
        owners = by_pid.get(s.pid)
        if owners:
            borrower += s.sm_ratio
            if s.listed or s.sm_ratio > 0:
                for up in owners:
                    seen[up] = True
        else:
            owner += s.sm_ratio
    return Attribution(min(owner, 1.0), min(borrower, 1.0), seen)


# -- the learned threshold ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LearnerSettings:
    """How a GPU's threshold is learned (docs/calibration.md).

    ``cap``: the highest threshold (0–1 load) observations can teach. ``margin``: added above
    the load quantile. ``quantile``: the share of observed time the idle owner load stays
    under. ``half_life_s``: observed seconds after which a sample weighs half as much.
    ``rise_per_hour``: the most the threshold may rise per observed hour (0–1 load).
    ``calibration_s``: observed seconds before the learned threshold is trusted.
    ``fixed``: a configured threshold, which skips learning and readiness altogether.
    ``max_step_s``: the longest interval one sample may stand for (the tracker's gap limit).
    """

    cap: float = 0.30
    margin: float = 0.05
    quantile: float = 0.95
    half_life_s: float = 7 * 24 * 3600.0
    rise_per_hour: float = 0.05
    calibration_s: float = 1800.0
    fixed: float | None = None
    max_step_s: float = 20.0


@dataclass
class ThresholdLearner:
    """A decaying histogram of one GPU's owner load and the threshold it teaches.

    The threshold is ``min(cap, quantile(load) + margin)``. Once calibrated it falls to a
    lower target at once and rises towards a higher one at most ``rise_per_hour`` per
    *observed* hour, so a long burst of owner work cannot quickly teach vacancyd to ignore
    it, and nothing can teach it past the cap. While calibrating it simply follows the
    target (it is not in force yet). Until ``calibration_s`` seconds have been observed the
    learner is not ready and the GPU is not lendable (unless ``fixed`` is set).
    """

    settings: LearnerSettings
    weights: list[float] = field(default_factory=lambda: [0.0] * BINS)
    observed_s: float = 0.0
    threshold: float | None = None
    last_at: float | None = None

    @property
    def ready(self) -> bool:
        return self.settings.fixed is not None or self.observed_s >= self.settings.calibration_s

    def current(self) -> float | None:
        """The threshold in force (0–1 load), or None while uncalibrated and not fixed."""
        if self.settings.fixed is not None:
            return self.settings.fixed
        return self.threshold if self.ready else None

    def observe(self, load: float, now: float) -> None:
        """Add one valid sample of owner load (0–1) taken at monotonic ``now``.

        The sample stands for the time since the previous one, at most ``max_step_s``; a
        first sample, or one after a longer gap, stands for nothing but still shapes the
        histogram, so unobserved time never counts towards calibration.
        """
        if self.settings.fixed is not None:
            return
        load = min(1.0, max(0.0, load))
        calibrating = not self.ready
        step = 0.0
        if self.last_at is not None and now > self.last_at:
            elapsed = now - self.last_at
            step = elapsed if elapsed <= self.settings.max_step_s else 0.0
        self.last_at = now if self.last_at is None else max(self.last_at, now)
        if step > 0:
            decay = 0.5 ** (step / self.settings.half_life_s)
            self.weights = [w * decay for w in self.weights]
        index = min(BINS - 1, int(load * BINS))
        self.weights[index] += step if step > 0 else 1e-9
        self.observed_s += step
        target = self.target()
        if self.threshold is None or calibrating or target <= self.threshold:
            # Falls at once; while calibrating it is not in force, so it follows the target.
            self.threshold = target
        else:
            self.threshold = min(target, self.threshold + self.settings.rise_per_hour * step / 3600)

    def target(self) -> float:
        """Where the histogram says the threshold belongs: ``min(cap, q-quantile + margin)``."""
        total = sum(self.weights)
        s = self.settings
        if total <= 0:
            return min(s.cap, s.margin)
        want = s.quantile * total
        acc = 0.0
        upper = 1.0
        for i, w in enumerate(self.weights):
            acc += w
            if acc >= want:
                upper = (i + 1) / BINS
                break
        return min(s.cap, upper + s.margin)

    def to_cache(self, identity: str) -> dict[str, Any]:
        """The calibration as JSON-ready data, tagged with the GPU's identity (its UUID)."""
        return {
            "version": CACHE_VERSION,
            "gpu": identity,
            "weights": list(self.weights),
            "observed_s": self.observed_s,
            "threshold": self.threshold,
        }

    def load_cache(self, data: Mapping[str, Any], identity: str) -> str | None:
        """Restore a saved calibration; returns None on success, else why it was ignored.

        A cache for another GPU, another version or with values out of range is ignored
        whole: a half-trusted calibration would be worse than none.
        """
        if data.get("version") != CACHE_VERSION:
            return f"cache version {data.get('version')!r} is not {CACHE_VERSION}"
        if data.get("gpu") != identity:
            return f"cache is for GPU {data.get('gpu')!r}, not {identity!r}"
        weights = data.get("weights")
        observed = data.get("observed_s")
        threshold = data.get("threshold")
        if (
            not isinstance(weights, list)
            or len(weights) != BINS
            or not all(isinstance(w, int | float) and 0 <= w < math.inf for w in weights)
        ):
            return "cache weights are malformed"
        if not isinstance(observed, int | float) or not 0 <= observed < math.inf:
            return "cache observed_s is malformed"
        if threshold is not None and (
            not isinstance(threshold, int | float) or not 0 <= threshold <= 1
        ):
            return "cache threshold is malformed"
        self.weights = [float(w) for w in weights]
        self.observed_s = float(observed)
        # A lowered cap applies to a restored threshold at once; a raised one does not lift it.
        self.threshold = None if threshold is None else min(float(threshold), self.settings.cap)
        self.last_at = None
        return None


# -- hysteresis and edges ---------------------------------------------------------


class EdgeCause(StrEnum):
    ENGAGED = "engaged"  # owner load above the threshold for engage_after_s
    UNKNOWN = "unknown"  # no valid reading for the gap limit
    LATE = "late"  # a valid sample arrived past the gap limit, or engaged/uncalibrated
    # after an unknown episode that had not yet raised an edge


@dataclass(frozen=True, slots=True)
class PressureEdge:
    """A resource-pressure rising edge: the reclaim of borrowed work on the GPU should start.

    ``unknown_for_s``: how long the reading had been unknown (0 for an engaged edge).
    """

    cause: EdgeCause
    at: float
    unknown_for_s: float = 0.0


@dataclass
class PressureTracker:
    """Hysteresis over one GPU's owner load with independent engage and release timers.

    * A valid sample above the threshold starts (or continues) the engage timer; once the
      load has stayed above for ``engage_after_s`` the tracker engages (a rising edge).
    * A valid sample at or below it starts the release timer; the tracker releases once the
      load has stayed below for ``release_after_s``.
    * Valid samples more than ``max_gap_s`` apart interrupt the tracker: only the release
      timer restarts, at the late sample, so unobserved quiet never counts towards release
      while sustained load still engages (docs/reclaim.md).
    * :meth:`unknown` marks a poll without a valid reading: new work is refused at once (the
      caller reports unknown quality), and the edge rises once the reading has been unknown
      for ``max_gap_s`` since the last valid sample.
    """

    engage_after_s: float
    release_after_s: float
    max_gap_s: float
    engaged: bool = False
    last_valid_at: float | None = None
    above_since: float | None = None
    below_since: float | None = None
    unknown_since: float | None = None
    episode_edge: bool = False
    started_at: float | None = None

    def observe(self, load: float, threshold: float | None, now: float) -> PressureEdge | None:
        """Feed one valid sample; ``threshold`` None means uncalibrated. Returns an edge or None.

        An uncalibrated sample never engages or releases (the gate refuses on readiness), but
        it is still a valid sample for the gap rules.
        """
        late = self.last_valid_at is not None and now - self.last_valid_at > self.max_gap_s
        episode = self.unknown_since is not None
        episode_had_edge = self.episode_edge
        self.unknown_since = None
        self.episode_edge = False
        if late:
            self.below_since = None  # restart the release timer only
        self.last_valid_at = now
        edge: PressureEdge | None = None
        if threshold is not None:
            if load > threshold:
                self.below_since = None
                if self.above_since is None:
                    self.above_since = now
                if not self.engaged and now - self.above_since >= self.engage_after_s:
                    self.engaged = True
                    edge = PressureEdge(EdgeCause.ENGAGED, now)
            else:
                self.above_since = None
                if self.below_since is None:
                    self.below_since = now
                if self.engaged and now - self.below_since >= self.release_after_s:
                    self.engaged = False
        if (
            edge is None
            and not episode_had_edge
            and (late or (episode and (self.engaged or threshold is None)))
        ):
            # A late sample, or the first valid one after an unknown episode that is itself
            # engaged or uncalibrated, reclaims at once (docs/reclaim.md).
            edge = PressureEdge(EdgeCause.LATE, now)
        return edge

    def unknown(self, now: float) -> PressureEdge | None:
        """Record a poll that produced no valid reading; returns the edge once past the gap.

        The gap counts from the last valid sample (or from the first poll when there never
        was one), as the tracker's own gap rule does.
        """
        if self.started_at is None:
            self.started_at = now
        if self.unknown_since is None:
            self.unknown_since = now
        since = self.last_valid_at if self.last_valid_at is not None else self.started_at
        if not self.episode_edge and now - since >= self.max_gap_s:
            self.episode_edge = True
            return PressureEdge(EdgeCause.UNKNOWN, now, unknown_for_s=now - self.unknown_since)
        return None

    def release_in_s(self, now: float) -> float | None:
        """Seconds until the release timer would release an engaged tracker, or None."""
        if not self.engaged or self.below_since is None:
            return None
        return max(0.0, self.release_after_s - (now - self.below_since))


@dataclass(frozen=True, slots=True)
class PressurePolicy:
    """One GPU's pressure settings as the state and tracker need them (seconds, 0–1 loads)."""

    poll_s: float = 2.0
    engage_after_s: float = 4.0
    release_after_s: float = 30.0
    learner: LearnerSettings = field(default_factory=LearnerSettings)

    @property
    def max_gap_s(self) -> float:
        return max_gap_s(self.poll_s)

    @property
    def stale_after_s(self) -> float:
        """A pressure reading older than three polls (at least 5 s) is stale."""
        return max(5.0, 3.0 * self.poll_s)

    def new_tracker(self) -> PressureTracker:
        return PressureTracker(self.engage_after_s, self.release_after_s, self.max_gap_s)

    def new_learner(self) -> ThresholdLearner:
        return ThresholdLearner(self.learner)


# -- work the attribution cannot see --------------------------------------------------

#: Attribution samples with admitted work and no GPU use in the upstream's tree before
#: ``unseen_gpu_work`` is reported.
UNSEEN_AFTER_SAMPLES = 3


@dataclass(frozen=True, slots=True)
class UnseenChange:
    """An upstream's unseen-GPU-work flag went up (``active``, with why) or down."""

    upstream: str
    active: bool
    detail: str | None = None


@dataclass
class UnseenGpuWork:
    """Counts pressure samples in which an upstream has admitted work running but none of
    the processes serving it use the GPU. After ``after_samples`` in a row its GPU work
    evidently runs outside that process tree (a relay into a VM or container) and so is
    counted as the owner's load; the flag is reported until the tree is seen again.

    ``flagged``: upstream name -> why, while the flag is up.
    """

    after_samples: int = UNSEEN_AFTER_SAMPLES
    flagged: dict[str, str] = field(default_factory=dict)
    _count: dict[str, int] = field(default_factory=dict)

    def observe(
        self,
        gpu: str,
        seen: Mapping[str, bool],
        running: Iterable[str],
        gpu_of: Mapping[str, str | None],
    ) -> list[UnseenChange]:
        """One sample of GPU ``gpu``: ``seen[upstream]`` says whether the upstream's tree used
        it, ``running`` names the upstreams with admitted work, ``gpu_of[upstream]`` is the
        pressure-measured GPU the upstream depends on (None: none). Returns the changes."""
        busy = set(running)
        changes: list[UnseenChange] = []
        for upstream, used in seen.items():
            if gpu_of.get(upstream) != gpu:
                continue
            if used:
                self._count[upstream] = 0
                if self.flagged.pop(upstream, None) is not None:
                    changes.append(UnseenChange(upstream, False))
                continue
            if upstream not in busy:
                self._count[upstream] = 0
                continue
            count = self._count.get(upstream, 0) + 1
            self._count[upstream] = count
            if count >= self.after_samples and upstream not in self.flagged:
                why = (
                    f"{count} samples with admitted work running and no process of the "
                    f"upstream's tree on GPU {gpu!r}; its GPU work runs outside that tree "
                    "(a relay into a VM or container?) and counts as the owner's load"
                )
                self.flagged[upstream] = why
                changes.append(UnseenChange(upstream, True, why))
        return changes


@dataclass(frozen=True, slots=True)
class PressureSample:
    """One pressure poll as a collector hands it over: the attribution and the GPU's UUID."""

    attribution: Attribution
    gpu: str


@dataclass
class PressureState:
    """One GPU's pressure guard (docs/architecture.md): reading, learner and hysteresis.

    ``pending_cache``: a saved calibration read at start, applied once the first sample says
    which GPU (UUID) this is. ``last_edge``: the newest rising edge, for /status.
    """

    policy: PressurePolicy
    learner: ThresholdLearner
    tracker: PressureTracker
    reading: Observation[Attribution] = field(default_factory=Observation)
    gpu: str | None = None
    pending_cache: Mapping[str, object] | None = None
    last_edge: PressureEdge | None = None
