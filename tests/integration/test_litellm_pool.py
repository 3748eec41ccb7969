"""A real LiteLLM Router pooling the lender with a second deployment (sharing issue).

The lender sits in front of a real llama-server with four slots and ``max_concurrent = 4``;
the second deployment is the same server reached directly, as a router user would list a
second provider. Four concurrent clients send 20 requests through the router: none may be
lost, and the lender must serve its share instead of refusing all but one at a time.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import running_daemon
from tests.support.llamacpp import LlamaServer, require_llama_server, running_llama_server

pytestmark = [
    pytest.mark.llama,
    # LiteLLM's own models warn under the installed pydantic; not this project's code.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture
async def llama(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    require_llama_server()
    async with running_llama_server(tmp_path, parallel=4) as server:
        yield server


def router_for(lender: str, direct: str) -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the library's own deprecation noise at import
        import litellm
        from litellm import Router  # type: ignore[attr-defined]

    # httpx's own transport: LiteLLM's aiohttp one leaves sessions for the garbage collector,
    # which would then warn inside whichever test runs next.
    litellm.disable_aiohttp_transport = True

    def deployment(base: str) -> dict[str, Any]:
        return {
            "model_name": "tiny",
            "litellm_params": {"model": "openai/tiny", "api_base": base, "api_key": "unused"},
        }

    return Router(
        model_list=[deployment(lender + "/v1"), deployment(direct + "/v1")],
        num_retries=0,  # a refusal would surface as a lost request, not hide in a retry
        timeout=60,
    )


async def close_clients() -> None:
    """Close the HTTP clients LiteLLM caches, so none outlives this test."""
    import gc

    from litellm.llms.custom_httpx.async_client_cleanup import close_litellm_async_clients

    await close_litellm_async_clients()  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()


async def test_router_loses_no_request_with_slots_matching_the_server(llama: LlamaServer) -> None:
    toml = daemon_toml(
        upstream("llama", llama.base_url, adapter="llamacpp", max_concurrent=4),
        collectors={"poll_s": 0.2},
    )
    async with running_daemon(toml) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "llama" in d.state.servers, 10)
        router = router_for(d.proxy_url("llama"), llama.base_url)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(20):
            queue.put_nowait(i)
        outcomes: list[str] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                try:
                    reply = await router.acompletion(
                        model="tiny",
                        messages=[{"role": "user", "content": "hello"}],
                        max_tokens=16,
                    )
                except Exception as exc:  # a lost request, whatever the library raised
                    outcomes.append(f"error: {exc!r}"[:300])
                else:
                    outcomes.append("ok" if reply.choices else "empty")

        await asyncio.gather(*(worker() for _ in range(4)))
        await close_clients()
        assert outcomes == ["ok"] * 20, outcomes
        text = d.daemon.metrics.registry.get_sample_value(
            "vacancyd_admission_decisions_total",
            {"upstream": "llama", "outcome": "admitted", "reason": ""},
        )
        assert text is not None and text >= 3, f"the lender served only {text} of 20"
