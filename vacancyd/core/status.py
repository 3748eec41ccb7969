"""The typed status document: one picture of the lender that ``/status``, ``/metrics`` and
the Kubernetes publisher all render from.

Built once per read by :func:`vacancyd.core.statusbuild.build_status` from inputs that
:func:`vacancyd.api.status.read_status` gathers. Values are raw (seconds, MiB, 0–1 ratios;
ages are monotonic-clock differences). Its JSON both ways is derived from the fields by the
one generic converter :mod:`vacancyd.core.jsonshape`: :meth:`StatusDocument.to_json` is the
``/status`` object whose shape :mod:`vacancyd.api.status` describes (rounded as each
field's ``shape(round_to=...)`` says; the few metrics-only fields are ``hidden``), and
:meth:`StatusDocument.from_json` reads one back into the same types.

Every reader renders the same document: ``GET /status`` is :meth:`StatusDocument.to_json`,
each ``/metrics`` gauge of the lender is read from its fields
(:func:`vacancyd.api.metrics.render_gauges`), and the host-side Kubernetes publisher reads
it into the lender state its Node conditions and EndpointSlices come from
(``vacancyd.core.lender.lender_from_document``; the in-cluster companion reads the same
state from the JSON over HTTP, ``lender_from_status``). Nothing any of them shows is read
from the live state beside it, so for one document they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vacancyd.core.jsonshape import from_json, shape, to_json
from vacancyd.core.observations import Quality


def _with_models(server: ServerStatus) -> bool:
    return server.models is not None


def _with_allocator(server: ServerStatus) -> bool:
    return server.allocator_mib is not None


@dataclass(frozen=True, slots=True)
class VetoStatus:
    active: bool
    release_in_s: float | None = field(metadata=shape(round_to=1))


@dataclass(frozen=True, slots=True)
class PresenceStatus:
    """Owner presence. ``sessions``: redacted per-session descriptions from the reading.

    ``owner_signal`` (metrics only): the newest reading matched the owner policy; None when
    there is no reading.
    """

    source: str
    sampled: bool
    age_s: float | None = field(metadata=shape(round_to=1))
    evidence_complete: bool
    refuses: bool
    veto: VetoStatus
    detail: str
    sessions: tuple[Mapping[str, object], ...]
    session_counts: Mapping[str, int]
    exempt_upstreams: tuple[str, ...]
    owner_signal: bool | None = field(default=None, metadata=shape(hidden=True))


@dataclass(frozen=True, slots=True)
class PressureEdgeStatus:
    cause: str
    age_s: float = field(metadata=shape(round_to=1))
    unknown_for_s: float = field(metadata=shape(round_to=1))


@dataclass(frozen=True, slots=True)
class PressureStatus:
    """One GPU's owner-pressure guard; ratios 0–1, times in seconds."""

    quality: Quality
    calibrated: bool
    engaged: bool
    threshold_ratio: float | None = field(metadata=shape(round_to=3))
    owner_load_ratio: float | None = field(metadata=shape(round_to=3))
    borrower_load_ratio: float | None = field(metadata=shape(round_to=3))
    calibration_observed_s: float = field(metadata=shape(round_to=1))
    calibration_needed_s: float | None
    release_in_s: float | None = field(metadata=shape(round_to=1))
    gpu: str | None
    detail: str
    last_edge: PressureEdgeStatus | None


@dataclass(frozen=True, slots=True)
class ThermalStatus:
    """One GPU's temperature guard (°C, seconds): its limits, whether it is hot (new work
    refused ``gpu_too_hot``), for how long, and for how long the current run of samples
    above ``max_c`` has lasted (None: not hot / not above)."""

    max_c: float
    resume_c: float
    hot_yield_after_s: float | None
    hot: bool
    hot_for_s: float | None = field(metadata=shape(round_to=1))
    above_for_s: float | None = field(metadata=shape(round_to=1))


