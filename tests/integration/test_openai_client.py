"""The real ``openai`` client against a real vacancyd: which refusals it retries.

The SDK retries 429 and 5xx twice by default, sleeping through a Retry-After of up to 120 s,
unless the answer carries ``x-should-retry: false``. vacancyd lets it retry only the refusals
that clear in seconds (``resource_busy``, ``body_budget_exhausted``); every other refusal must
come back to the caller at once, after exactly one request (docs/litellm.md, "The OpenAI
client").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest

from tests.support.config import daemon_toml, resource, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.lender import owner_returns
from vacancyd.core.ledger import Job
from vacancyd.core.observations import SampleKey


def toml(target: str, *, min_free_mib: int = 0, **upstream_keys: Any) -> str:
    return daemon_toml(
        upstream("up", target, **upstream_keys),
        resources=(resource("ram", min_free_mib=min_free_mib),),
    )


@asynccontextmanager
async def lender(**kw: object) -> AsyncIterator[tuple[RunningDaemon, openai.AsyncOpenAI]]:
    app, _ = openai_like_app()
    async with serve_app(app) as url, running_daemon(toml(url, **kw)) as d:  # type: ignore[arg-type]
        await d.wait_ready()
        # The SDK's defaults: 2 retries, honouring Retry-After up to 120 s (openai 3.57).
        client = openai.AsyncOpenAI(base_url=d.proxy_url("up") + "/v1", api_key="unused")
        try:
            yield d, client
        finally:
            await client.close()


def refusals(d: RunningDaemon, reason: str) -> float:
    value = d.daemon.metrics.registry.get_sample_value(
        "vacancyd_admission_decisions_total",
        {"upstream": "up", "outcome": "refused", "reason": reason},
    )
    return value or 0.0


async def chat(client: openai.AsyncOpenAI) -> object:
    return await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )


@pytest.mark.parametrize(
    ("setup", "reason", "retry_after"),
    [
        ("lending_off", "lending_disabled", "300"),
        ("no_room", "insufficient_capacity", "30"),
        ("owner_back", "owner_active", "120"),
    ],
)
async def test_long_refusals_return_at_once(setup: str, reason: str, retry_after: str) -> None:
    kw: dict[str, object] = {}
    if setup == "no_room":
        kw["min_free_mib"] = 1 << 30  # more memory than any machine has free
    async with lender(**kw) as (d, client):
        if setup == "lending_off":
            d.state.set_lending(False)
        elif setup == "owner_back":
            owner_returns(d)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await chat(client)
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"the client blocked {elapsed:.1f} s retrying a {reason} refusal"
        err = info.value
        assert err.status_code == 503
        assert err.response.headers["Retry-After"] == retry_after
        assert err.response.headers["x-should-retry"] == "false"
        assert isinstance(err.body, dict) and err.body["code"] == reason
        assert refusals(d, reason) == 1, "the SDK retried a refusal it was told not to"


async def test_capped_retry_after_still_says_do_not_retry() -> None:
    async with lender(retry_after_max_s=5) as (d, client):
        d.state.set_lending(False)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await chat(client)
        assert time.monotonic() - started < 1.5
        assert info.value.response.headers["Retry-After"] == "5"
        body = info.value.body
        assert isinstance(body, dict)
        assert body["retry_after_s"] == 5 and body["retry_after_hint_s"] == 300
        assert refusals(d, "lending_disabled") == 1


async def test_resource_busy_is_retried_by_the_sdk_and_then_served() -> None:
    async with lender() as (d, client):
        state = d.state
        held = state.ledger.reserve("up", ("ram",), state.clock(), "tiny")
        assert isinstance(held, Job)
        loop = asyncio.get_running_loop()

        def release() -> None:  # what the proxy does when a borrowed job ends
            state.ledger.release(held.id, state.clock())
            state.samples.request(SampleKey.capacity("ram"))

        loop.call_later(1.0, release)
        started = time.monotonic()
        reply = await chat(client)
        elapsed = time.monotonic() - started
        assert getattr(reply, "choices", None), reply
        assert refusals(d, "resource_busy") >= 1, "the first attempt was not refused busy"
        # One Retry-After of 2 s, then served: the SDK waited for the short refusal.
        assert 1.5 < elapsed < 10
