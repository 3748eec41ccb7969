"""The admission gate: a pure function from (request facts, snapshot, upstream) to a decision.

The checks run in this order; the first that fails decides (docs/architecture.md):

1. global lending switch                         -> lending_disabled      300 s
   an owner hold (schedule, pause, battery, exclusive app) covering the upstream
                                                 -> owner_active     5 s-1 h (until it ends)
2. presence never sampled / stale (host scope)   -> owner_active            5 s
3. incomplete session evidence (host scope)      -> owner_active           30 s
4. host policy veto (host scope)                 -> owner_active          120 s
5. per resource (primary, then also_requires):
   switch off                                    -> resource_disabled     300 s
   its durable state unreadable at startup       -> resource_unmeasured    30 s
   capacity unknown or stale                     -> resource_unmeasured    30 s
   no sample since the ledger's last release     -> resource_busy           2 s
   probe policy not lendable                     -> insufficient_capacity  30 s
   pressure unknown/stale/uncalibrated           -> resource_unmeasured    30 s
   pressure engaged                              -> resource_pressured     30 s
   temperature not reported (max_temperature_c)  -> resource_unmeasured    30 s
   above max_temperature_c, until below resume   -> gpu_too_hot            60 s
   (adapters that need it) server not observed   -> resource_unmeasured    30 s
6. owner present and the footprint over the upstream's present budget
                                                 -> owner_active          120 s
   per-model footprint vs live free memory       -> insufficient_capacity  30 s
   with a residency credit on proof: resident_min_free_mib charged in place of the
   footprint (a loaded model reused as loaded), or the server's reusable allocator memory
   added back to free memory (ComfyUI). Without a credit the charge is the larger of the
   configured footprint and the model's learned prior (vacancyd.core.footprint).

It never raises and never reads a clock: ``snap.now`` is the time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from vacancyd.core import footprint, residency
from vacancyd.core.holds import Hold, decide_holds
from vacancyd.core.observations import Quality
from vacancyd.core.policy import OwnerScope, ResourceKind, UpstreamPolicy
from vacancyd.core.reasons import Admit, Credit, CreditCode, Decision, Reason, Refresh, Refuse
from vacancyd.core.snapshot import (
    PresenceView,
    RequestFacts,
    ResourceView,
    ServerState,
    Snapshot,
)
from vacancyd.core.thermal import ThermalView

#: A residency proof must be at most this old (seconds; docs/architecture.md).
RESIDENCY_PROOF_MAX_AGE_S = 4.0


#: Step 1's two answers never vary, so each is one shared value (a ``Refuse`` is frozen):
#: the proxy can recognize it and reuse the reply it rendered for it.
SHUTTING_DOWN = Refuse.of(Reason.SHUTTING_DOWN, "vacancyd on this host is shutting down")
LENDING_OFF = Refuse.of(Reason.LENDING_DISABLED, "lending is switched off on this host")


def decide_switches(stopping: bool, lending_enabled: bool) -> Refuse | None:
    """Step 1 alone, from the daemon's two switches (shutting down, global lending switch):
    :data:`SHUTTING_DOWN`, :data:`LENDING_OFF` or None.

    It needs no snapshot, so the proxy asks it first: a flood of requests against a lender
    with lending off is refused without building one per request.
    """
    if stopping:
        return SHUTTING_DOWN
    if not lending_enabled:
        return LENDING_OFF
    return None


def decide_owner_steps(
    holds: Iterable[Hold], presence: PresenceView, now: float, upstream: UpstreamPolicy
) -> Refuse | None:
    """The owner's steps alone (a hold covering the upstream, then steps 2–4), from the holds
    in force and the presence view at ``now`` (monotonic seconds): what
    :func:`decide_before_body` answers when one of them refuses, and None when none does.

    They need no snapshot, so the proxy asks them before building one: a flood of requests
    while the owner is present (or has paused lending) is refused without a snapshot each.
    """
    refusal = decide_holds(holds, upstream.resources)
    if refusal is not None:
        return refusal
    return _decide_presence(presence, now, upstream)


def decide_before_body(snap: Snapshot, upstream: UpstreamPolicy) -> Refuse | None:
    """Steps 1–5: everything that does not depend on the request body.

    The proxy runs this before buffering a body, so a refusal that the model name could not
    change costs the borrower no upload. Returns None when the request may proceed to step 6.
    """
    now = snap.now
    refusal = decide_switches(snap.stopping, snap.lending_enabled)
    if refusal is not None:
        return refusal

    refusal = decide_holds(snap.holds, upstream.resources)
    if refusal is not None:
        return refusal

    refusal = _decide_owner(snap, upstream)
    if refusal is not None:
        return refusal

    for name in upstream.resources:
        refusal = _decide_resource(snap.resources.get(name), name, now)
        if refusal is not None:
            return refusal

    if upstream.needs_model_observation:
        server = snap.servers.get(upstream.name)
        quality = (
            Quality.UNKNOWN
            if server is None
            else server.quality(now, upstream.model_observation_max_age_s)
        )
        if quality is not Quality.READY:
            error = f" ({server.error})" if server is not None and server.error else ""
            return Refuse.of(
                Reason.RESOURCE_UNMEASURED,
                f"upstream {upstream.name!r} has no fresh observation of its server "
                f"({quality}){error}",
                refresh=Refresh.SERVER,
            )
    return None


def decide(facts: RequestFacts, snap: Snapshot, upstream: UpstreamPolicy) -> Decision:
    """Decide whether a borrowed work request on ``upstream`` may be forwarded now."""
    refusal = decide_before_body(snap, upstream)
    if refusal is not None:
        return refusal
    return _decide_model(facts, snap, upstream)


def decide_owner(
    snap: Snapshot, upstream: UpstreamPolicy, *, strict: bool = False
) -> Refuse | None:
    """Steps 2–4 alone; a reclaim's stand-down check reuses them (docs/reclaim.md) with
    ``strict``: an upstream that lends while the owner is present does not clear an owner
    edge until the veto itself releases."""
    return _decide_owner(snap, upstream, strict=strict)


def decide_resource(view: ResourceView | None, name: str, now: float) -> Refuse | None:
    """Step 5 for one resource alone; a reclaim's stand-down check reuses it."""
    return _decide_resource(view, name, now)


