"""Refusals per second on one pinned core: vacancyd (lending off) against a bare handler.

Every server runs pinned to CPU ``--server-cpu`` (taskset) and the load generator to
``--client-cpu``; the targets take turns, ``--rounds`` times, in one run:

* ``vacancyd``: a real ``vacancyd run`` (one ``openai`` upstream, loopback trusted) after
  ``PUT /admin/lending {"enabled": false}``: every borrowed request is refused by the gate.
  It runs at the default log level (``info``, as a service does), its log written to a
  file as the journal would be;
* ``quiet``: the same with ``--log-level warning`` (no access lines at all), on the default
  loop;
* ``paused``: the same after ``POST /admin/pause {}`` instead (the owner's pause: an
  ``owner_active`` refusal from the owner's steps of the gate, lending still on);
* ``bare``: bench/bare_refusal.py, an aiohttp handler answering the very envelope vacancyd
  sent (status, Retry-After, JSON body) and nothing else (``bare-paused``: the paused one);
* ``nginx``: ``return 503`` with the same body, when installed (a ceiling, not a goal);
* ``before`` (with ``--before SOURCE_TREE``, or ``NAME`` with ``--before NAME=SOURCE_TREE``,
  repeatable): an earlier vacancyd, lending off, to compare with in the same run.

Each target runs on asyncio's loop and, when installed, on uvloop. The load is ``wrk``
(``-t1 -c32``, a POST chat completion with a JSON body) when installed, else
bench/loadgen.py. Prints requests/s (median of rounds), the ratio vacancyd / bare on the same
loop (and paused / bare-paused), CPU seconds per 1,000 refusals (user + system of the server
process, from /proc), the server's RSS before the first round and after the last, and for
each daemon the bytes of log it wrote per 1,000 refusals.
Usage::

    .venv/bin/python bench/refusal_rate.py [--seconds 5] [--rounds 3] [--connections 32]
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CHAT_BODY,
    CHAT_PATH,
    ROOT,
    Client,
    Processes,
    free_port,
    iter_rotated,
    log_path,
    proc_cpu_s,
    proc_rss_mib,
    start_nginx,
    start_upstream,
    start_vacancyd,
    wait_admitted,
    wait_port,
)

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
LOOPS = ["asyncio", "uvloop"] if HAVE_UVLOOP else ["asyncio"]
#: Headers aiohttp adds by itself (and that change per response): not part of the envelope.
OWN_HEADERS = {"date", "server", "content-length"}


def lending_off(api_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", api_port, timeout=10)
    conn.request(
        "PUT",
        "/admin/lending",
        json.dumps({"enabled": False}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"PUT /admin/lending answered {resp.status}: {data!r}")


def pause(api_port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", api_port, timeout=10)
    conn.request("POST", "/admin/pause", b"{}", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"POST /admin/pause answered {resp.status}: {data!r}")


def envelope(port: int, code: str = "lending_disabled") -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", CHAT_PATH, CHAT_BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    if resp.status != 503 or json.loads(body)["error"]["code"] != code:
        raise RuntimeError(f"expected a 503 {code} refusal, got {resp.status}: {body!r}")
    headers = {k: v for k, v in resp.getheaders() if k.lower() not in OWN_HEADERS}
    return {"status": resp.status, "headers": headers, "body": body.decode()}


def nginx_location(env: dict[str, object]) -> str:
    headers = env["headers"]
    assert isinstance(headers, dict)
    body = str(env["body"]).replace("\\", "\\\\").replace("'", "\\'")
    adds = "".join(
        f"add_header {k} '{v}' always;\n" for k, v in headers.items() if k.lower() != "content-type"
    )
    return f"location / {{\n default_type application/json;\n {adds} return 503 '{body}';\n}}"


def load(port: int, tmp: Path, args: argparse.Namespace) -> tuple[int, float, int]:
    """(requests, seconds, non-503 answers) of one run of the load generator."""
    pin = ["taskset", "-c", args.client_cpu]
    url = f"http://127.0.0.1:{port}{CHAT_PATH}"
    if shutil.which("wrk"):
        script = tmp / "post.lua"
        script.write_text(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(CHAT_BODY.decode())}\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        argv = [*pin, "wrk", "-t1", f"-c{args.connections}", f"-d{args.seconds}s", "-s"]
        out = subprocess.run([*argv, str(script), url], capture_output=True, text=True, check=True)
        total = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out.stdout)
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out.stdout)
        errors = re.search(r"Socket errors: (.*)", out.stdout)
        if total is None:
            raise RuntimeError(f"cannot read wrk's output:\n{out.stdout}")
        n = int(total.group(1))
        secs = float(total.group(2)) / (1000 if total.group(3) == "ms" else 1)
        refused = int(non2xx.group(1)) if non2xx else 0
        if errors:
            print(f"  note: wrk on {port}: socket errors {errors.group(1)}")
        return n, secs, n - refused
    body = tmp / "body.json"
    body.write_bytes(CHAT_BODY)
    argv = [*pin, sys.executable, str(ROOT / "bench" / "loadgen.py"), str(port), CHAT_PATH]
    argv += [str(body), str(args.connections), str(args.seconds)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    return data["requests"], data["seconds"], data["requests"] - data["statuses"].get("503", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of one load run")
    parser.add_argument("--rounds", type=int, default=3, help="turns per target")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--client-cpu", default="1")
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        metavar="[NAME=]SOURCE_TREE",
        help="also run the vacancyd of this source tree (an earlier version, e.g. from "
        "`git archive`), lending off on the default loop at the default log level, as target "
        "NAME/LOOP (default name: before); may be given more than once",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("note: wrk is not installed; using bench/loadgen.py (a lower ceiling)")
    with tempfile.TemporaryDirectory() as tmpdir, Processes() as procs:
        tmp = Path(tmpdir)
        upstream = start_upstream(procs)
        pids: dict[str, int] = {}
        ports: dict[str, int] = {}
        envs: dict[str, dict[str, object]] = {}
        for loop in LOOPS:
            port, api, proc = start_vacancyd(procs, upstream, tmp, pin=args.server_cpu, loop=loop)
            wait_admitted(port)
            lending_off(api)
            envs.setdefault("lending_off", envelope(port))
            ports[f"vacancyd/{loop}"], pids[f"vacancyd/{loop}"] = port, proc.pid
        default = LOOPS[-1]
        port, api, proc = start_vacancyd(
            procs, upstream, tmp, pin=args.server_cpu, loop=default, log_level="warning"
        )
        wait_admitted(port)
        lending_off(api)
        ports[f"quiet/{default}"], pids[f"quiet/{default}"] = port, proc.pid
        befores = [b.partition("=")[::2] if "=" in b else ("before", b) for b in args.before]
        for label, source in befores:
            port, api, proc = start_vacancyd(
                procs, upstream, tmp, pin=args.server_cpu, loop=default, source=Path(source)
            )
            wait_admitted(port)
            lending_off(api)
            ports[f"{label}/{default}"], pids[f"{label}/{default}"] = port, proc.pid
        # the owner's pause, on the default loop (the last one: uvloop when installed)
        port, api, proc = start_vacancyd(procs, upstream, tmp, pin=args.server_cpu, loop=default)
        wait_admitted(port)
        pause(api)
        envs["paused"] = envelope(port, "owner_active")
        ports[f"paused/{default}"], pids[f"paused/{default}"] = port, proc.pid
        env = envs["lending_off"]
        for name, loop, which in [(f"bare/{lp}", lp, "lending_off") for lp in LOOPS] + [
            (f"bare-paused/{default}", default, "paused")
        ]:
            (tmp / f"{which}.json").write_text(json.dumps(envs[which]))
            port = free_port()
            argv = [sys.executable, str(ROOT / "bench" / "bare_refusal.py"), str(port)]
            argv.append(str(tmp / f"{which}.json"))
            if loop == "uvloop":
                argv.append("--uvloop")
            proc = procs.start(argv, pin=args.server_cpu)
            wait_port(port, proc)
            ports[name], pids[name] = port, proc.pid
        nginx = start_nginx(procs, tmp, location=nginx_location(env), pin=args.server_cpu)
        if nginx is None:
            print("note: nginx is not installed; skipping it (apt-get install nginx-light)")
        else:
            ports["nginx"] = nginx
            pids["nginx"] = procs.procs[-1].pid
        for name, port in ports.items():  # every target answers the envelope it stands for
            status, _, data = Client(port).post(CHAT_PATH, CHAT_BODY)
            want = envs["paused" if name.startswith(("paused", "bare-paused")) else "lending_off"]
            if status != 503 or json.loads(data) != json.loads(str(want["body"])):
                raise RuntimeError(f"{name} answered {status} {data!r}")
        rss_before = {name: proc_rss_mib(pid) for name, pid in pids.items()}
        rates: dict[str, list[float]] = {name: [] for name in ports}
        cpu: dict[str, float] = dict.fromkeys(ports, 0.0)
        total: dict[str, int] = dict.fromkeys(ports, 0)
        names = list(ports)
        for r in range(args.rounds):
            for name in iter_rotated(names, r):
                c0 = proc_cpu_s(pids[name])
                n, secs, wrong = load(ports[name], tmp, args)
                cpu[name] += proc_cpu_s(pids[name]) - c0
                if wrong:
                    raise RuntimeError(f"{name}: {wrong} of {n} answers were not 503")
                rates[name].append(n / secs)
                total[name] += n
        rss_after = {name: proc_rss_mib(pid) for name, pid in pids.items()}
        logged = {
            name: log_path(tmp, port).stat().st_size
            for name, port in ports.items()
            if log_path(tmp, port).exists()
        }

    print(
        f"\nrefusals on one pinned core (server CPU {args.server_cpu}, load on CPU "
        f"{args.client_cpu}, {args.connections} connections, {args.rounds} x {args.seconds} s)"
    )
    print(
        f"  {'target':20s} {'req/s p50':>10s} {'min':>8s} {'max':>8s} {'CPU s/1k':>9s}"
        f" {'RSS before':>11s} {'RSS after':>10s} {'log B/1k':>9s}"
    )
    rows: dict[str, dict[str, float]] = {}
    for name in ports:
        med = statistics.median(rates[name])
        per_k = cpu[name] / total[name] * 1000
        rows[name] = {
            "rps_median": med,
            "rps_min": min(rates[name]),
            "rps_max": max(rates[name]),
            "cpu_s_per_1000": per_k,
            "rss_before_mib": rss_before[name],
            "rss_after_mib": rss_after[name],
        }
        log_k = "-"
        if name in logged:
            # what the daemon logged over all its rounds (start-up lines included)
            rows[name]["log_bytes_per_1000"] = logged[name] / total[name] * 1000
            log_k = f"{rows[name]['log_bytes_per_1000']:.0f}"
        print(
            f"  {name:20s} {med:10.0f} {min(rates[name]):8.0f} {max(rates[name]):8.0f}"
            f" {per_k:9.4f} {rss_before[name]:9.1f} M {rss_after[name]:8.1f} M {log_k:>9s}"
        )
    pairs = [(f"vacancyd/{lp}", f"bare/{lp}") for lp in LOOPS]
    pairs += [(f"quiet/{LOOPS[-1]}", f"bare/{LOOPS[-1]}")]
    pairs += [(f"paused/{LOOPS[-1]}", f"bare-paused/{LOOPS[-1]}")]
    for label, _ in reversed(befores):
        pairs.insert(0, (f"{label}/{LOOPS[-1]}", f"bare/{LOOPS[-1]}"))
    for ours, anchor in pairs:
        ratio = rows[ours]["rps_median"] / rows[anchor]["rps_median"]
        cpu_ratio = rows[ours]["cpu_s_per_1000"] / rows[anchor]["cpu_s_per_1000"]
        rows[ours]["ratio_to_bare"] = ratio
        rows[ours]["cpu_ratio_to_bare"] = cpu_ratio
        print(f"  rate {ours} / {anchor}: {ratio:.2f} (CPU per refusal: {cpu_ratio:.2f})")
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