@dataclass(frozen=True, slots=True)
class PowerLimitStatus:
    """One GPU's lending power limit (``lend_power_limit_w``), in watts: the limit lent
    under, the card's own limit it restores (None until first read), whether the lending
    limit is in force now, and why the driver did not take it (``problem``: a
    ``vacancyd.core.powerlimit.PowerLimitProblem`` value, and ``error`` for a person; None
    when the last attempt succeeded). Lending goes on either way."""

    lend_w: float | None
    original_w: float | None
    applied: bool
    problem: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class HolderStatus:
    job: int
    upstream: str
    phase: str


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """One declared resource. Sizes MiB, ``utilization_ratio`` 0–1, ``age_s`` seconds.

    ``has_bytes`` (metrics only): the resource has a byte capacity (not CPU).
    """

    kind: str
    enabled: bool
    quality: Quality
    age_s: float | None = field(metadata=shape(round_to=1))
    free_mib: float | None = field(metadata=shape(round_to=1))
    total_mib: float | None = field(metadata=shape(round_to=1))
    utilization_ratio: float | None = field(metadata=shape(round_to=3))
    used_mib: float | None = field(metadata=shape(round_to=1))
    why_not: str | None
    error: str | None
    held_by: HolderStatus | None
    pressure: PressureStatus | None
    has_bytes: bool = field(default=True, metadata=shape(hidden=True))
    #: MiB it could lend now: free minus ``min_free_mib``, 0 while not lendable, None
    #: without byte capacity or a reading.
    lendable_mib: float | None = field(default=None, metadata=shape(round_to=1))
    #: Why a durable state file it depends on is unusable (it refuses until repaired).
    state_error: str | None = None
    #: Why a job held on it cannot be written to the state directory (it refuses
    #: ``state_write_failed`` until the retried write succeeds).
    hold_write_error: str | None = None
    #: Borrowed jobs holding it now (more than one with ``max_concurrent``).
    jobs: int = 0
    #: What it is doing when upstreams with ``exclusive_of`` share it (idle, shared,
    #: exclusive: ``vacancyd.core.sharing.CardState``); None when no such upstream uses it.
    card: str | None = None
    #: A GPU's temperature (°C) in the newest capacity sample; None where it reports none.
    temperature_c: float | None = field(default=None, metadata=shape(round_to=1))
    #: A GPU's cumulative energy counter (joules since its driver loaded) in the newest
    #: capacity sample; None where the card has no counter.
    energy_j: float | None = field(default=None, metadata=shape(round_to=1))
    #: A GPU's temperature guard (``max_temperature_c``); None where none is configured.
    thermal: ThermalStatus | None = None
    #: A GPU's lending power limit (``lend_power_limit_w``); None where none is configured
    #: or left to restore.
    power_limit: PowerLimitStatus | None = None

    JSON_EXTRA: ClassVar[tuple[str, ...]] = ("lendable",)

    @property
    def lendable(self) -> bool:
        return self.why_not is None


@dataclass(frozen=True, slots=True)
class ListenerStatus:
    """The upstream's proxy listener, and (``state``) what serves its own target:
    ``loopback_only``, ``listens_on_network``, ``unknown`` or ``not_observable``."""

    address: str
    bound: bool
    error: str | None
    state: str = "unknown"
    state_detail: str = "not observed yet"


@dataclass(frozen=True, slots=True)
class RefusalStatus:
    reason: str
    retry_after_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class ResidentModelStatus:
    """A model the server reports loaded (Ollama ``/api/ps``); sizes MiB, seconds."""

    name: str
    digest: str | None
    context_length: int | None
    size_mib: float | None = field(metadata=shape(round_to=1))
    size_vram_mib: float | None = field(metadata=shape(round_to=1))
    expires_in_s: float | None = field(metadata=shape(round_to=1))
    expires_error: str | None


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """The adapter's observation of its server. ``models``: what Ollama reports loaded;
    ``allocator_mib`` / ``devices``: ComfyUI's reusable allocator memory and GPU count."""

    quality: Quality
    age_s: float | None = field(metadata=shape(round_to=1))
    idle: bool | None
    error: str | None
    version: str | None = field(default=None, metadata=shape(when=_with_models))
    models: tuple[ResidentModelStatus, ...] | None = field(
        default=None, metadata=shape(when=_with_models)
    )
    allocator_mib: float | None = field(
        default=None, metadata=shape(round_to=1, when=_with_allocator)
    )
    devices: int | None = field(default=None, metadata=shape(when=_with_allocator))


@dataclass(frozen=True, slots=True)
class HoldStatus:
    """Why a job is held (``cut_uncertain``, ``tracking_lost``, ``upstream_silent``), since
    when (seconds ago), and what releases it (``server_idle`` or ``admin``)."""

    reason: str
    release_by: str
    for_s: float = field(metadata=shape(round_to=1))
    detail: str


@dataclass(frozen=True, slots=True)
class CreditStatus:
    """A residency proof's outcome for one admission; ``added_mib``: memory added back."""

    applied: bool
    why: str
    code: str
    added_mib: float | None = field(default=None, metadata=shape(round_to=1))


