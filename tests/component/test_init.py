"""``vacancyd init`` as a user runs it (a subprocess of ``python -m vacancyd init``) against
the Ollama, ComfyUI and vLLM look-alikes, a generic OpenAI-compatible server, a server that
accepts connections and never answers, a closed port, and a stand-in ``nvidia-smi``."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from tests.support.daemon import openai_like_app, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.fake_ollama import FakeOllama
from tests.support.fake_vllm import FakeVllm
from tests.support.gpu import SMI_TWO_GPUS, write_smi
from tests.support.llamacpp import free_port
from vacancyd.config import load_config
from vacancyd.config.secrets import read_secrets


async def init(tmp_path: Path, *args: str, smi: bool = True) -> tuple[int, str, str, float]:
    """Run ``vacancyd init`` in a subprocess with a clean NVML-less environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    if smi:
        bindir = tmp_path / "bin"
        write_smi(bindir, f"sys.stdout.write({SMI_TWO_GPUS!r})")
        env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vacancyd",
        "init",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - started


@asynccontextmanager
async def hanging_server() -> AsyncIterator[str]:
    """Accepts connections and reads requests, but never answers."""
    held: list[asyncio.StreamWriter] = []

    async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for w in held:
            w.close()
        server.close()


@asynccontextmanager
async def servers() -> AsyncIterator[dict[str, str]]:
    async with AsyncExitStack() as stack:
        found = {
            "ollama": await stack.enter_async_context(serve_app(FakeOllama().app())),
            "comfyui": await stack.enter_async_context(serve_app(FakeComfy().app())),
            "vllm": await stack.enter_async_context(serve_app(FakeVllm().app())),
            "vllm-plain": await stack.enter_async_context(
                serve_app(FakeVllm(sleep_mode=False, model="other").app())
            ),
            "openai": await stack.enter_async_context(serve_app(openai_like_app()[0])),
            "hang": "http://" + await stack.enter_async_context(hanging_server()),
        }
        yield {k: v.removeprefix("http://") for k, v in found.items()}


def flags(addresses: dict[str, str], *extra: str) -> list[str]:
    out = [f"--server={a}" for a in addresses.values()]
    return [*out, f"--server=127.0.0.1:{free_port()}", "--probe-timeout=0.5", *extra]


