"""Added latency of vacancyd's proxy, measured on loopback (issue: foundation, "Measure").

Runs a minimal upstream that answers at once (and streams SSE), a real ``vacancyd run``
process in front of it, and optionally a real llama-server (``--llama``), then sends the same
requests directly and through the proxy, sequentially over keep-alive connections.

Reports p50/p99 of the request latency direct and proxied, the added time and the ratio, and
the delay to the first streamed chunk. Usage::

    .venv/bin/python bench/proxy_overhead.py [--requests 2000] [--llama]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.daemon import single_upstream_toml

UPSTREAM = r"""
import asyncio, sys
from aiohttp import web
async def chat(request):
    body = await request.read()
    if b'"stream": true' in body:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"first": true}\n\n')
        await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return web.json_response({"choices": [{"message": {"content": "ok"}}]})
async def slots(request):
    return web.json_response([{"id": 0, "is_processing": False}])
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/slots", slots)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(url: str, n: int, body: dict[str, object]) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(n + 50):
            t0 = time.perf_counter()
            async with http.post(url, json=body) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
            if i >= 50:  # warm-up
                out.append((time.perf_counter() - t0) * 1000)
    return out


async def first_chunk(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(n + 10):
            t0 = time.perf_counter()
            async with http.post(url, json={"model": "m", "stream": True}) as r:
                await r.content.readline()
                dt = (time.perf_counter() - t0) * 1000
                await r.read()
            if i >= 10:
                out.append(dt)
    return out


async def until_admitted(url: str, timeout_s: float = 60) -> None:
    """Wait until the proxy (just started) admits a request."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                body = {
                    "model": "m",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "x"}],
                }
                async with http.post(url, json=body) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never admitted a request")


def report(name: str, direct: list[float], proxied: list[float]) -> dict[str, float]:
    d50, d99 = statistics.median(direct), pct(direct, 0.99)
    p50, p99 = statistics.median(proxied), pct(proxied, 0.99)
    row = {
        "direct_p50_ms": d50,
        "direct_p99_ms": d99,
        "proxied_p50_ms": p50,
        "proxied_p99_ms": p99,
        "added_p50_ms": p50 - d50,
        "added_p99_ms": p99 - d99,
        "ratio_p50": p50 / d50,
        "ratio_p99": p99 / d99,
    }
    print(f"{name:28s} " + "  ".join(f"{k}={v:.3f}" for k, v in row.items()))
    return row


def start_vacancyd(
    target_port: int, adapter: str, tmp: Path
) -> tuple[subprocess.Popen[bytes], int]:
    api, listen = free_port(), free_port()
    cfg = tmp / f"{adapter}-{target_port}.toml"
    cfg.write_text(
        single_upstream_toml(
            api=api, proxy=listen, target=f"http://127.0.0.1:{target_port}", adapter=adapter
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "vacancyd", "run", "--config", str(cfg), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
    )
    return proc, listen


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--llama", action="store_true", help="also against a real llama-server")
    args = parser.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        try:
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)]))
            vd, listen = start_vacancyd(port, "openai", tmp)
            procs.append(vd)
            direct = f"http://127.0.0.1:{port}/v1/chat/completions"
            proxied = f"http://127.0.0.1:{listen}/v1/chat/completions"
            await until_admitted(proxied)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            results["minimal upstream"] = report(
                "minimal upstream",
                await latency(direct, args.requests, body),
                await latency(proxied, args.requests, body),
            )
            n = max(50, args.requests // 10)
            results["first SSE chunk"] = report(
                "first SSE chunk", await first_chunk(direct, n), await first_chunk(proxied, n)
            )
            if args.llama:
                from tests.support.llamacpp import llama_server_binary, running_llama_server

                if llama_server_binary() is None:
                    raise SystemExit("llama-server is not built: run tools/build-llama-server.sh")
                async with running_llama_server(tmp) as server:
                    vd2, listen2 = start_vacancyd(server.port, "llamacpp", tmp)
                    procs.append(vd2)
                    await until_admitted(f"http://127.0.0.1:{listen2}/v1/chat/completions")
                    body = {
                        "model": "tiny",
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                    m = max(50, args.requests // 20)
                    results["llama-server"] = report(
                        "llama-server",
                        await latency(f"{server.base_url}/v1/chat/completions", m, body),
                        await latency(f"http://127.0.0.1:{listen2}/v1/chat/completions", m, body),
                    )
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(
        json.dumps(
            {"cpus": os.cpu_count(), "requests": args.requests, "results": results}, indent=2
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
