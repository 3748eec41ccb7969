"""Where the command-line clients (``status``, ``pause``, ``resume``, ``measure``, ``open``)
find the daemon's API and the token to call it with, so that nobody has to paste a secret.

In order of precedence:

* the URL: ``--url``, else the config's ``[server] listen`` (https when it serves TLS),
  else ``http://127.0.0.1:9470``;
* the config: ``--config FILE``, else ``/etc/vacancyd/vacancyd.toml`` when it exists and no
  ``--url`` was given (the file ``vacancyd init`` writes);
* the token: ``--token-file``, ``--token``, ``$VACANCYD_TOKEN``, else the config's
  ``[[server.tokens]]`` entry that grants the scope the command needs with the least
  besides (a ``read`` token before an ``admin`` one for ``status``), read from the file it
  names — directly, as root or its owner does, not through the service's credentials.

A token file that cannot be read is an error naming the file, the key that names it and
what to do (run it as root, or give ``--token-file``), never a silent call without a token
that the daemon would answer with 401.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vacancyd.config import ConfigError, Settings, load_config
from vacancyd.config.model import TokenSettings, read_secret_file
from vacancyd.web.auth import IMPLIED

DEFAULT_URL = "http://127.0.0.1:9470"
#: The config ``vacancyd init`` writes and ``install-service`` runs with.
DEFAULT_CONFIG = Path("/etc/vacancyd/vacancyd.toml")
TOKEN_ENV = "VACANCYD_TOKEN"


class TargetError(Exception):
    """The API or its token cannot be worked out; the message says what and what to do."""


@dataclass(frozen=True, slots=True)
class ApiTarget:
    """``url``: the API's base URL without a trailing slash. ``token``: the bearer token to
    send (None: none). ``source``: where the token came from, for messages (``--token``,
    ``server.tokens[0] ("admin") in FILE``, ``no token``). ``config``: the config used."""

    url: str
    token: str | None
    source: str
    config: Path | None = None


def api_url(settings: Settings) -> str:
    """The API listener's URL: https when the listeners serve TLS."""
    scheme = "https" if settings.server.tls_cert_file is not None else "http"
    return f"{scheme}://{settings.server.listen}"


def grants(token: TokenSettings, scope: str) -> bool:
    """Whether ``token`` holds ``scope`` itself or through an implied scope."""
    return any(s == scope or scope in IMPLIED.get(s, ()) for s in token.scopes)


def candidates(settings: Settings, scope: str) -> list[tuple[int, TokenSettings]]:
    """(index, token) of every ``[[server.tokens]]`` entry granting ``scope``, the least
    privileged first: one naming the scope itself before one implying it, fewer scopes
    before more."""
    found = [(i, t) for i, t in enumerate(settings.server.tokens) if grants(t, scope)]
    return sorted(found, key=lambda it: (scope not in it[1].scopes, len(it[1].scopes), it[0]))


def _denied(exc: ValueError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, PermissionError)


def token_from_config(settings: Settings, scope: str, path: Path, command: str) -> ApiTarget:
    """The URL and the least-privileged readable token granting ``scope`` in ``settings``
    (loaded from ``path``). Raises :class:`TargetError` when tokens grant the scope but
    none of them can be read."""
    url = api_url(settings)
    problems: list[str] = []
    denied = False
    for i, t in candidates(settings, scope):
        where = f'server.tokens[{i}] ("{t.name}") in {path}'
        try:
            return ApiTarget(url, t.secret(), where, path)
        except ValueError as exc:
            denied = denied or _denied(exc)
            problems.append(f"{where}: {exc}")
    if problems:
        how = (
            f"run it as root (sudo vacancyd {command}), or pass --token-file FILE with a token "
            f"that has the {scope} scope"
            if denied
            else f"fix the file, or pass --token-file FILE with a token that has the {scope} scope"
        )
        raise TargetError(
            f"cannot read a token with the {scope} scope: {'; '.join(problems)}; {how}"
        )
    return ApiTarget(url, None, f"no token: {path} has no token with the {scope} scope", path)


def resolve(
    *,
    scope: str,
    command: str,
    url: str | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    config: Path | None = None,
    environ: Mapping[str, str] | None = None,
    default_config: Path | None = None,
) -> ApiTarget:
    """Work out the API and token for ``vacancyd COMMAND`` (see the module docstring).

    ``scope`` is the scope the command needs (``read`` or ``admin``). Raises
    :class:`TargetError` for a config that does not load, an unreadable ``--token-file`` or
    token files in the config that cannot be read.
    """
    environ = os.environ if environ is None else environ
    default_config = DEFAULT_CONFIG if default_config is None else default_config
    if config is None and url is None and default_config.is_file():
        config = default_config
    settings: Settings | None = None
    if config is not None:
        try:
            settings = load_config(config)
        except ConfigError as exc:
            raise TargetError(str(exc)) from None
    base = (url or (api_url(settings) if settings is not None else DEFAULT_URL)).rstrip("/")
    if token_file is not None:
        try:
            secret = read_secret_file(token_file)
        except ValueError as exc:
            how = f" (run it as root: sudo vacancyd {command})" if _denied(exc) else ""
            raise TargetError(f"--token-file: {exc}{how}") from None
        return ApiTarget(base, secret, f"--token-file {token_file}", config)
    if token:
        return ApiTarget(base, token, "--token", config)
    if environ.get(TOKEN_ENV):
        return ApiTarget(base, environ[TOKEN_ENV], f"${TOKEN_ENV}", config)
    if settings is not None and config is not None:
        found = token_from_config(settings, scope, config, command)
        return ApiTarget(base, found.token, found.source, config)
    return ApiTarget(base, None, "no token", None)


def unauthorized_hint(target: ApiTarget, scope: str, command: str) -> str:
    """What to do after a 401/403: names the token that was sent, or says none was."""
    if target.token is None:
        where = f" ({target.source})" if target.source != "no token" else ""
        return (
            f"no token was sent{where}: pass --config with the daemon's config (as root), "
            f"--token-file FILE or ${TOKEN_ENV} with a token that has the {scope} scope"
        )
    return (
        f"the token from {target.source} was refused: it must be one of the running daemon's "
        f"tokens with the {scope} scope (a config changed since the daemon started takes "
        f"effect on restart)"
    )
