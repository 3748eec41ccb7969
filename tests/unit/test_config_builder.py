"""The tests' one daemon-config builder (tests/support/config.py) writes TOML the daemon
reads as intended."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.config import (
    companion_toml,
    daemon_toml,
    gpu,
    lender,
    resource,
    token,
    toml_value,
    upstream,
)
from vacancyd.config import parse_config
from vacancyd.config.load import parse_companion_config


def test_defaults_are_a_loopback_headless_lender() -> None:
    s = parse_config(daemon_toml(upstream("up", "http://127.0.0.1:9")), "<test>")
    assert s.server.listen == "127.0.0.1:0" and s.server.trust_loopback
    assert s.owner.presence == "headless" and s.collectors.poll_s == 0.1
    assert [(r.name, r.kind) for r in s.resource] == [("ram", "memory")]
    (up,) = s.upstream
    assert (up.name, up.adapter, up.resource, up.listen) == ("up", "openai", "ram", "127.0.0.1:0")


def test_every_table_takes_overrides_and_extra_keys() -> None:
    text = daemon_toml(
        upstream("a", "http://127.0.0.1:9", adapter="ollama", on_owner_return="cancel"),
        upstream("b", "http://127.0.0.1:9", resource="gpu0", owner_scope="resource"),
        resources=(resource("ram"), resource("gpu0", "gpu", device=0)),
        server={"trust_loopback": None},
        owner={"release_after_s": 5},
        collectors={"poll_s": 0.5},
        limits={"max_connections": 7},
    )
    s = parse_config(text, "<test>")
    assert not s.server.trust_loopback  # None drops the key: the default applies
    assert s.server.limits.max_connections == 7
    assert s.owner.release_after_s == 5 and s.collectors.poll_s == 0.5
    a, b = s.upstream
    assert a.adapter == "ollama" and a.on_owner_return == "cancel"
    assert b.resource == "gpu0" and b.owner_scope == "resource"


def test_values_are_written_as_toml() -> None:
    assert toml_value('say "hi" \\ bye') == '"say \\"hi\\" \\\\ bye"'
    assert toml_value([True, 1, 0.5]) == "[true, 1, 0.5]"
    assert toml_value({"name": "r", "scopes": ["read"]}) == '{name = "r", scopes = ["read"]}'
    with pytest.raises(TypeError):
        toml_value(object())


def test_sub_tables_tokens_and_top_level_keys(tmp_path: Path) -> None:
    text = daemon_toml(
        upstream(
            "llm",
            "http://127.0.0.1:9",
            resource="gpu0",
            models={"default_mib": 1, "footprint_mib": {"qwen2.5:7b": 5000, "tiny": 1}},
        ),
        resources=(gpu("gpu0", 0, pressure={"poll_ms": 100, "fixed_threshold": 0.2}),),
        tokens=(token("cluster", "s" * 24, "borrow"), token("prom", "r" * 24, "read")),
        limits={"max_connections": 7},
        collectors={"poll_s": None},
        state_dir=tmp_path,
        kubernetes={"node": "pc", "address": "192.0.2.10", "namespace": "vacancy"},
    )
    s = parse_config(text, "<test>")
    assert s.state_dir == tmp_path and "collectors" not in s.model_fields_set
    assert [(t.name, t.scopes) for t in s.server.tokens] == [
        ("cluster", ["borrow"]),
        ("prom", ["read"]),
    ]
    assert s.server.limits.max_connections == 7
    (card,) = s.resource
    assert card.kind == "gpu" and card.device == 0
    assert card.pressure is not None and card.pressure.poll_ms == 100
    (up,) = s.upstream
    assert up.models.default_mib == 1
    assert up.models.footprint_mib == {"qwen2.5:7b": 5000, "tiny": 1}
    assert s.kubernetes is not None and s.kubernetes.node == "pc"


def test_companion_config() -> None:
    text = companion_toml(
        lender("pc", "http://127.0.0.1:9", "r" * 24, "192.0.2.10", node="pc"),
        kubernetes={"namespace": "vacancy"},
        lender_timeout_s=1.5,
    )
    c = parse_companion_config(text, "<test>")
    assert c.listen == "127.0.0.1:0" and c.lender_timeout_s == 1.5
    assert c.kubernetes.namespace == "vacancy"
    (pc,) = c.lender
    assert (pc.name, pc.address, pc.node) == ("pc", "192.0.2.10", "pc")
