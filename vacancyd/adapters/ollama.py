"""Ollama (ollama/ollama ``server/routes.go`` ``GenerateRoutes``, ``api/types.go``).

Routes: inference (native NDJSON and the OpenAI/Anthropic shims) is work; ``/``,
``/api/version``, ``/api/tags``, ``/api/show`` and the ``/v1/models`` reads pass through so a
borrower can find models and check health while lending is off. ``/api/ps`` shows which
models the owner has loaded and when they were last used, so it is management, as are the
model store, account and cloud routes. Every work route reads the model from the JSON body's
``model`` field, as the handlers' request structs do (``GenerateRequest.Model``,
``ChatRequest.Model``, ``EmbedRequest.Model``).

Reclaim (docs/reclaim.md): Ollama cannot cancel a request other than by its connection
closing, and keeps a model resident after the request that loaded it ends (for its
``keep_alive``, default 5 minutes). With ``yield_on_veto`` the controller lists
``GET /api/ps`` and sends ``POST /api/generate {"model": M, "keep_alive": 0}`` (no prompt) for
each model; that call only marks the runner expired and answers at once, and the runner is
freed once its in-flight requests end, so the controller then polls ``/api/ps`` for a short
while to report what is still resident. Servers too old to unload an embedding-only model
through the generate route (it answered 400 there before the unload branch preceded the
capability check) get the same request on ``/api/embed``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from yarl import URL

from vacancyd.adapters import bodyparse
from vacancyd.adapters.base import Adapter, UpstreamError
from vacancyd.core import residency
from vacancyd.core.classify import Route, RouteClass, RouteTable, route
from vacancyd.core.observations import ProbeError
from vacancyd.core.residency import ResidentModel
from vacancyd.core.snapshot import ServerState

log = logging.getLogger(__name__)
MIB = 1024 * 1024

WORK, PASS, MGMT = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT

TABLE = RouteTable(
    "ollama",
    (
        route("POST", "/api/generate", WORK),
        route("POST", "/api/chat", WORK),
        route("POST", "/api/embed", WORK),
        route("POST", "/api/embeddings", WORK),
        route("POST", "/v1/chat/completions", WORK),
        route("POST", "/v1/completions", WORK),
        route("POST", "/v1/embeddings", WORK),
        route("POST", "/v1/responses", WORK),
        route("POST", "/v1/messages", WORK),
        route("POST", "/v1/audio/transcriptions", WORK),
        route("GET", "/", PASS, no_query=True),
        route("GET", "/api/version", PASS),
        route("GET", "/api/tags", PASS),
        route("POST", "/api/show", PASS),
        route("GET", "/v1/models", PASS),
        route("GET", "/v1/models/{}", PASS),
        route("GET", "/api/ps", MGMT),
        route("GET", "/api/status", MGMT),
        route("POST", "/api/pull", MGMT),
        route("POST", "/api/push", MGMT),
        route("POST", "/api/create", MGMT),
        route("POST", "/api/copy", MGMT),
        route("DELETE", "/api/delete", MGMT),
        route("GET POST", "/api/blobs/{}", MGMT),
        route("POST", "/api/me", MGMT),
        route("POST", "/api/signout", MGMT),
        route("DELETE", "/api/user/keys/{}", MGMT),
        route("POST", "/api/experimental/web_search", MGMT),
        route("POST", "/api/experimental/web_fetch", MGMT),
        route("GET", "/api/experimental/model-recommendations", MGMT),
    ),
)

#: How long an unload keeps polling /api/ps for the runners to go (seconds); the reclaim's
#: own ten-second deadline bounds the whole unload.
CONFIRM_S = 3.0
CONFIRM_INTERVAL_S = 0.1


def parse_ps(payload: Any) -> list[str]:
    """Model names from ``GET /api/ps`` (``ProcessResponse``: ``{"models": [{"name", ...}]}``).

    Raises :class:`UpstreamError` for any other shape.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("models"), list | None):
        raise UpstreamError("/api/ps did not return {'models': [...]}")
    names = []
    for entry in payload.get("models") or []:
        name = entry.get("name") or entry.get("model") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise UpstreamError("/api/ps lists a model without a name")
        names.append(name)
    return names


