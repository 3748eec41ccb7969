"""Building the daemon's collaborators from the settings: the store (with what the state
directory remembers), metrics, the supervisor, the learned-state saver, ``Work``, the
reclaimer, the owner controls, the authenticator, and the capacity probe of each resource.

Nothing here binds a socket or starts a loop (:mod:`vacancyd.runtime.listeners` binds,
:mod:`vacancyd.runtime.loops` samples, :mod:`vacancyd.runtime.daemon` starts and stops).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from vacancyd.adapters import ADAPTERS
from vacancyd.api.metrics import attach_saver
from vacancyd.collectors import system
from vacancyd.collectors.nvidia import GpuCapacityProbe, NvmlGpu, NvmlPowerControl, SmiProbe
from vacancyd.config.load import ConfigError
from vacancyd.config.model import ResourceSettings, Settings
from vacancyd.config.policies import (
    pressure_policy,
    reclaim_policy,
    resource_policy,
    thermal_policy,
    upstream_policy,
)
from vacancyd.config.secrets import Secrets
from vacancyd.config.zone import resolve_zone
from vacancyd.control.accounting import Accounting
from vacancyd.control.admission import Admission
from vacancyd.control.borrowers import Borrowers, limits_of
from vacancyd.control.owner import PAUSE_FILE, OwnerControls, OwnerControlsConfig
from vacancyd.control.reclaim import Reclaimer
from vacancyd.control.sharing import CardSharing, ExclusiveSettings
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.control.work import Work
from vacancyd.core import presence as presence_rules
from vacancyd.core.exclusive import ExclusiveScope, ExclusiveTracker
from vacancyd.core.gpu import GpuSelector
from vacancyd.core.observations import CapacityReading
from vacancyd.core.power import PowerPolicy
from vacancyd.core.powerlimit import to_mw
from vacancyd.core.sharing import UnloadTimeout
from vacancyd.runtime import calibration, durable, learned
from vacancyd.runtime.powerlimit import PowerLimiter
from vacancyd.runtime.tasks import Supervisor
from vacancyd.runtime.usage import USAGE_FILE, UsageStore
from vacancyd.state import SharedState
from vacancyd.web.auth import Authenticator, Token, borrower_token
from vacancyd.web.logins import Logins
from vacancyd.web.metrics import Metrics

log = logging.getLogger(__name__)


def capacity_probe(
    res: ResourceSettings, settings: Settings, gpus: dict[str, NvmlGpu]
) -> Callable[[], CapacityReading]:
    """The capacity probe of resource ``res``: /proc/meminfo, CPU load, or NVML with
    nvidia-smi as the fallback (``gpus``: one NVML handle per GPU resource, shared with the
    pressure probe; filled in here)."""
    if res.kind == "memory":
        return system.sample_memory
    if res.kind == "cpu":
        return system.CpuProbe()
    selector = GpuSelector.parse(res.device)
    gpu = gpus.setdefault(res.name, NvmlGpu(selector))
    # nvidia-smi must finish inside the probe deadline, leaving the loop time to kill it.
    smi_deadline = max(0.1, settings.collectors.probe_timeout_s * 0.8)
    return GpuCapacityProbe(gpu, SmiProbe(selector, smi_deadline))


def build_state(settings: Settings) -> SharedState:
    """The store for ``settings``, with the calibrations, learned contexts and footprint
    priors the state directory remembers (a file that cannot be used is logged and its
    resources refuse; never raises for it)."""
    resources = {r.name: resource_policy(settings, r) for r in settings.resource}
    upstreams = {
        u.name: upstream_policy(
            settings,
            u,
            needs_model_observation=ADAPTERS[u.adapter].needs_model_observation,
            canonical_model=ADAPTERS[u.adapter].canonical_model,
        )
        for u in settings.upstream
    }
    source = presence_rules.resolve_source(settings.owner.presence, sys.platform)
    pressure = {
        r.name: policy
        for r in settings.resource
        if r.enabled and (policy := pressure_policy(r)) is not None
    }
    state = SharedState(
        resources,
        upstreams,
        presence_source=source.value,
        presence_refuses=source is not presence_rules.PresenceSource.UNSUPPORTED,
        presence_max_age_s=settings.presence_max_age_s,
        release_after_s=settings.owner.release_after_s,
        pressure=pressure,
        thermal={
            r.name: limits
            for r in settings.resource
            if r.enabled and (limits := thermal_policy(r)) is not None
        },
    )
    saved = calibration.load_calibrations(settings.state_dir, pressure)
    for name, data in saved.items():
        state.pressure[name].pending_cache = data
    learned.load_learned(state, settings.state_dir)
    return state


def owner_controls_config(settings: Settings) -> OwnerControlsConfig:
    """The owner-controls loop's settings; raises ConfigError when the zone is unknown."""
    owner = settings.owner
    zone_name = settings.schedule.timezone if settings.schedule else None
    try:
        tz, zone = resolve_zone(zone_name)
    except ValueError as exc:
        raise ConfigError("configuration", [f"schedule.timezone: {exc}"]) from exc
    exclusive = {}
    for scope in ExclusiveScope:
        names = frozenset(a.name for a in owner.exclusive_apps if a.scope == scope.value)
        if names:
            exclusive[scope] = ExclusiveTracker(
                names, owner.exclusive_grace_s, owner.exclusive_resume_after_s
            )
    source = presence_rules.resolve_source(owner.presence, sys.platform)
    return OwnerControlsConfig(
        state_dir=settings.state_dir,
        tz=tz,
        zone=zone,
        schedule=None if settings.schedule is None else settings.schedule.build(tz, zone),
        power=PowerPolicy(owner.lend_on_battery, owner.min_battery_percent),
        exclusive=exclusive,
        gpu_resources=frozenset(r.name for r in settings.resource if r.kind == "gpu"),
        presence_evidence=source is presence_rules.PresenceSource.LOGIND,
        poll_s=settings.collectors.poll_s,
        probe_timeout_s=settings.collectors.probe_timeout_s,
    )


