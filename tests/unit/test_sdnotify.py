"""When the daemon pings the systemd watchdog, and how often."""

from __future__ import annotations

import os

import pytest

from vacancyd.runtime.sdnotify import watchdog_interval_s


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}, 15.0),
        ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "self"}, 15.0),
        ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "thirty"}, None),
        ({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "30000000"}, None),
        ({"NOTIFY_SOCKET": "/run/x"}, None),
    ],
)
def test_watchdog_interval(
    env: dict[str, str], expected: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert watchdog_interval_s() == expected


def test_service_status_line_says_what_lends_why_not_and_the_jobs() -> None:
    from vacancyd.core.status import service_status_line

    ups: dict[str, dict[str, object]] = {
        "ollama": {"lendable": True, "reason": None},
        "comfyui": {"lendable": False, "reason": "owner_active"},
    }
    assert service_status_line(ups, running=1, held=0, not_ready=[]) == (
        "lendable: ollama; not lending: comfyui (owner_active); 1 job running"
    )
    assert (
        service_status_line(
            {"ollama": ups["comfyui"]}, running=0, held=2, not_ready=["presence not sampled"]
        )
        == "not ready: presence not sampled; not lending: ollama (owner_active); "
        "0 jobs running, 2 held"
    )
