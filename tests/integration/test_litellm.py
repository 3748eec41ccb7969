"""docs/litellm.md's recipes, run with a real LiteLLM Router against a real vacancyd.

Each recipe's vacancyd keys and LiteLLM proxy config are read from the page itself, so the
page cannot drift from what was tested. The lender and the second deployment are
OpenAI-compatible servers (the lender behind vacancyd); LiteLLM talks to both over HTTP with
its OpenAI provider, exactly as the proxy would.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
litellm = pytest.importorskip("litellm")

DOC = Path(__file__).resolve().parents[2] / "docs" / "litellm.md"
REQUESTS = 20
#: LiteLLM's own pydantic models warn while it builds them; that is not our code.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic._internal._generate_schema")


def recipe_block(recipe: str, part: str) -> str:
    """The fenced block that follows ``<!-- recipe: RECIPE PART -->`` in docs/litellm.md."""
    text = DOC.read_text()
    match = re.search(rf"<!-- recipe: {recipe} {part} -->\n```\w+\n(.*?)```", text, flags=re.DOTALL)
    assert match is not None, f"docs/litellm.md has no {recipe} {part} block"
    return match.group(1)


def stated_recovery_s(recipe: str) -> float:
    """The 'within N s' the recipe promises, read from its result sentence."""
    text = DOC.read_text()
    section = text.split(f"<!-- recipe: {recipe} litellm -->", 1)[1]
    match = re.search(r"\*\*within (\d+) s\*\*", section)
    assert match is not None, f"recipe {recipe} states no recovery time"
    return float(match.group(1))


def lender_toml(target: str, upstream_keys: str) -> str:
    """A lender in front of ``target`` whose upstream carries the recipe's keys, given as
    the TOML lines docs/litellm.md shows."""
    return daemon_toml(
        upstream("up", target, **tomllib.loads(upstream_keys)), collectors={"poll_s": None}
    )


def group_of(config: dict[str, Any]) -> str:
    """The model group clients call: the first deployment's (the lender's)."""
    name: str = config["model_list"][0]["model_name"]
    return name


async def ask(router: Any, model: str) -> None:
    await router.acompletion(model=model, messages=[{"role": "user", "content": "hi"}], timeout=10)


@pytest.mark.parametrize("recipe", ["pool", "fallback"])
@pytest.mark.timeout(120)
async def test_recipe_has_no_client_errors_and_returns_to_the_lender(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = yaml.safe_load(recipe_block(recipe, "litellm"))
    lender_app, lender_seen = openai_like_app()
    backup_app, backup_seen = openai_like_app()
    async with serve_app(lender_app) as lender_url, serve_app(backup_app) as backup_url:
        toml = lender_toml(lender_url, recipe_block(recipe, "vacancyd"))
        async with running_daemon(toml) as d:
            await d.wait_ready()
            monkeypatch.setenv("LENDER_API_BASE", d.proxy_url("up") + "/v1")
            monkeypatch.setenv("LENDER_TOKEN", "unused-loopback-is-trusted")
            monkeypatch.setenv("BACKUP_API_BASE", backup_url + "/v1")
            monkeypatch.setenv("BACKUP_API_KEY", "unused")
            router = litellm.Router(model_list=config["model_list"], **config["router_settings"])
            model = group_of(config)

            # The lender has been serving this minute: the case where a 503 pool fared worst.
            # The Router picks a deployment at random, so six asks can all miss the lender
            # (1 in 64); keep asking, boundedly, until it has served at least once.
            for asked in range(40):
                await ask(router, model)
                if lender_seen and asked >= 5:
                    break
            assert lender_seen, "the lender served nothing while lending was on"

            d.state.set_lending(False)
            served_before = len(lender_seen), len(backup_seen)
            errors: list[str] = []
            for _ in range(REQUESTS):
                try:
                    await ask(router, model)
                except Exception as exc:  # every LiteLLM error is a client-visible failure
                    errors.append(f"{type(exc).__name__}: {exc}")
            assert errors == [], f"{len(errors)}/{REQUESTS} requests failed: {errors[:3]}"
            assert len(lender_seen) == served_before[0], "a refused request reached the lender"
            assert len(backup_seen) == served_before[1] + REQUESTS

            d.state.set_lending(True)
            lent_again_at = time.monotonic()
            limit = stated_recovery_s(recipe)
            before = len(lender_seen)
            while len(lender_seen) == before:
                waited = time.monotonic() - lent_again_at
                assert waited < limit, f"the lender was not used again within {limit:g} s"
                await ask(router, model)
                await asyncio.sleep(0.25)


def test_proxy_configs_in_the_docs_load() -> None:
    """Each documented proxy config parses and builds a Router with the keys it names."""
    for recipe in ("pool", "fallback"):
        config = yaml.safe_load(recipe_block(recipe, "litellm"))
        assert set(config) == {"model_list", "router_settings"}
        router = litellm.Router(model_list=config["model_list"], **config["router_settings"])
        with warnings.catch_warnings():  # the accessor's name changes between releases
            warnings.simplefilter("ignore", DeprecationWarning)
            names = set(router.get_model_names())
        assert names == {d["model_name"] for d in config["model_list"]}
        lender = config["model_list"][0]
        assert lender["model_info"]["disable_background_health_check"] is True
