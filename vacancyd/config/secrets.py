"""Read every secret a configuration names, once, with one report of what is wrong.

Used by ``vacancyd check-config`` (so validation covers token and credential files) and by
the daemon at start (which refuses to start on any problem).

Under the systemd unit the secret files stay root-only: ``vacancyd install-service`` passes
each one with ``LoadCredential=NAME:PATH``, NAME being the file's name
(:func:`credential_plan`), and the daemon reads ``$CREDENTIALS_DIRECTORY/NAME`` in place of
PATH (:func:`vacancyd.config.model.secret_path`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vacancyd.config.load import ConfigError
from vacancyd.config.model import Settings, secret_path

#: The variable systemd sets for a service it passes credentials to (LoadCredential=).
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"


def credentials_directory() -> Path | None:
    """The service's credentials directory (``$CREDENTIALS_DIRECTORY``), or None."""
    value = os.environ.get(CREDENTIALS_ENV)
    return Path(value) if value else None


def secret_files(settings: Settings) -> list[tuple[str, Path]]:
    """(key, path) for every token and credential file the settings name, in order
    (``[[server.tokens]]``, upstream credentials, ``[[borrower]]`` tokens); ``key`` as in
    ``server.tokens[0].token_file``."""
    files: list[tuple[str, Path]] = []
    for i, t in enumerate(settings.server.tokens):
        if t.token_file is not None:
            files.append((f"server.tokens[{i}].token_file", t.token_file))
    for i, up in enumerate(settings.upstream):
        if up.credential_file is not None:
            files.append((f"upstream[{i}].credential_file ({up.name})", up.credential_file))
    for i, b in enumerate(settings.borrower):
        files.append((f"borrower[{i}].token_file ({b.name})", b.token_file))
    return files


def credential_plan(settings: Settings, source: str = "configuration") -> dict[str, Path]:
    """Credential name -> secret file, as the systemd unit passes them (``LoadCredential=``).

    The name is the file's name. Raises :class:`ConfigError` when two different files share
    a name (the service could not tell them apart: rename one), a path is not absolute, or
    a path cannot be written on a ``LoadCredential=`` line as it is (see
    :func:`_unit_line_problem`).
    """
    plan: dict[str, Path] = {}
    first: dict[str, str] = {}
    problems: list[str] = []
    for key, path in secret_files(settings):
        if not path.is_absolute():
            problems.append(f"{key}: {path} must be an absolute path for the systemd service")
            continue
        name = path.name
        problem = _unit_line_problem(path)
        if problem:
            problems.append(
                f"{key}: {str(path)!r} {problem}, which systemd would read otherwise on the "
                "service's LoadCredential= line; rename or move the file"
            )
            continue
        if name in plan and plan[name] != path:
            problems.append(
                f"{key}: {path} has the same file name as {plan[name]} ({first[name]}); the "
                "service receives secret files by file name, so rename one of them"
            )
            continue
        plan[name] = path
        first.setdefault(name, key)
    if problems:
        raise ConfigError(source, problems)
    return plan


def _unit_line_problem(path: Path) -> str:
    """Why ``path`` cannot go on a ``LoadCredential=NAME:PATH`` line as it is ("" when it
    can): systemd ends NAME at the first ``:``, expands ``%`` specifiers, reads ``\\`` as
    an escape and a line break as the end of the line, and trims surrounding spaces."""
    text = str(path)
    if ":" in path.name:
        return "has a ':' in its file name (the credential's name ends at the first ':')"
    for char, what in (("%", "a '%'"), ("\\", "a backslash")):
        if char in text:
            return f"has {what}"
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return "has a space or control character"
    return ""


def _not_passed(path: Path, credentials: Path | None) -> str:
    """A hint for a secret file the service cannot read and was not passed."""
    if credentials is None or secret_path(path, credentials) != path:
        return ""
    return (
        f" (the service was not passed it as the credential {path.name!r}: run "
        "`sudo vacancyd install-service` again after changing the secret files of its config)"
    )


