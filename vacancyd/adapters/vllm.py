"""vLLM's OpenAI-compatible server (``vllm serve``; ../shared/docs/upstream-apis.md §5).

The OpenAI table plus vLLM's own work routes (tokenizer, pooling, scoring, reranking).
``/health`` and ``/ping`` pass through so a borrower's health checks keep working while
lending is off. ``/metrics`` and ``/load`` reveal the server's activity, and the sleep-mode
and profiling routes (present with ``VLLM_SERVER_DEV_MODE=1``) change the server's state:
all management. Like any OpenAI-compatible server, a cut stream does not prove the work
stopped (spec "Yield", Y8), so a cut job is held until an administrator releases it.
"""

from __future__ import annotations

from vacancyd.adapters import openai
from vacancyd.adapters.base import Adapter
from vacancyd.core.classify import RouteClass, route

WORK, PASS, MGMT = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT

TABLE = openai.TABLE.extend(
    "vllm",
    route("POST", "/tokenize", WORK),
    route("POST", "/detokenize", WORK),
    route("POST", "/pooling", WORK),
    route("POST", "/classify", WORK),
    route("POST", "/score", WORK),
    route("POST", "/v1/score", WORK),
    route("POST", "/rerank", WORK),
    route("POST", "/v2/rerank", WORK),
    route("POST", "/invocations", WORK),
    route("GET", "/ping", PASS, no_query=True),
    route("POST", "/ping", PASS, no_query=True, model_key=None),
    route("GET", "/version", PASS),
    route("GET", "/load", MGMT),
    route("GET", "/is_sleeping", MGMT),
    route("POST", "/sleep", MGMT),
    route("POST", "/wake_up", MGMT),
    route("POST", "/collective_rpc", MGMT),
    route("POST", "/reset_prefix_cache", MGMT),
    route("POST", "/start_profile", MGMT),
    route("POST", "/stop_profile", MGMT),
    route("GET", "/server_info", MGMT),
)

ADAPTER = Adapter(name="vllm", table=TABLE, cut_is_uncertain=True)
