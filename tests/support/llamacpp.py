"""A real llama.cpp ``llama-server`` for tests, serving a tiny random-weight model.

The binary and a vocab-only GGUF come from ``tools/build-llama-server.sh``, which
builds them into ``${VACANCYD_TOOLS_CACHE:-~/.cache/vacancyd-tools}/llama-server/current/``.
``VACANCYD_LLAMA_SERVER`` points at another binary instead (its vocab file is then
looked for next to it, or taken from ``VACANCYD_LLAMA_VOCAB``).

Tests call :func:`require_llama_server` first: it skips the test when the binary is
missing, or fails it when ``VACANCYD_REQUIRE_TOOLS=1`` (CI), so a broken build cannot
pass silently as a run of skips.

:func:`running_llama_server` writes the tiny model (unless given one), starts
``llama-server`` on a loopback port, waits for ``GET /health`` to answer 200 and
yields a :class:`LlamaServer`. The model is served under the alias :data:`MODEL_ALIAS`,
which is what ``/v1/models`` lists and what requests may name as ``model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.support.tiny_gguf import write_tiny_model

TOOLS_CACHE_ENV = "VACANCYD_TOOLS_CACHE"
REQUIRE_TOOLS_ENV = "VACANCYD_REQUIRE_TOOLS"
BINARY_ENV = "VACANCYD_LLAMA_SERVER"
VOCAB_ENV = "VACANCYD_LLAMA_VOCAB"
BUILD_HINT = "build it with tools/build-llama-server.sh"

VOCAB_NAME = "ggml-vocab-llama-spm.gguf"
"""File name of the vocab-only GGUF that the build script caches next to the binary."""
MODEL_ALIAS = "tiny"
"""Model id the server reports in ``/v1/models`` and accepts as ``model``."""

CONTEXT_TOKENS = 256
"""Context size given to the server (``-c``), in tokens."""

_LOG_TAIL_BYTES = 4000
_ADDR_IN_USE_MARKERS = ("address already in use", "couldn't bind", "failed to bind")


def tools_cache_dir() -> Path:
    """The tools cache root (``$VACANCYD_TOOLS_CACHE`` or ``~/.cache/vacancyd-tools``)."""
    env = os.environ.get(TOOLS_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vacancyd-tools"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def llama_server_binary() -> Path | None:
    """Path of the ``llama-server`` binary to test against, or ``None`` if there is none.

    ``$VACANCYD_LLAMA_SERVER`` wins when set (``None`` if it names no executable file);
    otherwise the binary under ``<tools cache>/llama-server/current/``.
    """
    env = os.environ.get(BINARY_ENV)
    candidate = (
        Path(env) if env else tools_cache_dir() / "llama-server" / "current" / "llama-server"
    )
    return candidate if _executable(candidate) else None


def llama_vocab_gguf(binary: Path | None = None) -> Path | None:
    """Path of the vocab-only GGUF used to build the tiny model, or ``None`` if missing.

    ``$VACANCYD_LLAMA_VOCAB`` wins when set; otherwise :data:`VOCAB_NAME` next to
    ``binary`` (default: :func:`llama_server_binary`).
    """
    env = os.environ.get(VOCAB_ENV)
    if env:
        candidate = Path(env)
    else:
        binary = binary or llama_server_binary()
        if binary is None:
            return None
        candidate = binary.resolve().parent / VOCAB_NAME
    return candidate if candidate.is_file() else None


def require_llama_server() -> tuple[Path, Path]:
    """Return ``(binary, vocab_gguf)``, or end the calling test if either is missing.

    A missing file skips the test, unless ``VACANCYD_REQUIRE_TOOLS=1`` is set (as CI
    does), in which case the test fails instead.
    """
    binary = llama_server_binary()
    vocab = llama_vocab_gguf(binary) if binary is not None else None
    if binary is not None and vocab is not None:
        return binary, vocab
    if binary is None:
        where = os.environ.get(BINARY_ENV) or str(tools_cache_dir() / "llama-server" / "current")
        message = f"llama-server binary missing (looked at {where}); {BUILD_HINT}"
    else:
        message = (
            f"vocab GGUF {VOCAB_NAME} missing next to {binary} (or set {VOCAB_ENV}); {BUILD_HINT}"
        )
    if os.environ.get(REQUIRE_TOOLS_ENV) == "1":
        pytest.fail(f"{message} [{REQUIRE_TOOLS_ENV}=1]", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return "<no log>"


@dataclass(frozen=True)
class LlamaServer:
    """A running ``llama-server`` process."""

    base_url: str
    """``http://127.0.0.1:<port>`` (no trailing slash; the OpenAI API is under ``/v1``)."""
    port: int
    process: asyncio.subprocess.Process
    model_path: Path
    alias: str
    """Model id served (see :data:`MODEL_ALIAS`)."""
    log_path: Path
    """File receiving the server's stdout and stderr."""

    def log_tail(self) -> str:
        """The last few KB of the server log, for assertion messages."""
        return _log_tail(self.log_path)


