"""[owner] configuration for presence, the unsupported-platform reading, the
owner-process scan's user checks, and how ``vacancyd status`` prints sessions."""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from vacancyd.cli import format_sessions, main
from vacancyd.collectors.processes import resolve_user, scan_owner_processes
from vacancyd.config import ConfigError, parse_config


def config(target: str, **owner: Any) -> str:
    """One upstream ``llm``; ``owner`` is the whole ``[owner]`` table (none by default)."""
    return daemon_toml(
        upstream("llm", target), owner={"presence": None, **owner}, collectors={"poll_s": 0.2}
    )


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        ('[""]', "owner.processes: owner process names must be program names: [0] is empty"),
        ('["steam", " steam"]', "[1] ' steam' has leading or trailing whitespace"),
        ('["/usr/bin/steam"]', "is a path; give the program's name (for example 'steam')"),
        ('["a\\u0007b"]', "contains control characters"),
    ],
)
def test_odd_owner_process_names_are_config_errors(names: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"[owner]\npresence = 'logind'\nprocesses = {names}\n", "<t>")
    assert problem in str(info.value)


def test_odd_owner_process_name_stops_the_daemon_with_a_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vacancyd.runtime import logging as vlogging

    monkeypatch.setattr(vlogging, "configure", lambda *_a: None)  # keep pytest's log handlers
    path = tmp_path / "v.toml"
    path.write_text('[owner]\npresence = "logind"\nprocesses = [""]\n', encoding="utf-8")
    assert main(["run", "--config", str(path)]) == 2  # nothing is lent: the safe reading
    assert "owner.processes: owner process names must be program names: [0] is empty" in (
        capsys.readouterr().err
    )
    assert main(["check-config", str(path)]) == 1


def test_owner_keys_parse() -> None:
    settings = parse_config(
        '[owner]\npresence = "auto"\nbus_address = "unix:path=/run/x"\nprocesses = ["steam"]\n'
        'idle_after_s = 300\nremote_graphical = "count"\nsignals = false\n'
    )
    owner = settings.owner
    assert (owner.presence, owner.bus_address, owner.processes) == (
        "auto",
        "unix:path=/run/x",
        ["steam"],
    )
    assert (owner.idle_after_s, owner.remote_graphical, owner.signals) == (300, "count", False)
    with pytest.raises(ConfigError, match=r"owner\.remote_graphical"):
        parse_config('[owner]\nremote_graphical = "yes"\n')


async def test_unsupported_platform_is_unknown_and_does_not_refuse(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        toml = config(target, presence="auto")
        async with running_daemon(toml) as d:
            await d.wait_ready()
            view = d.state.presence_view(d.state.clock())
            assert view.source == "unsupported" and not view.refuses
            assert "no owner-presence backend on darwin" in view.detail
    assert any("does not refuse" in r.getMessage() for r in caplog.records)


def test_resolve_user() -> None:
    me = pwd.getpwuid(os.getuid())
    assert resolve_user(me.pw_uid, me.pw_name) is None
    assert "does not resolve" in (resolve_user(4242, "vacancyd-no-such-user") or "")
    assert "resolves to uid" in (resolve_user(me.pw_uid + 1, me.pw_name) or "")


def test_scan_reports_unresolvable_users() -> None:
    scan = scan_owner_processes([(4242, "vacancyd-no-such-user")], frozenset({"sleep"}))
    assert scan.matches == {} and "does not resolve" in scan.problems[4242]


def test_vacancyd_status_prints_sessions() -> None:
    lines = format_sessions(
        [
            {
                "id": "2",
                "kind": "graphical",
                "type": "wayland",
                "owner": True,
                "why": "unlocked and in use",
                "remote": False,
                "locked": False,
                "active": True,
                "idle": False,
                "idle_for_s": None,
            },
            {
                "id": "5",
                "kind": "remote",
                "type": "tty",
                "owner": False,
                "why": "remote session; does not count",
                "remote": True,
                "locked": False,
                "active": True,
                "idle": True,
                "idle_for_s": 42.0,
            },
            {"id": "?", "kind": "unknown", "owner": True, "why": "unreadable (x)"},
        ],
        ["comfy"],
    )
    assert lines == [
        "  session 2 [graphical wayland] local, unlocked, active: OWNER (unlocked and in use)",
        "  session 5 [remote tty] remote, unlocked, active, idle 42s: not the owner "
        "(remote session; does not count)",
        "  session ? [unknown]: unreadable (x)",
        "  exempt from owner presence: comfy",
    ]
