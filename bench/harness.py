"""Processes and clients shared by bench/proxy_overhead.py and bench/refusal_rate.py.

Every server a benchmark compares runs as its own process on loopback: the canned upstream,
the naive aiohttp forwarder (bench/naive_forwarder.py), nginx when installed, and a real
``vacancyd run``. The client side is a blocking ``http.client`` connection per target, kept
alive, so the client costs the same for every target and adds no event loop of its own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.daemon import single_upstream_toml  # noqa: E402

#: The upstream every latency target ends at: a canned chat completion at once, or an SSE
#: stream whose second event comes STREAM_GAP_S after the first (so the first event is
#: measured alone). uvloop when installed, so the anchor itself is as quick as it gets.
UPSTREAM = r"""
import asyncio, sys
from aiohttp import web
GAP = float(sys.argv[2])
CANNED = (b'{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}')
async def chat(request):
    body = await request.read()
    if b'"stream": true' in body or b'"stream":true' in body:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        await asyncio.sleep(GAP)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return web.Response(body=CANNED, content_type="application/json")
async def slots(request):
    return web.json_response([{"id": 0, "is_processing": False}])
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/slots", slots)
loop = None
try:
    import uvloop
    loop = uvloop.new_event_loop()
except ImportError:
    pass
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, loop=loop)
"""

CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, separators=(",", ":")
).encode()
STREAM_BODY = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    separators=(",", ":"),
).encode()
JSON_HEADERS = {"Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s} s")


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Processes:
    """Started processes, stopped (SIGTERM, then SIGKILL) when the block ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        argv: list[str],
        *,
        pin: str | None = None,
        env: dict[str, str] | None = None,
        stderr: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (pinned to CPUs ``pin`` by taskset); its stderr goes to the file
        ``stderr`` when given (the daemon's log), else stays the benchmark's."""
        if pin is not None:
            argv = ["taskset", "-c", pin, *argv]
        if stderr is None:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
        else:
            with stderr.open("ab") as log:
                proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_upstream(procs: Processes, gap_s: float = 0.01) -> int:
    port = free_port()
    proc = procs.start([sys.executable, "-c", UPSTREAM, str(port), str(gap_s)])
    wait_port(port, proc)
    return port


def start_naive(procs: Processes, target_port: int, *, uvloop: bool, pin: str | None = None) -> int:
    port = free_port()
    argv = [sys.executable, str(ROOT / "bench" / "naive_forwarder.py"), str(port)]
    argv.append(f"http://127.0.0.1:{target_port}")
    if uvloop:
        argv.append("--uvloop")
    wait_port(port, procs.start(argv, pin=pin))
    return port


def start_vacancyd(
    procs: Processes,
    target_port: int,
    tmp: Path,
    *,
    adapter: str = "openai",
    pin: str | None = None,
    loop: str | None = None,
    source: Path | None = None,
    log_level: str | None = None,
) -> tuple[int, int, subprocess.Popen[bytes]]:
    """A real ``vacancyd run`` in front of ``target_port``; returns (proxy port, api port, proc).

    ``loop`` sets ``VACANCYD_EVENT_LOOP`` (``asyncio`` or ``uvloop``); None keeps the default.
    ``source``: run the ``vacancyd`` package of that source tree instead of this one (an
    earlier version, to compare in the same run). ``log_level``: ``--log-level`` (None: the
    daemon's default, ``info``, as a service runs). The daemon's log (stderr) is written to
    :func:`log_path` of the proxy port, a file as the journal would be, so writing it costs
    what it costs on a host.
    """
    api, listen = free_port(), free_port()
    cfg = tmp / f"vacancyd-{adapter}-{listen}.toml"
    # Its own state directory: what a run changes (a pause, learned state) must never reach
    # the machine's /var/lib/vacancyd, another run, or another benchmark.
    state_dir = tmp / f"state-{listen}"
    state_dir.mkdir()
    cfg.write_text(
        f"state_dir = {json.dumps(str(state_dir))}\n"
        + single_upstream_toml(
            api=api, proxy=listen, target=f"http://127.0.0.1:{target_port}", adapter=adapter
        )
    )
    env = dict(os.environ)
    if loop is not None:
        env["VACANCYD_EVENT_LOOP"] = loop
    if source is not None:
        # PYTHONSAFEPATH: the working directory (this tree) must not come first on the path
        env["PYTHONPATH"] = str(source)
        env["PYTHONSAFEPATH"] = "1"
    argv = [sys.executable, "-m", "vacancyd", "run", "--config", str(cfg)]
    if log_level is not None:
        argv += ["--log-level", log_level]
    proc = procs.start(argv, pin=pin, env=env, stderr=log_path(tmp, listen))
    wait_port(listen, proc)
    wait_port(api, proc)
    return listen, api, proc


def log_path(tmp: Path, port: int) -> Path:
    """Where :func:`start_vacancyd` writes the log of the daemon listening on ``port``."""
    return tmp / f"vacancyd-{port}.log"


NGINX_PROXY = """
location / {
    proxy_pass http://bench_upstream;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_request_buffering off;
}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def start_nginx(
    procs: Processes,
    tmp: Path,
    *,
    location: str,
    target_port: int | None = None,
    pin: str | None = None,
) -> int | None:
    """nginx (one worker) with ``location`` as its only server block body; None if absent."""
    binary = nginx_binary()
    if binary is None:
        return None
    port = free_port()
    root = tmp / f"nginx-{port}"
    root.mkdir()
    upstream = (
        f"upstream bench_upstream {{ server 127.0.0.1:{target_port}; keepalive 16; }}"
        if target_port is not None
        else ""
    )
    user = "user root;" if os.geteuid() == 0 else ""
    (root / "nginx.conf").write_text(
        f"""
{user}
worker_processes 1;
daemon off;
master_process off;
pid {root}/nginx.pid;
error_log {root}/error.log error;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    keepalive_requests 1000000;
    {upstream}
    server {{
        listen 127.0.0.1:{port};
        {location}
    }}
}}
"""
    )
    proc = procs.start([binary, "-p", str(root), "-c", str(root / "nginx.conf")], pin=pin)
    wait_port(port, proc)
    return port


class Client:
    """One kept-alive HTTP/1.1 connection; ``post`` returns (status, seconds, body)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes) -> tuple[int, float, bytes]:
        t0 = time.perf_counter()
        self.conn.request("POST", path, body, JSON_HEADERS)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, time.perf_counter() - t0, data

    def first_chunk(self, path: str, body: bytes) -> tuple[int, float]:
        """Seconds from sending the request to the first body bytes of the response."""
        t0 = time.perf_counter()
        self.conn.request("POST", path, body, JSON_HEADERS)
        resp = self.conn.getresponse()
        first = resp.read1(65536)
        dt = time.perf_counter() - t0
        if not first:
            raise RuntimeError(f"port {self.port}: the stream ended before its first chunk")
        resp.read()
        return resp.status, dt

    def close(self) -> None:
        self.conn.close()


def wait_admitted(port: int, body: bytes = CHAT_BODY, timeout_s: float = 60.0) -> None:
    """Wait until a freshly started proxy answers ``body`` with 200 (collectors sampled)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            client = Client(port)
            status, _, data = client.post(CHAT_PATH, body)
            client.close()
            if status == 200:
                return
            last = (status, data[:200])
        except OSError as exc:
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"port {port} never admitted a request: {last!r}")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def server_pid(proc: subprocess.Popen[bytes]) -> int:
    """The pid doing the work: under ``taskset`` it execs, so the pid is the same."""
    return proc.pid


def iter_rotated(items: Sequence[str], i: int) -> Iterator[str]:
    """``items`` starting at position ``i`` (so no target always goes first)."""
    n = len(items)
    for k in range(n):
        yield items[(i + k) % n]


def start_llama_server(procs: Processes, tmp: Path) -> int:
    """The real llama-server from the tools cache with the tiny test model; returns its port."""
    from tests.support.llamacpp import llama_server_argv, llama_server_binary, llama_vocab_gguf
    from tests.support.tiny_gguf import write_tiny_model

    binary, vocab = llama_server_binary(), llama_vocab_gguf()
    if binary is None or vocab is None:
        raise RuntimeError("llama-server is not built (tools/build-llama-server.sh)")
    model = write_tiny_model(tmp / "tiny.gguf", vocab)
    port = free_port()
    argv = llama_server_argv(binary, model, port, threads=1)
    proc = procs.start(argv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return port
            conn.close()
        time.sleep(0.1)
    raise RuntimeError("llama-server not healthy after 60 s")
