"""Generic OpenAI-compatible servers (the OpenAI API reference).

Work routes are the inference endpoints, gated and reserved; discovery (model list) and health
pass through; everything else is refused by the proxy's fail-closed rule.
"""

from __future__ import annotations

from vacancyd.adapters.base import Adapter
from vacancyd.core.classify import RouteClass, RouteTable, route

WORK, PASS, MGMT = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT

TABLE = RouteTable(
    "openai",
    (
        route("POST", "/v1/chat/completions", WORK),
        route("POST", "/v1/completions", WORK),
        route("POST", "/v1/embeddings", WORK),
        route("POST", "/v1/responses", WORK),
        route("POST", "/v1/audio/transcriptions", WORK),
        route("POST", "/v1/audio/translations", WORK),
        route("POST", "/v1/audio/speech", WORK),
        route("POST", "/v1/images/generations", WORK),
        route("POST", "/v1/rerank", WORK),
        route("GET", "/v1/models", PASS),
        route("GET", "/v1/models/{}", PASS),
        route("GET", "/health", PASS, no_query=True),
        route("GET", "/v1/health", PASS, no_query=True),
        route("GET", "/metrics", MGMT),
    ),
)

ADAPTER = Adapter(name="openai", table=TABLE, cut_is_uncertain=True)
