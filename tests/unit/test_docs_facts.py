"""What the docs state as fact about the code, the dashboard and the libraries we run with is
checked against them, so a page cannot keep saying what stopped being true."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    """(page, command) for every shell command in a fenced block, continuation lines joined."""
    out = []
    for page in PAGES:
        fence: str | None = None
        block: list[str] = []
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                if fence is None:
                    fence, block = line[3:].strip(), []
                    continue
                if fence in ("sh", "bash", "console", ""):
                    joined = re.sub(r"\\\n\s*", " ", "\n".join(block))
                    out += [(page.name, c.strip()) for c in joined.splitlines() if c.strip()]
                fence = None
            elif fence is not None:
                block.append(line)
    return out


def test_every_documented_admin_call_with_a_body_sends_json() -> None:
    """Admin requests trusted without a token must send their body as JSON (415 otherwise),
    so a documented curl without the header fails when pasted."""
    calls = [
        (page, cmd)
        for page, cmd in _commands()
        if cmd.startswith("curl") and "/admin/" in cmd and re.search(r"\s(-d|--data)\b", cmd)
    ]
    assert calls, "no documented admin call found: the check is not looking"
    bad = [(page, cmd) for page, cmd in calls if "Content-Type: application/json" not in cmd]
    assert not bad, bad


def test_the_dashboard_variable_the_docs_name_exists() -> None:
    dashboard = json.loads((ROOT / "dashboards" / "vacancyd.json").read_text(encoding="utf-8"))
    names = {v["name"] for v in dashboard["templating"]["list"]}
    text = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    named = re.findall(r"The `(\w+)` variable", text)
    assert named and set(named) <= names, (named, names)
    assert all(f"${n}" in json.dumps(dashboard) for n in named)


def test_the_openai_client_facts_match_the_installed_sdk() -> None:
    """docs/litellm.md says how long the OpenAI SDK waits; read it from the SDK itself."""
    import openai
    from openai import _constants

    text = (ROOT / "docs" / "litellm.md").read_text(encoding="utf-8")
    section = text.split("## The OpenAI client", 1)[1]
    assert "openai " + ".".join(openai.__version__.split(".")[:2]) in section
    assert f"up to {_constants.MAX_RETRY_AFTER_DELAY:g} s" in section
    assert f"`max_retries={_constants.DEFAULT_MAX_RETRIES}`" in section
    assert f"{_constants.DEFAULT_TIMEOUT.read:g} s ({_constants.DEFAULT_TIMEOUT.connect:g} s" in (
        section
    )
    assert f"{_constants.INITIAL_RETRY_DELAY:g} s, doubling to at most" in section
    assert f"{_constants.MAX_RETRY_DELAY:g} s" in section


def test_reclaim_limits_do_not_list_what_was_fixed() -> None:
    limits = (
        (ROOT / "docs" / "reclaim.md").read_text(encoding="utf-8").split("## Current limits")[1]
    )
    assert "durable" not in limits  # held jobs are saved: docs/footprints.md
    assert "zstd" not in limits  # aiohttp decodes zstd bodies (tests/component/test_proxy.py)


def test_readme_does_not_promise_unloading_every_server() -> None:
    intro = (ROOT / "README.md").read_text(encoding="utf-8").split("```", 1)[0]
    assert "yield_on_veto" in intro
    assert "models are\nunloaded." not in intro and "models are unloaded." not in intro
