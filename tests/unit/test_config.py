"""Configuration: parsing, validation errors naming the key, the example and default files."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.config import daemon_toml, resource, token, upstream
from vacancyd.cli import main
from vacancyd.config import ConfigError, load_config, load_default_config, parse_config

ROOT = Path(__file__).resolve().parents[2]

ISSUE_CONFIG = """
[server]
listen = "127.0.0.1:9470"
trust_loopback = true

[owner]
presence = "headless"

[[resource]]
name = "ram"
kind = "memory"

[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:18081"
target = "http://127.0.0.1:18080"
resource = "ram"

[upstream.models]
default_mib = 512
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text), "test.toml")
    assert "test.toml" in str(info.value)
    return info.value.problems


def test_issue_config_means_what_it_says() -> None:
    s = parse_config(ISSUE_CONFIG)
    assert s.server.listen == "127.0.0.1:9470" and s.server.trust_loopback
    assert s.owner.presence == "headless"
    (up,) = s.upstream
    assert (up.adapter, up.listen, str(up.target), up.resource) == (
        "llamacpp",
        "127.0.0.1:18081",
        "http://127.0.0.1:18080/",
        "ram",
    )
    assert up.models.default_mib == 512
    assert s.resource[0].kind == "memory"


def test_example_config_is_valid() -> None:
    s = load_config(ROOT / "vacancyd.example.toml")
    assert [r.name for r in s.resource] == ["gpu0", "ram"]
    assert [u.adapter for u in s.upstream] == ["llamacpp", "ollama"]
    assert s.owner.presence == "logind"
    assert s.upstream[0].models.footprint_mib["qwen2.5-7b-instruct"] == 6000


def test_embedded_default_serves_openai_on_loopback_gated_on_memory() -> None:
    s = load_default_config()
    (up,) = s.upstream
    assert up.adapter == "openai" and str(up.target) == "http://127.0.0.1:8080/"
    assert up.listen.startswith("127.0.0.1:")
    assert {r.name: r.kind for r in s.resource}[up.resource] == "memory"


def test_embedded_default_keeps_state_out_of_system_paths(tmp_path: Path) -> None:
    """A developer's or trial run writes no /var/lib; a service's manager decides; a config
    file without state_dir keeps the service's /var/lib/vacancyd."""
    home = {"HOME": str(tmp_path)}
    assert load_default_config(home).state_dir == tmp_path / ".local/state/vacancyd"
    xdg = {**home, "XDG_STATE_HOME": str(tmp_path / "xdg")}
    assert load_default_config(xdg).state_dir == tmp_path / "xdg/vacancyd"
    relative = {**home, "XDG_STATE_HOME": "rel"}  # the XDG spec ignores a relative one
    assert load_default_config(relative).state_dir == tmp_path / ".local/state/vacancyd"
    service = {**xdg, "STATE_DIRECTORY": "/var/lib/vacancyd:/var/lib/other"}
    assert load_default_config(service).state_dir == Path("/var/lib/vacancyd")
    assert parse_config(ISSUE_CONFIG).state_dir == Path("/var/lib/vacancyd")


def test_malformed_toml() -> None:
    (p,) = problems("[server\nlisten = 1")
    assert "not valid TOML" in p and "line 1" in p


def test_unknown_keys_name_their_path() -> None:
    ps = problems(
        """
        [server]
        lisen = "127.0.0.1:1"
        [[resource]]
        name = "ram"
        kind = "memory"
        colour = "red"
        """
    )
    assert "server.lisen: unknown key" in ps
    assert "resource[0].colour: unknown key" in ps


@pytest.mark.parametrize(
    ("snippet", "needle"),
    [
        ('[server]\nlisten = "127.0.0.1:70000"', "server.listen: Value error, port 70000"),
        ('[server]\nlisten = "nohost"', "server.listen"),
        ('[server]\nlisten = "example.com:80"', "must be an IP address"),
        ("[server.limits]\nmax_request_body_mib = 0", "server.limits.max_request_body_mib"),
        ("[collectors]\npoll_s = -1", "collectors.poll_s"),
        ('[[resource]]\nname = "Bad Name"\nkind = "gpu"', "resource[0].name"),
        ('[[resource]]\nname = "g"\nkind = "tpu"', "resource[0].kind"),
        ('[[resource]]\nname = "c"\nkind = "cpu"\nmin_free_mib = 5', "no byte capacity"),
        ('[[resource]]\nname = "g"\nkind = "gpu"\nmax_utilization = 1.5', "max_utilization"),
    ],
)
def test_out_of_range_values(snippet: str, needle: str) -> None:
    ps = problems(snippet)
    assert any(needle.replace("Value error, ", "") in p for p in ps), ps


