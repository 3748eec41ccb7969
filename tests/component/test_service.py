"""``vacancyd install-service`` / ``remove-service`` in a fake root: with a recording
``systemctl`` and ``systemd-sysusers`` standing in for the host's (what each run changes,
and that re-runs converge), and with ``--root`` (files only: nothing may reach systemd).
The same install against a real systemd is tests/integration/test_systemd_service.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vacancyd.cli import main
from vacancyd.runtime.service import (
    Service,
    ServiceError,
    check_as_service,
    render_unit,
    vacancyd_command,
)

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "support" / "fake_systemctl.py"
UNIT = Path("etc/systemd/system/vacancyd.service")
DROPIN = Path("etc/systemd/system/vacancyd.service.d/credentials.conf")
WANTS = Path("etc/systemd/system/multi-user.target.wants/vacancyd.service")
SYSUSERS = Path("etc/sysusers.d/vacancyd.conf")
CONFIG = Path("etc/vacancyd/vacancyd.toml")


def config_text(*tokens: str, presence: str = "auto") -> str:
    """A lender config naming each token file in ``tokens`` (absolute paths)."""
    text = f'[server]\nlisten = "127.0.0.1:9470"\n\n[owner]\npresence = "{presence}"\n'
    for i, path in enumerate(tokens):
        text += f'\n[[server.tokens]]\nname = "t{i}"\ntoken_file = "{path}"\nscopes = ["admin"]\n'
    return text


def write_lender(root: Path, *tokens: str, config: Path = CONFIG) -> None:
    """What `vacancyd init` leaves below ``root``: a config and its root-only tokens."""
    tokens = tokens or ("/etc/vacancyd/tokens/admin.token", "/etc/vacancyd/tokens/borrow.token")
    for i, token in enumerate(tokens):
        path = root / token.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"secret-token-number-{i}-{'x' * 20}\n")
        path.chmod(0o600)
    (root / config).parent.mkdir(parents=True, exist_ok=True)
    (root / config).write_text(config_text(*tokens))


class Systemd:
    """A recording systemctl (tests/support/fake_systemctl.py) and systemd-sysusers."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp / "systemctl"
        wrapper = tmp / "systemctl.sh"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        self.sysusers_log = tmp / "sysusers.log"
        sysusers = tmp / "sysusers.sh"
        sysusers.write_text(f'#!/bin/sh\necho "$@" >> "{self.sysusers_log}"\n')
        sysusers.chmod(0o755)
        monkeypatch.setenv("VACANCYD_SYSTEMCTL", str(wrapper))
        monkeypatch.setenv("VACANCYD_SYSUSERS", str(sysusers))
        monkeypatch.setenv("FAKE_SYSTEMCTL_DIR", str(self.dir))
        self.checked: list[Path] = []

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

    def check(self, config: Path, command: str) -> subprocess.CompletedProcess[str]:
        """Stands in for the check as the service user (tested on its own below)."""
        self.checked.append(config)
        return subprocess.CompletedProcess([], 0, f"{config}: OK\n", "")

    def service(self, root: Path, **kw: object) -> Service:
        return Service(root=root, check=self.check, report=lambda _line: None, **kw)  # type: ignore[arg-type]


@pytest.fixture
def systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Systemd:
    return Systemd(tmp_path, monkeypatch)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write_lender(root)
    return root


def test_first_install_writes_unit_user_and_credentials_then_enables_and_starts(
    root: Path, systemd: Systemd
) -> None:
    systemd.service(root).install()
    assert systemd.changes() == ["daemon-reload", "enable", "start"]
    unit = (root / UNIT).read_text()
    assert unit == render_unit(vacancyd_command(), Path("/etc/vacancyd/vacancyd.toml"))
    assert "\nUser=vacancyd\n" in unit and "\nDynamicUser=" not in unit
    assert "CAP_DAC_READ_SEARCH" not in unit and "ConditionPathExists=" in unit
    dropin = (root / DROPIN).read_text()
    assert "LoadCredential=admin.token:/etc/vacancyd/tokens/admin.token" in dropin
    assert "LoadCredential=borrow.token:/etc/vacancyd/tokens/borrow.token" in dropin
    assert "u vacancyd " in (root / SYSUSERS).read_text()
    assert systemd.sysusers_log.read_text().split() == [str(root / SYSUSERS)]
    assert systemd.checked == [Path("/etc/vacancyd/vacancyd.toml")]


def test_rerun_changes_nothing_when_nothing_drifted(root: Path, systemd: Systemd) -> None:
    systemd.service(root).install()
    systemd.calls()
    before = [(root / p).stat().st_mtime_ns for p in (UNIT, DROPIN, SYSUSERS)]
    systemd.service(root).install()
    assert systemd.changes() == []  # no reload, no enable, no restart
    assert [(root / p).stat().st_mtime_ns for p in (UNIT, DROPIN, SYSUSERS)] == before


