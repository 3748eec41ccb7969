"""Derive the pure core's frozen policies from validated settings."""

from __future__ import annotations

from collections.abc import Callable

from vacancyd.config.model import ResourceSettings, Settings, UpstreamSettings
from vacancyd.core.policy import OwnerScope, ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.pressure import LearnerSettings, PressurePolicy, max_gap_s
from vacancyd.core.reclaim import OnOwnerReturn, ReclaimPolicy
from vacancyd.core.thermal import ThermalPolicy


def resource_policy(settings: Settings, res: ResourceSettings) -> ResourcePolicy:
    return ResourcePolicy(
        name=res.name,
        kind=ResourceKind(res.kind),
        enabled=res.enabled,
        min_free_mib=res.min_free_mib,
        max_utilization=res.max_utilization,
        stale_after_s=res.stale_after_s or settings.stale_after_default_s,
    )


def upstream_policy(
    settings: Settings,
    up: UpstreamSettings,
    *,
    needs_model_observation: bool,
    canonical_model: Callable[[str], str] = str,
) -> UpstreamPolicy:
    """The gate's view of one upstream. ``canonical_model`` is the adapter's name rule
    (Ollama: ``Llama3.2`` is ``llama3.2:latest``), applied to the footprint table's keys as
    the adapter applies it to each request's model."""
    return UpstreamPolicy(
        name=up.name,
        adapter=up.adapter,
        resource=up.resource,
        also_requires=tuple(up.also_requires),
        owner_scope=OwnerScope(up.owner_scope),
        default_mib=up.models.default_mib,
        footprint_mib={canonical_model(k): v for k, v in up.models.footprint_mib.items()},
        resident_min_free_mib=up.resident_min_free_mib,
        needs_model_observation=needs_model_observation,
        model_observation_max_age_s=settings.stale_after_default_s,
        present_max_model_mib=settings.owner.present_max_model_mib
        if up.owner_scope == "resource" or up.lend_while_present
        else None,
        lend_while_present=up.lend_while_present,
        max_concurrent=up.max_concurrent,
        exclusive_of=frozenset(up.exclusive_of),
        excluded_by=frozenset(u.name for u in settings.upstream if up.name in u.exclusive_of),
    )


def pressure_policy(res: ResourceSettings) -> PressurePolicy | None:
    """The core's view of a GPU's ``[resource.pressure]`` table; None where it is off."""
    p = res.gpu_pressure
    if p is None:
        return None
    poll_s = p.poll_s
    return PressurePolicy(
        poll_s=poll_s,
        engage_after_s=p.engage_after_s,
        release_after_s=p.release_after_s,
        learner=LearnerSettings(
            cap=p.threshold_cap,
            fixed=p.fixed_threshold,
            calibration_s=p.calibration_s,
            rise_per_hour=p.rise_per_hour,
            half_life_s=p.half_life_h * 3600.0,
            max_step_s=max_gap_s(poll_s),
        ),
    )


def thermal_policy(res: ResourceSettings) -> ThermalPolicy | None:
    """The core's view of a GPU's temperature limits; None without ``max_temperature_c``."""
    resume = res.resume_temperature_c
    if res.max_temperature_c is None or resume is None:
        return None
    return ThermalPolicy(res.max_temperature_c, resume, res.hot_yield_after_s)


def reclaim_policy(up: UpstreamSettings) -> ReclaimPolicy:
    """The reclaim keys of one upstream (docs/reclaim.md)."""
    return ReclaimPolicy(
        on_owner_return=OnOwnerReturn(up.on_owner_return),
        drain_timeout_s=up.drain_timeout_s,
        completion_timeout_s=up.completion_timeout_s,
        yield_on_veto=up.yield_on_veto,
    )
