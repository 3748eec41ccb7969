"""Latency vacancyd's proxy adds, side by side with the anchors, interleaved in one run.

Targets, each its own process on loopback, all ending at the same canned upstream:

* ``direct``: the upstream itself (the baseline every "added" figure subtracts);
* ``naive``: bench/naive_forwarder.py, the 30-line aiohttp forwarder, on asyncio's loop and
  (when uvloop is installed) on uvloop;
* ``nginx``: nginx as a reverse proxy with upstream keep-alive, when installed (skipped with
  a note otherwise; ``apt-get install nginx-light``);
* ``vacancyd``: a real ``vacancyd run`` with one ``openai`` upstream gated on system memory,
  on each available event loop (``VACANCYD_EVENT_LOOP``), at the default log level (one
  access line per request, written to a file as the journal would be; ``--log-level``
  changes it);
* ``before`` (``--before [NAME=]SOURCE_TREE``, repeatable): the vacancyd of another source
  tree (an earlier version, e.g. from ``git archive``) on the default loop, as ``NAME/LOOP``.

Requests go over one kept-alive connection per target, in blocks of ``--block`` back-to-back
requests, the targets taking turns (rotating who goes first) so machine noise spreads over
all of them. Back-to-back blocks matter: a borrower hammering the lender sends its next
request right after the previous one released the reservation.

Prints p50/p99 of the added latency per target, the ratios vacancyd-added / naive-added at
p50 and p99 with both on the same event loop (asyncio for both, uvloop for both), the
first-streamed-chunk delay, and (``--llama``, or automatically when the tools cache has it)
the same against a real llama-server. Usage::

    .venv/bin/python bench/proxy_overhead.py [--requests 2000] [--block 20] [--llama]
        [--log-level warning] [--before /tmp/before]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CHAT_BODY,
    CHAT_PATH,
    NGINX_PROXY,
    STREAM_BODY,
    Client,
    Processes,
    iter_rotated,
    pct,
    proc_cpu_s,
    start_llama_server,
    start_naive,
    start_nginx,
    start_upstream,
    start_vacancyd,
    wait_admitted,
)

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
LOOPS = ["asyncio", "uvloop"] if HAVE_UVLOOP else ["asyncio"]


@dataclass
class Target:
    port: int
    pid: int  #: the process whose CPU time a request through this target costs
    samples: list[float] = field(default_factory=list)  #: milliseconds
    cpu_s: float = 0.0  #: CPU seconds of ``pid`` over the measured requests


@dataclass(frozen=True)
class Daemons:
    """How the vacancyd targets run: ``log_level`` (None: the default) and the earlier
    source trees to run beside this one, as (name, path)."""

    log_level: str | None = None
    before: tuple[tuple[str, Path], ...] = ()


def start_targets(
    procs: Processes,
    tmp: Path,
    upstream: int,
    upstream_pid: int,
    adapter: str,
    daemons: Daemons,
) -> dict[str, Target]:
    targets = {"direct": Target(upstream, upstream_pid)}
    for loop in LOOPS:
        port = start_naive(procs, upstream, uvloop=loop == "uvloop")
        targets[f"naive/{loop}"] = Target(port, procs.procs[-1].pid)
    nginx = start_nginx(procs, tmp, location=NGINX_PROXY, target_port=upstream)
    if nginx is None:
        print("note: nginx is not installed; skipping it (apt-get install nginx-light)")
    else:
        targets["nginx"] = Target(nginx, procs.procs[-1].pid)
    level = daemons.log_level
    for loop in LOOPS:
        port, _, proc = start_vacancyd(
            procs, upstream, tmp, adapter=adapter, loop=loop, log_level=level
        )
        targets[f"vacancyd/{loop}"] = Target(port, proc.pid)
    for name, source in daemons.before:
        port, _, proc = start_vacancyd(
            procs, upstream, tmp, adapter=adapter, loop=LOOPS[-1], source=source, log_level=level
        )
        targets[f"{name}/{LOOPS[-1]}"] = Target(port, proc.pid)
    return targets


def interleaved(
    targets: dict[str, Target], n: int, block: int, measure: Callable[[Client], float]
) -> dict[str, Target]:
    """``n`` samples (milliseconds) per target after a warm-up, taken in rotating blocks,
    and the CPU time each target's own process spent on them."""
    clients = {name: Client(t.port) for name, t in targets.items()}
    names = list(targets)
    for t in targets.values():
        t.samples, t.cpu_s = [], 0.0
    warm = max(block, 20)
    rounds = warm // block + -(-n // block)
    for r in range(rounds):
        for name in iter_rotated(names, r):
            client, target = clients[name], targets[name]
            cpu0 = proc_cpu_s(target.pid)
            for _ in range(block):
                ms = measure(client) * 1000
                if r * block >= warm:
                    target.samples.append(ms)
            if r * block >= warm:
                target.cpu_s += proc_cpu_s(target.pid) - cpu0
    for c in clients.values():
        c.close()
    return targets


