"""Reading the few fields the gate needs from a work body, at bounded cost.

A work body may be as large as ``max_request_body_mib`` and is chosen by the borrower, so
reading it must never hold the event loop (the owner's reclaim and ``/healthz`` run there).
Three rules keep it cheap:

* Only the wanted top-level fields are kept. A JSON body larger than
  :data:`SMALL_JSON_BYTES` is fed in 4 KiB pieces to ijson's push parser (C, yajl) and only
  the values of the wanted keys are built, instead of materialising the whole document; the
  whole body is still checked to be one valid JSON object, as before.
* A ``multipart/form-data`` body is split with ``bytes.find`` on its boundary (memchr speed),
  not with the e-mail parser, which costs seconds per MiB of small fields.
* The parsers are generators that pause after every piece or part (:data:`Steps`). Run
  synchronously (:func:`run`) they simply finish; run by :func:`run_cooperatively` on the
  event loop they hand the loop back every :data:`SLICE_S` seconds, so the loop's lag stays
  a few milliseconds whatever the body. This is cooperative on purpose: a worker thread
  would have to win the GIL back from the loop, which on a busy machine stalls it for far
  longer.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import quopri
import re
import time
from collections.abc import Generator, Iterable
from email.message import Message
from typing import Any, TypeVar

import ijson  # type: ignore[import-untyped]

T = TypeVar("T")
#: A parser that pauses (yields None) between bounded pieces of work and returns T.
Steps = Generator[None, None, T]

#: Bodies up to this size are parsed at once by ``json.loads`` (a few ms at most).
SMALL_JSON_BYTES = 64 * 1024
#: Bytes of JSON fed to the parser between pauses.
PIECE_BYTES = 4096
#: How long :func:`run_cooperatively` works before handing the loop back (seconds).
SLICE_S = 0.002
#: Deeper nesting than this is refused, as ``json.loads`` refuses it past the recursion limit.
MAX_JSON_DEPTH = 512
#: A multipart part's header block larger than this is malformed (bytes).
MAX_PART_HEADER_BYTES = 16 * 1024
#: Placeholder for a wanted key whose value is an object or array (so a caller that wants
#: a string can still say "must be a string").
NON_SCALAR: dict[str, Any] = {}

_DISPOSITION = re.compile(rb"(?im)^content-disposition:([^\r\n]*)")
_ENCODING = re.compile(rb"(?im)^content-transfer-encoding:\s*([^\s;]+)")
_PARAM = re.compile(r';\s*([A-Za-z0-9_*.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


class BodyParseError(ValueError):
    """The body is not what its framing says (not JSON, not multipart, too deep)."""


def run(steps: Steps[T]) -> T:
    """Run a parser to its end on the calling thread; returns its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def run_cooperatively(steps: Steps[T], slice_s: float = SLICE_S) -> T:
    """Run a parser on the event loop, yielding to other tasks every ``slice_s`` seconds."""
    clock = time.perf_counter
    began = clock()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if clock() - began >= slice_s:
            await asyncio.sleep(0)
            began = clock()


def json_fields(body: bytes, keys: Iterable[str], whole: Iterable[str] = ()) -> dict[str, Any]:
    """The top-level ``keys`` present in a JSON object body (see :func:`json_fields_steps`)."""
    return run(json_fields_steps(body, keys, whole))