@dataclass(frozen=True, slots=True)
class Secrets:
    """``tokens``: (name, secret, scopes) per ``[[server.tokens]]``, in order.
    ``credentials``: upstream name -> the credential sent to it (absent when none).
    ``borrowers``: (name, secret) per ``[[borrower]]``, in order (each holds ``borrow``)."""

    tokens: tuple[tuple[str, str, frozenset[str]], ...]
    credentials: dict[str, str]
    borrowers: tuple[tuple[str, str], ...] = ()

    def all_secrets(self) -> list[str]:
        """Every secret read (tokens, borrowers' tokens, upstream credentials): what logs
        and diagnostics must never show."""
        return (
            [t[1] for t in self.tokens]
            + [b[1] for b in self.borrowers]
            + list(self.credentials.values())
        )


def read_secrets(
    settings: Settings, source: str = "configuration", credentials: Path | None = None
) -> Secrets:
    """Read token and credential files (from ``credentials``, the service's credentials
    directory, when it holds them). Raises :class:`ConfigError` listing every problem:
    unreadable, non-regular, oversized or empty files, tokens shorter than 16 characters,
    and two tokens with the same secret (which would make their scopes, or which borrower
    presents them, ambiguous), ``[[borrower]]`` tokens included."""
    problems: list[str] = []
    tokens: list[tuple[str, str, frozenset[str]]] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(settings.server.tokens):
        try:
            secret = t.secret(credentials)
        except ValueError as exc:
            hint = _not_passed(t.token_file, credentials) if t.token_file else ""
            problems.append(f"server.tokens[{i}].token_file: {exc}{hint}")
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
    upstream_credentials: dict[str, str] = {}
    for i, up in enumerate(settings.upstream):
        try:
            credential = up.upstream_credential(credentials)
        except ValueError as exc:
            hint = _not_passed(up.credential_file, credentials) if up.credential_file else ""
            problems.append(f"upstream[{i}].credential_file ({up.name}): {exc}{hint}")
            continue
        if credential is not None:
            upstream_credentials[up.name] = credential
    borrowers: list[tuple[str, str]] = []
    seen_as: dict[str, str] = {secret: f"server.tokens[{i}]" for secret, i in seen.items()}
    for i, b in enumerate(settings.borrower):
        try:
            secret = b.secret(credentials)
        except ValueError as exc:
            hint = _not_passed(b.token_file, credentials)
            problems.append(f"borrower[{i}].token_file ({b.name}): {exc}{hint}")
            continue
        if len(secret) < 16:
            problems.append(f"borrower[{i}] ({b.name}): token shorter than 16 characters")
            continue
        if secret in seen_as:
            problems.append(
                f"borrower[{i}] ({b.name}) has the same token as {seen_as[secret]}; every "
                "token must be distinct so the borrower presenting it is unambiguous"
            )
            continue
        seen_as[secret] = f"borrower[{i}] ({b.name})"
        borrowers.append((b.name, secret))
    if problems:
        raise ConfigError(source, problems)
    return Secrets(tuple(tokens), upstream_credentials, tuple(borrowers))


def missing_secret_files(
    settings: Settings, credentials: Path | None = None
) -> list[tuple[str, Path]]:
    """(where, path) for every token or credential file the settings name that does not
    exist (yet), neither as a credential in ``credentials`` nor at its path. ``where`` is
    the key, as in ``server.tokens[0].token_file``."""
    return [
        (key, path)
        for key, path in secret_files(settings)
        if not secret_path(path, credentials).exists()
    ]


def without_missing_files(settings: Settings, credentials: Path | None = None) -> Settings:
    """A copy of ``settings`` minus the tokens and credentials whose files do not exist, so
    the files that do exist can still be checked (``vacancyd check-config``)."""

    def there(path: Path | None) -> bool:
        return path is None or secret_path(path, credentials).exists()

    tokens = [t for t in settings.server.tokens if there(t.token_file)]
    server = settings.server.model_copy(update={"tokens": tokens})
    upstreams = [
        up if there(up.credential_file) else up.model_copy(update={"credential_file": None})
        for up in settings.upstream
    ]
    borrowers = [b for b in settings.borrower if there(b.token_file)]
    return settings.model_copy(
        update={"server": server, "upstream": upstreams, "borrower": borrowers}
    )
