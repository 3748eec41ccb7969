"""Sharing keys: max_concurrent, the bounded wait and exclusivity, and every bad input."""

from __future__ import annotations

import tomllib

import pytest

from tests.support.config import daemon_toml, resource, upstream
from vacancyd.config import ConfigError, Settings, parse_config
from vacancyd.config.policies import upstream_policy


def parse(ollama: str = "", comfy: str = "", comfy_resource: str = "gpu0") -> Settings:
    """Ollama on ``gpu0`` and ComfyUI on ``comfy_resource``; ``ollama`` and ``comfy`` are more
    keys of each upstream, as the TOML lines a user would write."""
    text = daemon_toml(
        upstream(
            "ollama",
            "http://127.0.0.1:11435",
            adapter="ollama",
            resource="gpu0",
            listen="127.0.0.1:11434",
            **tomllib.loads(ollama),
        ),
        upstream(
            "comfy",
            "http://127.0.0.1:8189",
            adapter="comfyui",
            resource=comfy_resource,
            listen="127.0.0.1:8188",
            **tomllib.loads(comfy),
        ),
        resources=(resource("gpu0"), resource("gpu1")),
        defaults=False,
    )
    return parse_config(text, "test.toml")


def problems(**kw: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(**kw)
    return info.value.problems


def test_defaults_keep_one_job_and_refuse() -> None:
    settings = parse()
    up = settings.upstream[0]
    assert up.max_concurrent == 1 and up.busy == "refuse" and up.exclusive_of == []
    policy = upstream_policy(settings, up, needs_model_observation=False)
    assert policy.max_concurrent == 1 and not policy.exclusive_of and not policy.excluded_by


def test_wait_defaults_and_explicit_values() -> None:
    settings = parse(ollama='busy = "wait"\nmax_concurrent = 4')
    up = settings.upstream[0]
    assert (up.wait_timeout, up.waiting_limit) == (30.0, 32)
    settings = parse(ollama='busy = "wait"\nwait_timeout_s = 2.5\nmax_waiting = 1000')
    assert (settings.upstream[0].wait_timeout, settings.upstream[0].waiting_limit) == (2.5, 1000)


def test_exclusivity_policies_point_both_ways() -> None:
    settings = parse(comfy='exclusive_of = ["ollama"]\non_unload_timeout = "refuse"')
    ollama = upstream_policy(settings, settings.upstream[0], needs_model_observation=False)
    comfy = upstream_policy(settings, settings.upstream[1], needs_model_observation=False)
    assert comfy.exclusive_of == {"ollama"} and ollama.excluded_by == {"comfy"}
    assert settings.upstream[1].unload_timeout == 30.0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"ollama": "max_concurrent = 0"}, "upstream[0].max_concurrent"),
        ({"ollama": "max_concurrent = -3"}, "greater than or equal to 1"),
        ({"ollama": "max_concurrent = 2.5"}, "upstream[0].max_concurrent"),
        ({"ollama": "max_waiting = 4"}, "max_waiting applies only to busy = 'wait'"),
        ({"ollama": "wait_timeout_s = 4"}, "wait_timeout_s applies only to busy = 'wait'"),
        ({"ollama": 'busy = "queue"'}, "upstream[0].busy"),
        ({"ollama": 'busy = "wait"\nmax_waiting = 0'}, "upstream[0].max_waiting"),
        ({"ollama": 'busy = "wait"\nwait_timeout_s = 0'}, "upstream[0].wait_timeout_s"),
        (
            {"comfy": 'exclusive_of = ["ollama"]', "comfy_resource": "gpu1"},
            "they are on different resources ('gpu1' and 'gpu0')",
        ),
        ({"comfy": 'exclusive_of = ["nobody"]'}, "exclusive_of names 'nobody'"),
        ({"comfy": 'exclusive_of = ["comfy"]'}, "exclusive_of names the upstream itself"),
        ({"comfy": 'exclusive_of = ["ollama", "ollama"]'}, "lists an upstream twice"),
        (
            {"comfy": 'exclusive_of = ["ollama"]', "ollama": 'exclusive_of = ["comfy"]'},
            "only one side of an exclusivity takes the card",
        ),
        ({"comfy": "unload_timeout_s = 5"}, "applies only to an upstream with exclusive_of"),
        ({"comfy": 'on_unload_timeout = "forward"'}, "applies only to an upstream with"),
        (
            {"comfy": 'exclusive_of = ["ollama"]\non_unload_timeout = "wait"'},
            "upstream[1].on_unload_timeout",
        ),
    ],
)
def test_bad_sharing_input(kw: dict[str, str], needle: str) -> None:
    ps = problems(**kw)
    assert any(needle in p for p in ps), ps


def test_the_worked_one_card_example_is_valid() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sharing-one-card.md").read_text()
    toml = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    settings = parse_config(toml, "docs/sharing-one-card.md")
    ollama, comfy = settings.upstream
    assert (ollama.max_concurrent, ollama.busy, comfy.exclusive_of) == (4, "wait", ["ollama"])
    policy = upstream_policy(settings, ollama, needs_model_observation=False)
    assert policy.excluded_by == {"comfy"}


def test_the_configuration_doc_examples_are_valid() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = doc.split("### Sharing keys", 1)[1].split("## [kubernetes]", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```toml\n")[1:]]
    resources = '[[resource]]\nname = "gpu0"\nkind = "gpu"\n'
    resources += '[[resource]]\nname = "gpu1"\nkind = "gpu"\ndevice = 1\n'
    tokens = '[[server.tokens]]\ntoken = "0123456789abcdef"\nscopes = ["borrow"]\n'
    for block in blocks:
        parse_config(tokens + resources + block, "docs/configuration.md")
    assert len(blocks) == 2