def _decide_owner(
    snap: Snapshot, upstream: UpstreamPolicy, *, strict: bool = False
) -> Refuse | None:
    return _decide_presence(snap.presence, snap.now, upstream, strict=strict)


def _decide_presence(
    presence: PresenceView, now: float, upstream: UpstreamPolicy, *, strict: bool = False
) -> Refuse | None:
    if not presence.refuses:
        return None
    if not presence.sampled:
        return _owner_refusal("owner presence has not been sampled since vacancyd started", 5)
    if upstream.owner_scope is OwnerScope.RESOURCE:
        return None
    age = presence.age_s(now)
    if age is None or age > presence.max_age_s:
        return Refuse.of(
            Reason.OWNER_ACTIVE,
            f"the newest owner presence reading is {age or 0:.0f} s old "
            f"(limit {presence.max_age_s:.0f} s)",
            retry_after_s=5,
        )
    if not presence.evidence_complete:
        return _owner_refusal(
            "a session on this host could not be read clearly; it counts as the owner"
            + (f": {presence.detail}" if presence.detail else ""),
            30,
        )
    if presence.veto_active:
        if (
            not strict
            and upstream.lend_while_present
            and upstream.present_max_model_mib is not None
            and not presence.owner_process
        ):
            return None  # the present budget (step 6) decides
        return _owner_refusal(
            "the owner is using this machine" + (f": {presence.detail}" if presence.detail else ""),
            120,
        )
    return None


@functools.lru_cache(maxsize=64)
def _owner_refusal(detail: str, retry_after_s: int) -> Refuse:
    """One shared ``owner_active`` value per distinct detail (a ``Refuse`` is frozen): while
    the owner stays present, every refusal is the same value, answered from one rendering."""
    return Refuse.of(Reason.OWNER_ACTIVE, detail, retry_after_s=retry_after_s)


