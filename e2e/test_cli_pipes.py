"""The CLI's printing subcommands when their reader goes away: ``vacancyd status | head -1``
ends quietly (exit 1, nothing about the pipe on stderr), never with a BrokenPipeError
traceback, whether standard output is buffered or not. The pipe here is closed before the
command writes, so every run meets the closed pipe (a real ``head`` does only some of the
time)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.test_daemon_process import lender_config, proc_env, vacancyd, wait_for
from tests.support.daemon import single_upstream_toml
from vacancyd.cli import BROKEN_PIPE_EXIT

__all__ = ["proc_env"]  # the fixture, shared with test_daemon_process


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pipes")
    cfg, api, _proxy = lender_config(tmp)
    p = subprocess.Popen(
        vacancyd("run", "--config", str(cfg)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(f"http://127.0.0.1:{api}/readyz")
        yield f"http://127.0.0.1:{api}"
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(15)


def into_a_closed_pipe(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``vacancyd ARGS`` with its standard output the write end of a pipe whose reader
    has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            vacancyd(*args),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=30,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("form", [[], ["--json"]], ids=["text", "json"])
def test_status_into_a_closed_pipe_exits_quietly(
    api_url: str, proc_env: dict[str, str], buffered: bool, form: list[str]
) -> None:
    env = dict(proc_env)
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    done = into_a_closed_pipe(["status", "--url", api_url, *form], env)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == BROKEN_PIPE_EXIT


def test_check_config_into_a_closed_pipe_exits_quietly(
    tmp_path: Path, proc_env: dict[str, str]
) -> None:
    cfg = tmp_path / "v.toml"
    cfg.write_text(single_upstream_toml(api=1, proxy=2, target="http://127.0.0.1:3"))
    done = into_a_closed_pipe(["check-config", str(cfg)], proc_env)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == BROKEN_PIPE_EXIT
