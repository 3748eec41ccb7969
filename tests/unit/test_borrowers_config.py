"""``[[borrower]]`` tables and the usage keys: parsing, the checks that name the borrower
and the bad value, and reading each borrower's token with the other secrets."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vacancyd.config import ConfigError, parse_config
from vacancyd.config.secrets import (
    credential_plan,
    read_secrets,
    secret_files,
    without_missing_files,
)

BASE = """
state_dir = "/tmp/vacancyd-test"
{top}

[server]
listen = "127.0.0.1:9470"

[[server.tokens]]
name = "gateway"
token_file = "{tokens}/gateway.token"
scopes = ["borrow"]

[[resource]]
name = "ram"
kind = "memory"

[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:18081"
target = "http://127.0.0.1:18080"
resource = "ram"

[[upstream]]
name = "llama2"
adapter = "llamacpp"
listen = "127.0.0.1:18082"
target = "http://127.0.0.1:18083"
resource = "ram"

[[pool]]
name = "both"
listen = "127.0.0.1:18084"
members = ["llama", "llama2"]
"""


def config(borrowers: str = "", top: str = "", tokens: str = "/etc/vacancyd/tokens") -> str:
    return BASE.format(top=top, tokens=tokens) + textwrap.dedent(borrowers)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value.problems


FRIEND = """
[[borrower]]
name = "friend"
token_file = "{tokens}/friend.token"
upstreams = ["llama", "both"]
max_concurrent = 2
daily_busy_s = 3600
"""


def test_borrowers_and_usage_keys_parse() -> None:
    s = parse_config(
        config(
            FRIEND.format(tokens="/etc/vacancyd/tokens")
            + '\n[[borrower]]\nname = "litellm"\ntoken_file = "/etc/vacancyd/tokens/l.token"\n',
            top='usage_retention_days = 30\nenergy_price_per_kwh = 0.31\nenergy_currency = "EUR"',
        ),
        "test.toml",
    )
    friend, litellm = s.borrower
    assert friend.name == "friend" and friend.upstreams == ["llama", "both"]
    assert friend.max_concurrent == 2 and friend.daily_busy_s == 3600
    assert friend.token_file == Path("/etc/vacancyd/tokens/friend.token")
    assert litellm.upstreams is None and litellm.max_concurrent is None
    assert litellm.daily_busy_s is None
    assert (s.usage_retention_days, s.energy_price_per_kwh, s.energy_currency) == (
        30,
        0.31,
        "EUR",
    )


def test_usage_defaults() -> None:
    s = parse_config(config(), "test.toml")
    assert s.borrower == []
    assert s.usage_retention_days == 90
    assert s.energy_price_per_kwh is None and s.energy_currency == ""


def test_an_unknown_upstream_names_the_borrower_and_the_name() -> None:
    text = config(
        '[[borrower]]\nname = "friend"\ntoken_file = "/t/f.token"\nupstreams = ["llama", "nope"]\n'
    )
    (p,) = problems(text)
    assert "borrower[0] (friend)" in p and "'nope'" in p
    assert "llama, llama2, both" in p or "both, llama, llama2" in p


def test_borrower_names_are_unique_labels_and_not_the_unnamed_label() -> None:
    two = '[[borrower]]\nname = "a"\ntoken_file = "/t/a.token"\n'
    assert any("repeated: a" in p for p in problems(config(two + two.replace("a.t", "b.t"))))
    for bad in ("Friend", "with space", "x" * 64, 'a\\"b', "-lead"):
        ps = problems(config(f'[[borrower]]\nname = "{bad}"\ntoken_file = "/t/a.token"\n'))
        assert any("borrower[0].name" in p for p in ps), (bad, ps)
    ps = problems(config('[[borrower]]\nname = "default"\ntoken_file = "/t/a.token"\n'))
    assert any("unnamed borrower" in p for p in ps), ps


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_concurrent", "0"),
        ("max_concurrent", "-1"),
        ("max_concurrent", "1.5"),
        ("daily_busy_s", "0"),
        ("daily_busy_s", "-5"),
        ("daily_busy_s", "nan"),
        ("daily_busy_s", "inf"),
    ],
)
def test_limits_must_be_positive(key: str, value: str) -> None:
    text = config(f'[[borrower]]\nname = "a"\ntoken_file = "/t/a.token"\n{key} = {value}\n')
    assert any(f"borrower[0].{key}" in p for p in problems(text))


def test_a_borrower_needs_a_token_file() -> None:
    assert any("token_file" in p for p in problems(config('[[borrower]]\nname = "a"\n')))


@pytest.mark.parametrize(
    "top",
    [
        "usage_retention_days = 0",
        "energy_price_per_kwh = -0.1",
        "energy_price_per_kwh = nan",
        'energy_currency = "a\\nb"',
    ],
)
def test_bad_usage_keys(top: str) -> None:
    key = top.split(" ", 1)[0]
    assert any(key in p for p in problems(config(top=top)))


def test_borrower_tokens_are_read_with_the_others(tmp_path: Path) -> None:
    (tmp_path / "gateway.token").write_text("gateway-secret-0123456789\n")
    (tmp_path / "friend.token").write_text("friend-secret-0123456789\n")
    s = parse_config(config(FRIEND.format(tokens=tmp_path), tokens=str(tmp_path)), "test.toml")
    secrets = read_secrets(s, "test.toml")
    assert secrets.borrowers == (("friend", "friend-secret-0123456789"),)
    assert "friend-secret-0123456789" in secrets.all_secrets()
    assert ("borrower[0].token_file (friend)", tmp_path / "friend.token") in secret_files(s)
    assert credential_plan(s)["friend.token"] == tmp_path / "friend.token"


def test_a_borrower_token_must_be_long_distinct_and_readable(tmp_path: Path) -> None:
    (tmp_path / "gateway.token").write_text("same-secret-0123456789\n")
    (tmp_path / "friend.token").write_text("same-secret-0123456789\n")
    (tmp_path / "short.token").write_text("short\n")
    text = config(
        FRIEND.format(tokens=tmp_path)
        + f'[[borrower]]\nname = "short"\ntoken_file = "{tmp_path}/short.token"\n'
        + f'[[borrower]]\nname = "gone"\ntoken_file = "{tmp_path}/gone.token"\n'
        + f'[[borrower]]\nname = "twin"\ntoken_file = "{tmp_path}/friend.token"\n',
        tokens=str(tmp_path),
    )
    s = parse_config(text, "test.toml")
    with pytest.raises(ConfigError) as info:
        read_secrets(s, "test.toml")
    ps = info.value.problems
    assert any("borrower[0] (friend) has the same token as server.tokens[0]" in p for p in ps)
    assert any("borrower[1] (short): token shorter than 16" in p for p in ps)
    assert any("borrower[2].token_file (gone): cannot read" in p for p in ps)
    assert any("borrower[3] (twin) has the same token as server.tokens[0]" in p for p in ps)
    # check-config without --strict checks the files that exist
    assert [b.name for b in without_missing_files(s).borrower] == ["friend", "short", "twin"]