@dataclass(frozen=True, slots=True)
class LearnedContextStatus:
    digest: str
    num_ctx: int | None
    dialect: str
    loads: int


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One borrowed job; ``phase`` is the ledger phase (forwarding, tracking, held)."""

    job: int
    phase: str
    model: str | None
    age_s: float = field(metadata=shape(round_to=1))
    #: MiB the per-model step charged (None without byte capacity).
    charged_mib: int | None = None
    residency: CreditStatus | None = None
    #: Why a held job is held and what releases it (``held`` phase only).
    hold: HoldStatus | None = None
    #: Whose job it is: its ``[[borrower]]`` name, or ``default`` (docs/borrowers.md).
    borrower: str = "default"


@dataclass(frozen=True, slots=True)
class ReclaimStatus:
    """An upstream's latest reclaim; ``edges_age_s`` first edge first, seconds."""

    phase: str
    policy: str
    trigger: str
    resource: str | None
    edges_age_s: tuple[float, ...] = field(metadata=shape(round_to=1))
    edge_triggers: tuple[str, ...]
    deadline_in_s: float | None = field(metadata=shape(round_to=1))
    outcome: str | None


@dataclass(frozen=True, slots=True)
class SharingStatus:
    """An upstream's slots and wait queue (``max_concurrent``, ``busy = "wait"``) and its
    side of an exclusivity; ``card`` is its primary resource's state (idle, shared,
    exclusive)."""

    max_concurrent: int
    jobs: int
    waiting: int
    exclusive_of: tuple[str, ...]
    excluded_by: tuple[str, ...]
    card: str


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """A ``[[pool]]`` listener: its members (first member first) and whether any lends."""

    members: tuple[str, ...]
    listener: ListenerStatus | None = field(metadata=shape(only=("address", "bound", "error")))
    lendable: bool


@dataclass(frozen=True, slots=True)
class HeadroomStatus:
    """What fits on an upstream now (see ``vacancyd.core.gate.Headroom``); MiB."""

    lendable_mib: float | None = field(metadata=shape(round_to=1))
    largest_model: str | None
    largest_model_mib: int | None


@dataclass(frozen=True, slots=True)
class ReachStatus:
    """Whether the upstream's server accepted connections when last checked (see
    ``vacancyd.core.reach``): ``ok``, seconds since that evidence, and why it failed."""

    ok: bool
    age_s: float = field(metadata=shape(round_to=1))
    error: str | None


