"""``vacancyd run`` as a real process finding the fake libnvidia-ml.so.1 through the dynamic
linker's normal search (LD_LIBRARY_PATH, read at process start), with an nvidia-smi on PATH
that would report different numbers: capacity must come from NVML, and owner GPU work must
refuse borrowed work (gate step 5)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support import config as cfg
from tests.support.gpu import Gpu, Scenario, write_smi


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as r:
        doc: dict[str, Any] = json.load(r)
    return doc


def test_daemon_process_loads_nvml_by_library_search(fake_nvml_lib: Path, tmp_path: Path) -> None:
    scenario = Scenario(tmp_path / "scenario.txt", gpus=[Gpu(used_mib=4096, util_pct=33)])
    scenario.sample(4_000_000, 60)
    scenario.write()
    write_smi(tmp_path / "bin", "print('0, GPU-x, 00000000:01:00.0, 1, 1, 0, 1')")
    api = _free_port()
    config = tmp_path / "vacancyd.toml"
    pressure = {"fixed_threshold": 0.2, "engage_after_s": 0, "release_after_s": 600, "poll_ms": 200}
    config.write_text(
        cfg.daemon_toml(
            cfg.upstream("llm", f"http://127.0.0.1:{_free_port()}", resource="gpu0"),
            resources=(cfg.gpu("gpu0", "00000000:01:00.0", pressure=pressure),),
            server={"listen": f"127.0.0.1:{api}"},
            collectors={"poll_s": 0.2},
            state_dir=tmp_path / "state",
        ),
        encoding="utf-8",
    )
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(fake_nvml_lib.parent)
    env["FAKE_NVML_SCENARIO"] = str(scenario.path)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vacancyd", "run", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                doc = _status(api)
                if doc["resources"]["gpu0"]["pressure"]["engaged"]:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        gpu = doc["resources"]["gpu0"]
        assert gpu["quality"] == "ready"
        assert (gpu["total_mib"], gpu["used_mib"], gpu["free_mib"]) == (24576, 4096, 20480)
        assert gpu["utilization_ratio"] == 0.33
        assert gpu["pressure"]["engaged"] is True
        assert gpu["pressure"]["gpu"] == Gpu().uuid
        assert doc["upstreams"]["llm"]["refusal"]["reason"] == "resource_pressured"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()
    assert b"nvidia-smi" not in err
