"""The tests' one daemon-config builder (tests/support/config.py) writes TOML the daemon
reads as intended."""

from __future__ import annotations

import pytest

from tests.support.config import daemon_toml, resource, toml_value, upstream
from vacancyd.config import parse_config


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