def test_drifted_unit_is_rewritten_and_restarted_only_if_it_was_running(
    root: Path, systemd: Systemd
) -> None:
    systemd.service(root).install()
    systemd.calls()
    (root / UNIT).write_text((root / UNIT).read_text().replace("WatchdogSec=30", "WatchdogSec=5"))
    systemd.service(root).install()
    assert systemd.changes() == ["daemon-reload", "restart"]
    assert "WatchdogSec=30" in (root / UNIT).read_text()

    systemd.set(active=False)  # stopped by hand: a re-run must not start it
    (root / UNIT).write_text("[Unit]\n")
    systemd.service(root).install()
    assert systemd.changes() == ["daemon-reload"]
    assert not (systemd.dir / "active").exists()


def test_a_new_secret_file_in_the_config_updates_the_credentials_and_restarts(
    root: Path, systemd: Systemd
) -> None:
    systemd.service(root).install()
    systemd.calls()
    write_lender(root, "/etc/vacancyd/tokens/admin.token", "/srv/keys/upstream.key")
    systemd.service(root).install()
    assert systemd.changes() == ["daemon-reload", "restart"]
    dropin = (root / DROPIN).read_text()
    assert "LoadCredential=upstream.key:/srv/keys/upstream.key" in dropin
    assert "borrow.token" not in dropin


def test_two_secret_files_with_one_name_are_refused(tmp_path: Path, systemd: Systemd) -> None:
    root = tmp_path / "root"
    write_lender(root, "/etc/vacancyd/a/admin.token", "/etc/vacancyd/b/admin.token")
    with pytest.raises(ServiceError, match="same file name"):
        systemd.service(root).install()
    assert systemd.changes() == [] and not (root / UNIT).exists()


def test_disabled_unit_is_enabled_again(root: Path, systemd: Systemd) -> None:
    systemd.service(root).install()
    (systemd.dir / "enabled").unlink()
    systemd.calls()
    systemd.service(root).install()
    assert systemd.changes() == ["enable"]


def test_no_config_is_refused_with_the_next_step_and_nothing_is_written(
    tmp_path: Path, systemd: Systemd
) -> None:
    root = tmp_path / "root"
    with pytest.raises(ServiceError, match=r"vacancyd init"):
        systemd.service(root).install()
    assert not root.exists() or not any(root.rglob("*"))
    assert systemd.changes() == []


