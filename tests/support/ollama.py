"""A real Ollama (``ollama serve``) for tests, serving a tiny random-weight model on the CPU.

The binary comes from ``tools/build-ollama.sh``, which builds it into
``${VACANCYD_TOOLS_CACHE:-~/.cache/vacancyd-tools}/ollama/current/ollama``;
``VACANCYD_OLLAMA`` points at another binary instead. The model is the tiny llama GGUF the
llama-server tests write (:mod:`tests.support.tiny_gguf`), made from the vocab-only GGUF that
``tools/build-llama-server.sh`` caches, and registered with ``ollama create NAME -f
Modelfile`` (``FROM /path/model.gguf``).

Tests call :func:`require_ollama` first: it skips the test when the binary or the vocab is
missing, or fails it when ``VACANCYD_REQUIRE_TOOLS=1`` (CI), as the llama-server tests do.

:func:`started_ollama` runs ``ollama serve`` on a loopback port with its own model store and
home under a temporary directory, waits for ``GET /`` to answer, registers the models and
returns an :class:`OllamaServer`; :meth:`OllamaServer.stop` ends it. Both are synchronous so
one server can serve a whole test module (each test runs on its own event loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.llamacpp import (
    REQUIRE_TOOLS_ENV,
    free_port,
    llama_vocab_gguf,
    tools_cache_dir,
)
from tests.support.tiny_gguf import write_tiny_model

BINARY_ENV = "VACANCYD_OLLAMA"
BUILD_HINT = "build it with tools/build-ollama.sh"
VOCAB_HINT = "the tiny model's vocab comes from tools/build-llama-server.sh"

MODEL = "tiny:latest"
"""The registered model, as Ollama names it in ``/api/tags`` and ``/api/ps``."""
CONTEXT_TOKENS = 512
"""The tiny model's training context (``TinyLlamaConfig.n_ctx_train``): Ollama's default
context is clamped to it, so ``/api/ps`` lists this ``context_length``."""

_LOG_TAIL_BYTES = 4000


def ollama_binary() -> Path | None:
    """Path of the ``ollama`` binary to test against, or ``None`` if there is none.

    ``$VACANCYD_OLLAMA`` wins when set (``None`` if it names no executable file); otherwise
    the binary under ``<tools cache>/ollama/current/``.
    """
    env = os.environ.get(BINARY_ENV)
    candidate = Path(env) if env else tools_cache_dir() / "ollama" / "current" / "ollama"
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def require_ollama() -> tuple[Path, Path]:
    """Return ``(ollama binary, vocab GGUF)``, or end the calling test if either is missing.

    A missing file skips the test, unless ``VACANCYD_REQUIRE_TOOLS=1`` is set (as CI does),
    in which case the test fails instead.
    """
    binary = ollama_binary()
    vocab = llama_vocab_gguf()
    if binary is not None and vocab is not None:
        return binary, vocab
    if binary is None:
        where = os.environ.get(BINARY_ENV) or str(tools_cache_dir() / "ollama" / "current")
        message = f"ollama binary missing (looked at {where}); {BUILD_HINT}"
    else:
        message = f"vocab GGUF for the tiny model missing; {VOCAB_HINT}"
    if os.environ.get(REQUIRE_TOOLS_ENV) == "1":
        pytest.fail(f"{message} [{REQUIRE_TOOLS_ENV}=1]", pytrace=False)
    pytest.skip(message)


def _log_tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return "<no log>"


@dataclass
class OllamaServer:
    """A running ``ollama serve``. Its helpers block (urllib): call them from sync code, or
    through ``asyncio.to_thread`` from a test's event loop."""

    binary: Path
    base_url: str
    """``http://127.0.0.1:<port>`` (no trailing slash)."""
    port: int
    process: subprocess.Popen[bytes]
    home: Path
    """``HOME`` and ``OLLAMA_MODELS`` live under this directory."""
    log_path: Path
    model_path: Path
    models: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment the ``ollama`` command line needs to reach this server."""
        return _env(self.home, self.port)

    def log_tail(self) -> str:
        """The last few KB of the server log, for assertion messages."""
        return _log_tail(self.log_path)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One JSON request: (status, decoded body, or the raw text when not JSON)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode("utf-8", errors="replace")

    def ps(self) -> list[dict[str, Any]]:
        """``GET /api/ps`` ``models``: what the server holds in memory now."""
        status, payload = self.request("GET", "/api/ps")
        assert status == 200, payload
        return list(payload.get("models") or [])

    def unload_all(self) -> None:
        """Ask every loaded model to unload and wait (up to 10 s) until ``/api/ps`` is empty."""
        for entry in self.ps():
            self.request("POST", "/api/generate", {"model": entry["name"], "keep_alive": 0})
        deadline = time.monotonic() + 10
        while self.ps():
            if time.monotonic() > deadline:
                raise AssertionError(f"models still loaded: {self.ps()}\n{self.log_tail()}")
            time.sleep(0.05)

    def create(self, name: str, modelfile: str) -> None:
        """``ollama create NAME -f Modelfile`` with ``modelfile`` as the Modelfile's text."""
        path = self.home / f"{name.replace(':', '_').replace('/', '_')}.Modelfile"
        path.write_text(modelfile)
        done = subprocess.run(
            [str(self.binary), "create", name, "-f", str(path)],
            env=self.env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"ollama create {name} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')[-2000:]}"
            )
        self.models.append(name if ":" in name else f"{name}:latest")

    def runner_cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the server's model runners (its child
        processes), from ``/proc``; 0.0 when none runs."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for child in _children(self.process.pid):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the server (and its runners), SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # runners left behind