class OllamaController:
    """Unload and warm reload for one Ollama server. Cancels nothing itself."""

    can_cancel = False

    def __init__(self, session: aiohttp.ClientSession, target: URL) -> None:
        self.session = session
        self.target = target

    def prepare(self, route: Route, body: bytes) -> tuple[bytes, str | None]:
        return body, None

    def allows_result(self, route: Route, path: str) -> bool:
        return True  # Ollama has no results routes

    async def wait_done(self, key: str) -> None:
        return None

    async def cancel(self, keys: list[str]) -> str:
        return "nothing to cancel: Ollama stops a request when its connection closes"

    async def _json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        try:
            async with self.session.request(
                method, self.target.with_path(path), json=body, allow_redirects=False
            ) as resp:
                text = await resp.text(errors="replace")
                try:
                    payload = json.loads(text) if text else None
                except ValueError:
                    payload = text
                return resp.status, payload
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"{method} {path} failed: {exc.__class__.__name__}: {exc}") from exc

    async def resident(self) -> list[str]:
        status, payload = await self._json("GET", "/api/ps")
        if status != 200:
            raise UpstreamError(f"GET /api/ps answered {status}")
        return parse_ps(payload)

    async def _unload_one(self, model: str) -> str | None:
        """Ask for ``model`` to be unloaded; returns an error sentence or None."""
        status, payload = await self._json(
            "POST", "/api/generate", {"model": model, "keep_alive": 0}
        )
        if status == 200:
            return None
        if status == 400:  # very old servers: embedding-only models refuse the generate route
            status, payload = await self._json(
                "POST", "/api/embed", {"model": model, "input": [], "keep_alive": 0}
            )
            if status == 200:
                return None
        return f"{model}: {status} {str(payload)[:200]}"

    async def unload(self, admitted: frozenset[str]) -> tuple[str, str]:
        models = await self.resident()
        if not models:
            return "unloaded", "no model was resident"
        errors = [e for e in await asyncio.gather(*(self._unload_one(m) for m in models)) if e]
        if errors and len(errors) == len(models):
            raise UpstreamError("every unload request failed: " + "; ".join(errors))
        loop = asyncio.get_running_loop()
        until = loop.time() + CONFIRM_S
        left = await self.resident()
        while left and loop.time() < until:
            await asyncio.sleep(CONFIRM_INTERVAL_S)
            left = await self.resident()
        detail = f"asked {len(models)} model(s) to unload ({', '.join(models)})"
        if errors:
            detail += "; failed: " + "; ".join(errors)
        if left:
            detail += (
                f"; still resident after {CONFIRM_S:g} s (in use by a request that has not "
                f"ended): {', '.join(left)}"
            )
        return "unloaded", detail

    async def warm(self, model: str) -> str:
        status, payload = await self._json("POST", "/api/generate", {"model": model})
        if status != 200:
            raise UpstreamError(f"load of {model!r} answered {status}: {str(payload)[:200]}")
        return "loaded"


def canonical_model(name: str) -> str:
    """Ollama's shortest display name (``types/model/name.go`` ``DisplayShortest``; matched
    case-insensitively, routes.go ``getExistingName``): the default host
    ``registry.ollama.ai`` and namespace ``library`` dropped, the tag always present
    (``:latest`` by default), lower case. ``Library/Llama3.2`` -> ``llama3.2:latest``."""
    parts = name.strip().lower().split("/")
    if len(parts) == 3 and parts[0] == "registry.ollama.ai":
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == "library":
        parts = parts[1:]
    if ":" not in parts[-1] and "@" not in parts[-1]:
        parts[-1] += ":latest"
    return "/".join(parts)


# -- residency observation -----------------------------------------------------------------

#: After a failed ``/api/show``, wait this long before asking about that digest again (s).
SHOW_RETRY_S = 60.0


