"""One generic converter between frozen dataclasses and JSON values, both ways.

:func:`to_json` writes a dataclass as a JSON object with one key per field, in field order,
then the names in its ``JSON_EXTRA`` class attribute (read-only properties, such as a
document's ``lendable``); enums as their values, tuples as lists, mappings as objects.
:func:`from_json` reads such a value back into the type its annotations name. What a field
does beyond that is declared on the field (``dataclasses.field(metadata=...)``) with
:func:`shape`:

* ``round_to``: floats (or each float of a tuple) are written rounded to that many digits;
* ``hidden``: never written; read back as the field's default;
* ``when``: written only where ``when(obj)`` is true; read back as the default when absent;
* ``only``: of a nested dataclass, only these keys are written;
* ``sort``: a mapping is written with its keys sorted;
* ``flatten``: a mapping's keys are written into the enclosing object; on reading, every
  key that names no other field goes back into it.

Reading is strict about types (a clear :class:`JsonShapeError` naming the path of the
first wrong value) and lenient about keys: unknown keys are ignored, a missing key takes
the field's default and only a missing key without a default is an error. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")

_KEY = "vacancyd.json"


class JsonShapeError(ValueError):
    """A JSON value does not have the shape of the type it is read as; the message names
    the path of the first wrong value (``upstreams.chat.listener.bound``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    round_to: int | None = None
    hidden: bool = False
    when: Callable[[Any], bool] | None = None
    only: tuple[str, ...] | None = None
    sort: bool = False
    flatten: bool = False


def shape(
    *,
    round_to: int | None = None,
    hidden: bool = False,
    when: Callable[[Any], bool] | None = None,
    only: tuple[str, ...] | None = None,
    sort: bool = False,
    flatten: bool = False,
) -> dict[str, Shape]:
    """Field metadata declaring how the field is written and read (see the module doc)."""
    return {_KEY: Shape(round_to, hidden, when, only, sort, flatten)}


_PLAIN = Shape()


def _shape_of(f: dataclasses.Field[Any]) -> Shape:
    found = f.metadata.get(_KEY, _PLAIN)
    assert isinstance(found, Shape)
    return found


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_json(value: Any, *, round_to: int | None = None) -> Any:
    """``value`` as a JSON value (dicts, lists, str, int, float, bool, None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _object_to_json(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and round_to is not None:
        return round(value, round_to)
    if isinstance(value, tuple | list):
        return [to_json(v, round_to=round_to) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def _object_to_json(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        how = _shape_of(f)
        if how.hidden or (how.when is not None and not how.when(obj)):
            continue
        value = getattr(obj, f.name)
        if how.flatten:
            out.update(to_json(value or {}))
            continue
        written = to_json(value, round_to=how.round_to)
        if how.only is not None and isinstance(written, dict):
            written = {k: v for k, v in written.items() if k in how.only}
        if how.sort and isinstance(written, dict):
            written = dict(sorted(written.items()))
        out[f.name] = written
    for name in getattr(type(obj), "JSON_EXTRA", ()):
        out[name] = to_json(getattr(obj, name))
    return out


def from_json(cls: type[T], data: Any, where: str = "") -> T:
    """Read the JSON value ``data`` as a ``cls`` (a dataclass written by :func:`to_json`).
    ``where``: the path of ``data`` in an enclosing document, for messages. Raises
    :class:`JsonShapeError`."""
    value: T = _read(cls, data, where or cls.__name__)
    return value


def _read(kind: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if data is None and type(None) in options:
            return None
        rest = [o for o in options if o is not type(None)]
        if len(rest) == 1:
            return _read(rest[0], data, where)
        raise JsonShapeError(f"{where}: unsupported type {kind}")  # pragma: no cover
    if kind is Any or kind is object:
        return data
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _read_object(kind, data, where)
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(data)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise JsonShapeError(f"{where}: {data!r} is not one of {choices}") from None
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(data, list):
            raise JsonShapeError(f"{where}: expected a list, got {_name(data)}")
        return tuple(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
    if origin in (Mapping, dict, typing.Mapping):
        _key, item = typing.get_args(kind)
        if not isinstance(data, dict):
            raise JsonShapeError(f"{where}: expected an object, got {_name(data)}")
        return {str(k): _read(item, v, f"{where}.{k}") for k, v in data.items()}
    if kind is bool:
        if not isinstance(data, bool):
            raise JsonShapeError(f"{where}: expected true or false, got {_name(data)}")
        return data
    if kind is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise JsonShapeError(f"{where}: expected an integer, got {_name(data)}")
        return data
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise JsonShapeError(f"{where}: expected a number, got {_name(data)}")
        return data
    if kind is str:
        if not isinstance(data, str):
            raise JsonShapeError(f"{where}: expected a string, got {_name(data)}")
        return data
    raise JsonShapeError(f"{where}: unsupported type {kind}")  # pragma: no cover


def _read_object(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise JsonShapeError(f"{where}: expected an object, got {_name(data)}")
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    named = {f.name for f in fields if not _shape_of(f).flatten}
    values: dict[str, Any] = {}
    for f in fields:
        how = _shape_of(f)
        if how.hidden:
            continue
        if how.flatten:
            rest = {k: v for k, v in data.items() if k not in named}
            values[f.name] = _read(hints[f.name], rest, where)
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise JsonShapeError(f"{where}: {f.name!r} is missing")
            continue
        values[f.name] = _read(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**values)


def _name(data: Any) -> str:
    if data is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(data), type(data).__name__
    )
