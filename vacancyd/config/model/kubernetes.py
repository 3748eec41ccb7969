"""``[kubernetes]`` host publishing, and the companion's file (``[kubernetes]``, ``[[lender]]``)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import AnyHttpUrl, Field, SecretStr, StrictBool, field_validator, model_validator

from vacancyd.config.model.base import (
    DNS_LABEL_PATTERN,
    FrozenModel,
    Name,
    check_listen,
    read_secret_file,
)


class ClusterSettings(FrozenModel):
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


class LenderSettings(FrozenModel):
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


class CompanionSettings(FrozenModel):
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

    _listen = field_validator("listen")(check_listen)

    @model_validator(mode="after")
    def _unique(self) -> CompanionSettings:
        names = [lender.name for lender in self.lender]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"lender names must be unique; repeated: {', '.join(dupes)}")
        return self
