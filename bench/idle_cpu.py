"""The daemon's idle CPU with every collector at its default cadence (goal: < 1% of a core).

Not a timed test: run it by hand and copy the figures into docs/benchmarks.md.

    .venv/bin/python bench/idle_cpu.py [--seconds 60]

It compiles the fake libnvidia-ml (tests/fakes/fake_nvml.c), then runs ``python -m vacancyd
run`` as a subprocess with LD_LIBRARY_PATH pointing at it and a config declaring one GPU
(capacity every 3 s, pressure every 2 s, defaults), system memory and CPU, headless presence
and one local upstream whose target port is served by a listening process (so the pressure
probe has a tree to find). The fake reports one owner process and one upstream process on
the GPU with fresh utilization samples written by this script every second, so every poll
does the full attribution. CPU is the daemon's user+system time (children included) over
the window, after a warm-up, as a share of one core.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.gpu import Scenario, build_fake_nvml  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=8.0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vacancyd-idle-"))
    lib = build_fake_nvml(work)
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen()
    target_port = target.getsockname()[1]
    api = free_port()
    config = work / "vacancyd.toml"
    config.write_text(
        f'state_dir = "{work / "state"}"\n'
        f'[server]\nlisten = "127.0.0.1:{api}"\ntrust_loopback = true\n'
        '[owner]\npresence = "headless"\n'
        '[[resource]]\nname = "gpu0"\nkind = "gpu"\ndevice = 0\n'
        '[[resource]]\nname = "ram"\nkind = "memory"\n'
        '[[resource]]\nname = "cpu"\nkind = "cpu"\n'
        '[[upstream]]\nname = "llm"\nadapter = "openai"\nlisten = "127.0.0.1:0"\n'
        f'target = "http://127.0.0.1:{target_port}"\nresource = "gpu0"\n'
        'also_requires = ["ram", "cpu"]\n',
        encoding="utf-8",
    )
    scenario = Scenario(work / "scenario.txt")
    scenario.procs = [(0, "graphics", 4_000_000, 300), (0, "compute", os.getpid(), 4000)]
    scenario.write()
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib.parent), FAKE_NVML_SCENARIO=str(scenario.path))
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vacancyd",
            "run",
            "--config",
            str(config),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=ROOT,
    )
    proc = psutil.Process(daemon.pid)

    def feed_until(deadline: float) -> None:
        while time.monotonic() < deadline:
            scenario.samples = scenario.samples[-8:]
            scenario.sample(4_000_000, 5)
            scenario.sample(os.getpid(), 40)
            scenario.write()
            time.sleep(1.0)

    try:
        feed_until(time.monotonic() + args.warmup)
        t0 = proc.cpu_times()
        w0 = time.monotonic()
        feed_until(w0 + args.seconds)
        t1 = proc.cpu_times()
        wall = time.monotonic() - w0
        cpu = (t1.user - t0.user) + (t1.system - t0.system)
        cpu += (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
        print(
            f"daemon idle CPU over {wall:.0f} s: {cpu:.3f} s CPU = {100 * cpu / wall:.2f}% of one "
            f"core (RSS {proc.memory_info().rss / 2**20:.0f} MiB)"
        )
    finally:
        daemon.terminate()
        daemon.wait(10)
        target.close()


if __name__ == "__main__":
    main()
