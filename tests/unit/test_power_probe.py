"""The power probe: the kernel's power-supply list decides whether a missing psutil reading
means "no battery" (mains) or "a battery that cannot be read" (held)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from vacancyd.collectors import power
from vacancyd.core.power import PowerReading


def supplies(root: Path, **kinds: str) -> Path:
    for name, kind in kinds.items():
        (root / name).mkdir(parents=True)
        (root / name / "type").write_text(kind + "\n")
    return root


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")


def test_a_desktop_without_a_battery_is_on_mains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linux: None
) -> None:
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    root = supplies(tmp_path / "ps", AC="Mains")
    assert power.read_power(root) == PowerReading(False)


def test_a_listed_battery_psutil_cannot_read_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linux: None
) -> None:
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    root = supplies(tmp_path / "ps", AC="Mains", BAT0="Battery")
    reading = power.read_power(root)
    assert reading.has_battery is True and reading.plugged is None
    assert "cannot read it" in (reading.error or "")


def test_a_laptop_on_battery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linux: None) -> None:
    battery = SimpleNamespace(percent=42.0, secsleft=3600, power_plugged=False)
    monkeypatch.setattr(psutil, "sensors_battery", lambda: battery)
    root = supplies(tmp_path / "ps", BAT0="Battery")
    assert power.read_power(root) == PowerReading(True, False, 42.0)


def test_a_failing_sensor_is_an_error_not_mains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linux: None
) -> None:
    def broken() -> None:
        raise OSError("EIO")

    monkeypatch.setattr(psutil, "sensors_battery", broken)
    reading = power.read_power(supplies(tmp_path / "ps", BAT0="Battery"))
    assert reading.has_battery is True and "EIO" in (reading.error or "")


def test_other_platforms_take_the_os_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    assert power.read_power() == PowerReading(False)