#: The saved pause's format version in ``STATE_DIR/pause.json``.
PAUSE_VERSION = 1


class DurablePauseStore:
    """The owner's pause as a versioned durable-state file (:mod:`vacancyd.runtime.durable`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Mapping[str, object] | None:
        try:
            return durable.read_state(self.path, {PAUSE_VERSION})
        except durable.StateFileError as exc:
            raise ValueError(str(exc)) from exc

    def save(self, data: Mapping[str, object] | None) -> None:
        if data is None:
            durable.remove_state(self.path)
        else:
            durable.write_state(self.path, {"version": PAUSE_VERSION, **data})


def read_tokens(secrets: Secrets) -> list[Token]:
    """The bearer tokens the secrets declare: ``[[server.tokens]]``, then each
    ``[[borrower]]``'s (which names its borrower)."""
    return [Token(name, secret, scopes) for name, secret, scopes in secrets.tokens] + [
        borrower_token(name, secret) for name, secret in secrets.borrowers
    ]


def make_authenticator(settings: Settings, tokens: list[Token], metrics: Metrics) -> Authenticator:
    """The bearer-token gate every listener shares (``[server]`` decides who may pass)."""
    server = settings.server
    return Authenticator(
        tokens,
        trust_loopback=server.trust_loopback,
        metrics=metrics,
        allow_unauthenticated_remote=server.allow_unauthenticated_remote,
        server_names=server.server_names,
        allowed_origins=server.allowed_origins,
        logins=Logins(),
        trusted_proxies=server.trusted_proxies,
    )


def card_sharing(
    settings: Settings,
    state: SharedState,
    calls: UpstreamCalls,
    metrics: Metrics,
) -> CardSharing | None:
    """Exclusivity effects for upstreams with ``exclusive_of`` (Ollama + ComfyUI); None
    when no upstream is exclusive of another."""
    exclusive = {
        u.name: ExclusiveSettings(
            u.unload_timeout, UnloadTimeout(u.on_unload_timeout or UnloadTimeout.FORWARD)
        )
        for u in settings.upstream
        if u.exclusive_of
    }
    if not exclusive:
        return None
    return CardSharing(
        state.upstreams,
        exclusive,
        calls,
        warm_models={u.name: u.warm_model for u in settings.upstream if u.warm_model},
        clock=state.clock,
        registry=metrics.registry,
    )


