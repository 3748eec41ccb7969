"""Reading the few fields the gate needs from a work body, at bounded cost.

A work body may be as large as ``max_request_body_mib`` and is chosen by the borrower, so
reading it must never hold the event loop (the owner's reclaim and ``/healthz`` run there).
Three rules keep it cheap:

* Only the wanted top-level fields are kept. A JSON body larger than
  :data:`SMALL_JSON_BYTES` is fed in 4 KiB pieces to ijson's push parser (C, yajl) and only
  the values of the wanted keys are built, instead of materialising the whole document; the
  whole body is still checked to be one valid JSON object, as before.
* yajl keeps a token that spans pieces in a buffer and reads that buffer again from its
  start each time a piece arrives, so a string of n bytes fed 4 KiB at a time costs
  O(n²) (a 15 MiB base64 image took about 23 s of CPU). Strings longer than
  :data:`LONG_STRING_BYTES` therefore never reach yajl: they are found with regular
  expressions (C speed), checked here in 1 MiB slices (no control characters, valid
  escapes, valid UTF-8, as yajl would check), and replaced by a short placeholder in what
  yajl reads; a wanted value that was such a string is decoded from the body at the end.
  A number longer than that is refused (Python's own ``json`` refuses integers of more
  than 4,300 digits).
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
import codecs
import json
import quopri
import re
import time
from collections.abc import Generator, Iterable, Mapping
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
#: A JSON string longer than this (bytes, quotes included) is checked by :func:`_long_string`
#: and never fed to yajl; a number longer than this is refused.
LONG_STRING_BYTES = 64 * 1024
#: Bytes scanned or checked between pauses inside a long string.
SCAN_BYTES = 1024 * 1024
#: Deeper nesting than this is refused, as ``json.loads`` refuses it past the recursion limit.
MAX_JSON_DEPTH = 512
#: A multipart part's header block larger than this is malformed (bytes).
MAX_PART_HEADER_BYTES = 16 * 1024
#: Placeholder for a wanted key whose value is an object or array (so a caller that wants
#: a string can still say "must be a string").
NON_SCALAR: dict[str, Any] = {}

# Outside a string: runs of anything but a quote, and whole strings, possessively (no
# backtracking). Matched with an end position, it stops at the opening quote of the first
# string that does not close before that end.
_OUTSIDE = re.compile(rb'(?:[^"]++|"(?:[^"\\]++|\\.)*+")*+', re.DOTALL)
# Inside a string: everything up to its closing quote (or the end position).
_INSIDE = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
_CONTROL = re.compile(rb"[\x00-\x1f]")
_VALID_ESCAPE = re.compile(rb'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_NUMBER_BYTES = b"0123456789+-.eE"
_PLACEHOLDER = "\x00vacancyd-long-string-"

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


#: Non-ASCII letters that Go's encoding/json folds onto an ASCII one when it matches an
#: object key to a struct field (``unicode.ToUpper(unicode.ToLower(r))``): Kelvin sign,
#: long s, dotless i and capital I with dot.
_GO_ASCII_FOLDS = {"\u212a": "K", "\u017f": "S", "\u0131": "I", "\u0130": "I"}


def go_fold(name: str) -> str:
    """``name`` folded as Go's encoding/json folds object keys before it matches them to a
    struct's fields case-insensitively, as far as the result can equal an ASCII name:
    ``go_fold("Keep_Alive") == go_fold("keep_alive")``, and so for ``"\u212aeep_alive"``."""
    return "".join(_GO_ASCII_FOLDS.get(c, c) if c > "\x7f" else c.upper() for c in name)


def _check_spelling(key: str, exact: Mapping[str, str]) -> None:
    """Raise :class:`BodyParseError` when ``key`` is a different spelling of one of the keys
    in ``exact`` (their :func:`go_fold` -> the key)."""
    meant = exact.get(go_fold(key))
    if meant is not None and meant != key:
        raise BodyParseError(
            f"request body has the key {key!r}, which the server reads as {meant!r}: "
            f"send {meant!r} spelled exactly so"
        )


def json_fields(body: bytes, keys: Iterable[str], whole: Iterable[str] = ()) -> dict[str, Any]:
    """The top-level ``keys`` present in a JSON object body (see :func:`json_fields_steps`)."""
    return run(json_fields_steps(body, keys, whole))


def json_fields_steps(
    body: bytes, keys: Iterable[str], whole: Iterable[str] = (), exact: Iterable[str] = ()
) -> Steps[dict[str, Any]]:
    """The top-level ``keys`` present in a JSON object body, scalars by value.

    A wanted key whose value is an object or array maps to :data:`NON_SCALAR`, unless it is
    also in ``whole``: those values are built in full (an adapter's small option objects).
    A key given twice keeps its last value (what ``json.loads`` and the servers do). Raises
    :class:`BodyParseError` when the body is not one JSON object, and when a top-level key is
    another spelling of one in ``exact`` that Go's decoder would take for it (``"MODEL"``
    for ``model``): a server written in Go (Ollama) then reads a value the proxy did not.
    """
    full = frozenset(whole)
    wanted = frozenset(keys) | full
    spellings = {go_fold(k): k for k in exact}
    if len(body) <= SMALL_JSON_BYTES:
        try:
            payload = json.loads(body)
        except RecursionError as exc:
            raise BodyParseError("request body nests JSON too deeply to read") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise BodyParseError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise BodyParseError("request body must be a JSON object")
        if spellings:
            for name in payload:
                _check_spelling(name, spellings)
        return {
            k: NON_SCALAR if isinstance(payload[k], dict | list) and k not in full else payload[k]
            for k in wanted
            if k in payload
        }
    try:
        return (yield from _json_fields_pushed(body, wanted, full, spellings))
    except BodyParseError:
        raise
    except (ijson.JSONError, UnicodeDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise BodyParseError(f"request body is not valid JSON: {reason}") from exc


def _json_fields_pushed(
    body: bytes, wanted: frozenset[str], full: frozenset[str], spellings: Mapping[str, str]
) -> Steps[dict[str, Any]]:
    # basic events, not ijson.parse: parse builds a dotted path per event, which costs
    # O(depth²) memory on a deeply nested body.
    found: dict[str, Any] = {}
    depth = 0
    key: str | None = None  # the top-level key whose value comes next
    builder: Any = None  # builds the value of a key in ``full``
    seen_any = False
    longs: dict[str, tuple[int, int]] = {}  # placeholder -> (start, end) of the string
    events = ijson.sendable_list()
    parser = ijson.basic_parse_coro(events, use_float=True)
    for piece in _pieces(body, longs):
        if piece is None:  # a pause inside a long string: nothing for yajl yet
            yield
            continue
        parser.send(piece)
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
                if longs and value in longs:  # a key longer than LONG_STRING_BYTES
                    value = _restore(value, body, longs)
                if spellings:
                    _check_spelling(value, spellings)
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
    if longs:
        found = {k: _restore(v, body, longs) for k, v in found.items()}
    return found


def _pieces(body: bytes, longs: dict[str, tuple[int, int]]) -> Generator[bytes | None, None, None]:
    """What yajl reads: ``body`` in pieces of at most :data:`PIECE_BYTES`, each long string
    replaced by a placeholder (recorded in ``longs``); None between steps of checking a
    long string. Raises :class:`BodyParseError` for a long string that is not valid JSON
    or a number longer than :data:`LONG_STRING_BYTES`."""
    size = len(body)
    pos = 0  # the next byte yajl reads
    scan = 0  # bytes before this are classified; ``scan`` is never inside a string
    number_run = 0  # number bytes that end the pieces fed so far, outside strings
    while pos < size:
        end = min(pos + PIECE_BYTES, size)
        long_at = -1
        while scan < end:
            stop = _OUTSIDE.match(body, scan, end).end()  # type: ignore[union-attr]
            if stop >= end:
                scan = stop
                break
            close = yield from _string_end(body, stop)
            if close + 1 - stop > LONG_STRING_BYTES:
                long_at = stop
                break
            scan = close + 1  # a short string: yajl may read it in pieces
        if long_at < 0:
            piece = body[pos:end]
            if scan == end:  # ``end`` lies outside any string: a number may run across it
                tail = len(piece) - len(piece.rstrip(_NUMBER_BYTES))
                number_run = number_run + tail if tail == len(piece) else tail
                if number_run > LONG_STRING_BYTES:
                    raise BodyParseError(
                        f"request body is not valid JSON: a number longer than "
                        f"{LONG_STRING_BYTES} bytes"
                    )
            else:
                number_run = 0
            yield piece
            pos = end
            continue
        if long_at > pos:
            yield body[pos:long_at]
        close = yield from _string_end(body, long_at)
        yield from _long_string(body, long_at + 1, close)
        placeholder = f"{_PLACEHOLDER}{len(longs)}"
        longs[placeholder] = (long_at, close + 1)
        yield json.dumps(placeholder).encode()
        pos = scan = close + 1
        number_run = 0


def _string_end(body: bytes, opening: int) -> Steps[int]:
    """The index of the quote that closes the string opened at ``opening``; pauses every
    :data:`SCAN_BYTES`. Raises :class:`BodyParseError` when the body ends first."""
    size = len(body)
    at = opening + 1
    while True:
        window = min(at + SCAN_BYTES, size)
        stop = _INSIDE.match(body, at, window).end()  # type: ignore[union-attr]
        if stop < window and body[stop] == 0x22:  # '"'
            return stop
        if window == size and (stop == size or stop == size - 1):
            raise BodyParseError("request body is not valid JSON: a string is not closed")
        at = stop  # the window ended inside the string (perhaps inside an escape)
        yield


def _long_string(body: bytes, start: int, end: int) -> Steps[None]:
    """Check the content ``body[start:end]`` of a long JSON string as yajl would, one
    :data:`SCAN_BYTES` slice per step: no raw control characters, only JSON's escapes,
    valid UTF-8. Raises :class:`BodyParseError` or :class:`UnicodeDecodeError`."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    at = start
    while at < end:
        cut = min(at + SCAN_BYTES, end)
        if cut < end:
            cut = _escape_safe(body, at, cut, end)
        part = body[at:cut]
        if _CONTROL.search(part):
            raise BodyParseError("request body is not valid JSON: a control character in a string")
        if b"\\" in part and b"\\" in _VALID_ESCAPE.sub(b"", part):
            raise BodyParseError("request body is not valid JSON: a bad escape in a string")
        utf8.decode(part)
        del part
        at = cut
        yield
    utf8.decode(b"", final=True)