def _children(pid: int) -> Iterator[int]:
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                yield int(child)


def _env(home: Path, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLLAMA_")}
    env.update(
        HOME=str(home),
        OLLAMA_HOST=f"127.0.0.1:{port}",
        OLLAMA_MODELS=str(home / "models"),
        OLLAMA_NOPRUNE="1",
        **(extra or {}),
    )
    return env


def _answers(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def started_ollama(
    workdir: Path,
    *,
    models: Sequence[str] = (MODEL,),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
) -> OllamaServer:
    """Start ``ollama serve`` under ``workdir`` with the tiny model registered as each of
    ``models``; ``env`` adds ``OLLAMA_*`` settings (``OLLAMA_KEEP_ALIVE``...). Ends the
    calling test (skip or fail) when the binary or vocab is missing; raises RuntimeError when
    the server does not come up within ``startup_timeout`` seconds."""
    binary, vocab = require_ollama()
    workdir.mkdir(parents=True, exist_ok=True)
    model_path = write_tiny_model(workdir / "tiny.gguf", vocab)
    log_path = workdir / "ollama.log"
    for _attempt in range(3):
        port = free_port()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [str(binary), "serve"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(workdir, port, env),
                start_new_session=True,
            )
        server = OllamaServer(
            binary, f"http://127.0.0.1:{port}", port, process, workdir, log_path, model_path
        )
        deadline = time.monotonic() + startup_timeout
        while process.poll() is None and not _answers(server.base_url):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"ollama not up after {startup_timeout:.0f} s\n{_log_tail(log_path)}"
                )
            time.sleep(0.05)
        if process.poll() is None:
            break
        if "address already in use" not in _log_tail(log_path):
            raise RuntimeError(
                f"ollama serve exited with {process.returncode}\n{_log_tail(log_path)}"
            )
    else:
        raise RuntimeError(f"ollama serve could not bind a port\n{_log_tail(log_path)}")
    try:
        for name in models:
            server.create(name, f"FROM {model_path}\n")
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_ollama(workdir: Path, **kw: Any) -> Iterator[OllamaServer]:
    """:func:`started_ollama` for the length of a ``with`` block."""
    server = started_ollama(workdir, **kw)
    try:
        yield server
    finally:
        server.stop()