def llama_server_argv(
    binary: Path,
    model: Path,
    port: int,
    *,
    alias: str = MODEL_ALIAS,
    threads: int = 2,
    parallel: int = 1,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line for a small CPU server on 127.0.0.1:``port``.

    ``threads`` is the number of CPU threads for generation and batch processing;
    ``parallel`` the number of slots (``-np``), each with :data:`CONTEXT_TOKENS` of context.
    """
    return [
        str(binary),
        "--model", str(model),
        "--alias", alias,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(CONTEXT_TOKENS * parallel),
        "--parallel", str(parallel),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--seed", "42",
        "--no-webui",
        "--no-warmup",
        *extra_args,
    ]  # fmt: skip


async def _healthy(session: aiohttp.ClientSession, base_url: str) -> bool:
    try:
        async with session.get(f"{base_url}/health") as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _stop(process: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM ``process``, then SIGKILL it if still alive after ``grace`` seconds."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def _start_once(
    argv: list[str], log_path: Path, port: int, startup_timeout: float
) -> asyncio.subprocess.Process:
    """Start the server and wait until healthy; on failure stop it and raise RuntimeError."""
    # LLAMA_ARG_* variables would silently override our command line; drop them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    try:
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if process.returncode is not None:
                    raise RuntimeError(
                        f"llama-server exited with {process.returncode} during startup; "
                        f"log tail:\n{_log_tail(log_path)}"
                    )
                if await _healthy(session, base_url):
                    return process
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"llama-server not healthy after {startup_timeout:.0f} s; "
                        f"log tail:\n{_log_tail(log_path)}"
                    )
                await asyncio.sleep(0.1)
    except BaseException:
        await _stop(process, grace=2.0)
        raise


@contextlib.asynccontextmanager
async def running_llama_server(
    tmp_path: Path,
    *,
    port: int | None = None,
    model: Path | None = None,
    alias: str = MODEL_ALIAS,
    startup_timeout: float = 60.0,
    stop_grace: float = 5.0,
    parallel: int = 1,
    extra_args: Sequence[str] = (),
) -> AsyncIterator[LlamaServer]:
    """Run ``llama-server`` with a tiny model until the ``async with`` block ends.

    ``tmp_path`` receives the model (when ``model`` is not given) and ``llama-server.log``.
    ``port`` defaults to a free loopback port (retried a few times should another process
    grab it first). ``startup_timeout`` bounds the wait for ``GET /health`` == 200, in
    seconds. On exit the server gets SIGTERM, then SIGKILL after ``stop_grace`` seconds.
    ``parallel`` is the server's slot count (``-np``). Ends the calling test (skip or fail,
    see :func:`require_llama_server`) if the binary is missing.
    """
    binary, vocab = require_llama_server()
    if model is None:
        # Blocking file work (reading the vocab takes seconds): keep it off the event loop.
        model = await asyncio.to_thread(write_tiny_model, tmp_path / "tiny.gguf", vocab)
    log_path = tmp_path / "llama-server.log"

    attempts = 1 if port is not None else 3
    process: asyncio.subprocess.Process | None = None
    chosen = port
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        argv = llama_server_argv(
            binary, model, chosen, alias=alias, parallel=parallel, extra_args=extra_args
        )
        try:
            process = await _start_once(argv, log_path, chosen, startup_timeout)
            break
        except RuntimeError as exc:
            lost_port_race = any(m in str(exc).lower() for m in _ADDR_IN_USE_MARKERS)
            if attempt + 1 >= attempts or not lost_port_race:
                raise
    assert process is not None and chosen is not None

    server = LlamaServer(
        base_url=f"http://127.0.0.1:{chosen}",
        port=chosen,
        process=process,
        model_path=model,
        alias=alias,
        log_path=log_path,
    )
    try:
        yield server
    finally:
        await _stop(process, grace=stop_grace)