async def test_init_finds_each_server_and_gpu_and_writes_a_safe_config(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "vacancyd.toml"
    async with servers() as found:
        code, _, err, took = await init(tmp_path, *flags(found, f"--config={path}"))
    assert code == 0, err
    assert took < 15  # the hanging server cost its deadline, not a hang
    settings = load_config(path)
    read_secrets(settings, str(path))  # the token files exist and are readable
    ups = {u.name: u for u in settings.upstream}
    assert {n: (u.adapter, str(u.target)) for n, u in ups.items()} == {
        "ollama": ("ollama", f"http://{found['ollama']}/"),
        "comfyui": ("comfyui", f"http://{found['comfyui']}/"),
        "vllm": ("vllm", f"http://{found['vllm']}/"),
        "vllm-2": ("vllm", f"http://{found['vllm-plain']}/"),
        "openai": ("openai", f"http://{found['openai']}/"),
    }
    assert ups["ollama"].yield_on_veto and ups["comfyui"].yield_on_veto
    assert ups["vllm"].yield_on_veto and not ups["vllm-2"].yield_on_veto  # sleep mode only
    assert set(ups["ollama"].models.footprint_mib) == {"tiny:latest", "embedder:latest"}
    # Safe defaults: the API on loopback, tokens on every listener, presence auto.
    assert settings.server.listen == "127.0.0.1:9470"
    assert not settings.server.trust_loopback
    assert {t.name: t.scopes for t in settings.server.tokens} == {
        "admin": ["admin"],
        "borrow": ["borrow"],
    }
    assert settings.owner.presence == "auto"
    gpus = [(r.name, r.kind, r.device) for r in settings.resource]
    assert gpus == [
        ("gpu0", "gpu", "GPU-11111111-2222-3333-4444-555555555555"),
        ("gpu1", "gpu", "GPU-66666666-7777-8888-9999-000000000000"),
    ]
    assert all(u.resource == "gpu0" for u in settings.upstream)
    for token in (path.parent / "tokens").iterdir():
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert len(token.read_text().strip()) >= 32
    assert stat.S_IMODE((path.parent / "tokens").stat().st_mode) == 0o700
    text = path.read_text()
    assert f"{found['hang']}: " in text and "no answer within 0.5 s" in text
    assert "nothing listens" in text
    assert "Measuring" in text  # the next step
    assert "found ollama at" in err and "2 GPU(s) from nvidia-smi" in err
    # Models of unknown size are charged gpu0's whole lendable memory (24576 - 2048 MiB
    # kept free), never 0; a server listing no models is warned about.
    assert ups["vllm"].models.default_mib == ups["openai"].models.default_mib == 22528
    assert "whole lendable card" in text
    assert ups["ollama"].models.default_mib > 0
    assert "warning: upstream[1] (comfyui): [upstream.models] default_mib is 0" in err
    assert "default_mib is 0" not in err.replace("(comfyui): [upstream.models] default_mib", "")


async def test_print_writes_nothing_and_existing_files_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "vacancyd.toml"
    async with servers() as found:
        code, out, err, _ = await init(tmp_path, *flags(found, f"--config={path}", "--print"))
        assert code == 0, err
        assert 'adapter = "ollama"' in out
        assert not path.exists() and not (tmp_path / "tokens").exists()
        assert (await init(tmp_path, *flags(found, f"--config={path}")))[0] == 0
        tokens = {p.name: p.read_text() for p in (tmp_path / "tokens").iterdir()}
        path.write_text("# the owner's edits\n")
        code, _, err, _ = await init(tmp_path, *flags(found, f"--config={path}"))
        assert code == 1 and "exists; not overwriting it (use --force" in err
        assert path.read_text() == "# the owner's edits\n"
        code, _, err, _ = await init(tmp_path, *flags(found, f"--config={path}", "--force"))
        assert code == 0, err
        assert "kept" in err and 'adapter = "ollama"' in path.read_text()
        # Borrowers may hold the tokens: --force never replaces them.
        assert {p.name: p.read_text() for p in (tmp_path / "tokens").iterdir()} == tokens


async def test_init_into_a_place_that_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err, _ = await init(
        tmp_path, "--server=127.0.0.1:1", "--no-gpus", f"--config={blocker / 'vacancyd.toml'}"
    )
    assert code == 1 and f"cannot create {blocker}" in err
    assert blocker.read_text() == ""


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--server=localhost"], "is not HOST:PORT"),
        (["--server=127.0.0.1:70000"], "is not HOST:PORT"),
        (["--probe-timeout=0"], "--probe-timeout must be"),
    ],
)
async def test_bad_init_arguments(tmp_path: Path, args: list[str], error: str) -> None:
    code, _, err, _ = await init(tmp_path, *args, f"--config={tmp_path / 'v.toml'}", "--print")
    assert code == 2 and error in err


async def test_no_server_no_gpu_still_writes_a_valid_config(tmp_path: Path) -> None:
    path = tmp_path / "vacancyd.toml"
    code, _, err, _ = await init(
        tmp_path, f"--server=127.0.0.1:{free_port()}", f"--config={path}", smi=False
    )
    assert code == 0, err
    settings = load_config(path)
    assert [(r.name, r.kind) for r in settings.resource] == [("ram", "memory")]
    assert settings.upstream == []
    assert "no GPU" in path.read_text() and "No inference server was found" in path.read_text()


async def test_without_a_gpu_unknown_footprints_are_zero_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "vacancyd.toml"
    async with serve_app(openai_like_app()[0]) as url:
        code, _, err, _ = await init(
            tmp_path, f"--server={url.removeprefix('http://')}", f"--config={path}", smi=False
        )
    assert code == 0, err
    (up,) = load_config(path).upstream
    assert up.models.default_mib == 0
    assert "# WARNING: footprints of" in path.read_text()
    assert "warning: upstream[0] (openai): [upstream.models] default_mib is 0" in err
