"""The Debian package on a real systemd: Debian 12 booted in a container
(tests/support/systemd_guest.py), the package built by tools/build-deb from this checkout and
installed with apt, as docs/install.md says.

One guest serves the whole module; the tests run in order: install, first steps, remove,
purge.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.systemd_guest import Guest, add_upstream, booted_guest

pytestmark = pytest.mark.systemd

READYZ = (
    "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:9470/readyz',"
    ' timeout=5).status)"'
)

#: Prints the pids of processes running `vacancyd run` (the guest has no pgrep).
NO_DAEMON = (
    "import os\n"
    "def cmd(p):\n"
    "    try:\n"
    "        return open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        return b''\n"
    "print([p for p in os.listdir('/proc') if p.isdigit() and b'vacancyd\\x00run' in cmd(p)])"
)


@pytest.fixture(scope="module")
def guest(
    vacancyd_package: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guest]:
    deb, _ = vacancyd_package

    def setup(root: Path) -> None:
        add_upstream(root)
        shutil.copy2(deb, root / "root" / deb.name)

    with booted_guest(tmp_path_factory.mktemp("systemd-deb"), setup) as g:
        g.deb = f"/root/{deb.name}"  # type: ignore[attr-defined]
        yield g


@pytest.fixture(scope="module")
def installed(guest: Guest) -> str:
    """apt's output of installing the package (no network in the guest: everything the
    package needs is in it or already on Debian 12)."""
    done = guest.run(
        ["apt-get", "install", "-y", "--no-install-recommends", guest.deb],  # type: ignore[attr-defined]
        timeout=300,
    )
    return done.stdout + done.stderr


def test_package_installs_daemon_unit_and_user_but_does_not_lend_without_a_config(
    guest: Guest, installed: str
) -> None:
    assert "sudo vacancyd init" in installed, installed  # the package says what is next
    guest.run(["vacancyd", "--version"])
    assert guest.run(["getent", "passwd", "vacancyd"]).stdout.startswith("vacancyd:")
    props = guest.show("vacancyd", "FragmentPath", "ActiveState", "UnitFileState")
    assert props["FragmentPath"] == "/lib/systemd/system/vacancyd.service", props
    assert props["ActiveState"] == "inactive" and props["UnitFileState"] == "disabled", props
    # Even started by hand, a unit without a config does not run (ConditionPathExists).
    guest.run(["systemctl", "start", "vacancyd"])
    assert guest.show("vacancyd", "ActiveState", "ConditionResult") == {
        "ActiveState": "inactive",
        "ConditionResult": "no",
    }


def test_init_and_install_service_start_it_ready_on_the_packaged_unit(
    guest: Guest, installed: str
) -> None:
    guest.wait_for(
        "the stand-in upstream",
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8080), 1)\"",
    )
    guest.run(["vacancyd", "init"])
    guest.run(["vacancyd", "check-config", "--service", "/etc/vacancyd/vacancyd.toml"])
    out = guest.run(["vacancyd", "install-service"]).stdout
    assert "(from the package) is the unit" in out, out
    assert guest.run(["test", "-e", "/etc/systemd/system/vacancyd.service"], check=False).returncode
    assert guest.run(["systemctl", "is-active", "vacancyd"]).stdout.strip() == "active"
    guest.wait_for("/readyz 200", READYZ)
    assert "openai" in guest.run(["vacancyd", "status"]).stdout


def test_apt_remove_stops_and_removes_the_service_and_keeps_config_and_state(
    guest: Guest, installed: str
) -> None:
    guest.run(["apt-get", "remove", "-y", "vacancyd"], timeout=300)
    assert guest.show("vacancyd", "LoadState")["LoadState"] == "not-found"
    running = guest.run(["python3", "-c", NO_DAEMON]).stdout.strip()
    assert running == "[]", running
    for kept in (
        "/etc/vacancyd/vacancyd.toml",
        "/etc/vacancyd/tokens/admin.token",
        "/var/lib/vacancyd",
    ):
        guest.run(["test", "-e", kept])
    assert guest.run(["test", "-e", "/opt/vacancyd"], check=False).returncode == 1


def test_apt_purge_removes_config_and_state(guest: Guest, installed: str) -> None:
    guest.run(["apt-get", "purge", "-y", "vacancyd"], timeout=300)
    for gone in ("/etc/vacancyd", "/var/lib/vacancyd", "/etc/systemd/system/vacancyd.service.d"):
        assert guest.run(["test", "-e", gone], check=False).returncode == 1, gone
