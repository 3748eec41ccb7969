"""Frozen policies the pure core reads, derived from configuration by ``vacancyd.config``.

The core never sees pydantic models: these dataclasses are its whole view of the settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from vacancyd.core.observations import CapacityReading


class ResourceKind(StrEnum):
    GPU = "gpu"
    MEMORY = "memory"
    CPU = "cpu"


class OwnerScope(StrEnum):
    HOST = "host"
    RESOURCE = "resource"


@dataclass(frozen=True, slots=True)
class ResourcePolicy:
    """A declared resource's probe policy (docs/configuration.md).

    ``min_free_mib``: free MiB that must remain for the resource to be lendable at all.
    ``max_utilization``: 0–1 ratio above which it is not lendable (None: not checked).
    ``stale_after_s``: age (monotonic seconds) after which a capacity reading is stale.
    """

    name: str
    kind: ResourceKind
    enabled: bool = True
    min_free_mib: int = 0
    max_utilization: float | None = None
    stale_after_s: float = 10.0

    @property
    def has_bytes(self) -> bool:
        return self.kind is not ResourceKind.CPU

    def evaluate(self, reading: CapacityReading) -> str | None:
        """Return None when ``reading`` is lendable, else a sentence saying why not."""
        if self.has_bytes:
            if reading.free_mib is None:
                return f"{self.name}: free memory not reported"
            if reading.free_mib < self.min_free_mib:
                return (
                    f"{self.name}: {reading.free_mib:.0f} MiB free, "
                    f"policy keeps at least {self.min_free_mib} MiB free"
                )
        if self.max_utilization is not None:
            if reading.utilization is None:
                return f"{self.name}: utilization not reported"
            if reading.utilization > self.max_utilization:
                return (
                    f"{self.name}: utilization {reading.utilization:.0%} "
                    f"above the {self.max_utilization:.0%} limit"
                )
        return None


@dataclass(frozen=True, slots=True)
class UpstreamPolicy:
    """What the gate needs to know about one ``[[upstream]]``.

    Footprints are MiB charged against the primary resource (docs/architecture.md step 6).
    ``needs_model_observation`` is set by adapters (llamacpp) whose admission requires a fresh
    observation of the server itself. ``max_concurrent``: borrowed jobs that may run at once
    (:mod:`vacancyd.core.sharing`). ``exclusive_of``: upstreams whose jobs this one's never
    overlap and which it takes the card from; ``excluded_by``: the upstreams that list this
    one in theirs (derived by the config layer). ``present_max_model_mib``: while the owner
    is present, only requests whose footprint is at most this many MiB are lent (None: no
    budget; set on resource-scoped upstreams, which otherwise ignore presence, and on
    host-scoped ones with ``lend_while_present``, which then lend within it while the owner's
    desktop is in use, but not while an owner program holds the machine).
    """

    name: str
    adapter: str
    resource: str
    also_requires: tuple[str, ...] = ()
    owner_scope: OwnerScope = OwnerScope.HOST
    default_mib: int = 0
    footprint_mib: Mapping[str, int] = field(default_factory=dict)
    resident_min_free_mib: int = 0
    needs_model_observation: bool = False
    model_observation_max_age_s: float = 10.0
    max_concurrent: int = 1
    exclusive_of: frozenset[str] = frozenset()
    excluded_by: frozenset[str] = frozenset()
    present_max_model_mib: int | None = None
    lend_while_present: bool = False

    @property
    def resources(self) -> tuple[str, ...]:
        return (self.resource, *self.also_requires)

    def footprint_for(self, model: str | None) -> tuple[int, str]:
        """Load requirement in MiB for ``model`` and where it came from ("table" or "default")."""
        if model is not None and model in self.footprint_mib:
            return self.footprint_mib[model], "table"
        return self.default_mib, "default"