def check_state_dir(path: Path, saver: learned.LearnedSaver) -> None:
    """Say at startup, not at the first save, when the state directory is unusable (logged,
    and shown in /status through ``saver.errors``). Never raises."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".vacancyd-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        log.error(
            "state directory %s is not writable (%s): learned calibration, contexts, "
            "footprint priors and held jobs will not survive a restart",
            path,
            exc.strerror or exc,
        )
        saver.errors[str(path)] = f"not writable: {exc.strerror or exc}"


class ControllerViews(Mapping[str, Callable[[], Mapping[str, object]]]):
    """Each upstream controller's own view for /status (a vLLM controller's sleep mode),
    by upstream name, read live from ``calls`` (controllers are added as proxies start):
    only upstreams among ``names`` whose controller has a ``view()``."""

    def __init__(self, calls: UpstreamCalls, names: Iterable[str]) -> None:
        self._calls = calls
        self._names = tuple(names)

    def __getitem__(self, name: str) -> Callable[[], Mapping[str, object]]:
        view = getattr(self._calls.controller(name), "view", None)
        if name not in self._names or not callable(view):
            raise KeyError(name)
        return view  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class Collaborators:
    """What the daemon is made of before anything listens or samples. The upstreams'
    controllers, whose HTTP sessions need the running event loop, are added to ``calls``
    by :meth:`vacancyd.runtime.daemon.Daemon.start`, which builds the card sharing
    (:func:`card_sharing`) once they are."""

    state: SharedState
    #: the holds ``holds.json`` listed at startup, restored before any proxy listens
    saved_holds: list[learned.SavedHold]
    metrics: Metrics
    supervisor: Supervisor
    saver: learned.LearnedSaver
    learner: learned.Learner
    #: every call to an upstream server's own API (controllers are added as proxies start)
    calls: UpstreamCalls
    work: Work
    #: every admission decision (the proxy's one way in)
    admission: Admission
    reclaimer: Reclaimer
    owner: OwnerControls
    #: each GPU's lending power limit (``lend_power_limit_w``), applied and restored
    power: PowerLimiter
    #: the usage ledger (opened by the daemon's start)
    usage: UsageStore
    #: what each borrowed job used (the borrowers' quota counts, metrics, ledger rows)
    accounting: Accounting


def energy_reading(state: SharedState) -> Callable[[str], tuple[float, float] | None]:
    """The newest (monotonic s, J) of a resource's GPU energy counter (None without one)."""

    def read(resource: str) -> tuple[float, float] | None:
        observed = state.capacity.get(resource)
        if observed is None or observed.value is None or observed.observed_at is None:
            return None
        energy = observed.value.energy_j
        return None if energy is None else (observed.observed_at, energy)

    return read


def accounting_for(
    settings: Settings, state: SharedState, metrics: Metrics, usage: UsageStore
) -> Accounting:
    """The named borrowers' limits (``[[borrower]]``) and each job's accounting, written to
    ``usage``."""
    borrowers = Borrowers(
        limits_of(
            (b.name, b.upstreams, b.max_concurrent, b.daily_busy_s) for b in settings.borrower
        )
    )
    return Accounting(
        borrowers, metrics, record=usage.record, energy_of=energy_reading(state), clock=state.clock
    )


def power_limiter(settings: Settings, state: SharedState) -> PowerLimiter:
    """The power limiter for every GPU with ``lend_power_limit_w`` (and for any card a
    previous run left limited, found from ``state_dir``)."""

    def control_for(device: str) -> NvmlPowerControl:
        return NvmlPowerControl(NvmlGpu(GpuSelector.parse(device)))

    cards = {
        r.name: (str(r.device if r.device is not None else 0), r.lend_power_limit_w)
        for r in settings.resource
        if r.kind == "gpu" and r.lend_power_limit_w is not None
    }
    return PowerLimiter(
        state,
        settings.state_dir,
        {
            name: (device, control_for(device), to_mw(watts))
            for name, (device, watts) in cards.items()
        },
        control_for,
    )


def build(settings: Settings) -> Collaborators:
    """Build the collaborators from ``settings``, reading the state directory (calibrations,
    learned contexts and priors, held jobs, the pause). Raises ConfigError when the
    schedule's time zone is unknown. Needs no running event loop."""
    state = build_state(settings)
    saved_holds = learned.load_holds(state, settings.state_dir)
    metrics = Metrics()
    supervisor = Supervisor()
    saver = learned.LearnedSaver(state, settings.state_dir)
    attach_saver(metrics, saver)
    learner = learned.Learner(state, saver.mark)
    calls = UpstreamCalls(metrics)
    power = power_limiter(settings, state)
    usage = UsageStore(
        settings.state_dir / USAGE_FILE, retention_days=settings.usage_retention_days
    )
    accounting = accounting_for(settings, state, metrics, usage)
    work = Work(
        state,
        supervisor=supervisor,
        metrics=metrics,
        calls=calls,
        observers=(power,),
        # a holds.json that could not be read is never written: every resource refuses
        holds_writer=None if saver.holds_frozen else saver,
        after_release=learner.after_release,
        accounting=accounting,
    )
    for up in settings.upstream:
        if up.busy == "wait":
            work.enable_wait(up.name, max_waiting=up.waiting_limit, timeout_s=up.wait_timeout)
    reclaimer = Reclaimer(
        state,
        policies={u.name: reclaim_policy(u) for u in settings.upstream},
        calls=calls,
        warm_models={u.name: u.warm_model for u in settings.upstream if u.warm_model},
        supervisor=supervisor,
        metrics=metrics,
        work=work,
    )
    owner = OwnerControls(
        state,
        owner_controls_config(settings),
        DurablePauseStore(settings.state_dir / PAUSE_FILE),
        reclaimer=reclaimer,
        supervisor=supervisor,
    )
    return Collaborators(
        state=state,
        saved_holds=saved_holds,
        metrics=metrics,
        supervisor=supervisor,
        saver=saver,
        learner=learner,
        calls=calls,
        work=work,
        admission=Admission(state, work),
        reclaimer=reclaimer,
        owner=owner,
        power=power,
        usage=usage,
        accounting=accounting,
    )