def decide_unsaved_hold(view: ResourceView, name: str) -> Refuse | None:
    """A job held on ``name`` that is not on disk yet refuses new borrowed work there: a
    restart meanwhile would forget the hold (docs/footprints.md, "Held jobs survive a
    restart"). ``state_write_failed`` while its write fails, ``resource_busy`` while it is
    under way (a few milliseconds)."""
    if not view.hold_unsaved:
        return None
    if view.hold_write_error is not None:
        return Refuse.of(
            Reason.STATE_WRITE_FAILED,
            f"a job held on {name!r} cannot be written to the state directory "
            f"({view.hold_write_error}); a restart would forget it, so {name!r} lends "
            "nothing until the write succeeds (retried)",
            resource=name,
        )
    return Refuse.of(
        Reason.RESOURCE_BUSY,
        f"a job held on {name!r} is being written to the state directory",
        resource=name,
    )


def _decide_resource(view: ResourceView | None, name: str, now: float) -> Refuse | None:
    if view is None:
        return Refuse.of(Reason.RESOURCE_UNMEASURED, f"resource {name!r} is not declared")
    if not view.switch_on:
        return Refuse.of(
            Reason.RESOURCE_DISABLED, f"resource {name!r} is switched off", resource=name
        )
    if view.state_error is not None:
        return Refuse.of(
            Reason.RESOURCE_UNMEASURED,
            f"durable state for {name!r} is unusable, so what it holds is unknown: "
            f"{view.state_error}",
            resource=name,
        )
    refusal = decide_unsaved_hold(view, name)
    if refusal is not None:
        return refusal
    quality = view.quality(now)
    if quality is not Quality.READY:
        error = f": {view.capacity.error}" if view.capacity.error else ""
        return Refuse.of(
            Reason.RESOURCE_UNMEASURED,
            f"capacity of {name!r} is {quality}{error}",
            resource=name,
        )
    observed_at = view.capacity.observed_at
    assert observed_at is not None and view.capacity.value is not None  # READY implies both
    if view.released_at is not None and observed_at <= view.released_at:
        return Refuse.of(
            Reason.RESOURCE_BUSY,
            f"waiting for a fresh capacity sample of {name!r} after the previous job",
            resource=name,
            refresh=Refresh.CAPACITY,
        )
    why = view.policy.evaluate(view.capacity.value)
    if why is not None:
        return Refuse.of(Reason.INSUFFICIENT_CAPACITY, why, resource=name)
    pressure = view.pressure
    if pressure is not None:
        if pressure.quality is not Quality.READY or not pressure.calibrated:
            state = pressure.quality if pressure.calibrated else "uncalibrated"
            return Refuse.of(
                Reason.RESOURCE_UNMEASURED,
                f"GPU pressure on {name!r} is {state}"
                + (f": {pressure.detail}" if pressure.detail else ""),
                resource=name,
            )
        if pressure.engaged:
            return Refuse.of(
                Reason.RESOURCE_PRESSURED,
                f"the owner's GPU work is pressing {name!r}"
                + (f": {pressure.detail}" if pressure.detail else ""),
                resource=name,
            )
    return decide_thermal(view.thermal, view.capacity.value.temperature_c, name)


def decide_thermal(
    thermal: ThermalView | None, temperature_c: float | None, name: str
) -> Refuse | None:
    """The temperature step for GPU ``name`` (``max_temperature_c``): ``gpu_too_hot`` while
    its guard is hot, ``resource_unmeasured`` when the newest capacity sample has no
    temperature (°C) to check; None without a guard or when it is cool enough."""
    if thermal is None:
        return None
    if temperature_c is None:
        return Refuse.of(
            Reason.RESOURCE_UNMEASURED,
            f"the temperature of {name!r} is not reported, and max_temperature_c "
            f"({thermal.policy.max_c:g} °C) needs it",
            resource=name,
        )
    if thermal.hot:
        return Refuse.of(
            Reason.GPU_TOO_HOT,
            f"{name!r} is at {temperature_c:g} °C: above its {thermal.policy.max_c:g} °C "
            f"limit, it lends again below {thermal.policy.resume_c:g} °C",
            resource=name,
        )
    return None


