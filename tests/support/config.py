"""One builder for the daemon and companion configurations the tests run.

``daemon_toml`` writes the TOML a test passes to ``running_daemon`` (or to ``vacancyd run``):
a loopback-trusting API listener on an ephemeral port, headless presence polled quickly,
one memory resource ``ram`` and the upstreams given, each on an ephemeral loopback port.
Every default can be overridden (``None`` drops a key, so the daemon's own default applies),
and any table can take extra keys, so a test spells out only what it is about::

    daemon_toml(upstream("up", target, adapter="ollama", on_owner_return="cancel"))
    daemon_toml(upstream("a", t), upstream("b", t), owner={"release_after_s": 5})
    daemon_toml(
        upstream("llm", t, resource="gpu0", models={"default_mib": 1}),
        resources=(gpu("gpu0", 0, pressure={"poll_ms": 100}),),
        tokens=(token("cluster", SECRET, "borrow"),),
        state_dir=tmp_path,
    )

``companion_toml`` writes the Kubernetes companion's configuration in the same way::

    companion_toml(lender("pc", url, READ, "192.0.2.10"), kubernetes={"namespace": "ns"})

Values are written as TOML (strings quoted, booleans lower-case, lists and inline tables).
Inside a table, a mapping value becomes a sub-table (``models={...}`` on an upstream writes
``[upstream.models]``) and a list of mappings an array of sub-tables (``[[server.tokens]]``).
``extra`` is appended verbatim for tables the builder does not model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    """``key`` as a TOML key: bare when TOML allows it, quoted otherwise."""
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def toml_value(value: Any) -> str:
    """``value`` as a TOML value. Raises TypeError for anything TOML cannot hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(v, Mapping) for v in value)
    )


def table(header: str, keys: Mapping[str, Any]) -> str:
    """``[header]`` (or ``[[header]]`` when given with brackets) and its keys, None skipped.

    A mapping value is written as the sub-table ``[header.key]`` and a list of mappings as
    the array ``[[header.key]]``, after the plain keys.
    """
    name = header.strip("[]")
    head = header if header.startswith("[") else f"[{name}]"
    present = {k: v for k, v in keys.items() if v is not None}
    lines = [head] + [
        f"{toml_key(k)} = {toml_value(v)}"
        for k, v in present.items()
        if not isinstance(v, Mapping) and not _is_table_array(v)
    ]
    text = "\n".join(lines) + "\n"
    for k, v in present.items():
        if isinstance(v, Mapping):
            text += table(f"{name}.{toml_key(k)}", v)
        elif _is_table_array(v):
            text += "".join(table(f"[[{name}.{toml_key(k)}]]", item) for item in v)
    return text


def root_keys(keys: Mapping[str, Any]) -> str:
    """Top-level ``key = value`` lines (before any table), None skipped."""
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items() if v is not None)


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
    """An ``[[upstream]]`` named ``name`` in front of ``target``; ``keys`` are its other keys
    (``models={"default_mib": 1}`` writes its ``[upstream.models]``)."""
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
    """A ``[[resource]]`` of ``kind`` named ``name``; ``keys`` are its other keys."""
    return Resource(name, kind, keys)


def gpu(name: str, device: int | str, **keys: Any) -> Resource:
    """A GPU ``[[resource]]`` on NVML ``device`` (index, UUID or PCI bus id);
    ``pressure={...}`` writes its ``[resource.pressure]``."""
    return Resource(name, "gpu", {"device": device, **keys})


RAM = Resource("ram")


def token(name: str | None, secret: str, *scopes: str, **keys: Any) -> dict[str, Any]:
    """One ``[[server.tokens]]`` entry: ``secret`` (the ``token`` key) granting ``scopes``.
    Pass ``token_file=...`` in ``keys`` and an empty ``secret`` for a file-held token."""
    return {"name": name, "token": secret or None, "scopes": list(scopes), **keys}