def one_upstream(
    listen: str = "127.0.0.1:1", target: str = "http://127.0.0.1:2", resource: str = "ram"
) -> str:
    """One memory resource and one upstream ``a``, nothing else."""
    return daemon_toml(upstream("a", target, resource=resource, listen=listen), defaults=False)


def test_zero_event_subscribers_is_an_error_naming_the_key() -> None:
    # 0 would silently shut /events to the status page and the Kubernetes companion.
    ps = problems("[server.limits]\nmax_event_subscribers = 0")
    assert any("server.limits.max_event_subscribers" in p and "1" in p for p in ps), ps
    assert (
        parse_config(
            "[server.limits]\nmax_event_subscribers = 1"
        ).server.limits.max_event_subscribers
        == 1
    )


def test_cross_checks() -> None:
    ps = problems(one_upstream(resource="gpu"))
    assert any("names resource 'gpu', which no [[resource]] declares" in p for p in ps)
    ps = problems(one_upstream(listen="0.0.0.0:1"))
    assert any(
        "non-loopback listener needs [[server.tokens]]" in p and "0.0.0.0:1" in p for p in ps
    )
    ps = problems(one_upstream(target="https://127.0.0.1:2"))
    assert any("http://" in p for p in ps)
    ps = problems(one_upstream(target="http://127.0.0.1:2/v1"))
    assert any("no path" in p for p in ps)
    ps = problems(one_upstream(listen="127.0.0.1:9470"))
    assert any("listen addresses must be unique" in p for p in ps)


