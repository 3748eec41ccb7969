"""llama.cpp ``llama-server`` (its ``tools/server/README.md``).

The OpenAI table plus llama-server's native work routes. ``/slots``, ``/metrics`` and
``/props`` reveal the owner's activity and the server's settings, so they are management.
Admission needs a fresh ``GET /slots`` observation: an idle, answering server holding its one
model is what proves residency (docs/architecture.md, the gate's step 6).
"""

from __future__ import annotations

from typing import Any

import aiohttp
from yarl import URL

from vacancyd.adapters import openai
from vacancyd.adapters.base import Adapter
from vacancyd.core.classify import RouteClass, route
from vacancyd.core.observations import ProbeError
from vacancyd.core.snapshot import ServerState

WORK, PASS, MGMT = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT

TABLE = openai.TABLE.extend(
    "llamacpp",
    route("POST", "/completion", WORK),
    route("POST", "/completions", WORK),
    route("POST", "/chat/completions", WORK),
    route("POST", "/responses", WORK),
    route("POST", "/v1/messages", WORK),
    route("POST", "/v1/messages/count_tokens", WORK),
    route("POST", "/infill", WORK),
    route("POST", "/embedding", WORK),
    route("POST", "/embeddings", WORK),
    route("POST", "/rerank", WORK),
    route("POST", "/reranking", WORK),
    route("POST", "/v1/reranking", WORK),
    route("POST", "/tokenize", WORK),
    route("POST", "/detokenize", WORK),
    route("POST", "/apply-template", WORK),
    route("GET", "/models", PASS),
    route("GET", "/slots", MGMT),
    route("POST", "/slots/{}", MGMT),
    route("GET POST", "/props", MGMT),
    route("GET POST", "/lora-adapters", MGMT),
)


def parse_slots(payload: Any) -> ServerState:
    """Read ``GET /slots`` (a JSON array of slots with ``is_processing``) into a ServerState.

    Raises :class:`ProbeError` for any other shape.
    """
    if not isinstance(payload, list) or not payload:
        raise ProbeError("/slots did not return a non-empty JSON array")
    busy = False
    for slot in payload:
        if not isinstance(slot, dict) or not isinstance(slot.get("is_processing"), bool):
            raise ProbeError("/slots entry lacks a boolean is_processing")
        busy = busy or slot["is_processing"]
    return ServerState(resident_models=None, idle=not busy)


async def observe(session: aiohttp.ClientSession, target: URL) -> ServerState:
    """GET /slots on the server. Raises :class:`ProbeError` on any failure."""
    try:
        async with session.get(target / "slots", allow_redirects=False) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:200]
                raise ProbeError(f"GET /slots answered {resp.status}: {text}")
            payload = await resp.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise ProbeError(f"GET /slots failed: {exc}") from exc
    except ValueError as exc:
        raise ProbeError(f"GET /slots returned invalid JSON: {exc}") from exc
    return parse_slots(payload)


ADAPTER = Adapter(
    name="llamacpp",
    table=TABLE,
    observe=observe,
    needs_model_observation=True,
    cut_is_uncertain=True,
    detached_work=True,
)
