"""nvidia-smi fallback: a stand-in executable printing the real CSV format,
one that hangs (killed at the deadline), one printing garbage; and a daemon on a host where
the NVML library cannot be loaded at all, which measures capacity through nvidia-smi and
refuses on pressure it cannot measure.
"""

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

import psutil
import pytest

from tests.support import config as cfg
from tests.support.gpu import SMI_TWO_GPUS, write_smi
from vacancyd.collectors.base import ProbeError
from vacancyd.collectors.nvidia import SmiProbe, parse_smi_csv
from vacancyd.core.gpu import GpuSelector


def probe(device: int | str, path: Path, timeout_s: float = 2.0) -> SmiProbe:
    return SmiProbe(GpuSelector.parse(device), timeout_s, executable=str(path))


def test_parse_real_format() -> None:
    rows = parse_smi_csv(SMI_TWO_GPUS)
    assert [r.index for r in rows] == [0, 1]
    assert rows[0].free_mib == 23552 and rows[0].utilization == 0.07
    assert rows[1].utilization is None  # [N/A]


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "hello world\n",
        "0, GPU-x, 00000000:01:00.0, lots, 1, 2, 3\n",
        "0, GPU-x, 00000000:01:00.0, 100, 50, 900, 3\n",  # free > total
        "0, GPU-x, 00000000:01:00.0, 100, 50, 50, 300\n",
        "0, GPU-x, 00000000:01:00.0, 100, 50, 50\n",
    ],
)
def test_garbage_is_an_error(garbage: str) -> None:
    with pytest.raises(ValueError):
        parse_smi_csv(garbage)


@pytest.mark.parametrize(
    ("device", "free"),
    [(0, 23552), (1, 288), ("GPU-66666666-7777-8888-9999-000000000000", 288), ("02:00.0", 288)],
)
def test_stand_in_selects_by_index_uuid_or_pci(
    tmp_path: Path, device: int | str, free: int
) -> None:
    smi = write_smi(
        tmp_path,
        "assert '--format=csv,noheader,nounits' in sys.argv, sys.argv\n"
        f"sys.stdout.write({SMI_TWO_GPUS!r})",
    )
    reading = probe(device, smi)()
    assert reading.free_mib == free


def test_garbage_output_is_a_probe_error(tmp_path: Path) -> None:
    smi = write_smi(tmp_path, "print('NVIDIA-SMI has failed because it could not communicate')")
    with pytest.raises(ProbeError, match="cannot read"):
        probe(0, smi)()


def test_failing_exit_is_a_probe_error(tmp_path: Path) -> None:
    smi = write_smi(tmp_path, "sys.stderr.write('No devices were found'); sys.exit(6)")
    with pytest.raises(ProbeError, match="No devices"):
        probe(0, smi)()


def test_hung_nvidia_smi_is_killed_at_the_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    smi = write_smi(
        tmp_path, f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    )
    started = time.monotonic()
    with pytest.raises(ProbeError, match="deadline"):
        probe(0, smi, timeout_s=0.5)()
    assert time.monotonic() - started < 3
    pid = int(pidfile.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_missing_executable_is_a_probe_error(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="not on PATH"):
        probe(0, tmp_path / "nope")()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_daemon_without_nvml_uses_nvidia_smi_and_refuses_unmeasured_pressure(
    tmp_path: Path,
) -> None:
    """A real ``vacancyd run`` process: no libnvidia-ml.so.1 anywhere, nvidia-smi on PATH."""
    write_smi(tmp_path / "bin", f"sys.stdout.write({SMI_TWO_GPUS!r})")
    api = _free_port()
    config = tmp_path / "vacancyd.toml"
    config.write_text(
        cfg.daemon_toml(
            cfg.upstream("llm", f"http://127.0.0.1:{_free_port()}", resource="gpu1"),
            resources=(cfg.gpu("gpu1", 1, pressure={"fixed_threshold": 0.2, "poll_ms": 200}),),
            server={"listen": f"127.0.0.1:{api}"},
            collectors={"poll_s": 0.2},
            state_dir=tmp_path / "state",
        ),
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
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
                with urllib.request.urlopen(f"http://127.0.0.1:{api}/status", timeout=2) as r:
                    doc = json.load(r)
                if (
                    doc["resources"]["gpu1"]["free_mib"] is not None
                    and doc["resources"]["gpu1"]["pressure"]["quality"] == "unknown"
                ):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        gpu = doc["resources"]["gpu1"]
        assert gpu["quality"] == "ready"
        assert gpu["free_mib"] == 288 and gpu["total_mib"] == 12288 and gpu["used_mib"] == 12000
        assert gpu["pressure"]["quality"] == "unknown"
        assert "cannot be loaded" in gpu["pressure"]["detail"]
        refusal = doc["upstreams"]["llm"]["refusal"]
        assert refusal["reason"] == "resource_unmeasured"
        assert "pressure" in refusal["detail"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()
    assert b"using nvidia-smi for capacity" in err
