"""``[[upstream]]`` (with its ``models``) and ``[[pool]]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AnyHttpUrl, Field, SecretStr, StrictBool, field_validator, model_validator

from vacancyd.config.model.base import (
    FrozenModel,
    Name,
    check_listen,
    read_secret_file,
    secret_path,
)


class ModelsSettings(FrozenModel):
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


class UpstreamSettings(FrozenModel):
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

    _listen = field_validator("listen")(check_listen)

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


class PoolSettings(FrozenModel):
    """One listener in front of several upstreams, each on its own GPU (``[[pool]]``).

    ``members``: names of ``[[upstream]]`` entries, all with the same adapter. A borrowed
    work request goes to the member that can lend it with the most room; every other request
    (model lists, health) goes to the first member, with that member's ``management`` and
    authorization settings.
    """

    name: Name
    listen: str
    members: list[Name] = Field(min_length=1)

    _listen = field_validator("listen")(check_listen)

    @field_validator("members")
    @classmethod
    def _distinct(cls, members: list[str]) -> list[str]:
        if len(set(members)) != len(members):
            raise ValueError("members lists an upstream twice")
        return members
