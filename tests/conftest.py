"""Shared fixtures. Test modules name what they cover in their docstrings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.support.gpu import Scenario, build_fake_nvml, preload


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
