"""WebSocket tunnels are tunneled only where the adapter lists a WebSocket: a progress
channel the borrower keeps whatever the gate says (ComfyUI's ``/ws``). An upgrade anywhere
else would be borrowed work that no gate admits, no reclaim cuts and lending off does not
stop, so it is refused (501) before the upstream sees it, even on a pass-through route
whose server would accept it."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from tests.support.fake_comfyui import FakeComfy
from tests.support.lender import lender, owner_returns


def upgrading_app() -> tuple[web.Application, list[str]]:
    """An OpenAI-like server that accepts a WebSocket on ``GET /v1/models`` (as a hostile
    or unusual server may) and echoes; records each upgrade it accepted."""
    upgrades: list[str] = []

    async def models(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        if not ws.can_prepare(request).ok:
            return web.json_response({"object": "list", "data": []})
        await ws.prepare(request)
        upgrades.append(request.path)
        async for msg in ws:
            await ws.send_str(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", models)
    return app, upgrades


async def test_an_upgrade_on_a_route_without_a_websocket_is_refused() -> None:
    app, upgrades = upgrading_app()
    async with lender(app, adapter="openai") as (d, client):
        url = d.proxy_url("up")
        for lending in (True, False):
            d.state.set_lending(lending)
            for path in ("/v1/models", "/health"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await client.ws_connect(url + path)
                assert refused.value.status == 501, (lending, path)
        async with client.get(url + "/v1/models") as r:  # the plain read still passes
            assert r.status == 200
        assert upgrades == []
        # the refusal names the rule
        async with client.get(
            url + "/v1/models",
            headers={
                "Connection": "Upgrade",
                "Upgrade": "websocket",
                "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            },
        ) as r:
            assert r.status == 501
            assert (await r.json())["error"]["code"] == "websocket_not_offered"


async def test_the_comfyui_progress_channel_stays_open_whatever_the_gate_says() -> None:
    """The borrower keeps its progress channel (like its health checks) through lending off
    and a reclaim: the work it reports on is gated, cut and held on its own."""
    fake = FakeComfy()
    async with lender(fake.app(), adapter="comfyui") as (d, client):
        url = d.proxy_url("up") + "/ws?clientId=abc"
        async with client.ws_connect(url) as ws:
            assert (await ws.receive_json(timeout=5))["type"] == "status"
            d.state.set_lending(False)
            owner_returns(d)
            await ws.send_str("still-there")
            assert await ws.receive_json(timeout=5) == {"type": "echo", "data": "still-there"}
            async with client.ws_connect(url) as second:
                assert (await second.receive_json(timeout=5))["type"] == "status"
