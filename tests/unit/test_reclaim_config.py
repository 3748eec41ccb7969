"""Reclaim configuration keys (docs/configuration.md "[[upstream]] (reclaim keys)") and how
/status and ``vacancyd status`` show a reclaim."""

from __future__ import annotations

import pytest

from tests.support.lender import config
from vacancyd.cli import format_status
from vacancyd.config import ConfigError, parse_config
from vacancyd.config.policies import reclaim_policy
from vacancyd.core.reclaim import OnOwnerReturn
from vacancyd.core.status import StatusDocument


def test_defaults_and_new_adapters() -> None:
    for adapter in ("ollama", "comfyui", "openai", "llamacpp"):
        settings = parse_config(config("http://127.0.0.1:1", adapter=adapter), "<t>")
        policy = reclaim_policy(settings.upstream[0])
        assert policy.on_owner_return is OnOwnerReturn.DRAIN
        assert policy.drain_timeout_s == 30 and policy.completion_timeout_s is None
        assert not policy.yield_on_veto


@pytest.mark.parametrize(
    ("adapter", "extra", "match"),
    [
        ("openai", "yield_on_veto = true", "unload API"),
        ("llamacpp", "yield_on_veto = true", "unload API"),
        ("comfyui", 'warm_model = "x"', "warm_model applies only"),
        ("ollama", "completion_timeout_s = 5", "only to on_owner_return = 'finish'"),
        ("ollama", 'on_owner_return = "later"', "on_owner_return"),
        ("ollama", "drain_timeout_s = -1", "drain_timeout_s"),
    ],
)
def test_rejected_combinations(adapter: str, extra: str, match: str) -> None:
    toml = config("http://127.0.0.1:1", adapter=adapter, extra=extra)
    if "on_owner_return" in extra:
        toml = toml.replace('on_owner_return = "drain"\n', "")
    with pytest.raises(ConfigError, match=match):
        parse_config(toml, "<t>")


def test_finish_with_completion_timeout_and_yield() -> None:
    toml = config(
        "http://127.0.0.1:1",
        adapter="ollama",
        policy="finish",
        extra='completion_timeout_s = 90\nyield_on_veto = true\nwarm_model = "tiny"',
    )
    policy = reclaim_policy(parse_config(toml, "<t>").upstream[0])
    assert policy.on_owner_return is OnOwnerReturn.FINISH
    assert policy.completion_timeout_s == 90 and policy.yield_on_veto


def test_vacancyd_status_prints_the_reclaim_phase() -> None:
    from tests.unit.test_status_model import MINIMAL

    up = {
        "adapter": "ollama",
        "resource": "gpu0",
        "also_requires": [],
        "owner_scope": "host",
        "listener": {"address": "127.0.0.1:1", "bound": True, "error": None},
        "lendable": False,
        "refusal": {"reason": "owner_active", "retry_after_s": 5, "detail": "owner"},
        "busy": False,
        "server": None,
        "unseen_gpu_work": None,
        "active_work": [],
        "reclaim": {
            "phase": "waiting",
            "trigger": "owner",
            "policy": "drain",
            "resource": None,
            "edges_age_s": [2.0, 1.0],
            "edge_triggers": ["owner", "pressure"],
            "deadline_in_s": None,
            "outcome": None,
        },
    }
    doc = StatusDocument.from_json({**MINIMAL, "upstreams": {"up": up}})
    assert "reclaim: waiting (owner, policy drain, 2 edge(s))" in format_status(doc)
