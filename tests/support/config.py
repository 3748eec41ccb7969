"""One builder for the daemon configurations the tests run.

``daemon_toml`` writes the TOML a test passes to ``running_daemon`` (or to ``vacancyd run``):
a loopback-trusting API listener on an ephemeral port, headless presence polled quickly,
one memory resource ``ram`` and the upstreams given, each on an ephemeral loopback port.
Every default can be overridden, and any table can take extra keys, so a test spells out
only what it is about::

    daemon_toml(upstream("up", target, adapter="ollama", on_owner_return="cancel"))
    daemon_toml(upstream("a", t), upstream("b", t), owner={"release_after_s": 5})

Values are written as TOML (strings quoted, booleans lower-case, lists and inline tables).
``extra`` is appended verbatim for tables the builder does not model (``[kubernetes]``,
``[[pool]]``, ``[schedule]``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def toml_value(value: Any) -> str:
    """``value`` as a TOML value. Raises TypeError for anything TOML cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def table(header: str, keys: Mapping[str, Any]) -> str:
    """``[header]`` (or ``[[header]]`` when given with brackets) and its keys, None skipped."""
    head = header if header.startswith("[") else f"[{header}]"
    lines = [head] + [f"{k} = {toml_value(v)}" for k, v in keys.items() if v is not None]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Upstream:
    """One ``[[upstream]]``; ``keys`` holds every other key of the table."""

    name: str
    target: str
    adapter: str = "openai"
    resource: str = "ram"
    listen: str = "127.0.0.1:0"
    keys: Mapping[str, Any] = field(default_factory=dict)

    def toml(self) -> str:
        return table(
            "[[upstream]]",
            {
                "name": self.name,
                "adapter": self.adapter,
                "listen": self.listen,
                "target": self.target,
                "resource": self.resource,
                **self.keys,
            },
        )


def upstream(
    name: str,
    target: str,
    *,
    adapter: str = "openai",
    resource: str = "ram",
    listen: str = "127.0.0.1:0",
    **keys: Any,
) -> Upstream:
    """An ``[[upstream]]`` named ``name`` in front of ``target``; ``keys`` are its other keys."""
    return Upstream(name, target, adapter, resource, listen, keys)


@dataclass(frozen=True)
class Resource:
    """One ``[[resource]]``; ``keys`` holds every other key of the table."""

    name: str
    kind: str = "memory"
    keys: Mapping[str, Any] = field(default_factory=dict)

    def toml(self) -> str:
        return table("[[resource]]", {"name": self.name, "kind": self.kind, **self.keys})


def resource(name: str, kind: str = "memory", **keys: Any) -> Resource:
    return Resource(name, kind, keys)


RAM = Resource("ram")


def daemon_toml(
    *upstreams: Upstream,
    resources: tuple[Resource, ...] = (RAM,),
    server: Mapping[str, Any] | None = None,
    owner: Mapping[str, Any] | None = None,
    collectors: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    extra: str = "",
) -> str:
    """A whole daemon configuration.

    ``server``: keys of ``[server]`` over ``listen = "127.0.0.1:0"`` and
    ``trust_loopback = true``. ``owner``: keys of ``[owner]`` over ``presence =
    "headless"`` (``presence = None`` leaves presence unconfigured). ``collectors``: keys of
    ``[collectors]`` over ``poll_s = 0.1``. ``limits``: ``[server.limits]``, when given.
    """
    parts = [
        table("server", {"listen": "127.0.0.1:0", "trust_loopback": True, **(server or {})}),
    ]
    if limits:
        parts.append(table("server.limits", limits))
    parts.append(table("owner", {"presence": "headless", **(owner or {})}))
    parts.append(table("collectors", {"poll_s": 0.1, **(collectors or {})}))
    parts += [r.toml() for r in resources]
    parts += [u.toml() for u in upstreams]
    if extra:
        parts.append(extra.strip() + "\n")
    return "\n".join(parts)