def daemon_toml(
    *upstreams: Upstream,
    resources: Sequence[Resource] = (RAM,),
    server: Mapping[str, Any] | None = None,
    tokens: Sequence[Mapping[str, Any]] = (),
    limits: Mapping[str, Any] | None = None,
    owner: Mapping[str, Any] | None = None,
    collectors: Mapping[str, Any] | None = None,
    state_dir: str | Path | None = None,
    root: Mapping[str, Any] | None = None,
    kubernetes: Mapping[str, Any] | None = None,
    pools: Sequence[Mapping[str, Any]] = (),
    schedule: Mapping[str, Any] | None = None,
    defaults: bool = True,
    extra: str = "",
) -> str:
    """A whole daemon configuration.

    ``server``: keys of ``[server]`` over ``listen = "127.0.0.1:0"`` and
    ``trust_loopback = true``; ``tokens``: its ``[[server.tokens]]`` (see :func:`token`);
    ``limits``: ``[server.limits]``, when given. ``owner``: keys of ``[owner]`` over
    ``presence = "headless"``. ``collectors``: keys of ``[collectors]`` over ``poll_s = 0.1``.
    A table left with no keys at all (``collectors={"poll_s": None}``) is not written.
    ``state_dir`` and ``root``: top-level keys. ``kubernetes``: the ``[kubernetes]`` table
    (node-side publishing), when given; ``pools``: ``[[pool]]`` tables; ``schedule``: the
    ``[schedule]`` table, when given. ``defaults=False`` writes only what is given, none of
    the defaults above (for tests of the parser itself); ``resources`` still defaults to ram.
    """
    parts = [root_keys({"state_dir": state_dir, **(root or {})})]
    server_keys: dict[str, Any] = {"listen": "127.0.0.1:0", "trust_loopback": True}
    if not defaults:
        server_keys = {}
    server_keys.update(server or {})
    if tokens:
        server_keys["tokens"] = list(tokens)
    if limits:
        server_keys["limits"] = limits
    sections: list[tuple[str, Mapping[str, Any] | None, dict[str, Any]]] = [
        ("server", server_keys, {}),
        ("owner", owner, {"presence": "headless"}),
        ("collectors", collectors, {"poll_s": 0.1}),
    ]
    for name, keys, given_defaults in sections:
        merged = {**(given_defaults if defaults else {}), **(keys or {})}
        if any(v is not None for v in merged.values()):
            parts.append(table(name, merged))
    if schedule is not None:
        parts.append(table("schedule", schedule))
    parts += [r.toml() for r in resources]
    parts += [u.toml() for u in upstreams]
    parts += [table("[[pool]]", p) for p in pools]
    if kubernetes is not None:
        parts.append(table("kubernetes", kubernetes))
    if extra:
        parts.append(extra.strip() + "\n")
    return "\n".join(p for p in parts if p)


def lender(name: str, url: str, secret: str, address: str, **keys: Any) -> dict[str, Any]:
    """One companion ``[[lender]]``: the daemon at ``url`` read with token ``secret``, whose
    node answers at ``address``; ``keys`` are its other keys (``node``...)."""
    return {"name": name, "url": url, "token": secret, "address": address, **keys}


def companion_toml(
    *lenders: Mapping[str, Any],
    kubernetes: Mapping[str, Any] | None = None,
    listen: str = "127.0.0.1:0",
    extra: str = "",
    **keys: Any,
) -> str:
    """A whole companion configuration: top-level ``listen`` (ephemeral loopback) and
    ``keys`` (``lender_timeout_s``, ``status_poll_s``...), ``[kubernetes]`` and one
    ``[[lender]]`` per ``lenders`` (see :func:`lender`); ``extra`` appended verbatim."""
    parts = [root_keys({"listen": listen, **keys})]
    if kubernetes is not None:
        parts.append(table("kubernetes", kubernetes))
    parts += [table("[[lender]]", entry) for entry in lenders]
    if extra:
        parts.append(extra.strip() + "\n")
    return "\n".join(parts)
