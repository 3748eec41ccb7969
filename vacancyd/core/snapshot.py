"""The frozen view of shared state that the gate decides on.

``vacancyd.state.SharedState.snapshot(now)`` builds one per request; tests build them
directly. All times are monotonic seconds from the daemon's clock (``SharedState.clock``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vacancyd.core.holds import Hold
from vacancyd.core.observations import CapacityReading, Observation, Quality
from vacancyd.core.policy import ResourcePolicy
from vacancyd.core.presence import PresenceReading, matched_owner_process
from vacancyd.core.pressure import PressureState
from vacancyd.core.residency import ContextLearning, ResidentModel
from vacancyd.core.thermal import ThermalView


@dataclass(frozen=True, slots=True)
class PresenceView:
    """Owner presence as the gate sees it (docs/architecture.md steps 2–4).

    ``sampled``: a presence reading has arrived since start.
    ``observed_at``: monotonic time of the newest reading (None when never sampled).
    ``evidence_complete``: every session vacancyd sees could be read clearly.
    ``veto_active``: the host policy veto is engaged (owner present, locked screen excepted…).
    ``refuses``: False only for platforms without a backend, whose unknown
    reading must not refuse.
    """

    source: str
    sampled: bool
    observed_at: float | None
    evidence_complete: bool
    veto_active: bool
    max_age_s: float
    refuses: bool = True
    detail: str = ""
    #: The newest reading matched a configured owner program (``[owner] processes``).
    owner_process: bool = False

    def age_s(self, now: float) -> float | None:
        return None if self.observed_at is None else max(0.0, now - self.observed_at)

    def fresh(self, now: float) -> bool:
        """A reading exists and is no older than ``max_age_s`` at ``now``."""
        age = self.age_s(now)
        return age is not None and age <= self.max_age_s

    def allows_learning(self, now: float) -> bool:
        """Whether a GPU's threshold learner may take the owner load sampled at ``now``.

        Learning pauses while a presence source that refuses is configured but its reading
        is missing or stale: load seen then cannot be told apart from the owner's return.
        """
        return not self.refuses or not self.sampled or self.fresh(now)


@dataclass(frozen=True, slots=True)
class PressureView:
    """Per-resource owner GPU pressure; None on resources without it.

    ``above_threshold``: the newest valid reading's owner load is above the threshold in
    force, so the hysteresis is building towards engagement (or holding it). The gate still
    admits until it engages; a reclaim never stands down on such a reading.
    """

    quality: Quality
    calibrated: bool
    engaged: bool
    detail: str = ""
    above_threshold: bool = False


@dataclass(frozen=True, slots=True)
class ResourceView:
    """One declared resource: its policy, runtime switch, capacity and ledger timestamps.

    ``released_at``: when the ledger last released a job on it (monotonic s); the gate admits
    into it again only on a capacity sample taken after that.
    ``yielded_at``: when a reclaim last unloaded an upstream that depends on it (monotonic
    s); no residency is credited from a server observation older than that.
    ``state_error``: why a durable state file it depends on is unusable, if one is.
    ``hold_unsaved``/``hold_write_error``: a job held on it is not yet written to the state
    directory (and why the write failed, when it did); it lends nothing until it is.
    ``charged_mib``: MiB the gate charged the jobs still running on it; a new admission must
    fit beside them, so concurrent jobs together never take more than the resource can lend.
    """

    policy: ResourcePolicy
    switch_on: bool
    capacity: Observation[CapacityReading]
    released_at: float | None = None
    pressure: PressureView | None = None
    yielded_at: float | None = None
    #: Set when durable state this resource depends on could not be read at startup: the
    #: resource refuses borrowed work rather than lend on a guess.
    state_error: str | None = None
    charged_mib: int = 0
    #: A job held on it is not on disk yet (``holds.json``): its write is under way (None)
    #: or failed (why; retried until it succeeds). ``hold_unsaved`` False: nothing pending.
    hold_unsaved: bool = False
    hold_write_error: str | None = None
    #: A GPU's temperature guard (``max_temperature_c``); None where none is configured.
    thermal: ThermalView | None = None

    @property
    def name(self) -> str:
        return self.policy.name

    def quality(self, now: float) -> Quality:
        return self.capacity.quality(now, self.policy.stale_after_s)


@dataclass(frozen=True, slots=True)
class ServerState:
    """What an adapter observed of its upstream server (llama.cpp /slots and the like).

    ``resident_models``: models proved loaded; None means "the one model a single-model server
    holds", which serves any model name. ``idle``: no slot is processing; None when the
    server does not report it (Ollama's /api/ps does not).
    ``models``: per loaded model, what the server reports of it (Ollama), else None.
    ``allocator_mib``: memory the server's own allocator holds and reuses for its next job
    (ComfyUI ``torch_vram_total``, MiB), with ``devices`` the number of GPUs it reports.
    ``version``: the server's version string, when the adapter reads it.
    ``modelfile_num_ctx``: per model digest, the ``num_ctx`` its Modelfile sets (None: none),
    for the digests this observer read (Ollama ``/api/show``).
    """

    resident_models: frozenset[str] | None
    idle: bool | None
    models: tuple[ResidentModel, ...] | None = None
    allocator_mib: float | None = None
    devices: int | None = None
    version: str | None = None
    modelfile_num_ctx: Mapping[str, int | None] | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the gate reads, frozen at ``now``."""

    now: float
    lending_enabled: bool
    presence: PresenceView
    resources: Mapping[str, ResourceView]
    servers: Mapping[str, Observation[ServerState]] = field(default_factory=dict)
    #: The daemon is shutting down: no new borrowed work, whatever else holds.
    stopping: bool = False
    #: Per upstream, what it learned about its models' contexts (Ollama residency).
    learning: Mapping[str, ContextLearning] = field(default_factory=dict)
    #: Per upstream, per model: the learned footprint prior in MiB (vacancyd.core.footprint).
    priors: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: The owner's holds in force now (schedule, pause, battery, exclusive apps).
    holds: tuple[Hold, ...] = ()
    #: Borrowed jobs running per upstream (the ledger's), for residency proofs under concurrency.
    active_jobs: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the proxy read from a work request.

    ``model``: the canonical model name, if the route carries one. ``num_ctx``: the context
    length the request asks for explicitly (Ollama ``options.num_ctx``), else None.
    ``runner_options``: other load-time options it sets (names, sorted). ``dialect``: which
    family of routes it came by (Ollama: ``"api"`` or ``"v1"``), None where it does not matter.
    """

    model: str | None = None
    num_ctx: int | None = None
    runner_options: tuple[str, ...] = ()
    dialect: str | None = None


def presence_view_of(
    obs: Observation[PresenceReading],
    *,
    source: str,
    veto_active: bool,
    max_age_s: float,
    refuses: bool,
) -> PresenceView:
    """The gate's view of owner presence from its newest observation ``obs`` (``source``:
    the configured source; ``veto_active``: the host policy veto is engaged;
    ``max_age_s``: the freshness bound; ``refuses``: whether presence may refuse)."""
    reading = obs.value
    sampled = reading is not None
    failed = obs.failed_at is not None and (
        obs.observed_at is None or obs.failed_at >= obs.observed_at
    )
    detail = reading.detail if reading is not None else ""
    if failed:
        detail = f"presence unreadable: {obs.error}"
    return PresenceView(
        source=source,
        sampled=sampled,
        observed_at=obs.observed_at,
        evidence_complete=bool(reading and reading.evidence_complete) and not failed,
        veto_active=veto_active,
        max_age_s=max_age_s,
        refuses=refuses,
        detail=detail,
        owner_process=reading is not None and matched_owner_process(reading),
    )


def pressure_view(ps: PressureState, now: float) -> PressureView:
    """The gate's view of one GPU's pressure guard ``ps`` at ``now`` (monotonic s)."""
    quality = ps.reading.quality(now, ps.policy.stale_after_s)
    threshold = ps.learner.current()
    value = ps.reading.value
    if quality is Quality.UNKNOWN and ps.reading.error:
        detail = ps.reading.error
    elif quality is Quality.STALE:
        detail = f"newest reading is {ps.reading.age_s(now) or 0:.0f} s old"
    elif not ps.learner.ready:
        left = ps.learner.settings.calibration_s - ps.learner.observed_s
        detail = f"calibrating, {left:.0f} s of observation left"
    elif value is not None and threshold is not None:
        detail = f"owner load {value.owner_load:.0%}, threshold {threshold:.0%}"
    else:
        detail = ""
    return PressureView(
        quality=quality,
        calibrated=ps.learner.ready,
        engaged=ps.tracker.engaged,
        detail=detail,
        above_threshold=ps.tracker.above_since is not None,
    )
