"""An OpenAI-compatible upstream whose streams are long, for drain/cancel/finish tests.

Wire format as the OpenAI API reference gives it:
``POST /v1/chat/completions`` with ``"stream": true`` answers ``text/event-stream`` chunks
``data: {chat.completion.chunk}\\n\\n`` and ends with ``data: [DONE]\\n\\n``. Each stream sends
``chunks`` chunks ``interval_s`` apart; ``started`` is set when the first chunk is written and
``ended`` records how each stream ended ("complete" or "disconnected"), so tests can tell a
cut upstream connection from one that ran to its end. ``hold_headers`` delays the response
headers until the event is set, to exercise a cut before headers. ``detached_busy`` plays
llama-server going on with a request whose client went away: while that event is unset, a
stream that ended "disconnected" keeps ``GET /slots`` busy.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class SlowOpenAI:
    chunks: int = 50
    interval_s: float = 0.05
    chunk_bytes: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: list[str] = field(default_factory=list)
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    hold_headers: asyncio.Event | None = None
    detached_busy: asyncio.Event | None = None
    requests: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/slots", self.slots)
        return app

    async def slots(self, _: web.Request) -> web.Response:
        """llama-server's ``GET /slots`` shape: one slot, processing while a stream runs."""
        busy = self.requests > len(self.ended)
        if self.detached_busy is not None and not self.detached_busy.is_set():
            busy = busy or "disconnected" in self.ended
        return web.json_response([{"id": 0, "is_processing": busy}])

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        try:
            if self.hold_headers is not None:
                self.started.set()
                await self.hold_headers.wait()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            pad = "x" * self.chunk_bytes
            for i in range(self.chunks):
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "model": body.get("model"),
                    "choices": [
                        {"index": 0, "delta": {"content": f"tok{i}{pad}"}, "finish_reason": None}
                    ],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.started.set()
                await asyncio.sleep(self.interval_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            self.ended.append("disconnected")
            self.ended_event.set()
            raise
        self.ended.append("complete")
        self.ended_event.set()
        return resp
