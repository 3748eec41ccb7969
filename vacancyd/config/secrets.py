"""Read every secret a configuration names, once, with one report of what is wrong.

Used by ``vacancyd check-config`` (so validation covers token and credential files) and by
the daemon at start (which refuses to start on any problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vacancyd.config.load import ConfigError
from vacancyd.config.model import Settings


@dataclass(frozen=True, slots=True)
class Secrets:
    """``tokens``: (name, secret, scopes) per ``[[server.tokens]]``, in order.
    ``credentials``: upstream name -> the credential sent to it (absent when none)."""

    tokens: tuple[tuple[str, str, frozenset[str]], ...]
    credentials: dict[str, str]


def read_secrets(settings: Settings, source: str = "configuration") -> Secrets:
    """Read token and credential files. Raises :class:`ConfigError` listing every problem:
    unreadable, non-regular, oversized or empty files, tokens shorter than 16 characters,
    and two tokens with the same secret (which would make their scopes ambiguous)."""
    problems: list[str] = []
    tokens: list[tuple[str, str, frozenset[str]]] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(settings.server.tokens):
        try:
            secret = t.secret()
        except ValueError as exc:
            problems.append(f"server.tokens[{i}].token_file: {exc}")
            continue
        if len(secret) < 16:
            problems.append(f"server.tokens[{i}]: token shorter than 16 characters")
            continue
        if secret in seen:
            problems.append(
                f"server.tokens[{i}] ({t.name}) has the same secret as server.tokens"
                f"[{seen[secret]}]; every token must be distinct so its scopes are unambiguous"
            )
            continue
        seen[secret] = i
        tokens.append((t.name, secret, frozenset(t.scopes)))
    credentials: dict[str, str] = {}
    for i, up in enumerate(settings.upstream):
        try:
            credential = up.upstream_credential()
        except ValueError as exc:
            problems.append(f"upstream[{i}].credential_file ({up.name}): {exc}")
            continue
        if credential is not None:
            credentials[up.name] = credential
    if problems:
        raise ConfigError(source, problems)
    return Secrets(tuple(tokens), credentials)


def missing_secret_files(settings: Settings) -> list[tuple[str, Path]]:
    """(where, path) for every token or credential file the settings name that does not
    exist (yet). ``where`` is the key, as in ``server.tokens[0].token_file``."""
    missing: list[tuple[str, Path]] = []
    for i, t in enumerate(settings.server.tokens):
        if t.token_file is not None and not t.token_file.exists():
            missing.append((f"server.tokens[{i}].token_file", t.token_file))
    for i, up in enumerate(settings.upstream):
        if up.credential_file is not None and not up.credential_file.exists():
            missing.append((f"upstream[{i}].credential_file ({up.name})", up.credential_file))
    return missing


def without_missing_files(settings: Settings) -> Settings:
    """A copy of ``settings`` minus the tokens and credentials whose files do not exist, so
    the files that do exist can still be checked (``vacancyd check-config``)."""
    tokens = [t for t in settings.server.tokens if t.token_file is None or t.token_file.exists()]
    server = settings.server.model_copy(update={"tokens": tokens})
    upstreams = [
        up
        if up.credential_file is None or up.credential_file.exists()
        else up.model_copy(update={"credential_file": None})
        for up in settings.upstream
    ]
    return settings.model_copy(update={"server": server, "upstream": upstreams})