def _size_mib(entry: Mapping[str, Any], key: str, name: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ProbeError(f"/api/ps entry {name!r} has a {key} that is not a byte count: {value!r}")
    return value / MIB


def parse_ps_models(payload: Any, wall_now: float) -> tuple[ResidentModel, ...]:
    """Read ``GET /api/ps`` (``api.ProcessResponse``) into resident models.

    ``wall_now``: wall-clock epoch seconds when the reply arrived, to turn ``expires_at``
    into seconds left. Names are canonicalised the way Ollama matches them. An entry whose
    ``expires_at`` cannot be parsed is kept with ``expires_in_s`` None (it earns no credit).
    Raises :class:`ProbeError` for a reply that is not ``{"models": [...]}``, an entry
    without a name, a field of the wrong type, or a model listed twice.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("models"), list | None):
        raise ProbeError("/api/ps did not return {'models': [...]}")
    models: list[ResidentModel] = []
    seen: set[str] = set()
    for entry in payload.get("models") or []:
        if not isinstance(entry, dict):
            raise ProbeError("/api/ps lists an entry that is not an object")
        raw = entry.get("name") or entry.get("model")
        if not isinstance(raw, str) or not raw.strip():
            raise ProbeError("/api/ps lists a model without a name")
        name = canonical_model(raw)
        if name in seen:
            raise ProbeError(f"/api/ps lists {name!r} twice; its residency is ambiguous")
        seen.add(name)
        digest = entry.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise ProbeError(f"/api/ps entry {name!r} has a digest that is not a string")
        context = entry.get("context_length")
        if context is not None and (
            isinstance(context, bool) or not isinstance(context, int) or context <= 0
        ):
            raise ProbeError(f"/api/ps entry {name!r} has an invalid context_length {context!r}")
        expires_in: float | None = None
        expires_error: str | None = None
        raw_expiry = entry.get("expires_at")
        if raw_expiry is None:
            expires_error = "expires_at is missing"
        else:
            try:
                expires_in = residency.parse_expires_at(raw_expiry) - wall_now
            except ValueError as exc:
                expires_error = str(exc)
        models.append(
            ResidentModel(
                name=name,
                digest=digest or None,
                size_mib=_size_mib(entry, "size", name),
                size_vram_mib=_size_mib(entry, "size_vram", name),
                context_length=context,
                expires_in_s=expires_in,
                expires_error=expires_error,
            )
        )
    return tuple(models)


def parse_modelfile_num_ctx(payload: Any) -> int | None:
    """The ``num_ctx`` a model's Modelfile sets, from ``POST /api/show``, or None.

    ``parameters`` holds one option per line, the name padded to 30 columns and then the
    value (in no fixed order), so each line is split on whitespace. Raises
    :class:`ProbeError` when the reply is not an object or ``num_ctx`` is not an integer.
    """
    if not isinstance(payload, dict):
        raise ProbeError("/api/show did not return an object")
    text = payload.get("parameters") or ""
    if not isinstance(text, str):
        raise ProbeError("/api/show parameters is not a string")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "num_ctx":
            try:
                value = int(parts[1])
            except ValueError:
                raise ProbeError(f"/api/show num_ctx {parts[1]!r} is not an integer") from None
            if value <= 0:
                raise ProbeError(f"/api/show num_ctx {value} is not positive")
            return value
    return None


class OllamaObserver:
    """Polls ``/api/ps`` (and ``/api/show`` once per new digest) for residency proofs.

    ``known`` returns the Modelfile contexts already read (persisted across restarts), so a
    digest is asked about once. Each call returns a :class:`ServerState` whose
    ``modelfile_num_ctx`` holds what this observer read; raises :class:`ProbeError` when
    ``/api/ps`` cannot be read. A failed ``/api/show`` is logged and retried after
    :data:`SHOW_RETRY_S`; until then that model earns no Modelfile-based credit.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: URL,
        known: Callable[[], Mapping[str, int | None]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.session = session
        self.target = target
        self.known = known
        self.clock = clock
        self.wall = wall
        self.version: str | None = None
        self._read: dict[str, int | None] = {}
        self._show_failed: dict[str, float] = {}

    async def _get_json(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self.session.request(
                method, self.target.with_path(path), json=body, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:200]
                    raise ProbeError(f"{method} {path} answered {resp.status}: {text}")
                return await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise ProbeError(f"{method} {path} failed: {exc.__class__.__name__}: {exc}") from exc
        except ValueError as exc:
            raise ProbeError(f"{method} {path} returned invalid JSON: {exc}") from exc

    async def __call__(self) -> ServerState:
        if self.version is None:
            try:
                payload = await self._get_json("GET", "/api/version")
                version = payload.get("version") if isinstance(payload, dict) else None
                self.version = version if isinstance(version, str) else "unknown"
            except ProbeError:
                self.version = None  # asked again next time; /api/ps decides the outcome
        try:
            payload = await self._get_json("GET", "/api/ps")
            models = parse_ps_models(payload, self.wall())
        except ProbeError:
            self.version = None  # the server may have been replaced: read it again
            raise
        known = self.known()
        for model in models:
            digest = model.digest
            if digest is None or digest in known or digest in self._read:
                continue
            failed = self._show_failed.get(digest)
            if failed is not None and self.clock() - failed < SHOW_RETRY_S:
                continue
            try:
                show = await self._get_json("POST", "/api/show", {"model": model.name})
                self._read[digest] = parse_modelfile_num_ctx(show)
                self._show_failed.pop(digest, None)
            except ProbeError as exc:
                self._show_failed[digest] = self.clock()
                log.warning(
                    "ollama at %s: cannot read the Modelfile of %s (%s); no Modelfile-based "
                    "residency credit for it until a retry in %g s succeeds",
                    self.target,
                    model.name,
                    exc,
                    SHOW_RETRY_S,
                )
        return ServerState(
            resident_models=frozenset(m.name for m in models),
            idle=None,
            models=models,
            version=self.version,
            modelfile_num_ctx=dict(self._read),
        )


def make_observer(
    session: aiohttp.ClientSession, target: URL, known: Callable[[], Mapping[str, int | None]]
) -> OllamaObserver:
    return OllamaObserver(session, target, known)


def read_options(
    route_: Route, payload: dict[str, Any] | None
) -> tuple[int | None, tuple[str, ...], str]:
    """(explicit ``options.num_ctx``, other load-time options set, dialect) of a work body.

    The OpenAI/Anthropic shims (``/v1/...``) take no options. A ``num_ctx`` that is not a
    whole number, or a top-level ``shift``, counts as a load-time option (no credit).
    """
    dialect = residency.DIALECT_V1 if route_.pattern.startswith("/v1/") else residency.DIALECT_API
    if payload is None or dialect == residency.DIALECT_V1:
        return None, (), dialect
    extra: list[str] = []
    options = payload.get("options")
    num_ctx: int | None = None
    if isinstance(options, dict):
        extra.extend(residency.runner_options_in(options))
        raw = options.get("num_ctx")
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
            num_ctx = raw
        elif raw is not None:
            extra.append("num_ctx (not a positive integer)")
    elif options is not None:
        extra.append("options (not an object)")
    if payload.get("shift") is not None:
        extra.append("shift")
    return num_ctx, tuple(sorted(extra)), dialect


# -- keep-alive cap ------------------------------------------------------------------------

#: Native routes whose request struct has ``KeepAlive *api.Duration`` (``GenerateRequest``,
#: ``ChatRequest``, ``EmbedRequest``, ``EmbeddingRequest``). The ``/v1`` shims take none:
#: their requests keep the server's default (``OLLAMA_KEEP_ALIVE``).
KEEP_ALIVE_ROUTES = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings"})
#: Go's ``time.Duration(math.MaxInt64)`` in seconds: what a negative keep-alive means.
FOREVER_S = (2**63 - 1) / 1e9

_GO_DURATION = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_GO_UNITS["h"] = 3600.0


def keep_alive_s(value: object) -> float | None:
    """Seconds a ``keep_alive`` value keeps a model loaded, as Ollama reads it
    (``api.Duration.UnmarshalJSON``): a number is seconds, a string a Go duration
    (``"5m"``, ``"1h30m"``, ``"0"``), and anything negative means forever
    (:data:`FOREVER_S`). None for a value Ollama refuses (it answers 400 itself)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return FOREVER_S if value < 0 else min(float(value), FOREVER_S)
    if not isinstance(value, str):
        return None
    text = value
    sign = 1.0
    if text[:1] in ("-", "+"):
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    if text == "0":
        return 0.0
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in parts)
    return FOREVER_S if seconds < 0 else min(seconds, FOREVER_S)


def cap_keep_alive_steps(route_: Route, body: bytes, max_s: float) -> bodyparse.Steps[bytes]:
    """A native work body whose ``keep_alive`` is at most ``max_s`` seconds, so a borrowed
    request cannot keep its model in the owner's memory longer (docs/configuration.md,
    ``keep_alive_max_s``).

    A body that asks for ``max_s`` or less is returned as it is; one that asks for more,
    for forever (a negative number, ``"-1m"``) or for nothing (the server's default,
    ``OLLAMA_KEEP_ALIVE``, may be forever) gets ``"keep_alive": max_s`` appended after its
    own keys: Go's decoder lets the last of two keys win, whatever their case. A body
    Ollama would refuse anyway (not a JSON object, a keep-alive it cannot read) and the
    other routes pass unchanged. Runs in pauseable steps (vacancyd.adapters.bodyparse).
    """
    if route_.pattern not in KEEP_ALIVE_ROUTES or not body or body.isspace():
        return body
    try:
        fields = yield from bodyparse.json_fields_steps(body, ("keep_alive",))
    except bodyparse.BodyParseError:
        return body
    raw = fields.get("keep_alive")
    if raw is not None:
        asked = keep_alive_s(raw)
        if asked is None or asked <= max_s:
            return body
    end = len(body)
    while end and body[end - 1] in b" \t\r\n":
        end -= 1
    if body[end - 1 : end] != b"}":
        return body
    inside = body.index(b"{") + 1  # the body is one JSON object: read_facts checked it
    while inside < end and body[inside] in b" \t\r\n":
        inside += 1
    empty = inside == end - 1
    value = int(max_s) if float(max_s).is_integer() else max_s
    extra = f'"keep_alive":{json.dumps(value)}'.encode()
    return body[: end - 1] + (extra if empty else b"," + extra) + b"}"


def cap_keep_alive(route_: Route, body: bytes, max_s: float) -> bytes:
    """:func:`cap_keep_alive_steps`, run at once."""
    return bodyparse.run(cap_keep_alive_steps(route_, body, max_s))


ADAPTER = Adapter(
    name="ollama",
    table=TABLE,
    make_controller=OllamaController,
    canonical_model=canonical_model,
    make_observer=make_observer,
    read_options=read_options,
    body_fields=frozenset({"options", "shift"}),
    flat_error_prefixes=("/api/",),
    cap_keep_alive=cap_keep_alive_steps,
    # Ollama is written in Go: its decoder matches these whatever their case
    exact_keys=frozenset({"model", "options", "shift", "keep_alive"}),
)
