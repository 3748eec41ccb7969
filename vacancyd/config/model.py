"""Pydantic models, one per TOML table. Every key and its unit is documented in
docs/configuration.md; ``vacancyd.example.toml`` is a commented instance validated by a test.

Unknown keys are errors (``extra="forbid"``) and the models are frozen.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    field_validator,
    model_validator,
)

from vacancyd.config.files import read_regular_file
from vacancyd.config.zone import zone_by_name
from vacancyd.core import presence as presence_rules
from vacancyd.core import schedule as schedule_rules
from vacancyd.core.gpu import GpuSelector

Scope = Literal["borrow", "read", "admin", "probe"]
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
#: A Kubernetes DNS-1123 label (namespace, Service name).
DNS_LABEL_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def split_listen(value: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port`` into (host, port); raises ValueError."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port {port_s!r} is not a number") from None
    if not 0 <= port < 65536:
        raise ValueError(f"port {port} is out of range 0-65535 (0 picks a free port)")
    return host, port


def is_loopback(host: str) -> bool:
    """True for loopback addresses and the name ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Secrets are short; a token file larger than this is a mistake (or /dev/urandom).
SECRET_FILE_MAX_BYTES = 64 * 1024
#: Seconds a followed lender's listeners keep answering after SIGTERM (the default
#: ``shutdown_delay_s`` with ``[kubernetes]``, and the least whenever an ``/events`` follower
#: is connected at the stop): what being published not-ready takes to reach kube-proxy.
FOLLOWED_SHUTDOWN_DELAY_S = 2.0


def read_secret_file(path: Path) -> str:
    """Read a token or credential file: a regular file of at most 64 KiB, UTF-8, stripped.

    Raises ValueError (with the reason) for anything else, including I/O errors; a FIFO or
    a device is refused at once (:func:`vacancyd.config.files.read_regular_file`).
    """
    data = read_regular_file(path, SECRET_FILE_MAX_BYTES)
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret


def secret_path(path: Path, credentials: Path | None) -> Path:
    """Where a token or credential file is read from.

    Under the systemd unit (``credentials``: the service's ``$CREDENTIALS_DIRECTORY``) a
    secret file is passed with ``LoadCredential=`` as the credential named after its file
    name, so ``/etc/vacancyd/tokens/admin.token`` is read from
    ``$CREDENTIALS_DIRECTORY/admin.token`` when that credential exists; otherwise (no
    credentials, or none of that name) from ``path`` itself.
    """
    if credentials is not None:
        candidate = credentials / path.name
        if os.path.exists(candidate):  # False also when the directory cannot be searched
            return candidate
    return path


def _check_listen(value: str) -> str:
    host, _ = split_listen(value)
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"listen host {host!r} must be an IP address or localhost") from None
    return value


class TokenSettings(_Model):
    """A bearer token and the scopes it grants. Exactly one of ``token``/``token_file``."""

    name: str = "token"
    token: SecretStr | None = None
    token_file: Path | None = None
    scopes: list[Scope] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> TokenSettings:
        if (self.token is None) == (self.token_file is None):
            raise ValueError("set exactly one of token or token_file")
        if self.token is not None and len(self.token.get_secret_value()) < 16:
            raise ValueError("token must be at least 16 characters")
        return self

    def secret(self, credentials: Path | None = None) -> str:
        """The token value; reads ``token_file`` (from ``credentials`` when the service was
        passed it: :func:`secret_path`). Raises ValueError if it cannot be used."""
        if self.token is not None:
            return self.token.get_secret_value()
        assert self.token_file is not None
        return read_secret_file(secret_path(self.token_file, credentials))


