"""``vacancyd status / pause / resume / measure`` find the API and the right token in the
config (the one ``vacancyd init`` writes: token files beside it), so nobody pastes a secret;
a token file the caller cannot read is an error that names it and says what to do."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import running_daemon
from vacancyd.cli import main
from vacancyd.config import parse_config
from vacancyd.runtime import apitarget

ADMIN = "admin-token-from-init-0123456789"
BORROW = "borrow-token-from-init-012345678"
READ = "read-token-for-prometheus-0123456"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Etc:
    path: Path
    text: str


@pytest.fixture
def etc() -> Iterator[Etc]:
    """A config directory laid out as ``vacancyd init`` leaves /etc/vacancyd: the config
    world-readable, the tokens in ``tokens/`` (0700) as root-only files (0600). Made in a
    directory any user can enter, so a test can try it as an unprivileged user."""
    top = Path(tempfile.mkdtemp(prefix="vacancyd-etc-"))
    top.chmod(0o755)
    tokens = top / "tokens"
    tokens.mkdir(mode=0o700)
    for name, secret in (("admin", ADMIN), ("borrow", BORROW)):
        path = tokens / f"{name}.token"
        path.write_text(secret + "\n", encoding="ascii")
        path.chmod(0o600)
    config = top / "vacancyd.toml"
    config.write_text(
        daemon_toml(
            upstream("up", "http://127.0.0.1:9", adapter="openai"),
            server={"listen": f"127.0.0.1:{free_port()}", "trust_loopback": None},
            tokens=(
                token("admin", "", "admin", token_file=str(tokens / "admin.token")),
                token("borrow", "", "borrow", token_file=str(tokens / "borrow.token")),
            ),
        ),
        encoding="utf-8",
    )
    config.chmod(0o644)
    try:
        yield Etc(config, config.read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(top)


async def cli(*args: str, user: str | None = None) -> tuple[int, str, str]:
    prefix = ["setpriv", "--reuid", user, "--regid", "nogroup", "--clear-groups"] if user else []
    proc = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        "vacancyd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "VACANCYD_TOKEN"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_pause_and_resume_use_the_configs_admin_token(etc: Etc) -> None:
    async with running_daemon(etc.text) as d:
        await d.wait_ready()
        code, out, err = await cli("status", "--config", str(etc.path))
        assert code == 0, err
        assert "lending: on" in out
        code, out, err = await cli("pause", "--config", str(etc.path), "--for", "1h")
        assert code == 0, err
        assert d.daemon.owner.pause is not None
        code, out, err = await cli("resume", "--config", str(etc.path))
        assert code == 0, err
        assert "lending resumed" in out and d.daemon.owner.pause is None


async def test_without_flags_the_default_config_is_used(
    etc: Etc, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VACANCYD_TOKEN", raising=False)
    monkeypatch.setattr(apitarget, "DEFAULT_CONFIG", etc.path)
    async with running_daemon(etc.text) as d:
        await d.wait_ready()
        assert await asyncio.to_thread(main, ["status"]) == 0
        assert "lending: on" in capsys.readouterr().out
        assert await asyncio.to_thread(main, ["pause"]) == 0
        assert d.daemon.owner.pause is not None
        assert await asyncio.to_thread(main, ["resume"]) == 0
        assert d.daemon.owner.pause is None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root")
async def test_an_unreadable_token_file_names_it_and_says_what_to_do(etc: Etc) -> None:
    async with running_daemon(etc.text) as d:
        await d.wait_ready()
        code, out, err = await cli("status", "--config", str(etc.path), user="nobody")
    assert code == 2, err
    assert str(etc.path.parent / "tokens" / "admin.token") in err
    assert 'server.tokens[0] ("admin")' in err
    assert "sudo vacancyd status" in err and "--token-file" in err
    assert "401" not in err and out == ""


async def test_a_refused_token_is_not_reported_as_a_stopped_daemon(etc: Etc) -> None:
    async with running_daemon(etc.text) as d:
        await d.wait_ready()
        url = d.api_url
        code, _, err = await cli("measure", "--url", url, "--model", "m")
        assert code == 1
        assert "answered 401" in err and "no token was sent" in err
        assert "must run" not in err
        code, _, err = await cli("status", "--url", url, "--token", "x" * 20)
        assert code == 1
        assert "answered 401" in err and "the token from --token was refused" in err
        # a borrow token is a real token without the scope: 403, said so
        code, _, err = await cli("pause", "--url", url, "--token", BORROW)
        assert code == 1
        assert "answered 403" in err and "admin scope" in err


def test_the_least_privileged_token_that_grants_the_scope_is_chosen() -> None:
    settings = parse_config(
        daemon_toml(
            upstream("up", "http://127.0.0.1:9", adapter="openai"),
            tokens=(
                token("ops", ADMIN, "admin"),
                token("borrow", BORROW, "borrow"),
                token("prom", READ, "read"),
            ),
        ),
        "<test>",
    )
    assert [t.name for _, t in apitarget.candidates(settings, "read")] == ["prom", "ops"]
    assert [t.name for _, t in apitarget.candidates(settings, "admin")] == ["ops"]
    chosen = apitarget.token_from_config(settings, "read", Path("cfg.toml"), "status")
    assert chosen.token == READ and 'server.tokens[2] ("prom")' in chosen.source
