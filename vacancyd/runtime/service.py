"""``vacancyd install-service`` / ``remove-service``: the systemd unit, converging on re-run.

install-service, run as root:

1. creates the config file from the embedded default (loopback-only, headless) when none
   exists at ``--config``; an existing file is never touched;
2. writes ``/etc/systemd/system/vacancyd.service`` (rendered from the packaged template with
   this installation's ``vacancyd`` command and the config path) only when its content
   differs, then ``systemctl daemon-reload``;
3. enables the unit if it is not enabled;
4. on a first install starts the service; on a re-run restarts it only when the unit
   changed *and* it was running, and never starts a stopped one.

remove-service stops the service if it runs, disables it if enabled, deletes the unit file
and reloads systemd. The config file and the state directory (learned calibrations) stay.

Every step is reported as one line (``created``, ``unchanged``, ``updated``, ...). Errors
raise :class:`ServiceError` with what failed; the command exits 1 on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

UNIT_NAME = "vacancyd.service"
UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_CONFIG = Path("/etc/vacancyd/vacancyd.toml")
#: The systemctl to run; tests point it at a recording fake.
SYSTEMCTL_ENV = "VACANCYD_SYSTEMCTL"


class ServiceError(Exception):
    """A step of install-service / remove-service failed (message says which and why)."""


def vacancyd_command() -> str:
    """How systemd should start this installation: its ``vacancyd`` script when it sits
    next to the interpreter (a venv or pipx), else ``python -m vacancyd``."""
    script = Path(sys.executable).with_name("vacancyd")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script)
    return f"{sys.executable} -m vacancyd"


def render_unit(command: str, config: Path) -> str:
    """The unit file text for ``command`` (the vacancyd executable) and ``config``."""
    template = resources.files("vacancyd.runtime").joinpath("systemd/vacancyd.service.in")
    text = template.read_text(encoding="utf-8")
    return text.replace("@VACANCYD@", command).replace("@CONFIG@", str(config))


def default_config_text() -> str:
    text = resources.files("vacancyd").joinpath("default.toml").read_text(encoding="utf-8")
    return (
        "# Written by `vacancyd install-service` from the embedded default; edit it (see\n"
        "# docs/configuration.md), check it with `vacancyd check-config`, then\n"
        "# `systemctl restart vacancyd`. install-service never overwrites this file.\n" + text
    )


Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceError(f"cannot run {' '.join(argv)}: {exc}") from exc


@dataclass
class Service:
    """The unit and config under ``root`` (``/`` normally; a directory for images/tests)."""

    root: Path = Path("/")
    config: Path = DEFAULT_CONFIG
    command: str = field(default_factory=vacancyd_command)
    systemctl: str = field(default_factory=lambda: os.environ.get(SYSTEMCTL_ENV, "systemctl"))
    run: Runner = _run
    report: Callable[[str], None] = print

    def _under_root(self, path: Path) -> Path:
        return self.root / path.relative_to("/") if path.is_absolute() else self.root / path

    @property
    def unit_path(self) -> Path:
        return self._under_root(UNIT_DIR / UNIT_NAME)

    def _systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [self.systemctl, *args]
        done = self.run(argv)
        if check and done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()
            raise ServiceError(f"{' '.join(argv)} failed ({done.returncode}): {detail}")
        return done

    def _state(self, verb: str) -> str:
        """``is-active`` / ``is-enabled``: the word systemctl prints (exit code ignored)."""
        return self._systemctl(verb, UNIT_NAME, check=False).stdout.strip()

    def install(self, *, start: bool = True) -> None:
        if not self.config.is_absolute():
            raise ServiceError(f"--config must be an absolute path (got {self.config})")
        self._ensure_config()
        existed = self.unit_path.exists()
        changed = self._write_unit()
        if changed:
            self._systemctl("daemon-reload")
        if self._state("is-enabled") != "enabled":
            self._systemctl("enable", UNIT_NAME)
            self.report(f"enabled {UNIT_NAME}")
        else:
            self.report(f"{UNIT_NAME} already enabled")
        running = self._state("is-active") == "active"
        if not existed:
            if start:
                self._systemctl("start", UNIT_NAME)
                self.report(f"started {UNIT_NAME}")
        elif changed and running:
            self._systemctl("restart", UNIT_NAME)
            self.report(f"restarted {UNIT_NAME} (its unit changed)")
        elif running:
            self.report(f"{UNIT_NAME} keeps running (nothing it depends on changed)")
        else:
            self.report(f"{UNIT_NAME} was not running; left stopped (systemctl start vacancyd)")

    def remove(self) -> None:
        if self._state("is-active") in ("active", "activating", "reloading"):
            self._systemctl("stop", UNIT_NAME)
            self.report(f"stopped {UNIT_NAME}")
        if self._state("is-enabled") in ("enabled", "enabled-runtime"):
            self._systemctl("disable", UNIT_NAME)
            self.report(f"disabled {UNIT_NAME}")
        if self.unit_path.exists():
            try:
                self.unit_path.unlink()
            except OSError as exc:
                raise ServiceError(f"cannot remove {self.unit_path}: {exc}") from exc
            self._systemctl("daemon-reload")
            self.report(f"removed {self.unit_path}")
        else:
            self.report(f"{self.unit_path} was not installed")
        config = self._under_root(self.config)
        if config.exists():
            self.report(f"kept {config} (delete it yourself if you no longer need it)")

    def _ensure_config(self) -> None:
        path = self._under_root(self.config)
        if path.exists():
            self.report(f"{path} exists; left as it is")
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x", encoding="utf-8") as f:  # never overwrite, even in a race
                f.write(default_config_text())
            path.chmod(0o644)
        except OSError as exc:
            raise ServiceError(f"cannot create {path}: {exc}") from exc
        self.report(f"created {path} from the embedded default (loopback only); edit it")

    def _write_unit(self) -> bool:
        """Write the unit when it differs; True when it was written."""
        desired = render_unit(self.command, self.config)
        path = self.unit_path
        try:
            current = path.read_text(encoding="utf-8") if path.exists() else None
        except OSError as exc:
            raise ServiceError(f"cannot read {path}: {exc}") from exc
        if current == desired:
            self.report(f"{path} unchanged")
            return False
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(desired, encoding="utf-8")
            tmp.chmod(0o644)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ServiceError(f"cannot write {path}: {exc}") from exc
        self.report(f"{'updated' if current is not None else 'created'} {path}")
        return True


def command_warning(command: str) -> str | None:
    """Why systemd's dynamic user may be unable to run ``command``, or None."""
    first = Path(command.split(" ", 1)[0])
    if first.is_relative_to("/root") or first.is_relative_to("/home"):
        return (
            f"{first} is under /root or /home, which the service's dynamic user cannot read; "
            "install vacancyd into /opt (python3 -m venv /opt/vacancyd) or set PIPX_HOME and "
            "PIPX_BIN_DIR outside home directories (docs/install.md)"
        )
    return None