class LimitsSettings(_Model):
    """Per-listener protections (docs/architecture.md). Sizes MiB, times seconds."""

    max_request_body_mib: int = Field(64, ge=1, le=4096)
    max_passthrough_body_kib: int = Field(1024, ge=0, le=1024 * 1024)
    max_buffered_body_mib: int | None = Field(None, ge=1, le=65536)
    header_read_timeout_s: float = Field(15.0, gt=0, le=3600)
    keepalive_timeout_s: float = Field(75.0, gt=0, le=86400)
    max_connections: int = Field(256, ge=1, le=100_000)
    max_unauthenticated_connections: int | None = Field(None, ge=1, le=100_000)
    max_unauthenticated_per_peer: int = Field(16, ge=1, le=100_000)
    unauthenticated_timeout_s: float = Field(10.0, gt=0, le=3600)
    max_event_subscribers: int = Field(32, ge=1, le=10_000)
    body_read_timeout_s: float = Field(120.0, gt=0, le=86400)
    body_idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    write_stall_timeout_s: float = Field(60.0, gt=0, le=3600)
    upstream_connect_timeout_s: float = Field(10.0, gt=0, le=600)

    @property
    def unauthenticated_cap(self) -> int:
        """Unauthenticated connections per listener: the configured value, else half of
        ``max_connections`` (at least 1), never more than ``max_connections``."""
        if self.max_unauthenticated_connections is not None:
            return min(self.max_unauthenticated_connections, self.max_connections)
        return max(1, self.max_connections // 2)

    @property
    def buffered_budget_mib(self) -> int:
        """Per-proxy body budget: the configured value, else max(256, max_request_body_mib)."""
        if self.max_buffered_body_mib is not None:
            return self.max_buffered_body_mib
        return max(256, self.max_request_body_mib)


class ServerSettings(_Model):
    """The API listener and authentication (docs/architecture.md)."""

    listen: str = "127.0.0.1:9470"
    tokens: list[TokenSettings] = []
    trust_loopback: StrictBool = False
    allow_unauthenticated_remote: StrictBool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    server_names: list[Annotated[str, Field(min_length=1, max_length=253)]] = []
    allowed_origins: list[Annotated[str, Field(min_length=1, max_length=300)]] = []
    #: Addresses or networks of reverse proxies whose client-address headers are believed
    #: when they relay a request (docs/configuration.md, THREAT_MODEL.md).
    trusted_proxies: list[Annotated[str, Field(min_length=1, max_length=64)]] = []
    #: After SIGTERM, the most seconds borrowed work in flight gets to finish (the drain).
    shutdown_grace_s: float = Field(20.0, ge=0, le=3600)
    #: After SIGTERM, the least seconds the listeners keep answering (with refusals) even
    #: when nothing is in flight; None: FOLLOWED_SHUTDOWN_DELAY_S with ``[kubernetes]`` (the
    #: endpoints' change has to reach kube-proxy), else 0. Whatever it says, a lender with an
    #: ``/events`` follower at the stop (the companion) keeps them up that long too.
    shutdown_delay_s: float | None = Field(None, ge=0, le=600)
    limits: LimitsSettings = LimitsSettings()

    _listen = field_validator("listen")(_check_listen)

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (such as 127.0.0.1 or 10.0.0.0/8)"
                ) from None
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.shutdown_delay_s is not None and self.shutdown_delay_s > self.shutdown_grace_s:
            raise ValueError(
                f"shutdown_delay_s ({self.shutdown_delay_s:g}) cannot exceed "
                f"shutdown_grace_s ({self.shutdown_grace_s:g}): the drain never outlasts "
                "its grace"
            )
        return self


class ExclusiveAppSettings(_Model):
    """A program that holds lending while it runs (docs/presence.md "Exclusive apps").

    ``name``: the program's name, matched like ``[owner] processes``. ``scope``: ``host``
    holds every upstream; ``gpu`` holds only upstreams that depend on a GPU resource.
    """

    name: str
    scope: Literal["host", "gpu"] = "host"

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        why = presence_rules.validate_process_name(name)
        if why is not None:
            raise ValueError(f"exclusive app name must be a program name: {why}")
        return name


class OwnerSettings(_Model):
    """Owner presence (docs/architecture.md). ``presence`` unset: an unknown reading that refuses.

    ``release_after_s``: consecutive clear seconds before the host policy veto releases.
    ``presence``: "logind" reads systemd-logind over D-Bus; "auto" is logind on Linux and an
    unknown, non-refusing reading elsewhere; "headless" is a fixed logged-out reading.
    ``bus_address``: D-Bus address of the bus logind is on (default: the system bus).
    ``processes``: owner-process names that hold the machine while their user's desktop is
    unlocked, even when it is idle. ``idle_after_s``: seconds a session's idle hint must have
    held before it counts as away. ``remote_graphical``: "count" (the default) treats remote
    x11/wayland sessions (remote desktop, VNC) like local ones; "ignore" does not count them.
    ``signals``: subscribe to logind's change signals (false: polling only).
    ``lend_on_battery``: lend while running on battery; ``min_battery_percent``: hold while a
    battery is below this charge. ``exclusive_apps`` hold lending while they run, once seen
    for ``exclusive_grace_s`` and until ``exclusive_resume_after_s`` after the last one
    exits. ``present_max_model_mib``: while the owner is present, resource-scoped upstreams
    lend only requests whose footprint is at most this many MiB (unset: no limit).
    """

    presence: Literal["headless", "logind", "auto"] | None = None
    release_after_s: float = Field(60.0, ge=0, le=86400)
    bus_address: str | None = Field(None, min_length=1)
    processes: list[str] = []
    idle_after_s: float = Field(0.0, ge=0, le=86400)
    remote_graphical: Literal["ignore", "count"] = "count"
    signals: StrictBool = True
    lend_on_battery: StrictBool = False
    min_battery_percent: float | None = Field(None, gt=0, le=100)
    exclusive_apps: list[ExclusiveAppSettings] = []
    exclusive_grace_s: float = Field(5.0, ge=0, le=3600)
    exclusive_resume_after_s: float = Field(60.0, ge=0, le=86400)
    present_max_model_mib: int | None = Field(None, ge=0)

    @field_validator("processes")
    @classmethod
    def _process_names(cls, names: list[str]) -> list[str]:
        problems = [
            f"[{i}] {why}"
            for i, name in enumerate(names)
            if (why := presence_rules.validate_process_name(name)) is not None
        ]
        if problems:
            raise ValueError("owner process names must be program names: " + "; ".join(problems))
        return names