@dataclass(frozen=True, slots=True)
class LearnedStatus:
    """What an upstream learned of its models' contexts (Ollama): the learned context map
    and the Modelfile's ``num_ctx`` read per digest (None: the Modelfile sets none)."""

    contexts: tuple[LearnedContextStatus, ...]
    modelfile_num_ctx: Mapping[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UpstreamStatus:
    """One ``[[upstream]]``: what the gate would decide now and the work it has."""

    adapter: str
    resource: str
    also_requires: tuple[str, ...]
    owner_scope: str
    listener: ListenerStatus | None
    refusal: RefusalStatus | None
    busy: bool
    server: ServerStatus | None
    unseen_gpu_work: str | None
    active_work: tuple[JobStatus, ...]
    reclaim: ReclaimStatus | None
    sharing: SharingStatus | None = None
    headroom: HeadroomStatus | None = None
    #: Learned footprint priors per model, MiB.
    footprint_priors_mib: Mapping[str, int] = field(default_factory=dict)
    #: The learned context map (Ollama) and the Modelfile contexts read per digest.
    learned_contexts: LearnedStatus | None = None
    #: What the upstream's controller reports of its server beside the observation (a vLLM
    #: server's sleep mode), as the controller renders it; None (and not in the JSON) when
    #: it has no such view.
    sleep: Mapping[str, object] | None = field(
        default=None, metadata=shape(when=lambda u: u.sleep is not None)
    )
    #: The latest reachability evidence (None: none, or too old to count).
    reachable: ReachStatus | None = None

    JSON_EXTRA: ClassVar[tuple[str, ...]] = ("lendable",)

    @property
    def lendable(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, slots=True)
class OwnerHoldStatus:
    """One of the owner's holds in force (``vacancyd.core.holds.Hold``): its kind
    (schedule, pause, battery, exclusive_app), the resources it covers (None: the whole
    host), when it ends by itself (``until``: wall-clock epoch seconds; ``ends_in_s``:
    seconds from now), both None when it does not."""

    kind: str
    detail: str
    resources: tuple[str, ...] | None
    until: float | None
    ends_in_s: float | None = field(metadata=shape(round_to=1))


@dataclass(frozen=True, slots=True)
class PublisherStatus:
    """Host-side Kubernetes publishing (``[kubernetes]``): where this lender is published
    and whether the last attempt of every write went through (``writes_ok``); ``errors``
    maps each failing write (the client, the Node conditions, the EndpointSlices) to its
    newest error."""

    lender: str
    namespace: str
    node: str | None
    address: str | None
    writes_ok: bool
    errors: Mapping[str, str] = field(metadata=shape(sort=True))


@dataclass(frozen=True, slots=True)
class DurableStateStatus:
    """The durable state files: each file (or the directory) whose newest write failed,
    with why; and the usage ledger's error."""

    write_errors: Mapping[str, str] = field(default_factory=dict, metadata=shape(sort=True))
    #: Why the usage ledger (``usage.sqlite3``) is not as it should be: set aside as
    #: corrupt since the start, or unopenable or unwritable now; None when all is well.
    usage_ledger_error: str | None = None


@dataclass(frozen=True, slots=True)
class OwnerControlsStatus:
    """The owner's controls. ``controls``: the schedule, pause, power and exclusive apps as
    ``vacancyd.control.owner`` renders them in wall time (their keys sit beside ``holds`` in
    the JSON); ``holds``: the holds in force, in the order the owner controls list them."""

    controls: Mapping[str, object] = field(default_factory=dict, metadata=shape(flatten=True))
    holds: tuple[OwnerHoldStatus, ...] = ()


@dataclass(frozen=True, slots=True)
class StatusDocument:
    """The whole lender. ``uptime_s``: seconds since start (None where not known)."""

    version: str
    uptime_s: float | None = field(metadata=shape(round_to=1))
    ready: bool
    not_ready: tuple[str, ...]
    lending_enabled: bool
    presence: PresenceStatus
    resources: Mapping[str, ResourceStatus]
    upstreams: Mapping[str, UpstreamStatus]
    #: ``[[pool]]`` listeners; not in the JSON when none is configured.
    pools: Mapping[str, PoolStatus] = field(
        default_factory=dict, metadata=shape(when=lambda d: bool(d.pools))
    )
    #: True from the moment the daemon starts shutting down.
    stopping: bool = False
    durable_state: DurableStateStatus = field(default_factory=lambda: DurableStateStatus())
    #: The owner's controls: None when there are neither owner controls nor holds.
    owner_controls: OwnerControlsStatus | None = None
    #: Host-side Kubernetes publishing; None when ``[kubernetes]`` is not configured.
    kubernetes: PublisherStatus | None = None

    @property
    def holds(self) -> tuple[OwnerHoldStatus, ...]:
        """The owner's holds in force, in the order the owner controls list them."""
        return () if self.owner_controls is None else self.owner_controls.holds

    @property
    def write_errors(self) -> Mapping[str, str]:
        """Durable state files (or the directory) whose newest write failed -> why."""
        return self.durable_state.write_errors

    def to_json(self) -> dict[str, Any]:
        """The ``/status`` JSON object (rounded), derived from the fields by
        :func:`vacancyd.core.jsonshape.to_json`."""
        doc: dict[str, Any] = to_json(self)
        return doc

    @classmethod
    def from_json(cls, data: Any) -> StatusDocument:
        """Read a ``/status`` JSON object back (what :meth:`to_json` leaves out, such as the
        metrics-only fields, takes its default). Raises
        :class:`~vacancyd.core.jsonshape.JsonShapeError` (a ValueError) naming the first
        value of the wrong shape."""
        return from_json(cls, data, "status")


def service_status_line(
    upstreams: Mapping[str, Mapping[str, object]],
    *,
    running: int,
    held: int,
    not_ready: Sequence[str],
) -> str:
    """The one line the service manager shows (sd_notify ``STATUS=``, ``systemctl status``).

    ``upstreams``: per upstream name, ``{"lendable": bool, "reason": str | None}`` (the
    lendability summary); ``running``: borrowed jobs admitted, forwarding or tracked;
    ``held``: jobs held for an uncertain outcome; ``not_ready``: why ``/readyz`` fails
    ([] when ready). For example ``lendable: ollama; not lending: comfyui (owner_active);
    1 job running``.
    """
    parts: list[str] = []
    if not_ready:
        parts.append("not ready: " + ", ".join(not_ready))
    lendable = [name for name, up in upstreams.items() if up.get("lendable")]
    if lendable:
        parts.append("lendable: " + ", ".join(lendable))
    refused = [
        f"{name} ({up.get('reason') or 'refused'})"
        for name, up in upstreams.items()
        if not up.get("lendable")
    ]
    if refused:
        parts.append("not lending: " + ", ".join(refused))
    jobs = f"{running} job{'' if running == 1 else 's'} running"
    if held:
        jobs += f", {held} held"
    parts.append(jobs)
    return "; ".join(parts)