def _escape_safe(body: bytes, start: int, cut: int, end: int) -> int:
    """``cut``, moved back before an escape that it would split, or past it when the escape
    begins at ``start`` (which is known not to be inside one); never beyond ``end``. A JSON
    escape is at most six bytes (``\\uXXXX``)."""
    last = body.rfind(b"\\", max(start, cut - 6), cut)
    if last < 0:
        return cut
    run = last
    while run > start and body[run - 1] == 0x5C:  # count the backslashes before it
        run -= 1
    if (last - run) % 2:  # the second half of an escaped backslash: ends before ``cut``
        return cut
    length = 6 if last + 1 < len(body) and body[last + 1] == 0x75 else 2  # 'u'
    if last + length <= cut:
        return cut
    return last if last > start else min(last + length, end)


def _restore(value: Any, body: bytes, longs: dict[str, tuple[int, int]]) -> Any:
    """``value`` with every placeholder string replaced by the long string it stands for."""
    if isinstance(value, str):
        span = longs.get(value)
        return value if span is None else json.loads(body[span[0] : span[1]])
    if isinstance(value, list):
        return [_restore(v, body, longs) for v in value]
    if isinstance(value, dict) and value is not NON_SCALAR:
        return {_restore(k, body, longs): _restore(v, body, longs) for k, v in value.items()}
    return value


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