def _minutes(value: str | None, key: str, default: int) -> int:
    if value is None:
        return default
    try:
        return schedule_rules.parse_time_of_day(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


class WindowSettings(_Model):
    """A weekly lending window. ``days``: weekday names (``mon`` … ``sun``). ``start``/``end``:
    ``HH:MM`` local time; ``end`` unset means midnight at the end of the day. An ``end`` before
    ``start`` is accepted only with ``across_midnight = true``."""

    days: list[str] = Field(min_length=1)
    start: str = "00:00"
    end: str | None = None
    across_midnight: StrictBool = False

    def to_window(self) -> schedule_rules.Window:
        """The core's window; raises ValueError naming the bad value."""
        days = frozenset(schedule_rules.parse_weekday(d) for d in self.days)
        start = _minutes(self.start, "start", 0)
        end = _minutes(self.end, "end", schedule_rules.MINUTES_PER_DAY)
        return schedule_rules.Window(days, start, end, self.across_midnight)

    @model_validator(mode="after")
    def _valid(self) -> WindowSettings:
        self.to_window()
        return self


class ScheduleExceptionSettings(_Model):
    """A dated exception: on ``date`` (a TOML date), from ``start`` to ``end`` (the whole day
    by default), lending is ``lend`` (default false: a holiday) whatever the windows say."""

    date: dt.date
    lend: StrictBool = False
    start: str = "00:00"
    end: str | None = None

    def to_exception(self) -> schedule_rules.Exception_:
        start = _minutes(self.start, "start", 0)
        end = _minutes(self.end, "end", schedule_rules.MINUTES_PER_DAY)
        return schedule_rules.Exception_(self.date, self.lend, start, end)

    @model_validator(mode="after")
    def _valid(self) -> ScheduleExceptionSettings:
        self.to_exception()
        return self


class ScheduleSettings(_Model):
    """When lending is allowed (docs/presence.md "Lending schedule"). ``timezone``: an IANA
    zone name; unset means the host's local zone."""

    timezone: str | None = None
    window: list[WindowSettings] = Field(min_length=1)
    exception: list[ScheduleExceptionSettings] = []

    @field_validator("timezone")
    @classmethod
    def _zone(cls, name: str | None) -> str | None:
        if name is not None:
            zone_by_name(name)
        return name

    @model_validator(mode="after")
    def _valid(self) -> ScheduleSettings:
        self.build(dt.UTC, "UTC")
        return self

    def build(self, tz: dt.tzinfo, zone: str) -> schedule_rules.Schedule:
        """The core's schedule in ``tz``; raises ValueError."""
        return schedule_rules.Schedule(
            tuple(w.to_window() for w in self.window),
            tz,
            zone,
            tuple(e.to_exception() for e in self.exception),
        )


class CollectorSettings(_Model):
    """Sampling cadence. ``poll_s`` is the general poll; probes past ``probe_timeout_s`` fail."""

    poll_s: float = Field(3.0, ge=0.1, le=300)
    probe_timeout_s: float = Field(2.0, gt=0, le=60)


class PressureSettings(_Model):
    """GPU pressure for one ``kind = "gpu"`` resource.

    ``enabled``: attribute the GPU's per-process load and refuse while the owner presses it.
    ``poll_ms``: pressure sampling period (milliseconds); the gap limit is
    max(3 × poll_ms, 20 s). ``engage_after_s`` / ``release_after_s``: how long owner load must
    stay above / below the threshold before pressure engages / releases. ``threshold_cap``:
    the highest threshold (0–1 load) learning may reach. ``fixed_threshold``: a 0–1 threshold
    that replaces learning (the GPU is then lendable without calibration).
    ``calibration_s``: observed seconds before a learned threshold is trusted.
    ``rise_per_hour``: how far (0–1 load) a learned threshold may rise per observed hour.
    ``half_life_h``: observed hours after which a sample weighs half in the histogram.
    """

    enabled: StrictBool = True
    poll_ms: int = Field(2000, ge=100, le=60_000)
    engage_after_s: float = Field(4.0, ge=0, le=3600)
    release_after_s: float = Field(30.0, ge=0, le=86400)
    threshold_cap: float = Field(0.30, gt=0, le=1)
    fixed_threshold: float | None = Field(None, gt=0, le=1)
    calibration_s: float = Field(1800.0, ge=0, le=30 * 86400)
    rise_per_hour: float = Field(0.05, ge=0, le=1)
    half_life_h: float = Field(168.0, gt=0, le=24 * 365)

    @model_validator(mode="after")
    def _fixed_under_cap(self) -> PressureSettings:
        if self.fixed_threshold is not None and self.fixed_threshold > self.threshold_cap:
            raise ValueError("fixed_threshold is above threshold_cap")
        return self

    @property
    def poll_s(self) -> float:
        return self.poll_ms / 1000.0


class ResourceSettings(_Model):
    """A declared resource (docs/configuration.md).

    ``device`` selects the GPU (gpu only): an NVML index (``0``), a UUID (``"GPU-…"``) or a
    PCI bus id (``"0000:01:00.0"``); unset means index 0. ``min_free_mib``: MiB that must stay
    free. ``max_utilization``: 0–1 ratio above which the resource is not lendable.
    ``stale_after_s``: default 3 × the general poll, at least 5 s. ``pressure``: GPU pressure
    settings (gpu only).
    """

    name: Name
    kind: Literal["gpu", "memory", "cpu"]
    enabled: StrictBool = True
    device: int | str | None = None
    min_free_mib: int = Field(0, ge=0)
    max_utilization: float | None = Field(None, ge=0, le=1)
    stale_after_s: float | None = Field(None, gt=0, le=3600)
    pressure: PressureSettings | None = None

    @model_validator(mode="after")
    def _kind_rules(self) -> ResourceSettings:
        if self.kind == "cpu" and self.min_free_mib:
            raise ValueError("min_free_mib does not apply to a cpu resource (no byte capacity)")
        if self.kind != "gpu" and self.device is not None:
            raise ValueError("device applies only to kind = 'gpu'")
        if self.kind != "gpu" and self.pressure is not None:
            raise ValueError("pressure applies only to kind = 'gpu'")
        if self.kind == "gpu":
            GpuSelector.parse(self.device)  # raises ValueError with the reason
        return self

    @property
    def gpu_pressure(self) -> PressureSettings | None:
        """Effective pressure settings: on by default for a GPU, None when off or not a GPU."""
        if self.kind != "gpu":
            return None
        settings = self.pressure or PressureSettings()
        return settings if settings.enabled else None

    @property
    def device_key(self) -> str:
        """The GPU selector in normal form, for duplicate detection."""
        sel = GpuSelector.parse(self.device)
        return f"{sel.kind}:{sel.value.lower()}"


class ModelsSettings(_Model):
    """Per-model load requirements in MiB, charged against the upstream's primary resource."""

    default_mib: int = Field(0, ge=0)
    footprint_mib: dict[str, Annotated[int, Field(ge=0)]] = {}


#: Defaults of the sharing keys (docs/configuration.md).
DEFAULT_WAIT_TIMEOUT_S = 30.0
DEFAULT_MAX_WAITING = 32
DEFAULT_UNLOAD_TIMEOUT_S = 30.0
#: Default of ``upstream_silence_s`` (docs/configuration.md).
DEFAULT_UPSTREAM_SILENCE_S = 300.0
#: Default of ``detached_work_timeout_s`` (docs/configuration.md).
DEFAULT_DETACHED_WORK_TIMEOUT_S = 60.0


class UpstreamSettings(_Model):
    """One gated listener in front of one inference server (docs/architecture.md)."""

    name: Name
    adapter: Literal["openai", "llamacpp", "ollama", "comfyui", "vllm"]
    listen: str
    target: AnyHttpUrl
    resource: Name
    also_requires: list[Name] = []
    models: ModelsSettings = ModelsSettings()
    resident_min_free_mib: int = Field(0, ge=0)
    owner_scope: Literal["host", "resource"] = "host"
    management: Literal["deny", "allow"] = "deny"
    forward_authorization: StrictBool = False
    credential: SecretStr | None = None
    credential_file: Path | None = None
    refusal_status: Literal[503, 429] = 503
    retry_after_max_s: int | None = Field(None, ge=1, le=86400)
    #: A host-scoped upstream that lends small models while the owner is present
    #: (``[owner] present_max_model_mib``; docs/presence.md).
    lend_while_present: StrictBool = False
    #: The lendability probe (docs/balancers.md) answers without a token.
    public_probe: StrictBool = False
    # Reclaim keys (docs/reclaim.md; docs/configuration.md "[[upstream]] (reclaim keys)").
    on_owner_return: Literal["drain", "cancel", "finish"] = "drain"
    drain_timeout_s: float = Field(30.0, ge=0, le=86400)
    completion_timeout_s: float | None = Field(None, ge=0, le=7 * 86400)
    yield_on_veto: StrictBool = False
    warm_model: str | None = Field(None, min_length=1, max_length=300)
    #: Longest an Ollama model may stay loaded after a borrowed request (its ``keep_alive``),
    #: in seconds; longer requests, "forever" and none at all are capped to it.
    keep_alive_max_s: float = Field(300.0, ge=0, le=86400, strict=True)
    #: Seconds the upstream may send nothing for a borrowed job (before its reply, or
    #: between two pieces of it) before the job is given up and held; 0: no limit.
    upstream_silence_s: float = Field(DEFAULT_UPSTREAM_SILENCE_S, ge=0, le=86400, strict=True)
    #: Seconds a borrowed job whose borrower disconnected stays tracked while the server
    #: may still be generating for it, before it is held (llamacpp only; default 60).
    detached_work_timeout_s: float | None = Field(None, ge=0, le=86400, strict=True)
    websocket_max_tunnels: int = Field(32, ge=0, le=10_000)
    websocket_idle_timeout_s: float = Field(300.0, gt=0, le=86400)
    allowed_origins: list[Annotated[str, Field(min_length=1, max_length=300)]] = []
    forwarded_headers: Literal["replace", "drop", "append"] = "replace"
    pass_response_headers: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,100}$")]] = []
    # Sharing keys (docs/configuration.md "[[upstream]] (sharing keys)").
    max_concurrent: int = Field(1, ge=1, le=1024)
    busy: Literal["refuse", "wait"] = "refuse"
    wait_timeout_s: float | None = Field(None, gt=0, le=3600)
    max_waiting: int | None = Field(None, ge=1, le=100_000)
    exclusive_of: list[Name] = []
    unload_timeout_s: float | None = Field(None, gt=0, le=600)
    on_unload_timeout: Literal["forward", "refuse"] | None = None

    _listen = field_validator("listen")(_check_listen)

    @property
    def wait_timeout(self) -> float:
        """Seconds a request may wait for a slot (``busy = "wait"``); default 30."""
        return DEFAULT_WAIT_TIMEOUT_S if self.wait_timeout_s is None else self.wait_timeout_s

    @property
    def waiting_limit(self) -> int:
        """Most requests that may wait at once (``busy = "wait"``); default 32."""
        return DEFAULT_MAX_WAITING if self.max_waiting is None else self.max_waiting

    @property
    def silence_limit(self) -> float | None:
        """Seconds of upstream silence after which a borrowed job is held; None: no limit."""
        return self.upstream_silence_s or None

    @property
    def detached_work_timeout(self) -> float:
        """Seconds a disconnected borrower's job stays tracked before it is held; default 60."""
        if self.detached_work_timeout_s is None:
            return DEFAULT_DETACHED_WORK_TIMEOUT_S
        return self.detached_work_timeout_s

    @property
    def unload_timeout(self) -> float:
        """Seconds an exclusive job waits for the other servers' models to go; default 30."""
        return DEFAULT_UNLOAD_TIMEOUT_S if self.unload_timeout_s is None else self.unload_timeout_s

    @field_validator("target")
    @classmethod
    def _target(cls, value: AnyHttpUrl) -> AnyHttpUrl:
        if value.scheme != "http":
            raise ValueError("target must be an http:// URL (a local inference server)")
        if value.path not in (None, "", "/") or value.query or value.fragment:
            raise ValueError("target must be scheme://host:port with no path or query")
        if value.username or value.password:
            # Forwarded requests carry only the host and port, so a user:password here
            # would silently never reach the server.
            raise ValueError(
                "target must not carry user:password; "
                "a key for the server goes in credential or credential_file"
            )
        return value

    @model_validator(mode="after")
    def _credentials(self) -> UpstreamSettings:
        if self.credential is not None and self.credential_file is not None:
            raise ValueError("set at most one of credential or credential_file")
        if self.forward_authorization and (self.credential or self.credential_file):
            raise ValueError("forward_authorization and an upstream credential exclude each other")
        if self.resource in self.also_requires:
            raise ValueError("also_requires repeats the primary resource")
        if len(set(self.also_requires)) != len(self.also_requires):
            raise ValueError("also_requires lists a resource twice")
        if self.yield_on_veto and self.adapter in ("openai", "llamacpp"):
            raise ValueError(
                f"yield_on_veto needs a server with an unload API (ollama, comfyui) or vLLM's "
                f"sleep mode (vllm); the {self.adapter!r} adapter can only refuse new work "
                "(see docs/reclaim.md)"
            )
        if self.warm_model is not None and self.adapter != "ollama":
            raise ValueError("warm_model applies only to adapter = 'ollama'")
        if "keep_alive_max_s" in self.model_fields_set and self.adapter != "ollama":
            raise ValueError("keep_alive_max_s applies only to adapter = 'ollama'")
        if self.detached_work_timeout_s is not None and self.adapter != "llamacpp":
            raise ValueError(
                "detached_work_timeout_s applies only to adapter = 'llamacpp' (the one server "
                "whose idleness after a borrower's disconnect vacancyd can observe; see "
                "docs/footprints.md)"
            )
        if self.lend_while_present and self.owner_scope == "resource":
            raise ValueError(
                "lend_while_present applies to host-scoped upstreams; a resource-scoped one "
                "already lends while the owner is present (within present_max_model_mib)"
            )
        if self.completion_timeout_s is not None and self.on_owner_return != "finish":
            raise ValueError("completion_timeout_s applies only to on_owner_return = 'finish'")
        if self.busy != "wait":
            for key in ("wait_timeout_s", "max_waiting"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies only to busy = 'wait'")
        if not self.exclusive_of:
            for key in ("unload_timeout_s", "on_unload_timeout"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies only to an upstream with exclusive_of")
        if self.name in self.exclusive_of:
            raise ValueError("exclusive_of names the upstream itself")
        if len(set(self.exclusive_of)) != len(self.exclusive_of):
            raise ValueError("exclusive_of lists an upstream twice")
        return self

    def upstream_credential(self, credentials: Path | None = None) -> str | None:
        """The credential sent to the upstream as a bearer token, if any; ``credential_file``
        is read from ``credentials`` when the service was passed it (:func:`secret_path`).

        Raises ValueError when ``credential_file`` cannot be used.
        """
        if self.credential is not None:
            return self.credential.get_secret_value()
        if self.credential_file is not None:
            return read_secret_file(secret_path(self.credential_file, credentials))
        return None


class PoolSettings(_Model):
    """One listener in front of several upstreams, each on its own GPU (``[[pool]]``).

    ``members``: names of ``[[upstream]]`` entries, all with the same adapter. A borrowed
    work request goes to the member that can lend it with the most room; every other request
    (model lists, health) goes to the first member, with that member's ``management`` and
    authorization settings.
    """

    name: Name
    listen: str
    members: list[Name] = Field(min_length=1)

    _listen = field_validator("listen")(_check_listen)

    @field_validator("members")
    @classmethod
    def _distinct(cls, members: list[str]) -> list[str]:
        if len(set(members)) != len(members):
            raise ValueError("members lists an upstream twice")
        return members


class ClusterSettings(_Model):
    """How vacancyd reaches a Kubernetes API server and what it writes there.

    ``kubeconfig``: a kubeconfig file; unset means in-cluster credentials when running in a
    Pod, else ``$KUBECONFIG`` or ``~/.kube/config``. ``namespace``: where the EndpointSlices
    live (the Services' namespace). ``services`` maps an upstream name to its gated Service;
    unset upstreams use ``service_prefix + "-" + upstream``. With ``direct_services`` each
    upstream also joins ``SERVICE-direct``, ready while the lender is alive. Times are seconds:
    ``heartbeat_s`` between Node condition refreshes when nothing changes, ``resync_s``
    between re-applies of the EndpointSlices (which repairs outside edits),
    ``request_timeout_s`` per API call, ``backoff_max_s`` the longest wait after API errors,
    ``lendable_stable_s`` how long an upstream that was published not lendable must stay
    lendable before it is published lendable again (not-lendable is always published at once).
    """

    kubeconfig: Path | None = None
    context: str | None = None
    namespace: str = Field("default", pattern=DNS_LABEL_PATTERN)
    service_prefix: str = Field("vacancyd", pattern=r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
    services: dict[Name, Annotated[str, Field(pattern=DNS_LABEL_PATTERN)]] = {}
    direct_services: StrictBool = True
    heartbeat_s: float = Field(60.0, ge=0.5, le=3600)
    resync_s: float = Field(30.0, ge=0.5, le=3600)
    request_timeout_s: float = Field(10.0, gt=0, le=300)
    backoff_max_s: float = Field(60.0, ge=1, le=3600)
    lendable_stable_s: float = Field(10.0, ge=0, le=3600)

    def service_for(self, upstream: str) -> str:
        return self.services.get(upstream) or f"{self.service_prefix}-{upstream}"


def _check_endpoint_ip(value: str | None) -> str | None:
    if value is not None:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"address {value!r} must be an IP address") from None
    return value


class KubernetesSettings(ClusterSettings):
    """Host-side publishing: the daemon writes its own Node conditions and EndpointSlices.

    ``node``: this host's Node name (unset: no Node conditions). ``address``: the IP the
    cluster reaches this host's proxy listeners at (unset: no EndpointSlices); the API server
    refuses loopback and link-local addresses. ``lender``: this host's name in EndpointSlice
    names and labels (default: ``node``, else the host name).
    """

    node: str | None = None
    address: str | None = None
    lender: Name | None = None

    _address = field_validator("address")(_check_endpoint_ip)


class TelemetrySettings(_Model):
    """OpenTelemetry tracing (docs/observability.md "Traces"). Off unless ``otlp_endpoint``
    is set: an OTLP/HTTP collector base URL (``/v1/traces`` is appended when it has no
    path). ``sample_ratio`` (0-1) samples new traces; a borrower's sampled ``traceparent``
    is always followed. Needs the ``otel`` extra."""

    otlp_endpoint: AnyHttpUrl | None = None
    service_name: str = Field("vacancyd", min_length=1, max_length=200)
    sample_ratio: float = Field(1.0, ge=0, le=1)


class Settings(_Model):
    """The whole configuration file."""

    server: ServerSettings = ServerSettings()
    owner: OwnerSettings = OwnerSettings()
    collectors: CollectorSettings = CollectorSettings()
    state_dir: Path = Path("/var/lib/vacancyd")
    resource: list[ResourceSettings] = []
    upstream: list[UpstreamSettings] = []
    pool: list[PoolSettings] = []
    kubernetes: KubernetesSettings | None = None
    schedule: ScheduleSettings | None = None
    telemetry: TelemetrySettings = TelemetrySettings()

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        names = [r.name for r in self.resource]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"resource names must be unique; repeated: {', '.join(dupes)}")
        unames = [u.name for u in self.upstream] + [p.name for p in self.pool]
        dupes = sorted({n for n in unames if unames.count(n) > 1})
        if dupes:
            raise ValueError(
                f"upstream and pool names must be unique; repeated: {', '.join(dupes)}"
            )
        listens = [
            listen
            for listen in (
                self.server.listen,
                *(u.listen for u in self.upstream),
                *(p.listen for p in self.pool),
            )
            if split_listen(listen)[1] != 0
        ]
        dupes = sorted({n for n in listens if listens.count(n) > 1})
        if dupes:
            raise ValueError(f"listen addresses must be unique; repeated: {', '.join(dupes)}")
        gpus = [r.device_key for r in self.resource if r.kind == "gpu"]
        if len(set(gpus)) != len(gpus):
            raise ValueError("two gpu resources select the same device")
        for i, up in enumerate(self.upstream):
            for dep in (up.resource, *up.also_requires):
                if dep not in names:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) names resource {dep!r}, which no "
                        f"[[resource]] declares (declared: {', '.join(names) or 'none'})"
                    )
        self._check_exclusivity()
        self._check_pools()
        if self.owner.present_max_model_mib is None:
            opted = [u.name for u in self.upstream if u.lend_while_present]
            if opted:
                raise ValueError(
                    "lend_while_present needs [owner] present_max_model_mib (the largest "
                    f"footprint lent while the owner is present): {', '.join(opted)}"
                )
        if not self.server.tokens and not self.server.allow_unauthenticated_remote:
            remote = (
                [
                    f"server.listen = {self.server.listen!r}"
                    for _ in [0]
                    if not is_loopback(split_listen(self.server.listen)[0])
                ]
                + [
                    f"upstream {u.name!r} listen = {u.listen!r}"
                    for u in self.upstream
                    if not is_loopback(split_listen(u.listen)[0])
                ]
                + [
                    f"pool {p.name!r} listen = {p.listen!r}"
                    for p in self.pool
                    if not is_loopback(split_listen(p.listen)[0])
                ]
            )
            if remote:
                raise ValueError(
                    "a non-loopback listener needs [[server.tokens]] (or the conspicuous "
                    "server.allow_unauthenticated_remote = true): " + "; ".join(remote)
                )
        return self

    def _check_exclusivity(self) -> None:
        by_name = {u.name: (i, u) for i, u in enumerate(self.upstream)}
        listed = {other for u in self.upstream for other in u.exclusive_of}
        for i, up in enumerate(self.upstream):
            for other in up.exclusive_of:
                if other not in by_name:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) exclusive_of names {other!r}, which no "
                        f"[[upstream]] declares"
                    )
                _, them = by_name[other]
                if them.resource != up.resource:
                    raise ValueError(
                        f"upstream[{i}] ({up.name}) is exclusive of {other!r}, but they are on "
                        f"different resources ({up.resource!r} and {them.resource!r}); "
                        "exclusivity shares one card, so both must name the same resource"
                    )
            if up.exclusive_of and up.name in listed:
                raise ValueError(
                    f"upstream[{i}] ({up.name}) both lists upstreams in exclusive_of and is "
                    "listed in another's; only one side of an exclusivity takes the card"
                )

    def _check_pools(self) -> None:
        by_name = {u.name: u for u in self.upstream}
        for i, pool in enumerate(self.pool):
            missing = [m for m in pool.members if m not in by_name]
            if missing:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) names {', '.join(map(repr, missing))}, which no "
                    "[[upstream]] declares"
                )
            adapters = sorted({by_name[m].adapter for m in pool.members})
            if len(adapters) > 1:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) mixes adapters ({', '.join(adapters)}); its "
                    "members must be servers of one kind"
                )
            if adapters == ["comfyui"]:
                raise ValueError(
                    f"pool[{i}] ({pool.name}) pools comfyui servers; a ComfyUI result is read "
                    "back from the server that ran the prompt, which a pool cannot route"
                )
            for m in pool.members:
                if by_name[m].exclusive_of or any(m in u.exclusive_of for u in self.upstream):
                    raise ValueError(
                        f"pool[{i}] ({pool.name}) member {m!r} takes part in an exclusivity; "
                        "a pool member must be a server of its own"
                    )

    @property
    def stale_after_default_s(self) -> float:
        return max(5.0, 3 * self.collectors.poll_s)

    @property
    def shutdown_delay_s(self) -> float:
        """``[server] shutdown_delay_s`` in force (seconds): as set, else 2 with
        ``[kubernetes]`` host publishing, else 0; never more than the grace."""
        delay = self.server.shutdown_delay_s
        if delay is None:
            delay = FOLLOWED_SHUTDOWN_DELAY_S if self.kubernetes is not None else 0.0
        return min(delay, self.server.shutdown_grace_s)

    @property
    def presence_max_age_s(self) -> float:
        """Presence older than four general polls, at least 15 s, is stale (docs/architecture.md
        2)."""
        return max(15.0, 4 * self.collectors.poll_s)


