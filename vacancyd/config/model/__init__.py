"""Pydantic models, one per TOML table. Every key and its unit is documented in
docs/configuration.md; ``vacancyd.example.toml`` is a commented instance validated by a test.

Unknown keys are errors (``extra="forbid"``) and the models are frozen. The models live in
one module per part of the file (:mod:`.server`, :mod:`.owner`, :mod:`.resources`,
:mod:`.upstreams`, :mod:`.borrowers`, :mod:`.kubernetes`, the whole file in
:mod:`.settings`, what they share in :mod:`.base`); this package re-exports them all.
"""

from vacancyd.config.model.base import (
    DNS_LABEL_PATTERN,
    FOLLOWED_SHUTDOWN_DELAY_S,
    NAME_PATTERN,
    SECRET_FILE_MAX_BYTES,
    FrozenModel,
    Name,
    Scope,
    check_listen,
    is_loopback,
    read_secret_file,
    secret_path,
    split_listen,
)
from vacancyd.config.model.borrowers import (
    DEFAULT_USAGE_RETENTION_DAYS,
    RESERVED_BORROWER_NAME,
    BorrowerSettings,
)
from vacancyd.config.model.kubernetes import (
    ClusterSettings,
    CompanionSettings,
    KubernetesSettings,
    LenderSettings,
)
from vacancyd.config.model.owner import (
    ExclusiveAppSettings,
    OwnerSettings,
    ScheduleExceptionSettings,
    ScheduleSettings,
    WindowSettings,
)
from vacancyd.config.model.resources import CollectorSettings, PressureSettings, ResourceSettings
from vacancyd.config.model.server import (
    LimitsSettings,
    ServerSettings,
    TelemetrySettings,
    TokenSettings,
)
from vacancyd.config.model.settings import Settings
from vacancyd.config.model.upstreams import (
    DEFAULT_DETACHED_WORK_TIMEOUT_S,
    DEFAULT_MAX_WAITING,
    DEFAULT_UNLOAD_TIMEOUT_S,
    DEFAULT_UPSTREAM_SILENCE_S,
    DEFAULT_WAIT_TIMEOUT_S,
    ModelsSettings,
    PoolSettings,
    UpstreamSettings,
)

__all__ = [
    "DEFAULT_DETACHED_WORK_TIMEOUT_S",
    "DEFAULT_MAX_WAITING",
    "DEFAULT_UNLOAD_TIMEOUT_S",
    "DEFAULT_UPSTREAM_SILENCE_S",
    "DEFAULT_USAGE_RETENTION_DAYS",
    "DEFAULT_WAIT_TIMEOUT_S",
    "DNS_LABEL_PATTERN",
    "FOLLOWED_SHUTDOWN_DELAY_S",
    "NAME_PATTERN",
    "RESERVED_BORROWER_NAME",
    "SECRET_FILE_MAX_BYTES",
    "BorrowerSettings",
    "ClusterSettings",
    "CollectorSettings",
    "CompanionSettings",
    "ExclusiveAppSettings",
    "FrozenModel",
    "KubernetesSettings",
    "LenderSettings",
    "LimitsSettings",
    "ModelsSettings",
    "Name",
    "OwnerSettings",
    "PoolSettings",
    "PressureSettings",
    "ResourceSettings",
    "ScheduleExceptionSettings",
    "ScheduleSettings",
    "Scope",
    "ServerSettings",
    "Settings",
    "TelemetrySettings",
    "TokenSettings",
    "UpstreamSettings",
    "WindowSettings",
    "check_listen",
    "is_loopback",
    "read_secret_file",
    "secret_path",
    "split_listen",
]
