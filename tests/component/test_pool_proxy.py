"""A ``[[pool]]`` listener in front of two upstreams on two resources (HTTP level)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, resource, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.held_openai import HeldOpenAI
from vacancyd.cli import format_status
from vacancyd.config import ConfigError, parse_config
from vacancyd.core.status import StatusDocument


def config(a: str, b: str) -> str:
    """Upstreams ``a`` (card0) and ``b`` (card1, which keeps 1000 MiB free) pooled as ``both``."""
    return daemon_toml(
        upstream("a", a, resource="card0"),
        upstream("b", b, resource="card1"),
        resources=(resource("card0"), resource("card1", min_free_mib=1000)),
        pools=({"name": "both", "listen": "127.0.0.1:0", "members": ["a", "b"]},),
    )


@asynccontextmanager
async def pool() -> AsyncIterator[
    tuple[RunningDaemon, HeldOpenAI, HeldOpenAI, aiohttp.ClientSession]
]:
    fa, fb = HeldOpenAI(model_id="from-a"), HeldOpenAI(model_id="from-b")
    async with (
        serve_app(fa.app()) as a,
        serve_app(fb.app()) as b,
        running_daemon(config(a, b)) as d,
    ):
        await d.wait_ready()
        async with aiohttp.ClientSession() as client:
            yield d, fa, fb, client


async def chat(d: RunningDaemon, client: aiohttp.ClientSession, user: str) -> tuple[int, Any]:
    async with client.post(
        d.proxy_url("both") + "/v1/chat/completions",
        json={"model": "tiny", "user": user, "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        return r.status, await r.json()


async def test_requests_go_to_the_member_with_room_and_are_refused_only_when_none_has() -> None:
    async with pool() as (d, fa, fb, client):
        first = asyncio.create_task(chat(d, client, "r1"))
        await fa.until_arrived(1)  # a has the most room
        second = asyncio.create_task(chat(d, client, "r2"))
        await fb.until_arrived(1)  # a's only slot is taken: b
        assert {j.upstream for j in d.state.ledger.jobs()} == {"a", "b"}
        status, body = await chat(d, client, "r3")
        assert status == 503 and body["error"]["code"] == "resource_busy"
        assert body["error"]["upstream"] == "both"
        probe = d.proxy_url("both") + "/.well-known/vacancyd/lendable"
        async with client.get(probe) as r:
            assert r.status == 503  # no member would admit now
        fa.release("r1")
        fb.release("r2")
        assert (await first)[0] == 200 and (await second)[0] == 200
        assert fa.arrived == ["r1"] and fb.arrived == ["r2"]
        await d.wait_until(lambda: not d.state.ledger.jobs())
        async with asyncio.timeout(5):  # once a sample after the releases has landed
            while True:
                async with client.get(probe) as r:
                    if r.status == 200:
                        assert (await r.json())["lendable"] is True
                        break
                await asyncio.sleep(0.05)
        # non-work reads go to the first member
        async with client.get(d.proxy_url("both") + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "from-a"
        async with client.get(d.api_url + "/status") as r:
            doc = await r.json()
        assert doc["pools"]["both"]["members"] == ["a", "b"]
        assert doc["pools"]["both"]["listener"]["bound"] is True
        assert doc["upstreams"]["a"]["sharing"]["max_concurrent"] == 1
        text = format_status(StatusDocument.from_json(doc))
        assert "pools:\n  both on 127.0.0.1:" in text and "-> a, b: lendable" in text
        assert "active work: 0 of 1 slot(s), 0 waiting" in text


async def test_a_pool_is_refused_like_its_members_when_lending_is_off() -> None:
    async with pool() as (d, _fa, _fb, client):
        d.state.set_lending(False)
        status, body = await chat(d, client, "r1")
        assert status == 503 and body["error"]["code"] == "lending_disabled"


def pool_config(
    adapter_a: str = "openai",
    adapter_b: str = "openai",
    pool_name: str = "p",
    pool_listen: str = "127.0.0.1:5",
    members: Sequence[str] = ("a", "b"),
) -> str:
    """Two upstreams on one card and a pool of them, nothing else (the parser's view)."""
    return daemon_toml(
        upstream(
            "a", "http://127.0.0.1:2", adapter=adapter_a, resource="card0", listen="127.0.0.1:1"
        ),
        upstream(
            "b", "http://127.0.0.1:4", adapter=adapter_b, resource="card0", listen="127.0.0.1:3"
        ),
        resources=(resource("card0"),),
        pools=({"name": pool_name, "listen": pool_listen, "members": list(members)},),
        defaults=False,
    )


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"members": ["a", "nobody"]}, "names 'nobody', which no [[upstream]] declares"),
        ({"members": ["a", "a"]}, "members lists an upstream twice"),
        ({"members": []}, "pool[0].members"),
        ({"adapter_b": "llamacpp"}, "mixes adapters (llamacpp, openai)"),
        ({"adapter_a": "comfyui", "adapter_b": "comfyui"}, "pools comfyui servers"),
        ({"pool_name": "a"}, "upstream and pool names must be unique; repeated: a"),
        ({"pool_listen": "127.0.0.1:1"}, "listen addresses must be unique"),
        ({"pool_listen": "0.0.0.0:9"}, "pool 'p' listen = '0.0.0.0:9'"),
    ],
)
def test_bad_pools(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(pool_config(**kw), "test.toml")
    assert any(needle in p for p in info.value.problems), info.value.problems
