"""The balancer recipes of docs/balancers.md, run by the real balancers (Debian's HAProxy
and nginx, which tools/dev installs): each config block as the docs print it passes the
tool's own check, and then, pointed at two real in-process lenders, the balancer sends
borrowed work only to the lender that would admit it.

Envoy, olla and LiteLLM are not packaged for Debian 12; their recipes are not run here (the
docs say so).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import BORROW, lender_toml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "balancers.md"
DOC_ADDRESSES = ("192.168.1.20:11435", "192.168.1.21:11435")


def block(lang: str) -> str:
    """The one fenced ``lang`` block of docs/balancers.md, exactly as printed."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, f"docs/balancers.md has {len(blocks)} {lang} blocks"
    return str(blocks[0])


def binary(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        if os.environ.get("VACANCYD_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{name} is not installed (tools/dev installs it)")
        pytest.skip(f"{name} is not installed (tools/dev installs it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def nginx_check(conf: Path) -> subprocess.CompletedProcess[str]:
    prefix = conf.parent
    return subprocess.run(
        [
            binary("nginx"), "-t", "-p", str(prefix), "-c", str(conf),
            "-g", f"pid {prefix}/nginx.pid; error_log {prefix}/error.log;",
        ],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_the_haproxy_recipe_passes_haproxy_check(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(block("haproxy"))
    proc = subprocess.run(
        [binary("haproxy"), "-c", "-f", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Configuration file is valid" in proc.stdout + proc.stderr


def test_the_nginx_recipe_passes_nginx_t(tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(block("nginx"))
    proc = nginx_check(conf)
    assert proc.returncode == 0, proc.stderr
    assert "test is successful" in proc.stderr


#: The upstream keys the lenders run with: the probe public, and four jobs at once, so a
#: check that lands while one request runs still says lendable (with one slot it would say
#: resource_busy and HAProxy would take the only lendable lender out for a moment).
PROBED: dict[str, Any] = {"public_probe": True, "max_concurrent": 4}


@asynccontextmanager
async def two_lenders() -> AsyncIterator[tuple[list[RunningDaemon], list[list[Any]]]]:
    """Two real lenders (probe public), each in front of its own recording upstream."""
    (app_a, seen_a), (app_b, seen_b) = openai_like_app(), openai_like_app()
    async with serve_app(app_a) as ta, serve_app(app_b) as tb:
        async with (
            running_daemon(lender_toml(ta, **PROBED)) as a,
            running_daemon(lender_toml(tb, **PROBED)) as b,
        ):
            await a.wait_ready()
            await b.wait_ready()
            yield [a, b], [seen_a, seen_b]


def pointed(text: str, lenders: list[RunningDaemon], listen: int) -> str:
    """The recipe with its example lender addresses and listen port replaced."""
    for doc_address, lender in zip(DOC_ADDRESSES, lenders, strict=True):
        text = text.replace(doc_address, lender.daemon.bound["chat"])
    return re.sub(r"127\.0\.0\.1:1808[01]", f"127.0.0.1:{listen}", text)


@contextmanager
def running(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def borrow(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {BORROW}"},
    ) as resp:
        await resp.read()
        return resp.status


async def until_logged(log: Path, text: str, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while text not in await asyncio.to_thread(log.read_text):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # another process writes the log: poll it


async def until_listening(port: int, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return


async def test_haproxy_checks_the_probe_and_routes_only_to_the_lendable_lender(
    tmp_path: Path,
) -> None:
    haproxy = binary("haproxy")
    async with two_lenders() as (lenders, seen):
        a, b = lenders
        b.state.set_lending(False)
        port = free_port()
        # checks every 300 ms instead of 2 s, so the test need not wait; each may take 2 s
        # (a loaded machine answers late, and HAProxy's check timeout defaults to inter)
        cfg = pointed(block("haproxy"), lenders, port).replace("inter 2s", "inter 300ms")
        cfg = cfg.replace(
            "    timeout server 300s\n", "    timeout server 300s\n    timeout check 2s\n"
        )
        assert "timeout check 2s" in cfg
        (tmp_path / "haproxy.cfg").write_text(cfg)
        argv = [haproxy, "-db", "-f", str(tmp_path / "haproxy.cfg")]
        log_path = tmp_path / "haproxy.log"
        with running(argv, log_path):
            await until_listening(port)
            # HAProxy logs each state change its checks make: b goes down, a stays up
            await until_logged(log_path, "lenders/office-pc is DOWN")
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                statuses = [await borrow(http, url) for _ in range(10)]
                assert statuses == [200] * 10
                assert (len(seen[0]), len(seen[1])) == (10, 0)
                # the owners swap: a is busy now, b free again
                a.state.set_lending(False)
                b.state.set_lending(True)
                await until_logged(log_path, "lenders/gaming-pc is DOWN")
                await until_logged(log_path, "lenders/office-pc is UP")
                statuses = [await borrow(http, url) for _ in range(10)]
        log = log_path.read_text()
        assert statuses == [200] * 10, log
        assert (len(seen[0]), len(seen[1])) == (10, 10), log
        assert "is DOWN" in log


async def test_nginx_retries_a_refusal_on_the_next_lender(tmp_path: Path) -> None:
    binary("nginx")
    async with two_lenders() as (lenders, seen):
        lenders[1].state.set_lending(False)
        port = free_port()
        conf = tmp_path / "nginx.conf"
        conf.write_text(pointed(block("nginx"), lenders, port))
        assert nginx_check(conf).returncode == 0
        prefix = tmp_path
        argv = [
            binary("nginx"), "-p", str(prefix), "-c", str(conf),
            "-g", f"daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log;",
        ]  # fmt: skip
        with running(argv, tmp_path / "nginx.log"):
            await until_listening(port)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                statuses = [await borrow(http, url) for _ in range(10)]
        assert statuses == [200] * 10, (tmp_path / "error.log").read_text()
        assert (len(seen[0]), len(seen[1])) == (10, 0)
