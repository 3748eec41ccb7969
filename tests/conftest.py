"""Shared fixtures. Test modules name what they cover in their docstrings."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gpu import Scenario, build_fake_nvml, preload

#: The state directory of a lender installed on this machine. A daemon a test starts without a
#: ``state_dir`` of its own would read and write held jobs and learned state here, and a later
#: run would restore them (tests/support/daemon.py has temporary_state_dir for that).
MACHINE_STATE_DIR = Path("/var/lib/vacancyd")


def _state_files() -> set[tuple[str, int, int]]:
    try:
        entries = list(MACHINE_STATE_DIR.iterdir())
    except OSError:
        return set()
    return {(e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries if e.is_file()}


@pytest.fixture(autouse=True)
def _machine_state_dir_untouched() -> Iterator[None]:
    """Fails a test that wrote into the machine's /var/lib/vacancyd."""
    before = _state_files()
    yield
    written = _state_files() - before
    assert not written, (
        f"this test wrote {sorted(name for name, _, _ in written)} into {MACHINE_STATE_DIR}: "
        "give its daemon a state_dir of its own (tests/support/daemon.py temporary_state_dir)"
    )


@pytest.fixture(autouse=True)
def _quiet_access_log() -> None:
    logging.getLogger("vacancyd.access").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled fake ``libnvidia-ml.so.1`` (fails clearly when gcc is missing)."""
    try:
        return build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def nvml(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Scenario:
    """The fake NVML loaded in this process, answering from a fresh scenario file."""
    preload(fake_nvml_lib)
    scenario = Scenario(tmp_path / "nvml-scenario.txt")
    scenario.write()
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(scenario.path))
    return scenario
