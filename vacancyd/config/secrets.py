"""Read every secret a configuration names, once, with one report of what is wrong.

Used by ``vacancyd check-config`` (so validation covers token and credential files) and by
the daemon at start (which refuses to start on any problem).
"""

from __future__ import annotations

from dataclasses import dataclass

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
