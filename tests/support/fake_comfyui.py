"""A look-alike ComfyUI server (aiohttp) for reclaim, adapter and WebSocket tests.

Shapes and behaviour follow comfyanonymous/ComfyUI (``server.py``, ``execution.py``):

* ``server.py``: every route also answers under ``/api``; ``POST /prompt`` queues and answers
  ``{"prompt_id", "number", "node_errors": {}}`` at once, before the prompt runs (the quirk
  vacancyd must handle: the job outlives its HTTP reply); ``GET /queue`` returns
  ``{"queue_running": [item], "queue_pending": [item]}`` with items
  ``[number, prompt_id, prompt, extra_data, outputs_to_execute]``; ``POST /queue
  {"delete": [ids]}`` removes pending prompts; ``POST /interrupt {"prompt_id"}`` interrupts
  only when that prompt is running (no id: global); ``POST /free`` only sets flags and
  answers 200 with an empty body; ``GET /history/{id}`` is ``{}`` until the prompt finished;
* ``comfy_execution/jobs.py`` ``validate_job_id``: a client ``prompt_id`` must be a canonical
  lowercase UUID or the reply is 400 ``invalid_prompt_id``; absent, the server mints one;
* ``POST /api/jobs/{id}/cancel`` (newer releases) answers ``{"cancelled": bool}``; with
  ``jobs_api=False`` it answers 405, as ComfyUI 0.3.64 does (upstream-apis.md appendix);
* ``GET /ws?clientId=``: a ``status`` message on connect, then ``execution_start``,
  ``progress {value, max, prompt_id, node}``, a binary preview frame (4-byte big-endian
  type 1 + 4-byte format + image bytes, ``protocol.py``) and ``executing {node: null}`` —
  sent to every socket for prompts without a ``client_id`` (``send_sync`` broadcast),
  ``execution_interrupted`` when a prompt is stopped.

One worker runs the lowest-numbered pending prompt for ``steps`` × ``step_s`` seconds.

Memory (``comfy/model_management.py``): a prompt makes torch's caching allocator reserve
``prompt_mib``, which it keeps after the prompt for the next one; ``/system_stats`` reports it
as ``torch_vram_total`` (bytes) on the one CUDA device, and ``POST /free {"free_memory":
true}`` releases it once no prompt is running. With ``scenario`` the reservation moves the
fake NVML's used memory on that GPU.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from tests.support.gpu import Scenario

MIB = 1024 * 1024

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass
class FakeComfy:
    steps: int = 10
    step_s: float = 0.05
    jobs_api: bool = True
    paused: bool = False
    pending: list[list[Any]] = field(default_factory=list)
    running: list[Any] | None = None
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    free_requests: list[dict[str, Any]] = field(default_factory=list)
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    sockets: list[web.WebSocketResponse] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    #: When set, ``/prompt`` queues the prompt and then holds its reply until the event is set
    #: (a submission whose reply is still in flight); ``queued`` fires once it is queued.
    reply_gate: asyncio.Event | None = None
    queued: asyncio.Event = field(default_factory=asyncio.Event)
    scenario: Scenario | None = None
    prompt_mib: int = 0
    reserved_mib: int = 0
    devices: int = 1
    _free_pending: bool = False
    _number: int = 0
    _interrupt: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        for prefix in ("", "/api"):
            r = app.router
            r.add_post(prefix + "/prompt", self.post_prompt)
            r.add_get(prefix + "/queue", self.get_queue)
            r.add_post(prefix + "/queue", self.post_queue)
            r.add_post(prefix + "/interrupt", self.interrupt)
            r.add_post(prefix + "/free", self.free)
            r.add_get(prefix + "/history/{id}", self.get_history)
            r.add_get(prefix + "/ws", self.ws)
            r.add_get(prefix + "/object_info", self.object_info)
            r.add_get(prefix + "/system_stats", self.system_stats)
        app.router.add_post("/api/jobs/{id}/cancel", self.jobs_cancel)
        app.cleanup_ctx.append(self._worker_ctx)
        return app

    async def _worker_ctx(self, _: web.Application) -> Any:
        task = asyncio.get_running_loop().create_task(self._worker())
        yield
        task.cancel()
        for ws in list(self.sockets):
            await ws.close()

    # -- helpers -------------------------------------------------------------------------

    def queued_ids(self) -> list[str]:
        ids = [item[1] for item in self.pending]
        if self.running is not None:
            ids.insert(0, self.running[1])
        return ids

    def add_foreign(self) -> str:
        """Queue a prompt as the owner would, straight on the server."""
        pid = str(uuid.uuid4())
        self._number += 1
        self.pending.append([self._number, pid, {}, {}, []])
        self._wake.set()
        return pid

    async def _broadcast(self, msg: dict[str, Any] | bytes) -> None:
        for ws in list(self.sockets):
            if ws.closed:
                continue
            if isinstance(msg, bytes):
                await ws.send_bytes(msg)
            else:
                await ws.send_str(json.dumps(msg))

    async def _worker(self) -> None:
        while True:
            if self.paused or not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.pending.sort(key=lambda item: item[0])
            item = self.pending.pop(0)
            self.running = item
            self._interrupt = False
            pid = item[1]
            if self.reserved_mib < self.prompt_mib:
                self._reserve(self.prompt_mib)
            self.started.set()
            await self._broadcast({"type": "execution_start", "data": {"prompt_id": pid}})
            interrupted = False
            for step in range(self.steps):
                if self._interrupt:
                    interrupted = True
                    break
                await asyncio.sleep(self.step_s)
                await self._broadcast(
                    {
                        "type": "progress",
                        "data": {
                            "value": step + 1,
                            "max": self.steps,
                            "prompt_id": pid,
                            "node": "3",
                        },
                    }
                )
                await self._broadcast(struct.pack(">II", 1, 2) + b"\x89PNG-preview")
            self.running = None
            if self._free_pending:
                self._free_pending = False
                self._reserve(0)
            status = "error" if interrupted else "success"
            self.history[pid] = {
                "prompt": item,
                "outputs": {},
                "status": {"status_str": status, "completed": not interrupted, "messages": []},
                "meta": {},
            }
            if interrupted:
                await self._broadcast(
                    {"type": "execution_interrupted", "data": {"prompt_id": pid, "node_id": "3"}}
                )
            else:
                await self._broadcast(
                    {"type": "executing", "data": {"node": None, "prompt_id": pid}}
                )

    # -- routes --------------------------------------------------------------------------

    async def post_prompt(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("POST", "/prompt", body))
        pid = body.get("prompt_id")
        if pid is None:
            pid = str(uuid.uuid4())
        elif not isinstance(pid, str) or not UUID_RE.match(pid):
            return web.json_response(
                {
                    "error": {
                        "type": "invalid_prompt_id",
                        "message": "prompt_id must be a valid UUID",
                        "details": "",
                        "extra_info": {},
                    },
                    "node_errors": {},
                },
                status=400,
            )
        if not isinstance(body.get("prompt"), dict):
            return web.json_response(
                {
                    "error": {
                        "type": "no_prompt",
                        "message": "No prompt provided",
                        "details": "",
                        "extra_info": {},
                    },
                    "node_errors": {},
                },
                status=400,
            )
        self._number += 1
        self.pending.append([self._number, pid, body["prompt"], body.get("extra_data", {}), []])
        self._wake.set()
        self.queued.set()
        number = self._number
        if self.reply_gate is not None:
            await self.reply_gate.wait()
        return web.json_response({"prompt_id": pid, "number": number, "node_errors": {}})

    async def get_queue(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "queue_running": [self.running] if self.running is not None else [],
                "queue_pending": list(self.pending),
            }
        )

    async def post_queue(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("POST", "/queue", body))
        if body.get("clear"):
            self.pending.clear()
        for pid in body.get("delete", []):
            self.pending = [item for item in self.pending if item[1] != pid]
        return web.Response()

    async def interrupt(self, request: web.Request) -> web.Response:
        body = json.loads(await request.text() or "{}")
        self.calls.append(("POST", "/interrupt", body))
        pid = body.get("prompt_id")
        if pid is None or (self.running is not None and self.running[1] == pid):
            self._interrupt = True
        return web.Response()

    async def jobs_cancel(self, request: web.Request) -> web.Response:
        pid = request.match_info["id"]
        self.calls.append(("POST", f"/api/jobs/{pid}/cancel", None))
        if not self.jobs_api:
            return web.Response(status=405)
        if self.running is not None and self.running[1] == pid:
            self._interrupt = True
            return web.json_response({"cancelled": True})
        before = len(self.pending)
        self.pending = [item for item in self.pending if item[1] != pid]
        return web.json_response({"cancelled": len(self.pending) < before})

    async def free(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.free_requests.append(body)
        if body.get("free_memory"):
            if self.running is None:
                self._reserve(0)
            else:
                self._free_pending = True
        return web.Response()

    def _reserve(self, mib: int) -> None:
        """Set what torch's allocator holds, moving the fake GPU's used memory with it."""
        if self.scenario is not None:
            gpu = self.scenario.gpus[0]
            gpu.used_mib += mib - self.reserved_mib
            self.scenario.write()
        self.reserved_mib = mib

    async def get_history(self, request: web.Request) -> web.Response:
        pid = request.match_info["id"]
        return web.json_response({pid: self.history[pid]} if pid in self.history else {})

    async def object_info(self, _: web.Request) -> web.Response:
        return web.json_response({"KSampler": {"input": {}, "output": ["LATENT"]}})

    async def system_stats(self, _: web.Request) -> web.Response:
        total, used = 24_576, 1_024
        if self.scenario is not None:
            total, used = self.scenario.gpus[0].total_mib, self.scenario.gpus[0].used_mib
        devices = [
            {
                "name": f"cuda:{i} NVIDIA GeForce RTX 4090 : cudaMallocAsync",
                "type": "cuda",
                "index": i,
                "vram_total": total * MIB,
                # cudaMemGetInfo free plus the reserved memory torch can reuse (all of it here)
                "vram_free": (total - used) * MIB + self.reserved_mib * MIB,
                "torch_vram_total": self.reserved_mib * MIB,
                "torch_vram_free": self.reserved_mib * MIB,
            }
            for i in range(self.devices)
        ]
        return web.json_response(
            {
                "system": {
                    "os": "posix",
                    "ram_total": 64 * 1024 * MIB,
                    "ram_free": 32 * 1024 * MIB,
                    "comfyui_version": "0.3.64",
                    "python_version": "3.12.3",
                    "pytorch_version": "2.8.0+cu128",
                    "embedded_python": False,
                    "argv": ["main.py"],
                },
                "devices": devices,
            }
        )

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.append(ws)
        sid = request.query.get("clientId") or uuid.uuid4().hex
        await ws.send_str(
            json.dumps(
                {
                    "type": "status",
                    "data": {
                        "status": {"exec_info": {"queue_remaining": len(self.queued_ids())}},
                        "sid": sid,
                    },
                }
            )
        )
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    await ws.send_str(json.dumps({"type": "echo", "data": msg.data}))
        finally:
            self.sockets.remove(ws)
        return ws