class LenderSettings(_Model):
    """One lender the companion follows (``[[lender]]`` in the companion's file).

    ``url``: the lender's API listener (``http://HOST:9470``, or ``https://`` when the lender
    serves TLS); ``token``/``token_file``: a bearer token with the read scope. ``address``:
    the IP its proxy listeners are reached at (default: ``url``'s host when it is an IP).
    ``node``: its Node name, for conditions. ``ca_file``: a PEM CA bundle to verify an
    ``https://`` lender's certificate with, in place of the companion's ``ca_file`` (a
    self-signed certificate or a private CA).
    """

    name: Name
    url: AnyHttpUrl
    token: SecretStr | None = None
    token_file: Path | None = None
    address: str | None = None
    node: str | None = None
    ca_file: Path | None = None

    _address = field_validator("address")(_check_endpoint_ip)

    @model_validator(mode="after")
    def _token(self) -> LenderSettings:
        if self.token is not None and self.token_file is not None:
            raise ValueError("set at most one of token or token_file")
        return self

    @property
    def endpoint_address(self) -> str | None:
        if self.address is not None:
            return self.address
        host = (self.url.host or "").strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return None
        return host

    def secret(self) -> str | None:
        """The read token; reads ``token_file``. Raises ValueError if it cannot be used."""
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is not None:
            return read_secret_file(self.token_file)
        return None


class CompanionSettings(_Model):
    """The in-cluster companion's configuration file (``vacancyd companion --config``).

    ``lender_timeout_s``: a lender that answers neither its event stream nor /status for this
    long is published as unreachable (not ready). ``status_poll_s``: seconds between /status
    reads even while events flow. ``listen``: the companion's own health and metrics listener.
    ``ca_file``: a PEM CA bundle that ``https://`` lenders' certificates are verified with
    (None: the system's CAs); a lender's own ``ca_file`` replaces it for that lender.
    """

    kubernetes: ClusterSettings = ClusterSettings()
    lender_timeout_s: float = Field(15.0, ge=1, le=3600)
    status_poll_s: float = Field(10.0, ge=0.2, le=3600)
    listen: str = "0.0.0.0:9471"
    ca_file: Path | None = None
    lender: list[LenderSettings] = Field(min_length=1)

    _listen = field_validator("listen")(_check_listen)

    @model_validator(mode="after")
    def _unique(self) -> CompanionSettings:
        names = [lender.name for lender in self.lender]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"lender names must be unique; repeated: {', '.join(dupes)}")
        return self
