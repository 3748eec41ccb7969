"""Read TOML into :class:`Settings`, with errors that name the file, the key and the reason."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from vacancyd.config.files import read_regular_file
from vacancyd.config.model import CompanionSettings, Settings

DEFAULT_CONFIG_RESOURCE = "default.toml"


class ConfigError(Exception):
    """The configuration could not be read or is invalid. ``str()`` is a full report."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration in {source}:\n{lines}")


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _describe(err: dict[str, Any]) -> str:
    loc = _key_path(tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if kind not in ("value_error", "missing") and "input" in err:
        value = err["input"]
        if not isinstance(value, dict | list):
            msg += f" (got {value!r})"
    return f"{loc}: {msg}"


ModelT = TypeVar("ModelT", bound=BaseModel)


def _parse(text: str, source: str, model: type[ModelT]) -> ModelT:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [f"not valid TOML: {exc}"]) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(e) for e in exc.errors()]) from exc  # type: ignore[arg-type]


#: A configuration file larger than this is a mistake (or a device).
CONFIG_MAX_BYTES = 4 * 1024 * 1024


def _read(path: Path) -> str:
    """The file's text: a regular UTF-8 file of at most 4 MiB (a FIFO, a device or a huge
    file is refused at once rather than hanging or filling memory)."""
    try:
        return read_regular_file(path, CONFIG_MAX_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"the file is not UTF-8 text: {exc}"]) from exc
    except ValueError as exc:
        raise ConfigError(str(path), [f"cannot read the file: {exc}"]) from exc


def parse_config(text: str, source: str = "<string>") -> Settings:
    """Parse TOML text into Settings. Raises :class:`ConfigError`."""
    return _parse(text, source, Settings)


def parse_companion_config(text: str, source: str = "<string>") -> CompanionSettings:
    """Parse the companion's TOML file. Raises :class:`ConfigError`."""
    return _parse(text, source, CompanionSettings)


def load_companion_config(path: Path) -> CompanionSettings:
    """Read and validate a companion config file. Raises :class:`ConfigError`."""
    return parse_companion_config(_read(path), str(path))


def load_config(path: Path) -> Settings:
    """Read and validate a config file. Raises :class:`ConfigError` (also for I/O errors)."""
    return parse_config(_read(path), str(path))


def default_config_text() -> str:
    """The embedded default configuration shipped inside the package."""
    return resources.files("vacancyd").joinpath(DEFAULT_CONFIG_RESOURCE).read_text("utf-8")


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the embedded default keeps its state: a developer's or a trial run must not
    write system paths, while a service keeps what its manager gave it.

    ``$STATE_DIRECTORY`` (set by systemd's ``StateDirectory=``; its first path) when set,
    else ``$XDG_STATE_HOME/vacancyd`` when that is an absolute path, else
    ``~/.local/state/vacancyd``; ``/var/lib/vacancyd`` (the config file default) only when
    there is no home directory to find. ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    given = env.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given)
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative one is ignored
        return Path(xdg) / "vacancyd"
    home = env.get("HOME", "")
    try:
        base = Path(home) if home and Path(home).is_absolute() else Path.home()
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry
        return Settings.model_fields["state_dir"].default  # type: ignore[no-any-return]
    return base / ".local" / "state" / "vacancyd"


def load_default_config(environ: Mapping[str, str] | None = None) -> Settings:
    """The embedded default (``vacancyd run`` without ``--config``), its ``state_dir``
    resolved by :func:`default_state_dir` from ``environ`` (default ``os.environ``)."""
    settings = parse_config(default_config_text(), "<embedded default>")
    return settings.model_copy(update={"state_dir": default_state_dir(environ)})