def test_no_config_under_root_fails_from_the_command_line(
    tmp_path: Path, systemd: Systemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install-service", "--root", str(tmp_path / "root")]) == 1
    assert "sudo vacancyd init" in capsys.readouterr().err
    assert not (tmp_path / "root" / CONFIG).exists()


def test_a_missing_secret_file_is_refused_before_anything_starts(
    root: Path, systemd: Systemd
) -> None:
    (root / "etc/vacancyd/tokens/borrow.token").unlink()
    with pytest.raises(ServiceError, match=r"borrow\.token.*does not exist"):
        systemd.service(root).install()
    assert systemd.changes() == []


def test_a_config_the_service_cannot_use_stops_the_install(root: Path, systemd: Systemd) -> None:
    def failing(config: Path, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 1, "", "cannot read /srv/tls.key: Permission denied")

    with pytest.raises(ServiceError, match="Permission denied"):
        Service(root=root, check=failing, report=lambda _l: None).install()
    assert "enable" not in systemd.changes()


def test_root_dir_install_never_runs_systemctl_or_sysusers(
    root: Path, systemd: Systemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install-service", "--root", str(root)]) == 0
    assert systemd.calls() == []
    assert not systemd.sysusers_log.exists()
    assert os.readlink(root / WANTS) == "/etc/systemd/system/vacancyd.service"
    assert (root / DROPIN).exists() and (root / SYSUSERS).exists()
    assert "first boot" in capsys.readouterr().out
    assert main(["install-service", "--root", str(root)]) == 0  # converges
    assert main(["remove-service", "--root", str(root)]) == 0
    assert systemd.calls() == []
    assert not (root / WANTS).is_symlink() and not (root / UNIT).exists()
    assert not (root / DROPIN).exists() and (root / CONFIG).exists()


def test_packaged_unit_is_used_as_it_is(root: Path, systemd: Systemd) -> None:
    packaged = root / "lib/systemd/system/vacancyd.service"
    packaged.parent.mkdir(parents=True)
    packaged.write_text(render_unit(vacancyd_command(), Path("/etc/vacancyd/vacancyd.toml")))
    (root / "usr/lib/sysusers.d").mkdir(parents=True)
    (root / "usr/lib/sysusers.d/vacancyd.conf").write_text("u vacancyd -\n")
    systemd.service(root).install()
    assert not (root / UNIT).exists() and not (root / SYSUSERS).exists()
    assert (root / DROPIN).exists()
    assert systemd.changes() == ["daemon-reload", "enable", "start"]
    systemd.service(root).remove()
    assert systemd.changes() == ["stop", "disable", "daemon-reload"]
    assert packaged.exists() and not (root / DROPIN).exists()


def test_remove_undoes_install_and_keeps_the_config(root: Path, systemd: Systemd) -> None:
    systemd.service(root).install()
    systemd.calls()
    systemd.service(root).remove()
    assert systemd.changes() == ["stop", "disable", "daemon-reload"]
    assert not (root / UNIT).exists() and not (root / DROPIN).exists()
    assert (root / CONFIG).exists() and (root / "etc/vacancyd/tokens/admin.token").exists()
    systemd.service(root).remove()  # again: nothing left to do
    assert systemd.changes() == []


def test_failing_systemctl_is_reported(
    root: Path, systemd: Systemd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACANCYD_SYSTEMCTL", "/bin/false")
    with pytest.raises(ServiceError, match="daemon-reload failed"):
        systemd.service(root).install()


def test_relative_config_is_refused(root: Path, systemd: Systemd) -> None:
    with pytest.raises(ServiceError, match="absolute"):
        systemd.service(root, config=Path("vacancyd.toml")).install()


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


# -- the check as the service sees it (a real user switch; needs root) -----------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is private to root), with
    ``vacancyd``: this checkout run by the system's Python, which other users may run (the
    test interpreter may live in /root)."""
    if os.geteuid() != 0:
        pytest.skip("switching to the service's user needs root")
    system_python = Path(f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}")
    if not system_python.exists():
        pytest.skip(f"{system_python} (for a vacancyd other users can run) is not installed")
    path = Path(tempfile.mkdtemp(prefix="vacancyd-service-check-"))
    path.chmod(0o755)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    wrapper = path / "vacancyd"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{ROOT}:{site}" exec {system_python} -m vacancyd "$@"\n'
    )
    wrapper.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _lender_for_nobody(base: Path, *extra: str) -> Path:
    """A config (world-readable, like /etc/vacancyd/vacancyd.toml) naming root-only tokens."""
    tokens = base / "tokens"
    tokens.mkdir(mode=0o700)
    for name in ("admin", "borrow"):
        (tokens / f"{name}.token").write_text(f"{name}-secret-{'y' * 24}\n")
        (tokens / f"{name}.token").chmod(0o600)
    config = base / "vacancyd.toml"
    config.write_text(
        config_text(str(tokens / "admin.token"), str(tokens / "borrow.token"), presence="logind")
        + "".join(extra)
    )
    config.chmod(0o644)
    return config


def test_check_as_the_service_reads_root_only_tokens_as_credentials(shared_dir: Path) -> None:
    config = _lender_for_nobody(shared_dir)
    # The service's user cannot read the tokens themselves...
    plain = subprocess.run(
        [str(shared_dir / "vacancyd"), "check-config", "--strict", str(config)],
        user="nobody",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert plain.returncode == 1 and "Permission denied" in plain.stderr
    # ...and as the service, with them passed as credentials, the same config is fine.
    done = check_as_service(config, command=str(shared_dir / "vacancyd"), user="nobody")
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


def test_check_as_the_service_finds_a_file_only_root_can_read(shared_dir: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(shared_dir / "tls.crt"))
    cert.private_key_pem.write_to_path(str(shared_dir / "tls.key"))
    (shared_dir / "tls.crt").chmod(0o644)
    (shared_dir / "tls.key").chmod(0o600)  # root-only, and not a credential: TLS is re-read
    config = _lender_for_nobody(shared_dir)
    text = config.read_text().replace(
        '[server]\nlisten = "127.0.0.1:9470"\n',
        f'[server]\nlisten = "127.0.0.1:9470"\ntls_cert_file = "{shared_dir}/tls.crt"\n'
        f'tls_key_file = "{shared_dir}/tls.key"\n',
    )
    config.write_text(text)
    assert main(["check-config", "--strict", str(config)]) == 0  # fine for root
    done = check_as_service(config, command=str(shared_dir / "vacancyd"), user="nobody")
    assert done.returncode == 1 and "tls.key" in done.stderr, done.stderr


def test_check_config_signal_sends_sighup_only_for_a_valid_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "v.toml"
    config.write_text(config_text())
    target = subprocess.Popen(["sleep", "60"])
    try:
        config.write_text("this is = not toml [")
        assert main(["check-config", "--signal", str(target.pid), str(config)]) == 1
        assert target.poll() is None  # a broken config: no signal
        config.write_text(config_text())
        assert main(["check-config", "--signal", str(target.pid), str(config)]) == 0
        assert target.wait(timeout=10) == -signal.SIGHUP
        assert f"sent SIGHUP to {target.pid}" in capsys.readouterr().out
    finally:
        target.kill()
        target.wait()
