"""A look-alike Ollama server (aiohttp) for reclaim and adapter tests.

Shapes and behaviour follow ollama/ollama (see ../shared/docs/upstream-apis.md §1):

* routes from ``server/routes.go`` ``GenerateRoutes``: ``GET``/``HEAD /``, ``/api/version``,
  ``/api/tags``, ``POST /api/show``, ``GET /api/ps``, ``POST /api/generate``, ``/api/chat``,
  ``/api/embed``; unknown routes 404;
* ``allowedHostsMiddleware`` (routes.go): a non-local ``Host`` gets 403 with an empty body;
* ``streamResponse`` (routes.go): streams are ``application/x-ndjson``, one JSON object per
  line, the last one ``"done": true`` with ``done_reason`` and the ns-duration metrics;
  ``stream`` absent means streaming;
* ``api.ProcessModelResponse`` (api/types.go) for ``/api/ps`` entries, names in the
  ``DisplayShortest`` form that always keeps the tag (``tiny`` -> ``tiny:latest``);
* the scheduler (``server/sched.go``): a model stays loaded after the request ends, until its
  ``keep_alive`` (default 5 m) expires; ``POST /api/generate {"model", "keep_alive": 0}`` with
  no prompt answers at once with ``done_reason: "unload"`` and only marks the runner expired —
  it is freed when the last in-flight request on it ends (``expireRunner``, refCount);
* unknown model: 404 ``{"error": "model 'x' not found"}``.

``token_interval_s`` spaces stream lines; ``tokens`` sets their count.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from aiohttp import web
from aiohttp.typedefs import Handler

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


def canonical(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


@dataclass
class Runner:
    refs: int = 0
    expired: bool = False


@dataclass
class FakeOllama:
    models: tuple[str, ...] = ("tiny:latest", "embedder:latest")
    tokens: int = 5
    token_interval_s: float = 0.01
    loaded: dict[str, Runner] = field(default_factory=dict)
    unload_requests: list[str] = field(default_factory=list)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    stream_ends: list[str] = field(default_factory=list)
    hosts_seen: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._host_guard])
        app.router.add_get("/", self.root)
        app.router.add_get("/api/version", self.version)
        app.router.add_get("/api/tags", self.tags)
        app.router.add_post("/api/show", self.show)
        app.router.add_get("/api/ps", self.ps)
        app.router.add_post("/api/generate", self.generate)
        app.router.add_post("/api/chat", self.chat)
        app.router.add_post("/api/embed", self.embed)
        return app

    @web.middleware
    async def _host_guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        self.hosts_seen.append(host)
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if name not in LOCAL_HOSTS:
            return web.Response(status=403)
        return await handler(request)

    async def root(self, _: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.33.0"})

    async def tags(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "models": [
                    {
                        "name": m,
                        "model": m,
                        "size": 1000,
                        "digest": "ab" * 32,
                        "details": {"format": "gguf", "family": "llama"},
                    }
                    for m in self.models
                ]
            }
        )

    async def show(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = canonical(str(body.get("model") or body.get("name") or ""))
        if name not in self.models:
            return web.json_response({"error": f"model '{name}' not found"}, status=404)
        return web.json_response(
            {
                "modelfile": f"# FROM {name}",
                "parameters": "",
                "details": {"format": "gguf"},
                "model_info": {},
                "capabilities": ["completion"],
            }
        )

    async def ps(self, _: web.Request) -> web.Response:
        now = datetime.now(UTC)
        return web.json_response(
            {
                "models": [
                    {
                        "name": m,
                        "model": m,
                        "size": 1000,
                        "size_vram": 1000,
                        "digest": "ab" * 32,
                        "details": {"format": "gguf"},
                        "context_length": 4096,
                        "expires_at": (
                            now if r.expired else now + timedelta(minutes=5)
                        ).isoformat(),
                    }
                    for m, r in self.loaded.items()
                ]
            }
        )

    def _release(self, name: str) -> None:
        runner = self.loaded.get(name)
        if runner is None:
            return
        runner.refs -= 1
        if runner.refs <= 0 and runner.expired:
            del self.loaded[name]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    async def _infer(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await request.json()
        raw = body.get("model")
        if not raw:
            return web.json_response({"error": "model is required"}, status=400)
        name = canonical(str(raw))
        if name not in self.models:
            return web.json_response({"error": f"model '{raw}' not found"}, status=404)
        empty = not body.get("messages") if chat else not body.get("prompt")
        if empty and body.get("keep_alive") == 0:
            self.unload_requests.append(name)
            runner = self.loaded.get(name)
            if runner is not None:
                runner.expired = True
                if runner.refs <= 0:
                    del self.loaded[name]
            done: dict[str, object] = {
                "model": name,
                "created_at": _now(),
                "done": True,
                "done_reason": "unload",
            }
            done["message" if chat else "response"] = (
                {"role": "assistant", "content": ""} if chat else ""
            )
            return web.json_response(done)
        runner = self.loaded.setdefault(name, Runner())
        runner.expired = False
        runner.refs += 1
        try:
            if empty:
                return web.json_response(
                    {
                        "model": name,
                        "created_at": _now(),
                        "response": "",
                        "done": True,
                        "done_reason": "load",
                    }
                )
            if body.get("stream") is False:
                return web.json_response(self._line(name, chat, "hello", done=True))
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            try:
                for i in range(self.tokens):
                    await resp.write(json.dumps(self._line(name, chat, f"t{i} ")).encode() + b"\n")
                    self.streaming.set()
                    await asyncio.sleep(self.token_interval_s)
                await resp.write(json.dumps(self._line(name, chat, "", done=True)).encode() + b"\n")
                await resp.write_eof()
            except (ConnectionError, asyncio.CancelledError):
                self.stream_ends.append("disconnected")
                raise
            self.stream_ends.append("complete")
            return resp
        finally:
            self._release(name)

    @staticmethod
    def _line(name: str, chat: bool, text: str, done: bool = False) -> dict[str, object]:
        line: dict[str, object] = {"model": name, "created_at": _now(), "done": done}
        if chat:
            line["message"] = {"role": "assistant", "content": text}
        else:
            line["response"] = text
        if done:
            line.update(
                done_reason="stop",
                total_duration=1000,
                load_duration=10,
                prompt_eval_count=3,
                prompt_eval_duration=100,
                eval_count=5,
                eval_duration=500,
            )
        return line

    async def embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = canonical(str(body.get("model") or ""))
        if name not in self.models:
            return web.json_response({"error": f"model '{name}' not found"}, status=404)
        self.loaded.setdefault(name, Runner())
        return web.json_response(
            {
                "model": name,
                "embeddings": [[0.1, 0.2]],
                "total_duration": 10,
                "load_duration": 1,
                "prompt_eval_count": 1,
            }
        )


def _now() -> str:
    return datetime.now(UTC).isoformat()
