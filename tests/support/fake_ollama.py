"""A look-alike Ollama server (aiohttp) for adapter, reclaim and residency tests.

Shapes and behaviour follow ollama/ollama (``server/routes.go``, ``server/sched.go``,
``api/types.go``):

* routes from ``GenerateRoutes``: ``GET``/``HEAD /``, ``/api/version``, ``/api/tags``,
  ``POST /api/show``, ``GET /api/ps``, ``POST /api/generate``, ``/api/chat``, ``/api/embed``,
  and the OpenAI shim ``POST /v1/chat/completions``; unknown routes 404;
* ``allowedHostsMiddleware``: a non-local ``Host`` gets 403 with an empty body;
* ``streamResponse``: streams are ``application/x-ndjson``, one JSON object per line, the last
  one ``"done": true`` with ``done_reason`` and the ns-duration metrics; ``stream`` absent
  means streaming;
* the model table (``sched.go``): a request loads its model with the runner options it
  resolves — ``num_ctx`` from the request (clamped to the training context), else the
  Modelfile's ``PARAMETER num_ctx``, else the server default; a loaded model whose runner
  options differ from the request's is reloaded (``needsReload``); ``num_parallel`` slots
  allocate ``num_ctx × parallel`` tokens of cache, and ``context_length`` in ``/api/ps`` is
  the per-slot context (current releases) or the whole (``report_total_context``, as
  v0.10–v0.11.4 did);
* keep-alive (``api.Duration``): absent means ``default_keep_alive_s``; a number is seconds,
  negative forever (Go's largest duration, ``expires_at`` about 292 years on); a string is a
  Go duration (``"5m"``, ``"1h30m"``); anything else 400. ``expires_at`` is set to
  now + keep-alive when the model goes idle, keeps that (possibly past) value while a request
  is in flight, reads now + keep-alive while the model is first loading, and the model is
  unloaded when it passes; ``{"model", "keep_alive": 0}`` with no prompt answers at once with
  ``done_reason: "unload"`` and unloads once in-flight requests end (``expireRunner``);
* ``/api/ps`` (``api.ProcessModelResponse``): names in the ``DisplayShortest`` form that
  keeps the tag, ``size``/``size_vram`` in bytes (``size_vram < size`` when the model did not
  fit the GPU and spilled to system memory), ``expires_at`` as Go writes ``time.Time``
  (RFC 3339, nanoseconds, the server's local offset), sorted by ``expires_at`` descending;
* ``/api/show`` (``ShowHandler``): ``parameters`` one option per line, the name padded to 30
  columns; ``modelfile`` with ``PARAMETER`` lines; ``model_info`` with the training context;
* unknown model: 404 ``{"error": "model 'x' not found"}``.

When ``scenario`` is given, loading and unloading move the fake NVML's used memory on
``scenario.gpus[gpu_index]``, so the GPU's free memory follows what is loaded.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tests.support.gpu import Scenario

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
MIB = 1024 * 1024
#: ``api.ModelDetails``, as ``/api/tags``, ``/api/show`` and ``/api/ps`` list it.
DETAILS = {
    "parent_model": "",
    "format": "gguf",
    "family": "llama",
    "families": ["llama"],
    "parameter_size": "8.0B",
    "quantization_level": "Q4_K_M",
}
#: Go's ``time.Duration(math.MaxInt64)`` in seconds: "forever".
FOREVER_S = (2**63 - 1) / 1e9
RUNNER_KEYS = ("num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread", "draft_num_predict")


def canonical(name: str) -> str:
    name = name.strip().lower()
    for prefix in ("registry.ollama.ai/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


@dataclass(frozen=True)
class ModelSpec:
    """A model in the fake's store: MiB of weights, MiB of cache per 1024 tokens."""

    weights_mib: int = 1
    kv_mib_per_1k: int = 0
    train_ctx: int = 131072
    modelfile_num_ctx: int | None = None
    digest: str = "ab" * 32


@dataclass
class Runner:
    """One loaded model. ``expires_at`` None: still in its first load (not yet idle)."""

    refs: int = 0
    expired: bool = False
    num_ctx: int = 4096
    parallel: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    session_s: float = 300.0
    expires_at: datetime | None = None
    size_mib: float = 1.0
    size_vram_mib: float = 1.0


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, default_s: float) -> float:
    """``api.Duration.UnmarshalJSON``; raises ValueError as Ollama answers 400."""
    if value is None:
        return default_s
    if isinstance(value, bool):
        raise ValueError(f"Unsupported type: '{type(value).__name__}'")
    if isinstance(value, int | float):
        return FOREVER_S if value < 0 else float(int(value))
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body == "0":
            return 0.0
        parts = _DURATION.findall(body)
        if not parts or "".join(n + u for n, u in parts) != body:
            raise ValueError(f'time: missing unit in duration "{value}"')
        seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
        return FOREVER_S if seconds < 0 else seconds
    raise ValueError(f"Unsupported type: '{type(value).__name__}'")


