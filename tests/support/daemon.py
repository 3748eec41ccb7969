"""Run a real vacancyd Daemon in-process on ephemeral loopback ports, and small fakes.

``running_daemon(toml)`` parses the config exactly as ``vacancyd run --config`` would, starts
every listener and loop, and yields a handle with the bound URLs. Use ``listen = "127.0.0.1:0"``
in test configs so ports never collide.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.config import daemon_toml, upstream
from vacancyd.config import parse_config
from vacancyd.runtime.daemon import Daemon
from vacancyd.state import SharedState


@dataclass
class RunningDaemon:
    daemon: Daemon

    @property
    def state(self) -> SharedState:
        return self.daemon.state

    @property
    def api_url(self) -> str:
        return f"http://{self.daemon.bound['api']}"

    def proxy_url(self, upstream: str) -> str:
        return f"http://{self.daemon.bound[upstream]}"

    async def wait_until(
        self, predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
    ) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():  # noqa: ASYNC110 - polls arbitrary state, not one event
                await asyncio.sleep(0.02)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        state = self.state
        await self.wait_until(lambda: state.ready(state.clock())[0], timeout_s, "readiness")


@contextmanager
def temporary_state_dir() -> Iterator[Path]:
    """A fresh state directory that is removed afterwards, for a daemon a test builds itself:
    tests never read or write the machine's /var/lib/vacancyd, nor each other's state."""
    with tempfile.TemporaryDirectory(prefix="vacancyd-state-") as scratch:
        yield Path(scratch)


@asynccontextmanager
async def running_daemon(toml: str) -> AsyncIterator[RunningDaemon]:
    """A config that sets no ``state_dir`` gets a fresh temporary one: tests never read or
    write the machine's /var/lib/vacancyd (held jobs, learned state), nor each other's."""
    settings = parse_config(toml, "<test>")
    with temporary_state_dir() as scratch:
        if "state_dir" not in settings.model_fields_set:
            settings = settings.model_copy(update={"state_dir": scratch})
        daemon = Daemon(settings)
        try:
            await daemon.start()
            yield RunningDaemon(daemon)
        finally:
            await daemon.shutdown()


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Serve an aiohttp app on an ephemeral loopback port; yields its base URL."""
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site.port}"
    finally:
        await runner.cleanup()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_like_app(
    *, slots_busy: bool = False, extra: dict[tuple[str, str], Handler] | None = None
) -> tuple[web.Application, list[dict[str, Any]]]:
    """A minimal OpenAI-compatible upstream that records what it received.

    Answers ``POST /v1/chat/completions`` (JSON, or SSE chunks ending with ``data: [DONE]``
    when ``stream`` is true, the OpenAI wire format), ``GET /v1/models``, ``GET /slots``
    (llama-server's shape: a list of slots with ``is_processing``) and ``GET /health``.
    """
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "choices": [
                        {"index": 0, "delta": {"content": f"tok{i}"}, "finish_reason": None}
                    ],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response(
            {
                "id": "c1",
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

    async def models(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "headers": dict(request.headers)})
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def slots(_: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "is_processing": slots_busy}])

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/slots", slots)
    app.router.add_get("/health", health)
    for (method, path), handler in (extra or {}).items():
        app.router.add_route(method, path, handler)
    return app, seen


def single_upstream_toml(
    *,
    api: int,
    proxy: int,
    target: str,
    adapter: str = "openai",
    name: str = "up",
    state_dir: Path | None = None,
) -> str:
    """A loopback-trusting lender with one upstream gated on system memory, presence
    headless, on fixed ports: the config the process-level tests and benchmarks start
    ``vacancyd run --config`` with. A process started on it should be given a ``state_dir``
    of its own (a temporary directory), or it uses the machine's /var/lib/vacancyd."""
    return daemon_toml(
        upstream(name, target, adapter=adapter, listen=f"127.0.0.1:{proxy}"),
        server={"listen": f"127.0.0.1:{api}"},
        collectors={"poll_s": None},
        state_dir=state_dir,
    )
