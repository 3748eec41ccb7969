"""``vacancyd install-service`` / ``remove-service`` in a fake root with a recording
``systemctl``: what each run changes, and that re-runs converge."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vacancyd.cli import main
from vacancyd.runtime.service import render_unit, vacancyd_command

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "support" / "fake_systemctl.py"
UNIT = Path("etc/systemd/system/vacancyd.service")
CONFIG = Path("etc/vacancyd/vacancyd.toml")


class Systemctl:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp / "systemctl"
        wrapper = tmp / "systemctl.sh"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("VACANCYD_SYSTEMCTL", str(wrapper))
        monkeypatch.setenv("FAKE_SYSTEMCTL_DIR", str(self.dir))

    def calls(self) -> list[list[str]]:
        log = self.dir / "calls.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [json.loads(line) for line in lines]

    def changes(self) -> list[str]:
        """The calls that change something (queries left out)."""
        return [c[0] for c in self.calls() if c[0] not in ("is-active", "is-enabled")]

    def set(self, *, active: bool) -> None:
        (self.dir / "active").touch() if active else (self.dir / "active").unlink(missing_ok=True)


@pytest.fixture
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Systemctl:
    return Systemctl(tmp_path, monkeypatch)


def install(root: Path, *extra: str) -> int:
    return main(["install-service", "--root", str(root), *extra])


def test_first_install_creates_config_and_unit_then_enables_and_starts(
    tmp_path: Path, systemctl: Systemctl, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    assert install(root) == 0
    assert systemctl.changes() == ["daemon-reload", "enable", "start"]
    unit = (root / UNIT).read_text()
    assert unit == render_unit(vacancyd_command(), Path("/etc/vacancyd/vacancyd.toml"))
    assert "WatchdogSec=30" in unit and "Type=notify" in unit
    config = (root / CONFIG).read_text()
    assert "[[upstream]]" in config and "install-service never overwrites" in config
    assert main(["check-config", str(root / CONFIG)]) == 0
    out = capsys.readouterr().out
    assert "created" in out and "started vacancyd.service" in out


def test_rerun_changes_nothing_when_nothing_drifted(tmp_path: Path, systemctl: Systemctl) -> None:
    root = tmp_path / "root"
    assert install(root) == 0
    systemctl.calls()
    before = (root / UNIT).stat().st_mtime_ns, (root / CONFIG).read_text()
    assert install(root) == 0
    assert systemctl.changes() == []  # no reload, no enable, no restart
    assert ((root / UNIT).stat().st_mtime_ns, (root / CONFIG).read_text()) == before


def test_drifted_unit_is_rewritten_and_restarted_only_if_it_was_running(
    tmp_path: Path, systemctl: Systemctl
) -> None:
    root = tmp_path / "root"
    assert install(root) == 0
    systemctl.calls()
    (root / UNIT).write_text((root / UNIT).read_text().replace("WatchdogSec=30", "WatchdogSec=5"))
    assert install(root) == 0
    assert systemctl.changes() == ["daemon-reload", "restart"]
    assert "WatchdogSec=30" in (root / UNIT).read_text()

    systemctl.set(active=False)  # stopped by hand: a re-run must not start it
    (root / UNIT).write_text("[Unit]\n")
    assert install(root) == 0
    assert systemctl.changes() == ["daemon-reload"]
    assert not (systemctl.dir / "active").exists()


def test_disabled_unit_is_enabled_again(tmp_path: Path, systemctl: Systemctl) -> None:
    root = tmp_path / "root"
    assert install(root) == 0
    (systemctl.dir / "enabled").unlink()
    systemctl.calls()
    assert install(root) == 0
    assert systemctl.changes() == ["enable"]


def test_existing_config_is_never_overwritten(tmp_path: Path, systemctl: Systemctl) -> None:
    root = tmp_path / "root"
    mine = root / "srv" / "lender.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text("# my own\n")
    assert install(root, "--config", "/srv/lender.toml", "--no-start") == 0
    assert mine.read_text() == "# my own\n"
    assert "run --config /srv/lender.toml" in (root / UNIT).read_text()
    assert not (root / CONFIG).exists()
    assert systemctl.changes() == ["daemon-reload", "enable"]  # --no-start


def test_remove_undoes_install_and_keeps_the_config(tmp_path: Path, systemctl: Systemctl) -> None:
    root = tmp_path / "root"
    assert install(root) == 0
    systemctl.calls()
    assert main(["remove-service", "--root", str(root)]) == 0
    assert systemctl.changes() == ["stop", "disable", "daemon-reload"]
    assert not (root / UNIT).exists()
    assert (root / CONFIG).exists()
    assert main(["remove-service", "--root", str(root)]) == 0  # again: nothing left to do
    assert systemctl.changes() == []


def test_failing_systemctl_is_reported(
    tmp_path: Path,
    systemctl: Systemctl,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("VACANCYD_SYSTEMCTL", "/bin/false")
    assert install(tmp_path / "root") == 1
    assert "daemon-reload failed" in capsys.readouterr().err


def test_relative_config_is_refused(tmp_path: Path, systemctl: Systemctl) -> None:
    assert install(tmp_path / "root", "--config", "vacancyd.toml") == 1


def test_needs_root_without_a_fake_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["install-service"]) == 1
    assert main(["remove-service"]) == 1


def test_shipped_unit_is_the_template_rendered_for_opt() -> None:
    shipped = (ROOT / "packaging" / "systemd" / "vacancyd.service").read_text()
    assert shipped == render_unit("/opt/vacancyd/bin/vacancyd", Path("/etc/vacancyd/vacancyd.toml"))


def test_rendered_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here")
    unit = tmp_path / "vacancyd.service"
    unit.write_text(render_unit(vacancyd_command(), Path("/etc/vacancyd/vacancyd.toml")))
    done = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "vacancyd.service" not in done.stderr, done.stderr  # no warning about our unit
