"""The cap on a borrowed Ollama request's ``keep_alive`` (``keep_alive_max_s``): how long a
borrowed model may stay in the owner's memory after the request. Values are read as Ollama's
``api.Duration`` reads them; what the real server does with the rewritten body is checked
in tests/integration/test_ollama_real.py."""

from __future__ import annotations

import json

import pytest

from tests.support.config import daemon_toml, upstream
from vacancyd.adapters.ollama import FOREVER_S, TABLE, cap_keep_alive, keep_alive_s
from vacancyd.config import parse_config
from vacancyd.config.load import ConfigError
from vacancyd.core.classify import Route


def route(path: str) -> Route:
    found = next((r for r in TABLE.routes if r.pattern == path), None)
    assert found is not None, path
    return found


def effective(body: bytes) -> object:
    """The keep_alive Go's decoder ends up with: the last one given."""
    pairs = json.loads(body, object_pairs_hook=list)
    return [v for k, v in pairs if k == "keep_alive"][-1]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (30, 30.0),
        (2.5, 2.5),
        (-1, FOREVER_S),
        ("0", 0.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        ("-1m", FOREVER_S),
        ("24h", 86400.0),
        ("5", None),
        ("forever", None),
        (True, None),
        ([1], None),
    ],
)
def test_keep_alive_is_read_as_ollama_reads_it(value: object, seconds: float | None) -> None:
    assert keep_alive_s(value) == seconds


@pytest.mark.parametrize("asked", [-1, "-1m", 3600, "24h", "2562047h", 1e30])
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/embed", "/api/embeddings"])
def test_longer_or_forever_is_capped_on_every_native_route(asked: object, path: str) -> None:
    body = json.dumps({"model": "m", "prompt": "x", "keep_alive": asked}).encode()
    capped = cap_keep_alive(route(path), body, 300)
    assert effective(capped) == 300
    assert json.loads(capped)["prompt"] == "x"


def test_none_given_gets_the_cap_since_the_servers_default_may_be_forever() -> None:
    assert effective(cap_keep_alive(route("/api/chat"), b'{"model":"m"}', 120)) == 120
    assert effective(cap_keep_alive(route("/api/chat"), b'{"keep_alive":null} ', 120)) == 120
    assert effective(cap_keep_alive(route("/api/chat"), b" { }\n", 120)) == 120


@pytest.mark.parametrize("asked", [0, 10, "1m", "300s", "0"])
def test_shorter_requests_pass_untouched(asked: object) -> None:
    body = json.dumps({"model": "m", "keep_alive": asked}).encode()
    assert cap_keep_alive(route("/api/generate"), body, 300) is body


@pytest.mark.parametrize("body", [b'{"model":"m","keep_alive":"soon"}', b"[1]", b"not json", b""])
def test_bodies_ollama_refuses_itself_pass_untouched(body: bytes) -> None:
    assert cap_keep_alive(route("/api/generate"), body, 300) is body


def test_the_v1_shims_take_no_keep_alive_and_pass_untouched() -> None:
    body = b'{"model":"m","keep_alive":-1}'
    assert cap_keep_alive(route("/v1/chat/completions"), body, 300) is body


def test_a_large_body_is_capped_too() -> None:
    body = json.dumps({"model": "m", "images": ["A" * 200_000], "keep_alive": -1}).encode()
    capped = cap_keep_alive(route("/api/generate"), body, 60)
    assert effective(capped) == 60 and len(capped) == len(body) + len(',"keep_alive":60')


def test_keep_alive_max_s_is_an_ollama_setting() -> None:
    ok = parse_config(
        daemon_toml(upstream("o", "http://127.0.0.1:1", adapter="ollama", keep_alive_max_s=60)),
        "<test>",
    )
    assert ok.upstream[0].keep_alive_max_s == 60
    default = parse_config(daemon_toml(upstream("o", "http://127.0.0.1:1", adapter="ollama")), "")
    assert default.upstream[0].keep_alive_max_s == 300
    with pytest.raises(ConfigError, match="keep_alive_max_s applies only to adapter"):
        parse_config(
            daemon_toml(upstream("v", "http://127.0.0.1:1", adapter="vllm", keep_alive_max_s=60)),
            "<test>",
        )


@pytest.mark.parametrize(
    "body",
    [
        # Go's decoder takes each of these for the key spelled in lowercase, and the last
        # one given wins: the server would load "huge", keep it for ever or with a context
        # the gate never charged
        b'{"model":"tiny","MODEL":"huge"}',
        b'{"model":"m","keep_alive":"1s","Keep_Alive":-1}',
        '{"model":"m","keep_alive":"1s","\u212aeep_alive":-1}'.encode(),  # Kelvin sign
        b'{"model":"m","Options":{"num_ctx":131072}}',
        b'{"model":"m","x":"' + b"a" * 100_000 + b'","MoDeL":"huge"}',  # the streamed parse
    ],
)
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/v1/chat/completions"])
def test_a_key_go_reads_under_another_spelling_is_refused(body: bytes, path: str) -> None:
    from vacancyd.adapters.base import BadRequest
    from vacancyd.adapters.ollama import ADAPTER

    with pytest.raises(BadRequest, match="spelled exactly"):
        ADAPTER.read_facts(route(path), body, "application/json")


def test_other_keys_keep_any_spelling() -> None:
    from vacancyd.adapters.ollama import ADAPTER

    body = b'{"model":"m","prompt":"x","Prompt":"y","Stream":false}'
    assert ADAPTER.read_facts(route("/api/generate"), body, "application/json").model == "m:latest"