def prove_residency(facts: RequestFacts, snap: Snapshot, upstream: UpstreamPolicy) -> Credit:
    """Try to prove ``facts.model`` is resident on ``upstream`` as the request needs it.

    The proof is the adapter's server observation. It must be the newest attempt (not
    failed), at most :data:`RESIDENCY_PROOF_MAX_AGE_S` old, and taken after the last job and
    the last yield on every dependency (a model a yield unloaded is not still resident);
    failing only that sets ``failed_only_for_age`` so the caller takes one fresh observation
    and decides again. Then, by what the server reports: Ollama's model table
    (:func:`vacancyd.core.residency.prove_ollama`), ComfyUI's allocator memory
    (:func:`_comfy_credit`), or a single-model server idle (llama-server ``/slots``).
    Pure; the same call serves every admission, whichever component makes it.
    """
    server = snap.servers.get(upstream.name)
    if server is None:
        return Credit(
            False, f"adapter {upstream.adapter!r} has no residency proof", code=CreditCode.NO_PROOF
        )
    state = server.value
    if state is None or server.observed_at is None:
        return Credit(False, "the server has not been observed", code=CreditCode.UNOBSERVED)
    if server.failed_at is not None and server.failed_at >= server.observed_at:
        return Credit(
            False,
            f"the newest server observation failed: {server.error}",
            code=CreditCode.OBSERVATION_FAILED,
        )
    for name in upstream.resources:
        view = snap.resources.get(name)
        if view is None:
            continue
        if view.released_at is not None and server.observed_at <= view.released_at:
            return Credit(
                False,
                f"the server observation predates the last job on {name!r}",
                failed_only_for_age=True,
                code=CreditCode.STALE,
            )
        if view.yielded_at is not None and server.observed_at <= view.yielded_at:
            return Credit(
                False,
                f"the server observation predates the last yield on {name!r}",
                failed_only_for_age=True,
                code=CreditCode.STALE,
            )
    age = snap.now - server.observed_at
    if age > RESIDENCY_PROOF_MAX_AGE_S:
        return Credit(
            False,
            f"the server observation is {age:.1f} s old (a proof must be at most "
            f"{RESIDENCY_PROOF_MAX_AGE_S:.0f} s old)",
            failed_only_for_age=True,
            code=CreditCode.STALE,
        )
    if state.idle is False and not snap.active_jobs.get(upstream.name):
        # A busy server proves nothing about memory unless the work it runs is borrowed
        # work this ledger already charged (concurrent jobs on one resident model).
        return Credit(False, "the server is processing other work", code=CreditCode.BUSY)
    if state.models is not None:
        model = None if facts.model is None else residency.find_model(state.models, facts.model)
        return residency.prove_ollama(
            model=model,
            requested=facts.model,
            num_ctx=facts.num_ctx,
            runner_options=facts.runner_options,
            dialect=facts.dialect,
            learning=snap.learning.get(upstream.name, residency.ContextLearning()),
            age_s=age,
        )
    if state.allocator_mib is not None:
        return _comfy_credit(state, snap, upstream)
    if state.resident_models is not None and (
        facts.model is None or facts.model not in state.resident_models
    ):
        return Credit(False, f"model {facts.model!r} is not resident", code=CreditCode.NOT_LOADED)
    return Credit(True, "the server reports the model loaded and idle", code=CreditCode.RESIDENT)


def _comfy_credit(state: ServerState, snap: Snapshot, upstream: UpstreamPolicy) -> Credit:
    """ComfyUI: its allocator's reserved memory is reused by its next job, so on a route with
    exactly one GPU (one GPU dependency, one device reported) it is added back to that GPU's
    free memory; the job is still charged its whole footprint."""
    gpus = [
        name
        for name in upstream.resources
        if (view := snap.resources.get(name)) is not None and view.policy.kind is ResourceKind.GPU
    ]
    if len(gpus) != 1 or gpus[0] != upstream.resource:
        return Credit(
            False,
            "the route does not have exactly one GPU, its primary resource",
            code=CreditCode.NOT_ONE_GPU,
        )
    if state.devices != 1:
        return Credit(
            False,
            f"the server reports {state.devices} devices, not exactly one GPU",
            code=CreditCode.NOT_ONE_GPU,
        )
    held = state.allocator_mib or 0.0
    if held <= 0:
        return Credit(
            False, "the server's allocator holds no memory", code=CreditCode.ALLOCATOR_EMPTY
        )
    return Credit(
        True,
        f"the server's allocator holds {held:.0f} MiB it reuses for the next job",
        added_mib=held,
        code=CreditCode.ALLOCATOR,
    )


