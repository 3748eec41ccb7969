"""Secret files under the systemd unit: each is passed as the credential named after its
file, and read from ``$CREDENTIALS_DIRECTORY`` in place of its path (docs/install.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vacancyd.config import ConfigError, Settings, parse_config
from vacancyd.config.secrets import credential_plan, missing_secret_files, read_secrets


def settings(*token_files: str) -> Settings:
    text = '[server]\nlisten = "127.0.0.1:9470"\n'
    for i, path in enumerate(token_files):
        text += f'[[server.tokens]]\nname = "t{i}"\ntoken_file = "{path}"\nscopes = ["admin"]\n'
    return parse_config(text, "<test>")


def test_tokens_are_read_from_the_credentials_in_place_of_their_root_only_paths(
    tmp_path: Path,
) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "admin.token").write_text("from-the-credential-0123456789\n")
    s = settings("/nonexistent/tokens/admin.token")
    secrets = read_secrets(s, "<test>", credentials)
    assert secrets.tokens[0][1] == "from-the-credential-0123456789"
    assert missing_secret_files(s, credentials) == []


def test_a_file_that_is_not_among_the_credentials_is_read_at_its_path(tmp_path: Path) -> None:
    token = tmp_path / "own.token"
    token.write_text("read-from-the-path-0123456789\n")
    (tmp_path / "credentials").mkdir()
    secrets = read_secrets(settings(str(token)), "<test>", tmp_path / "credentials")
    assert secrets.tokens[0][1] == "read-from-the-path-0123456789"


def test_a_secret_the_service_was_not_passed_says_to_rerun_install_service(
    tmp_path: Path,
) -> None:
    (tmp_path / "credentials").mkdir()
    with pytest.raises(ConfigError, match="install-service"):
        read_secrets(settings("/nonexistent/new.token"), "<test>", tmp_path / "credentials")
    with pytest.raises(ConfigError) as outside:  # not under systemd: no such hint
        read_secrets(settings("/nonexistent/new.token"), "<test>")
    assert "install-service" not in str(outside.value)


def test_credential_plan_names_each_file_by_its_name_and_refuses_two_of_one_name() -> None:
    plan = credential_plan(
        settings("/etc/vacancyd/tokens/admin.token", "/etc/vacancyd/tokens/borrow.token")
    )
    assert plan == {
        "admin.token": Path("/etc/vacancyd/tokens/admin.token"),
        "borrow.token": Path("/etc/vacancyd/tokens/borrow.token"),
    }
    with pytest.raises(ConfigError, match="same file name"):
        credential_plan(settings("/a/admin.token", "/b/admin.token"))
    with pytest.raises(ConfigError, match="absolute"):
        credential_plan(settings("tokens/admin.token"))


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/etc/vacancyd/tokens/ad:min.token", "':' in its file name"),
        ("/etc/vacancyd/tokens/admin%n.token", "'%'"),
        ("/etc/vacancy\\\\d/admin.token", "backslash"),
        ("/etc/vacancyd/tokens/admin .token", "space"),
    ],
)
def test_a_path_a_load_credential_line_cannot_carry_is_refused(path: str, why: str) -> None:
    # written as it is, systemd would pass another file, or under another name, than the
    # one the daemon then looks for in $CREDENTIALS_DIRECTORY
    with pytest.raises(ConfigError, match=why):
        credential_plan(settings(path))
