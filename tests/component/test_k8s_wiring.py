"""Kubernetes wiring: config models, the CLI, the upstream gauge, and import boundaries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import READ, lender_toml
from vacancyd import cli
from vacancyd.config import ConfigError, parse_config
from vacancyd.config.load import parse_companion_config

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_client_imports_kubernetes_asyncio() -> None:
    """style.md 5.4: one module talks to the Kubernetes API; core stays pure."""
    importers = []
    for path in sorted((ROOT / "vacancyd").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [str(node.args[0].value)]
            if any(n.split(".")[0] == "kubernetes_asyncio" for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(importers)) == ["vacancyd/k8s/client.py"]


def test_daemon_and_companion_modules_import_without_kubernetes_asyncio() -> None:
    code = (
        "import sys, vacancyd.runtime.daemon, vacancyd.k8s.companion, vacancyd.cli;"
        "assert 'kubernetes_asyncio' not in sys.modules, 'imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_kubernetes_section_validation() -> None:
    base = '[kubernetes]\nnode = "pc"\n'
    assert parse_config(base + 'address = "192.0.2.1"').kubernetes is not None
    with pytest.raises(ConfigError, match=r"kubernetes.address: .*must be an IP"):
        parse_config(base + 'address = "pc.local"')
    with pytest.raises(ConfigError, match=r"kubernetes\.namespace"):
        parse_config(base + 'namespace = "Not_A_Label"')
    with pytest.raises(ConfigError, match=r"kubernetes\.heartbeat_s"):
        parse_config(base + "heartbeat_s = 0")
    settings = parse_config(base + 'services = {chat = "llm"}').kubernetes
    assert settings is not None
    assert settings.service_for("chat") == "llm"
    assert settings.service_for("embed") == "vacancyd-embed"


def test_companion_config_validation() -> None:
    lender = '[[lender]]\nname = "{name}"\nurl = "{url}"\n'
    ok = parse_companion_config(lender.format(name="pc", url="http://192.0.2.5:9470"))
    assert ok.lender[0].endpoint_address == "192.0.2.5"
    named = parse_companion_config(lender.format(name="pc", url="http://pc.lan:9470"))
    assert named.lender[0].endpoint_address is None
    with pytest.raises(ConfigError, match="lender names must be unique"):
        parse_companion_config(
            lender.format(name="pc", url="http://a:1") + lender.format(name="pc", url="http://b:1")
        )
    with pytest.raises(ConfigError, match="lender"):
        parse_companion_config('listen = "0.0.0.0:9471"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        parse_companion_config(lender.format(name="pc", url="http://a:1") + "tokne = 'x'\n")


def test_cli_companion_reports_a_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "companion.toml"
    bad.write_text('[[lender]]\nname = "pc"\nurl = "ftp://x"\n')
    assert cli.main(["companion", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "vacancyd companion: invalid configuration" in err and "lender[0].url" in err


async def test_upstream_lendable_gauge_follows_the_gate() -> None:
    app, _ = openai_like_app()
    toml = lender_toml("http://127.0.0.1:9")
    async with serve_app(app), running_daemon(toml) as d, aiohttp.ClientSession() as http:
        await d.wait_ready()

        async def scrape() -> str:
            async with http.get(
                f"{d.api_url}/metrics", headers={"Authorization": f"Bearer {READ}"}
            ) as resp:
                return await resp.text()

        assert 'vacancyd_upstream_lendable{upstream="chat"} 1.0' in await scrape()
        d.state.set_lending(False)
        assert 'vacancyd_upstream_lendable{upstream="chat"} 0.0' in await scrape()
