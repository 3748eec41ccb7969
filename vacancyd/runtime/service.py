"""``vacancyd install-service`` / ``remove-service``: the systemd unit, converging on re-run.

install-service, run as root:

1. refuses when there is no config at ``--config`` (``vacancyd init`` writes one; a default
   written here would lend while the owner sits at the desk), and checks the config and the
   secret files it names;
2. makes sure the static system user ``vacancyd`` exists: ``sysusers.d/vacancyd.conf``
   (shipped by the Debian package, else written to ``/etc/sysusers.d``) applied with
   ``systemd-sysusers``;
3. writes ``/etc/systemd/system/vacancyd.service`` (rendered from the packaged template with
   this installation's ``vacancyd`` command and the config path) only when its content
   differs, unless the Debian package's unit is exactly that unit;
4. writes the drop-in ``vacancyd.service.d/credentials.conf``: one ``LoadCredential=`` per
   secret file of the config (:func:`vacancyd.config.secrets.credential_plan`), so the files
   stay root-only and the service reads its private copies;
5. checks the config as the service will see it (:func:`check_as_service`);
6. ``systemctl daemon-reload`` when a file changed, enables the unit if it is not enabled;
   on a first install starts the service; on a re-run restarts it only when the unit changed
   *and* it was running, and never starts a stopped one.

With ``--root DIR`` (an image being built) it writes the same files below ``DIR``, enables
the unit with the symlink ``systemctl enable`` would make, and never runs ``systemctl``,
``systemd-sysusers`` or the service check: none of them may act on the host that builds the
image. The user is created at the image's first boot by ``systemd-sysusers``.

remove-service stops the service if it runs, disables it if enabled, deletes the unit file
and its credentials drop-in and reloads systemd. The config file, the tokens, the state
directory (learned calibrations) and the ``vacancyd`` user stay.

Every step is reported as one line (``created``, ``unchanged``, ``updated``, ...). Errors
raise :class:`ServiceError` with what failed; the command exits 1 on them.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from vacancyd.config import ConfigError, load_config
from vacancyd.config.secrets import credential_plan

UNIT_NAME = "vacancyd.service"
UNIT_DIR = Path("/etc/systemd/system")
#: Where a distribution package puts its unit (Debian 12: /lib, merged with /usr/lib).
PACKAGED_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
DROPIN = UNIT_DIR / f"{UNIT_NAME}.d" / "credentials.conf"
WANTS = UNIT_DIR / "multi-user.target.wants" / UNIT_NAME
DEFAULT_CONFIG = Path("/etc/vacancyd/vacancyd.toml")
#: The service's static system user (and group).
SERVICE_USER = "vacancyd"
SYSUSERS_NAME = "vacancyd.conf"
SYSUSERS_DIR = Path("/etc/sysusers.d")
PACKAGED_SYSUSERS = Path("/usr/lib/sysusers.d") / SYSUSERS_NAME
#: The systemctl to run; tests point it at a recording fake.
SYSTEMCTL_ENV = "VACANCYD_SYSTEMCTL"
#: The systemd-sysusers to run; tests point it at a fake.
SYSUSERS_ENV = "VACANCYD_SYSUSERS"


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


def sysusers_text() -> str:
    """``sysusers.d/vacancyd.conf``: the service's system user and group."""
    return (
        "# The system user vacancyd's service runs as (docs/install.md); created by\n"
        "# systemd-sysusers. Written by `vacancyd install-service` or shipped by the package.\n"
        f'u {SERVICE_USER} - "vacancyd GPU lender" /var/lib/vacancyd /usr/sbin/nologin\n'
    )


def render_credentials(plan: dict[str, Path], config: Path) -> str:
    """The drop-in passing each secret file of ``config`` (``plan``: credential name ->
    file) with ``LoadCredential=``; vacancyd reads ``$CREDENTIALS_DIRECTORY/NAME`` in place
    of the file (:func:`vacancyd.config.model.secret_path`)."""
    lines = [
        "# Written by `vacancyd install-service` from the secret files that",
        f"# {config} names; it rewrites this file when they change. The files",
        "# stay root-only; systemd hands the service a private copy of each under",
        "# $CREDENTIALS_DIRECTORY, named after the file (docs/install.md).",
        "[Service]",
    ]
    lines += [f"LoadCredential={name}:{path}" for name, path in sorted(plan.items())]
    return "\n".join(lines) + "\n"


Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceError(f"cannot run {' '.join(argv)}: {exc}") from exc