def chat(body: bytes) -> Callable[[Client], float]:
    def measure(client: Client) -> float:
        status, dt, data = client.post(CHAT_PATH, body)
        if status != 200:
            raise RuntimeError(f"port {client.port} answered {status}: {data[:300]!r}")
        return dt

    return measure


def first_chunk(client: Client) -> float:
    status, dt = client.first_chunk(CHAT_PATH, STREAM_BODY)
    if status != 200:
        raise RuntimeError(f"port {client.port} answered {status} to a streamed request")
    return dt


def summarize(title: str, targets: dict[str, Target]) -> dict[str, dict[str, float]]:
    direct = targets["direct"].samples
    d50, d99 = statistics.median(direct), pct(direct, 0.99)
    rows: dict[str, dict[str, float]] = {}
    print(f"\n{title}  (ms; added = target - direct; {len(direct)} samples per target;")
    print("  CPU = the target's own process per request, the upstream's not included)")
    head = f"  {'target':18s} {'p50':>8s} {'p99':>8s} {'added p50':>10s} {'added p99':>10s}"
    print(head + f" {'CPU us/req':>11s}")
    for name, target in targets.items():
        values = target.samples
        p50, p99 = statistics.median(values), pct(values, 0.99)
        cpu_us = target.cpu_s / len(values) * 1e6
        rows[name] = {"p50_ms": p50, "p99_ms": p99, "added_p50_ms": p50 - d50}
        rows[name]["added_p99_ms"] = p99 - d99
        rows[name]["cpu_us_per_request"] = cpu_us
        added = " " * 21 if name == "direct" else f"{p50 - d50:10.3f} {p99 - d99:10.3f}"
        print(f"  {name:18s} {p50:8.3f} {p99:8.3f} {added} {cpu_us:11.0f}")
    for name in rows:
        ours, _, loop = name.partition("/")
        naive = rows.get(f"naive/{loop}")
        if ours in ("direct", "naive", "nginx") or naive is None:
            continue
        for q in ("p50", "p99"):
            theirs = naive[f"added_{q}_ms"]
            ratio = rows[name][f"added_{q}_ms"] / theirs if theirs > 0 else float("nan")
            rows[name][f"ratio_to_naive_{q}"] = ratio
        print(
            f"  ratio {ours}-added / naive-added, both on {loop}: "
            f"p50 {rows[name]['ratio_to_naive_p50']:.2f}, "
            f"p99 {rows[name]['ratio_to_naive_p99']:.2f}"
        )
    return rows


def llama_available() -> bool:
    from tests.support.llamacpp import llama_server_binary, llama_vocab_gguf

    return llama_server_binary() is not None and llama_vocab_gguf() is not None


def run_llama(
    procs: Processes, tmp: Path, n: int, block: int, daemons: Daemons
) -> dict[str, dict[str, float]]:
    port = start_llama_server(procs, tmp)
    targets = start_targets(procs, tmp, port, procs.procs[-1].pid, "llamacpp", daemons)
    body = json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    for target in targets.values():
        wait_admitted(target.port, body)
    return summarize("llama-server chat completion", interleaved(targets, n, block, chat(body)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="samples per target")
    parser.add_argument("--block", type=int, default=20, help="back-to-back requests per turn")
    parser.add_argument("--llama", action="store_true", help="require the llama-server run")
    parser.add_argument("--no-llama", action="store_true", help="skip the llama-server run")
    parser.add_argument(
        "--log-level", help="vacancyd's --log-level (default: the daemon's default, info)"
    )
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="[NAME=]SOURCE_TREE",
        help="also run the vacancyd of this source tree on the default loop, as NAME/LOOP "
        "(default name: before); may be given more than once",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    daemons = Daemons(
        args.log_level,
        tuple(
            (b.partition("=")[0], Path(b.partition("=")[2])) if "=" in b else ("before", Path(b))
            for b in args.before
        ),
    )
    results: dict[str, object] = {"cpus": os.cpu_count(), "requests": args.requests}
    with tempfile.TemporaryDirectory() as tmpdir, Processes() as procs:
        tmp = Path(tmpdir)
        upstream = start_upstream(procs)
        targets = start_targets(procs, tmp, upstream, procs.procs[-1].pid, "openai", daemons)
        for target in targets.values():
            wait_admitted(target.port)
        results["json"] = summarize(
            "canned JSON completion",
            interleaved(targets, args.requests, args.block, chat(CHAT_BODY)),
        )
        n_stream = max(50, args.requests // 10)
        results["first_chunk"] = summarize(
            "first streamed (SSE) chunk", interleaved(targets, n_stream, 5, first_chunk)
        )
    if args.no_llama:
        pass
    elif llama_available():
        with tempfile.TemporaryDirectory() as tmpdir, Processes() as procs:
            results["llama"] = run_llama(
                procs, Path(tmpdir), max(50, args.requests // 10), args.block, daemons
            )
    elif args.llama:
        raise SystemExit("llama-server is not built (tools/build-llama-server.sh)")
    else:
        print("\nnote: llama-server is not in the tools cache; skipping that run")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
