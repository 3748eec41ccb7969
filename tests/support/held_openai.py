"""An OpenAI-compatible upstream whose replies wait until the test releases them.

``POST /v1/chat/completions`` answers the chat completion JSON shape of the OpenAI API
reference (``{"id", "object": "chat.completion", "model", "choices": [{"index", "message",
"finish_reason"}]}``) only once ``release(user)`` is called for the request's ``user`` field;
``GET /v1/models`` lists one model. Tests decide exactly when a slot frees.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class HeldOpenAI:
    """``POST /v1/chat/completions`` answered only once ``release(user)`` is called; the
    ``user`` field names each request. ``arrived`` lists users in arrival order."""

    arrived: list[str] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    model_id: str = "tiny"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_id, "object": "model"}]}
        )

    def gate(self, user: str) -> asyncio.Event:
        return self.gates.setdefault(user, asyncio.Event())

    def release(self, user: str) -> None:
        self.gate(user).set()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        user = str(body.get("user"))
        self.arrived.append(user)
        self.changed.set()
        await self.gate(user).wait()
        return web.json_response(
            {
                "id": f"chatcmpl-{user}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": user},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    async def until_arrived(self, n: int, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.arrived) < n:
                self.changed.clear()
                await self.changed.wait()