def test_remote_listener_allowed_with_tokens_or_escape_hatch() -> None:
    remote = upstream("a", "http://127.0.0.1:2", listen="0.0.0.0:18081")
    parse_config(daemon_toml(remote, server={"allow_unauthenticated_remote": True}, defaults=False))
    parse_config(
        daemon_toml(remote, tokens=(token(None, "0123456789abcdef", "borrow"),), defaults=False)
    )
    ps = problems('[[server.tokens]]\ntoken = "short"\nscopes = ["borrow"]\n')
    assert any("at least 16" in p for p in ps)
    ps = problems('[[server.tokens]]\nscopes = ["borrow"]\n')
    assert any("exactly one of token or token_file" in p for p in ps)
    ps = problems('[[server.tokens]]\ntoken = "0123456789abcdef"\nscopes = ["root"]\n')
    assert any("server.tokens[0].scopes[0]" in p for p in ps)


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text(ISSUE_CONFIG)
    assert main(["check-config", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[owner]\npresence = 'telepathy'\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "owner.presence" in err and str(bad) in err
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 1
    assert "cannot read the file" in capsys.readouterr().err


def test_check_config_warns_when_unlisted_models_are_charged_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "v.toml"
    cfg.write_text(
        daemon_toml(
            upstream("zero", "http://127.0.0.1:1", models={"footprint_mib": {"a": 1000}}),
            upstream("sized", "http://127.0.0.1:2", models={"default_mib": 4096}),
            upstream("bare", "http://127.0.0.1:3"),
            upstream("cpu-only", "http://127.0.0.1:4", resource="cpu"),
            resources=(resource("ram"), resource("cpu", "cpu")),
        )
    )
    assert main(["check-config", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert "OK" in captured.out
    warned = [line for line in captured.err.splitlines() if "default_mib is 0" in line]
    assert len(warned) == 2, captured.err
    assert "upstream[0] (zero)" in warned[0] and "not among the 1 in footprint_mib" in warned[0]
    assert "upstream[2] (bare)" in warned[1] and "vacancyd measure" in warned[1]


def test_check_config_reads_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.token"
    big.write_text("x" * (65 * 1024))
    empty = tmp_path / "empty.token"
    empty.write_text("  \n")
    cfg = tmp_path / "v.toml"
    cfg.write_text(
        daemon_toml(
            upstream("up", "http://127.0.0.1:1", credential_file=tmp_path),
            tokens=(
                token("a", "same-secret-0123456789", "borrow"),
                token("b", "same-secret-0123456789", "admin"),
                token(None, "", "read", token_file="/dev/urandom"),
                token(None, "", "read", token_file=tmp_path / "missing.token"),
                token(None, "", "read", token_file=big),
                token(None, "", "read", token_file=empty),
            ),
            defaults=False,
        )
    )
    assert main(["check-config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "server.tokens[1] (b) has the same secret as server.tokens[0]" in err
    assert "server.tokens[2].token_file: /dev/urandom is not a regular file" in err
    assert "server.tokens[3].token_file: cannot read" in err
    assert "server.tokens[4].token_file:" in err and "larger than 64 KiB" in err
    assert "server.tokens[5].token_file:" in err and "is empty" in err
    assert "upstream[0].credential_file (up):" in err


@pytest.mark.parametrize("value", ['"yes"', "1", '"true"', "0"])
def test_switches_take_only_true_or_false(value: str) -> None:
    """A security switch written as a string or a number is an error naming the key, never
    read as "on" (pydantic's lax mode would turn "yes" and 1 into True)."""
    ps = problems(f"[server]\ntrust_loopback = {value}\n")
    assert any("server.trust_loopback" in p for p in ps), ps


def test_shutdown_grace_and_delay() -> None:
    settings = parse_config(ISSUE_CONFIG, "test.toml")
    assert settings.server.shutdown_grace_s == 20
    assert settings.shutdown_delay_s == 0  # no [kubernetes]: nothing to wait for
    with_kube = ISSUE_CONFIG + '\n[kubernetes]\nnode = "pc"\n'
    assert parse_config(with_kube, "test.toml").shutdown_delay_s == 2
    short = ISSUE_CONFIG.replace(
        "trust_loopback = true", "trust_loopback = true\nshutdown_grace_s = 1"
    )
    assert parse_config(short + '\n[kubernetes]\nnode = "pc"\n', "t.toml").shutdown_delay_s == 1
    ps = problems(
        ISSUE_CONFIG.replace(
            "trust_loopback = true",
            "trust_loopback = true\nshutdown_grace_s = 3\nshutdown_delay_s = 5",
        )
    )
    assert any("shutdown_delay_s (5) cannot exceed shutdown_grace_s (3)" in p for p in ps)
    ps = problems(ISSUE_CONFIG.replace("trust_loopback = true", "shutdown_grace_s = -1"))
    assert any("server.shutdown_grace_s" in p for p in ps)


def test_upstream_silence_defaults_to_five_minutes_and_zero_means_no_limit() -> None:
    (up,) = parse_config(ISSUE_CONFIG).upstream
    assert up.upstream_silence_s == 300 and up.silence_limit == 300
    text = ISSUE_CONFIG.replace('resource = "ram"\n', 'resource = "ram"\nupstream_silence_s = {}\n')
    assert parse_config(text.format(0)).upstream[0].silence_limit is None
    assert parse_config(text.format(12.5)).upstream[0].silence_limit == 12.5


@pytest.mark.parametrize("value", ["-1", "true", '"60"', "86401"])
def test_upstream_silence_must_be_a_number_of_seconds(value: str) -> None:
    text = ISSUE_CONFIG.replace(
        'resource = "ram"\n', f'resource = "ram"\nupstream_silence_s = {value}\n'
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    assert any("upstream_silence_s" in p for p in info.value.problems), info.value.problems


def test_detached_work_timeout_defaults_to_a_minute_on_llamacpp() -> None:
    (up,) = parse_config(ISSUE_CONFIG).upstream
    assert up.adapter == "llamacpp" and up.detached_work_timeout == 60
    text = ISSUE_CONFIG.replace(
        'resource = "ram"\n', 'resource = "ram"\ndetached_work_timeout_s = {}\n'
    )
    assert parse_config(text.format(0)).upstream[0].detached_work_timeout == 0
    assert parse_config(text.format(2.5)).upstream[0].detached_work_timeout == 2.5


@pytest.mark.parametrize(
    ("value", "adapter"),
    [("-1", "llamacpp"), ("true", "llamacpp"), ('"60"', "llamacpp"), ("60", "openai")],
)
def test_detached_work_timeout_is_seconds_on_a_llamacpp_upstream(value: str, adapter: str) -> None:
    text = ISSUE_CONFIG.replace(
        'resource = "ram"\n', f'resource = "ram"\ndetached_work_timeout_s = {value}\n'
    ).replace('adapter = "llamacpp"', f'adapter = "{adapter}"')
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    assert any("detached_work_timeout_s" in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("target", ["http://user:pw@127.0.0.1:8080", "http://user@127.0.0.1:8080"])
def test_target_with_user_info_is_an_error_naming_the_credential_keys(target: str) -> None:
    """A user:password in the target would never reach the server (forwarded requests carry
    only the target's host and port): the config says so rather than dropping it."""
    text = daemon_toml(upstream("up", target))
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    assert any("upstream[0].target" in p and "credential" in p for p in info.value.problems), (
        info.value.problems
    )
