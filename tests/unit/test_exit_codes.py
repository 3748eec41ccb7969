"""The exit-status contract of ``vacancyd run`` agrees with the systemd units (docs/install.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vacancyd.runtime.daemon import EXIT_ADDRESS_BUSY, EXIT_CONFIG

ROOT = Path(__file__).resolve().parents[2]
UNITS = [
    ROOT / "packaging" / "systemd" / "vacancyd.service",
    ROOT / "vacancyd" / "runtime" / "systemd" / "vacancyd.service.in",
]


def service_keys(unit: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith(("#", ";", "[")):
            keys.setdefault(key.strip(), []).extend(value.split())
    return keys


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_a_busy_address_is_restarted_and_a_config_error_is_not(unit: Path) -> None:
    keys = service_keys(unit)
    assert keys["Restart"] == ["always"]
    prevented = keys["RestartPreventExitStatus"]
    assert str(EXIT_CONFIG) in prevented
    assert str(EXIT_ADDRESS_BUSY) not in prevented
    assert EXIT_ADDRESS_BUSY not in (0, 1, EXIT_CONFIG)
