"""``[server]``: the API listener, its bearer tokens and per-listener limits; ``[telemetry]``."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import AnyHttpUrl, Field, SecretStr, StrictBool, field_validator, model_validator

from vacancyd.config.model.base import (
    FrozenModel,
    Scope,
    check_listen,
    read_secret_file,
    secret_path,
)


class TokenSettings(FrozenModel):
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


class LimitsSettings(FrozenModel):
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


class ServerSettings(FrozenModel):
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

    _listen = field_validator("listen")(check_listen)

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


class TelemetrySettings(FrozenModel):
    """OpenTelemetry tracing (docs/observability.md "Traces"). Off unless ``otlp_endpoint``
    is set: an OTLP/HTTP collector base URL (``/v1/traces`` is appended when it has no
    path). ``sample_ratio`` (0-1) samples new traces; a borrower's sampled ``traceparent``
    is always followed. Needs the ``otel`` extra."""

    otlp_endpoint: AnyHttpUrl | None = None
    service_name: str = Field("vacancyd", min_length=1, max_length=200)
    sample_ratio: float = Field(1.0, ge=0, le=1)