def go_time(when: datetime, tz: timezone) -> str:
    """Go's ``time.Time`` JSON form: RFC 3339, fraction to nanoseconds without trailing
    zeros, ``Z`` for UTC or the ±hh:mm offset."""
    local = when.astimezone(tz)
    frac = f"{local.microsecond * 1000:09d}".rstrip("0")
    offset = local.utcoffset() or timedelta(0)
    if offset == timedelta(0):
        zone = "Z"
    else:
        minutes = int(offset.total_seconds() // 60)
        sign = "+" if minutes >= 0 else "-"
        zone = f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
    return local.strftime("%Y-%m-%dT%H:%M:%S") + (f".{frac}" if frac else "") + zone


@dataclass
class FakeOllama:
    models: tuple[str, ...] = ("tiny:latest", "embedder:latest")
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    tokens: int = 5
    token_interval_s: float = 0.01
    default_num_ctx: int = 4096
    num_parallel: int = 1
    report_total_context: bool = False
    default_keep_alive_s: float = 300.0
    version_string: str = "0.33.0"
    tz: timezone = timezone(timedelta(hours=-7))
    scenario: Scenario | None = None
    gpu_index: int = 0
    #: A host without a GPU: every model runs from system memory (``size_vram`` 0).
    cpu_only: bool = False
    show_fails: bool = False
    #: Seconds a load takes (the model is listed in /api/ps meanwhile, as Ollama lists it).
    load_delay_s: float = 0.0
    ps_override: Any = None
    loaded: dict[str, Runner] = field(default_factory=dict)
    loads: list[tuple[str, int]] = field(default_factory=list)
    unload_requests: list[str] = field(default_factory=list)
    show_requests: list[str] = field(default_factory=list)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    stream_ends: list[str] = field(default_factory=list)
    hosts_seen: list[str] = field(default_factory=list)

    def spec(self, name: str) -> ModelSpec:
        return self.specs.get(name, ModelSpec())

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
        app.router.add_post("/v1/chat/completions", self.openai_chat)
        app.router.add_get("/v1/models", self.openai_models)
        app.cleanup_ctx.append(self._sweeper)
        return app

    async def _sweeper(self, _: web.Application) -> Any:
        """The scheduler's expiry timers: unload idle models whose keep-alive has passed."""

        async def sweep() -> None:
            while True:
                now = datetime.now(UTC)
                for name, runner in list(self.loaded.items()):
                    if runner.refs <= 0 and runner.expires_at is not None:
                        if runner.expires_at <= now:
                            self._unload(name)
                await asyncio.sleep(0.02)

        task = asyncio.get_running_loop().create_task(sweep())
        yield
        task.cancel()

    # -- the GPU ------------------------------------------------------------------------

    def _gpu_free_mib(self) -> float | None:
        if self.scenario is None:
            return None
        gpu = self.scenario.gpus[self.gpu_index]
        return float(gpu.total_mib - gpu.used_mib)

    def _charge(self, mib: float) -> None:
        if self.scenario is not None:
            gpu = self.scenario.gpus[self.gpu_index]
            gpu.used_mib = max(0, round(gpu.used_mib + mib))
            self.scenario.write()

    def _unload(self, name: str) -> None:
        runner = self.loaded.pop(name, None)
        if runner is not None:
            self._charge(-runner.size_vram_mib)

    def _load(self, name: str, num_ctx: int, options: dict[str, Any], session_s: float) -> Runner:
        spec = self.spec(name)
        size = spec.weights_mib + spec.kv_mib_per_1k * num_ctx * self.num_parallel / 1024
        free = self._gpu_free_mib()
        vram = size if free is None else max(0.0, min(size, free - 256))
        if self.cpu_only:
            vram = 0.0
        runner = Runner(
            num_ctx=num_ctx,
            parallel=self.num_parallel,
            options=dict(options),
            session_s=session_s,
            size_mib=size,
            size_vram_mib=vram,
        )
        self.loaded[name] = runner
        self.loads.append((name, num_ctx))
        self._charge(vram)
        return runner

    def _resolve(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The runner options a request loads with: (num_ctx per slot, other runner options)."""
        spec = self.spec(name)
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        assert isinstance(options, dict)
        num_ctx = options.get("num_ctx") or spec.modelfile_num_ctx or self.default_num_ctx
        num_ctx = min(int(num_ctx), spec.train_ctx)
        return num_ctx, {k: options[k] for k in RUNNER_KEYS if k in options}

    def _acquire(self, name: str, body: dict[str, Any]) -> bool:
        """Take a reference on the model, loading it as the request needs; True when this
        request loaded it."""
        session_s = parse_keep_alive(body.get("keep_alive"), self.default_keep_alive_s)
        num_ctx, options = self._resolve(name, body)
        runner = self.loaded.get(name)
        if runner is not None and (runner.num_ctx != num_ctx or runner.options != options):
            self._unload(name)  # needsReload
            runner = None
        loaded = runner is None
        if runner is None:
            runner = self._load(name, num_ctx, options, session_s)
        runner.session_s = session_s
        runner.expired = False
        runner.refs += 1
        return loaded

    def _release(self, name: str) -> None:
        runner = self.loaded.get(name)
        if runner is None:
            return
        runner.refs -= 1
        if runner.refs > 0:
            return
        if runner.expired or runner.session_s <= 0:
            self._unload(name)
            return
        runner.expires_at = datetime.now(UTC) + timedelta(seconds=min(runner.session_s, FOREVER_S))

    # -- routes -------------------------------------------------------------------------

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
        return web.json_response({"version": self.version_string})

    async def tags(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "models": [
                    {
                        "name": m,
                        "model": m,
                        "size": self.spec(m).weights_mib * MIB,
                        "modified_at": "2026-01-02T03:04:05.123456789Z",
                        "digest": self.spec(m).digest,
                        "details": DETAILS,
                    }
                    for m in self.models
                ]
            }
        )

    async def show(self, request: web.Request) -> web.Response:
        body, bad = await _bind(request, "ShowRequest")
        if bad is not None:
            return bad
        name = canonical(str(body.get("model") or body.get("name") or ""))
        self.show_requests.append(name)
        if self.show_fails:
            return web.json_response({"error": "failed to read manifest"}, status=500)
        if name not in self.models:
            return web.json_response({"error": f"model '{name}' not found"}, status=404)
        spec = self.spec(name)
        params: dict[str, object] = {}
        if spec.modelfile_num_ctx is not None:
            params["num_ctx"] = spec.modelfile_num_ctx
        modelfile = f'# Modelfile generated by "ollama show"\n# FROM {name}\nFROM /blobs/sha\n'
        modelfile += "".join(f"PARAMETER {k} {v}\n" for k, v in params.items())
        reply: dict[str, object] = {"modelfile": modelfile}
        if params:  # omitted when the Modelfile sets none (``omitempty``)
            reply["parameters"] = "\n".join(f"{k:<30} {v}" for k, v in params.items())
        return web.json_response(
            reply
            | {
                "template": "{{ .Prompt }}",
                "details": DETAILS,
                "model_info": {
                    "general.architecture": "llama",
                    "llama.context_length": spec.train_ctx,
                },
                "capabilities": ["completion"],
            }
        )

    async def ps(self, _: web.Request) -> web.Response:
        if self.ps_override is not None:
            if isinstance(self.ps_override, str | bytes):
                return web.Response(body=self.ps_override, content_type="application/json")
            return web.json_response(self.ps_override)
        now = datetime.now(UTC)
        entries = []
        for name, runner in self.loaded.items():
            if runner.expired:
                expires = now
            elif runner.expires_at is None:  # still loading: now + the session duration
                expires = now + timedelta(seconds=min(runner.session_s, FOREVER_S))
            else:  # idle, or busy with the value from its last idle transition
                expires = runner.expires_at
            context = runner.num_ctx * (runner.parallel if self.report_total_context else 1)
            entries.append(
                (
                    expires,
                    {
                        "name": name,
                        "model": name,
                        "size": int(runner.size_mib * MIB),
                        "digest": self.spec(name).digest,
                        "details": DETAILS,
                        "expires_at": go_time(expires, self.tz),
                        "size_vram": int(runner.size_vram_mib * MIB),
                        "context_length": context,
                    },
                )
            )
        entries.sort(key=lambda e: e[0], reverse=True)
        return web.json_response({"models": [e for _, e in entries]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    def _model(
        self, body: dict[str, Any], chat: bool = True
    ) -> tuple[str | None, web.Response | None]:
        raw = body.get("model")
        if not raw:  # an invalid name: GenerateHandler calls it not found, ChatHandler required
            if not chat:
                return None, web.json_response({"error": "model '' not found"}, status=404)
            return None, web.json_response({"error": "model is required"}, status=400)
        name = canonical(str(raw))
        if name not in self.models:
            return None, web.json_response({"error": f"model '{raw}' not found"}, status=404)
        return name, None

    async def _infer(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body, bad = await _bind(request, "ChatRequest" if chat else "GenerateRequest")
        if bad is not None:
            return bad
        name, error = self._model(body, chat)
        if error is not None:
            return error
        assert name is not None
        echo = str(body["model"])  # replies name the model as the request did
        empty = not body.get("messages") if chat else not body.get("prompt")
        if empty and body.get("keep_alive") == 0:
            self.unload_requests.append(name)
            runner = self.loaded.get(name)
            if runner is not None:
                runner.expired = True
                if runner.refs <= 0:
                    self._unload(name)
            done: dict[str, object] = {
                "model": echo,
                "created_at": _now(),
                "done": True,
                "done_reason": "unload",
            }
            done["message" if chat else "response"] = (
                {"role": "assistant", "content": ""} if chat else ""
            )
            return web.json_response(done)
        try:
            loaded = self._acquire(name, body)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        try:
            if loaded and self.load_delay_s:
                await asyncio.sleep(self.load_delay_s)
            if empty:
                return web.json_response(
                    {
                        "model": echo,
                        "created_at": _now(),
                        "response": "",
                        "done": True,
                        "done_reason": "load",
                    }
                )
            if body.get("stream") is False:
                return web.json_response(self._line(echo, chat, "hello", done=True))
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            try:
                for i in range(self.tokens):
                    await resp.write(json.dumps(self._line(echo, chat, f"t{i} ")).encode() + b"\n")
                    self.streaming.set()
                    await asyncio.sleep(self.token_interval_s)
                await resp.write(json.dumps(self._line(echo, chat, "", done=True)).encode() + b"\n")
                await resp.write_eof()
            except (ConnectionError, asyncio.CancelledError):
                self.stream_ends.append("disconnected")
                raise
            self.stream_ends.append("complete")
            return resp
        finally:
            self._release(name)

    async def openai_models(self, _: web.Request) -> web.Response:
        """``GET /v1/models`` (``openai.ListCompletion``)."""
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "library"}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        """``/v1/chat/completions`` (``middleware/openai.go``, ``openai/openai.go``): no
        options, so the Modelfile or default context applies; ``stream: true`` answers
        server-sent events ending ``data: [DONE]``; errors in the OpenAI envelope."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _openai_error(400, "invalid_request_error", str(exc))
        if not isinstance(body, dict):
            return _openai_error(400, "invalid_request_error", "cannot unmarshal")
        name, error = self._model(body)
        if error is not None:
            model = body.get("model")
            return _openai_error(404, "api_error", f"model '{model}' not found")
        assert name is not None
        self._acquire(name, {"model": name})
        try:
            head = {
                "id": "chatcmpl-1",
                "created": int(time.time()),
                "model": str(body["model"]),
                "system_fingerprint": "fp_ollama",
            }
            if body.get("stream") is not True:
                return web.json_response(
                    head
                    | {
                        "object": "chat.completion",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "hello"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.tokens + 1):
                last = i == self.tokens
                delta = {"role": "assistant", "content": "" if last else f"t{i} "}
                choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                chunk = head | {"object": "chat.completion.chunk", "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.token_interval_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
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
            if not chat:
                line["context"] = [1, 2, 3]  # GenerateResponse.Context (deprecated)
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
        body, bad = await _bind(request, "EmbedRequest")
        if bad is not None:
            return bad
        name, error = self._model(body)
        if error is not None:
            return error
        assert name is not None
        try:
            self._acquire(name, body)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self._release(name)
        return web.json_response(
            {
                "model": name,
                "embeddings": [[0.1, 0.2]],
                "total_duration": 10,
                "load_duration": 1,
                "prompt_eval_count": 1,
            }
        )


async def _bind(request: web.Request, kind: str) -> tuple[dict[str, Any], web.Response | None]:
    """gin's ``ShouldBindJSON`` into ``api.<kind>``: an empty body is 400 ``missing request
    body``, anything but a JSON object 400 with the decoder's message."""
    raw = await request.read()
    if not raw.strip():
        return {}, web.json_response({"error": "missing request body"}, status=400)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return {}, web.json_response({"error": f"invalid character: {exc}"}, status=400)
    if not isinstance(body, dict):
        what = "array" if isinstance(body, list) else type(body).__name__
        message = f"json: cannot unmarshal {what} into Go value of type api.{kind}"
        return {}, web.json_response({"error": message}, status=400)
    return body, None


def _openai_error(status: int, type_: str, message: str) -> web.Response:
    """``openai.ErrorResponse``: the OpenAI envelope Ollama's ``/v1`` routes answer with."""
    error = {"message": message, "type": type_, "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


def _now() -> str:
    return datetime.now(UTC).isoformat()