def _decide_present_budget(
    facts: RequestFacts, snap: Snapshot, upstream: UpstreamPolicy
) -> Refuse | None:
    """While the owner is present, a budgeted upstream lends only small models."""
    budget = upstream.present_max_model_mib
    if budget is None or not snap.presence.veto_active:
        return None
    need, source = upstream.footprint_for(facts.model)
    if need <= budget:
        return None
    return Refuse.of(
        Reason.OWNER_ACTIVE,
        f"the owner is using this machine; while they are, {upstream.name!r} lends only "
        f"models of at most {budget} MiB (present_max_model_mib), and model {facts.model!r} "
        f"needs {need} MiB ({source} footprint)",
        retry_after_s=120,
    )


def _decide_model(facts: RequestFacts, snap: Snapshot, upstream: UpstreamPolicy) -> Decision:
    refusal = _decide_present_budget(facts, snap, upstream)
    if refusal is not None:
        return refusal
    primary = snap.resources[upstream.resource]
    if not primary.policy.has_bytes:
        return Admit(resources=upstream.resources)
    need, source = upstream.footprint_for(facts.model)
    if facts.model is not None:
        prior = snap.priors.get(upstream.name, {}).get(facts.model)
        need, learned = footprint.charge_for(need, prior)
        if learned:
            source = "learned"
    credit = prove_residency(facts, snap, upstream)
    added = credit.added_mib if credit.applied else 0.0
    resident = credit.applied and not added
    charge = min(upstream.resident_min_free_mib, need) if resident else need
    reading = primary.capacity.value
    assert reading is not None and reading.free_mib is not None  # checked in step 5
    available = reading.free_mib + added - primary.policy.min_free_mib - primary.charged_mib
    if available < charge:
        beside = (
            f" beside {primary.charged_mib} MiB charged to running jobs"
            if primary.charged_mib
            else ""
        )
        if resident:
            what = f"{charge} MiB (resident_min_free_mib; residency credit: {credit.why})"
        elif added:
            what = (
                f"{charge} MiB ({source} footprint; a credit of {added:.0f} MiB applied: "
                f"{credit.why})"
            )
        else:
            what = (
                f"{charge} MiB ({source} footprint for model {facts.model!r}; no residency "
                f"credit: {credit.why})"
            )
        return Refuse.of(
            Reason.INSUFFICIENT_CAPACITY,
            f"{primary.name!r} has {available:.0f} MiB to lend{beside}, the request needs {what}",
            resource=primary.name,
            credit=credit,
            refresh=Refresh.SERVER if credit.failed_only_for_age else None,
        )
    return Admit(resources=upstream.resources, charged_mib=charge, credit=credit)


@dataclass(frozen=True, slots=True)
class Headroom:
    """What fits on an upstream now (MiB).

    ``lendable_mib``: live free memory of the primary resource minus its ``min_free_mib``,
    0 when the upstream would refuse any borrowed request, None when the resource has no
    byte capacity or is not measured. ``largest_model``/``largest_model_mib``: the model of
    the footprint table with the largest footprint that a request would be admitted for now
    (residency credit included), None when none would be.
    """

    lendable_mib: float | None
    largest_model: str | None
    largest_model_mib: int | None


def headroom(snap: Snapshot, upstream: UpstreamPolicy) -> Headroom:
    """The upstream's :class:`Headroom` at ``snap.now``; never raises."""
    primary = snap.resources.get(upstream.resource)
    reading = None if primary is None else primary.capacity.value
    free: float | None = None
    if (
        primary is not None
        and primary.policy.has_bytes
        and reading is not None
        and reading.free_mib is not None
        and primary.quality(snap.now) is Quality.READY
    ):
        free = max(0.0, reading.free_mib - primary.policy.min_free_mib)
    if decide_before_body(snap, upstream) is not None:
        return Headroom(0.0 if free is not None else None, None, None)
    # Largest footprint first: the first admitted model is the largest one that fits.
    for model, mib in sorted(upstream.footprint_mib.items(), key=lambda kv: (-kv[1], kv[0])):
        if isinstance(decide(RequestFacts(model=model), snap, upstream), Admit):
            return Headroom(free, model, mib)
    return Headroom(free, None, None)