def json_fields_steps(
    body: bytes, keys: Iterable[str], whole: Iterable[str] = ()
) -> Steps[dict[str, Any]]:
    """The top-level ``keys`` present in a JSON object body, scalars by value.

    A wanted key whose value is an object or array maps to :data:`NON_SCALAR`, unless it is
    also in ``whole``: those values are built in full (an adapter's small option objects).
    A key given twice keeps its last value (what ``json.loads`` and the servers do). Raises
    :class:`BodyParseError` when the body is not one JSON object.
    """
    full = frozenset(whole)
    wanted = frozenset(keys) | full
    if len(body) <= SMALL_JSON_BYTES:
        try:
            payload = json.loads(body)
        except RecursionError as exc:
            raise BodyParseError("request body nests JSON too deeply to read") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise BodyParseError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise BodyParseError("request body must be a JSON object")
        return {
            k: NON_SCALAR if isinstance(payload[k], dict | list) and k not in full else payload[k]
            for k in wanted
            if k in payload
        }
    try:
        return (yield from _json_fields_pushed(body, wanted, full))
    except BodyParseError:
        raise
    except (ijson.JSONError, UnicodeDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise BodyParseError(f"request body is not valid JSON: {reason}") from exc


def _json_fields_pushed(
    body: bytes, wanted: frozenset[str], full: frozenset[str]
) -> Steps[dict[str, Any]]:
    # basic events, not ijson.parse: parse builds a dotted path per event, which costs
    # O(depth²) memory on a deeply nested body.
    found: dict[str, Any] = {}
    depth = 0
    key: str | None = None  # the top-level key whose value comes next
    builder: Any = None  # builds the value of a key in ``full``
    seen_any = False
    events = ijson.sendable_list()
    parser = ijson.basic_parse_coro(events, use_float=True)
    view = memoryview(body)
    for offset in range(0, len(body), PIECE_BYTES):
        parser.send(bytes(view[offset : offset + PIECE_BYTES]))
        for event, value in events:
            if builder is not None:
                builder.event(event, value)
                if event in ("start_map", "start_array"):
                    depth += 1
                    if depth > MAX_JSON_DEPTH:
                        raise BodyParseError("request body nests JSON too deeply to read")
                elif event in ("end_map", "end_array"):
                    depth -= 1
                if depth == 1:
                    found[key] = builder.value  # type: ignore[index]
                    builder = None
                continue
            if not seen_any:
                if event != "start_map":
                    raise BodyParseError("request body must be a JSON object")
                seen_any = True
                depth = 1
                continue
            if depth == 1 and event == "map_key":
                key = value if value in wanted else None
                continue
            if event in ("start_map", "start_array"):
                if depth == 1 and key is not None:
                    if key in full:
                        builder = ijson.ObjectBuilder()
                        builder.event(event, value)
                    else:
                        found[key] = NON_SCALAR
                depth += 1
                if depth > MAX_JSON_DEPTH:
                    raise BodyParseError("request body nests JSON too deeply to read")
            elif event in ("end_map", "end_array"):
                depth -= 1
            elif depth == 1 and key is not None:
                found[key] = value
        del events[:]
        yield
    parser.close()  # raises for a document that is not finished
    if not seen_any:
        raise BodyParseError("request body is not valid JSON: no value")
    return found


def _boundary(content_type_header: str) -> str:
    msg = Message()
    msg["Content-Type"] = content_type_header
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not 0 < len(boundary) <= 200:
        raise BodyParseError("multipart/form-data body has no usable boundary parameter")
    return boundary


def _params(disposition: bytes) -> dict[str, str]:
    text = disposition.decode("utf-8", "replace")
    out: dict[str, str] = {}
    for name, raw in _PARAM.findall(text):
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        out[name.lower()] = raw
    return out


def _decode(payload: bytes, headers: bytes) -> bytes:
    enc = _ENCODING.search(headers)
    kind = enc.group(1).lower() if enc else b""
    try:
        if kind == b"base64":
            return base64.b64decode(payload)
        if kind == b"quoted-printable":
            return quopri.decodestring(payload)
    except (binascii.Error, ValueError) as exc:
        raise BodyParseError(f"multipart field has a bad {kind.decode()} payload") from exc
    return payload


def form_fields(body: bytes, content_type_header: str, keys: Iterable[str]) -> dict[str, str]:
    """The text fields ``keys`` of a multipart body (see :func:`form_fields_steps`)."""
    return run(form_fields_steps(body, content_type_header, keys))


def form_fields_steps(
    body: bytes, content_type_header: str, keys: Iterable[str]
) -> Steps[dict[str, str]]:
    """The text fields named in ``keys`` of a ``multipart/form-data`` body (last one wins).

    File parts (those with a filename) are skipped without being copied. Raises
    :class:`BodyParseError` when the body is not multipart with the header's boundary.
    """
    wanted = frozenset(keys)
    delimiter = b"--" + _boundary(content_type_header).encode("latin-1")
    separator = b"\r\n" + delimiter
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise BodyParseError("multipart/form-data body could not be parsed: no boundary line")
    pos = start + len(delimiter)
    fields: dict[str, str] = {}
    while True:
        if body.startswith(b"--", pos):
            return fields  # the close delimiter
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise BodyParseError("multipart/form-data body is truncated")
        head_end = body.find(b"\r\n\r\n", line_end, line_end + MAX_PART_HEADER_BYTES)
        if head_end < 0:
            raise BodyParseError("multipart/form-data part has no end of headers")
        headers = body[line_end + 2 : head_end + 2]
        data_start = head_end + 4
        data_end = body.find(separator, data_start)
        if data_end < 0:
            raise BodyParseError("multipart/form-data body is truncated (no closing boundary)")
        disposition = _DISPOSITION.search(headers)
        if disposition is not None:
            params = _params(disposition.group(1))
            name = params.get("name")
            if name in wanted and "filename" not in params and "filename*" not in params:
                payload = _decode(body[data_start:data_end], headers)
                fields[name] = payload.decode("utf-8", "replace")
        pos = data_end + len(separator)
        yield
