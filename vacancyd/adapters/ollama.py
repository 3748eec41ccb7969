"""Ollama (ollama/ollama ``server/routes.go`` ``GenerateRoutes``, ``api/types.go``;
../shared/docs/upstream-apis.md §1).

Routes: inference (native NDJSON and the OpenAI/Anthropic shims) is work; ``/``,
``/api/version``, ``/api/tags``, ``/api/show`` and the ``/v1/models`` reads pass through so a
borrower can find models and check health while lending is off. ``/api/ps`` shows which
models the owner has loaded and when they were last used, so it is management, as are the
model store, account and cloud routes. Every work route reads the model from the JSON body's
``model`` field, as the handlers' request structs do (``GenerateRequest.Model``,
``ChatRequest.Model``, ``EmbedRequest.Model``).

Reclaim (spec "Yield", Y7): Ollama cannot cancel a request other than by its connection
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
from typing import Any

import aiohttp
from yarl import URL

from vacancyd.adapters.base import Adapter, UpstreamError
from vacancyd.core.classify import Route, RouteClass, RouteTable, route

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
    """Unload and warm reload for one Ollama server (Y7, T2). Cancels nothing itself."""

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


ADAPTER = Adapter(
    name="ollama", table=TABLE, make_controller=OllamaController, canonical_model=canonical_model
)