def check_as_service(
    config: Path,
    *,
    command: str | None = None,
    strict: bool = True,
    user: str = SERVICE_USER,
) -> subprocess.CompletedProcess[str]:
    """Run ``vacancyd check-config`` on ``config`` as the service will see it: as ``user``
    (no supplementary groups), with each secret file handed over the way ``LoadCredential=``
    does (a private copy in a credentials directory named by ``$CREDENTIALS_DIRECTORY``).

    Needs root. Returns the finished check (its exit code and output). Raises ServiceError
    when the user does not exist, the config cannot be read, or the check cannot run.
    """
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ServiceError(
            f"there is no user {user!r} yet (`sudo vacancyd install-service` or the package "
            "creates it)"
        ) from None
    try:
        plan = credential_plan(load_config(config), str(config))
    except ConfigError as exc:
        raise ServiceError(str(exc)) from exc
    argv = [*shlex.split(command or vacancyd_command()), "check-config"]
    argv += ["--strict", str(config)] if strict else [str(config)]
    credentials = Path(tempfile.mkdtemp(prefix="vacancyd-credentials-"))
    try:
        for name, source in plan.items():
            if not source.exists():
                continue  # the check reports it as missing
            copy = credentials / name
            try:
                shutil.copyfile(source, copy)
            except OSError as exc:
                raise ServiceError(f"cannot read {source}: {exc.strerror or exc}") from exc
            os.chown(copy, entry.pw_uid, entry.pw_gid)
            copy.chmod(0o400)
        os.chown(credentials, entry.pw_uid, entry.pw_gid)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "CREDENTIALS_DIRECTORY": str(credentials),
        }
        try:
            return subprocess.run(
                argv,
                user=entry.pw_uid,
                group=entry.pw_gid,
                extra_groups=[],
                env=env,
                cwd="/",
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ServiceError(f"cannot run {' '.join(argv)} as {user}: {exc}") from exc
    finally:
        shutil.rmtree(credentials, ignore_errors=True)


@dataclass
class Service:
    """The unit and config under ``root`` (``/`` normally; a directory for images/tests).

    ``manage``: talk to the running systemd (systemctl, systemd-sysusers, the service
    check). False writes files only; the CLI sets it for ``--root`` other than ``/``.
    """

    root: Path = Path("/")
    config: Path = DEFAULT_CONFIG
    command: str = field(default_factory=vacancyd_command)
    manage: bool = True
    systemctl: str = field(default_factory=lambda: os.environ.get(SYSTEMCTL_ENV, "systemctl"))
    sysusers: str = field(default_factory=lambda: os.environ.get(SYSUSERS_ENV, "systemd-sysusers"))
    run: Runner = _run
    report: Callable[[str], None] = print
    check: Callable[[Path, str], subprocess.CompletedProcess[str]] = field(
        default=lambda config, command: check_as_service(config, command=command)
    )

    def _under_root(self, path: Path) -> Path:
        return self.root / path.relative_to("/") if path.is_absolute() else self.root / path

    @property
    def unit_path(self) -> Path:
        return self._under_root(UNIT_DIR / UNIT_NAME)

    @property
    def dropin_path(self) -> Path:
        return self._under_root(DROPIN)

    def packaged_unit(self) -> Path | None:
        """The distribution package's unit below root, if one is installed."""
        for directory in PACKAGED_UNIT_DIRS:
            path = self._under_root(directory / UNIT_NAME)
            if path.is_file():
                return path
        return None

    def _systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if not self.manage:  # a guard: an image build must never reach the host's systemd
            raise AssertionError(f"systemctl {' '.join(args)} with manage off")
        argv = [self.systemctl, *args]
        done = self.run(argv)
        if check and done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()
            raise ServiceError(f"{' '.join(argv)} failed ({done.returncode}): {detail}")
        return done

    def _state(self, verb: str) -> str:
        """``is-active`` / ``is-enabled``: the word systemctl prints (exit code ignored)."""
        return self._systemctl(verb, UNIT_NAME, check=False).stdout.strip()

    # -- install ------------------------------------------------------------------------------

    def install(self, *, start: bool = True) -> None:
        if not self.config.is_absolute():
            raise ServiceError(f"--config must be an absolute path (got {self.config})")
        plan = self._read_config()
        self._ensure_user()
        unit, first, changed = self._install_unit()
        changed = self._write(self.dropin_path, render_credentials(plan, self.config)) or changed
        if not self.manage:
            self._enable_offline(unit)
            return
        self._check_as_service()
        if changed:
            self._systemctl("daemon-reload")
        if self._state("is-enabled") != "enabled":
            self._systemctl("enable", UNIT_NAME)
            self.report(f"enabled {UNIT_NAME}")
        else:
            self.report(f"{UNIT_NAME} already enabled")
        running = self._state("is-active") == "active"
        if first:
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

    def _read_config(self) -> dict[str, Path]:
        """The config's credential plan; raises ServiceError when there is no config, it is
        invalid, or (managing a host) a secret file it names is missing."""
        path = self._under_root(self.config)
        if not path.exists():
            raise ServiceError(
                f"there is no config at {path}: run `sudo vacancyd init` first (it finds your "
                "inference servers and GPUs and writes a config with presence from logind and "
                "fresh tokens), check it, then run install-service again. install-service does "
                "not write a default config: one that assumes nobody sits at this machine "
                "would lend while you do"
            )
        try:
            settings = load_config(path)
            plan = credential_plan(settings, str(path))
        except ConfigError as exc:
            raise ServiceError(f"the config is not valid:\n{exc}") from exc
        self.report(f"{path} exists; left as it is")
        for name, source in sorted(plan.items()):
            if not self._under_root(source).is_file():
                message = f"{source} (credential {name}) does not exist"
                if self.manage:
                    raise ServiceError(f"{message}; create it first (vacancyd init does)")
                self.report(
                    f"warning: {message} below {self.root}; the service cannot start until it does"
                )
        return plan

    def _ensure_user(self) -> None:
        packaged = self._under_root(PACKAGED_SYSUSERS)
        if packaged.is_file():
            conf = packaged
            self.report(f"{packaged} (from the package) defines the user {SERVICE_USER}")
        else:
            conf = self._under_root(SYSUSERS_DIR / SYSUSERS_NAME)
            self._write(conf, sysusers_text())
        if not self.manage:
            self.report(f"the user {SERVICE_USER} is created at first boot (systemd-sysusers)")
            return
        done = self.run([self.sysusers, str(conf)])
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()
            raise ServiceError(f"{self.sysusers} {conf} failed ({done.returncode}): {detail}")
        self.report(f"user {SERVICE_USER} is in place ({self.sysusers})")

    def _install_unit(self) -> tuple[Path, bool, bool]:
        """(the unit in effect, whether this is a first install, whether a file was written).
        The package's unit is used as it is when it is exactly the unit this installation
        needs and nothing overrides it."""
        desired = render_unit(self.command, self.config)
        packaged = self.packaged_unit()
        if packaged is not None and not self.unit_path.exists():
            try:
                same = packaged.read_text(encoding="utf-8") == desired
            except OSError:
                same = False
            if same:
                self.report(f"{packaged} (from the package) is the unit; left as it is")
                first = self.manage and self._state("is-enabled") != "enabled"
                return packaged, first, False
        first = not self.unit_path.exists()
        return self.unit_path, first, self._write(self.unit_path, desired)

    def _check_as_service(self) -> None:
        done = self.check(self.config, self.command)
        output = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            raise ServiceError(
                f"the service (user {SERVICE_USER}, secrets as credentials) could not use "
                f"the config:\n{output}"
            )
        self.report(f"checked as the service would see it: {output.splitlines()[-1]}")

    def _enable_offline(self, unit: Path) -> None:
        """What ``systemctl enable`` does, without a running systemd: the wants symlink."""
        link = self._under_root(WANTS)
        target = Path("/") / unit.relative_to(self.root)
        if link.is_symlink() and Path(os.readlink(link)) == target:
            self.report(f"{UNIT_NAME} already enabled")
            return
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(target)
        except OSError as exc:
            raise ServiceError(f"cannot enable {UNIT_NAME} at {link}: {exc}") from exc
        self.report(f"enabled {UNIT_NAME} ({link} -> {target}); it starts when {self.root} boots")

    def _write(self, path: Path, desired: str) -> bool:
        """Write ``desired`` to ``path`` when it differs (mode 0644); True when written."""
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

    # -- remove -------------------------------------------------------------------------------

    def remove(self) -> None:
        if self.manage:
            if self._state("is-active") in ("active", "activating", "reloading"):
                self._systemctl("stop", UNIT_NAME)
                self.report(f"stopped {UNIT_NAME}")
            if self._state("is-enabled") in ("enabled", "enabled-runtime"):
                self._systemctl("disable", UNIT_NAME)
                self.report(f"disabled {UNIT_NAME}")
        else:
            link = self._under_root(WANTS)
            if link.is_symlink():
                link.unlink()
                self.report(f"disabled {UNIT_NAME} (removed {link})")
        removed = False
        for path in (self.unit_path, self.dropin_path):
            if path.exists():
                try:
                    path.unlink()
                except OSError as exc:
                    raise ServiceError(f"cannot remove {path}: {exc}") from exc
                self.report(f"removed {path}")
                removed = True
            else:
                self.report(f"{path} was not installed")
        try:
            self.dropin_path.parent.rmdir()  # only when empty: local drop-ins stay
        except OSError:
            pass
        if removed and self.manage:
            self._systemctl("daemon-reload")
        packaged = self.packaged_unit()
        if packaged is not None:
            self.report(f"kept {packaged} (the package's; `apt remove vacancyd` removes it)")
        config = self._under_root(self.config)
        if config.exists():
            self.report(
                f"kept {config}, its tokens, the state directory and the user {SERVICE_USER} "
                "(delete them yourself if you no longer need them)"
            )


def command_warning(command: str) -> str | None:
    """Why the service's user may be unable to run ``command``, or None."""
    first = Path(command.split(" ", 1)[0])
    if first.is_relative_to("/root") or first.is_relative_to("/home"):
        return (
            f"{first} is under /root or /home, which the service's user {SERVICE_USER} cannot "
            "read; install vacancyd into /opt (python3 -m venv /opt/vacancyd), install the "
            "Debian package, or set PIPX_HOME and PIPX_BIN_DIR outside home directories "
            "(docs/install.md)"
        )
    return None
