"""The bounded work-body readers: the same answers as a full parse, at bounded cost."""

from __future__ import annotations

import json

import pytest

from vacancyd.adapters.bodyparse import (
    NON_SCALAR,
    SMALL_JSON_BYTES,
    BodyParseError,
    form_fields,
    json_fields,
)

PAD = b'"pad": "' + b"x" * (2 * SMALL_JSON_BYTES) + b'", '


@pytest.mark.parametrize("pad", [b"", PAD], ids=["small", "large"])
def test_json_fields_agree_with_json_loads(pad: bytes) -> None:
    body = b'{"a": 1, ' + pad + b'"model": "m1", "x": {"model": "nested"}, "model": "m2"}'
    assert json_fields(body, ["model", "a", "absent"]) == {"model": "m2", "a": 1}
    assert json.loads(body)["model"] == "m2"
    obj = b'{"model": {"k": [1]}, ' + pad + b'"background": true}'
    assert json_fields(obj, ["model", "background"]) == {"model": NON_SCALAR, "background": True}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" + b"1, " * SMALL_JSON_BYTES + b"1]", "must be a JSON object"),
        (b'{"model": "m", ' + PAD[:-2], "not valid JSON"),
        (b'{"a": 1}' + b" " * SMALL_JSON_BYTES + b"{}", "not valid JSON"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
        (b"[" * 100_000 + b"]" * 100_000, "must be a JSON object"),
    ],
)
def test_json_fields_refuse_what_is_not_one_object(body: bytes, why: str) -> None:
    with pytest.raises(BodyParseError, match=why):
        json_fields(body, ["model"])


def test_form_fields_read_text_fields_and_skip_files() -> None:
    body = (
        b"preamble\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="file"; filename="model"\r\n'
        b"Content-Type: audio/wav\r\n\r\nRIFF\r\n--XyZ\r\n--not-a-boundary\r\n"
        b'Content-Disposition: form-data; name="model"\r\n\r\nfirst\r\n'
        b"--XyZ\r\n"
        b'Content-Disposition: form-data; name="model"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\nbGFzdA==\r\n"
        b'--XyZ\r\nContent-Disposition: form-data; name="empty"\r\n\r\n\r\n'
        b"--XyZ--\r\n"
    )
    ctype = 'multipart/form-data; boundary="XyZ"'
    assert form_fields(body, ctype, ["model", "empty", "file"]) == {"model": "last", "empty": ""}


@pytest.mark.parametrize(
    ("body", "ctype", "why"),
    [
        (b"--a\r\n\r\nx\r\n--a--", "multipart/form-data", "no usable boundary"),
        (b"no boundary at all", "multipart/form-data; boundary=a", "no boundary line"),
        (
            b'--a\r\nContent-Disposition: form-data; name="m"\r\n\r\nx',
            "multipart/form-data; boundary=a",
            "truncated",
        ),
        (b"--a\r\n" + b"H: v\r\n" * 5000, "multipart/form-data; boundary=a", "end of headers"),
    ],
)
def test_form_fields_refuse_malformed_bodies(body: bytes, ctype: str, why: str) -> None:
    with pytest.raises(BodyParseError, match=why):
        form_fields(body, ctype, ["m"])


@pytest.mark.parametrize("pad", [b"", PAD], ids=["small", "large"])
def test_whole_fields_are_built_in_full(pad: bytes) -> None:
    body = (
        b'{"options": {"num_ctx": 8192, "stop": ["a", {"b": null}]}, '
        + pad
        + b'"shift": false, "model": "m", "messages": [{"role": "user"}]}'
    )
    got = json_fields(body, ["model", "messages"], ["options", "shift"])
    assert got == {
        "model": "m",
        "messages": NON_SCALAR,
        "options": {"num_ctx": 8192, "stop": ["a", {"b": None}]},
        "shift": False,
    }


# Strings longer than LONG_STRING_BYTES are checked by vacancyd and never fed to yajl (which
# re-reads a token that spans pieces from its start on every piece: O(n²) for long strings).
# With the thresholds shrunk, every boundary case (an escape cut by a slice, a string
# cut by a piece) comes up in small bodies, and the answers must still be json.loads's.
_STRINGS = [
    "plain",
    'quote " and \\ backslash',
    "\\\\\\",
    "é ü 漢字 🎉 \u2028",
    "\n\t\r\b\f/",
    "😀 pair (escaped, a surrogate pair)",
    "x" * 70,
    "\\" * 33 + '"' * 5,
]


@pytest.fixture
def tiny_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    from vacancyd.adapters import bodyparse

    monkeypatch.setattr(bodyparse, "SMALL_JSON_BYTES", 0)
    monkeypatch.setattr(bodyparse, "PIECE_BYTES", 5)
    monkeypatch.setattr(bodyparse, "LONG_STRING_BYTES", 12)
    monkeypatch.setattr(bodyparse, "SCAN_BYTES", 3)


@pytest.mark.usefixtures("tiny_thresholds")
@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "raw"])
def test_long_strings_read_exactly_as_json_loads_reads_them(ascii_only: bool) -> None:
    for i, text in enumerate(_STRINGS):
        doc = {
            "pad": text,
            text: 1,
            "model": text,
            "options": {"stop": [text, {"k": text}], text: text},
            "n": [1.5e3, -2, text],
        }
        body = json.dumps(doc, ensure_ascii=ascii_only).encode()
        want = json.loads(body)
        key = json.loads(json.dumps(text))  # an escaped surrogate pair reads as one character
        got = json_fields(body, ["model", "n", key], ["options"])
        assert got == {"model": want["model"], "n": NON_SCALAR, "options": want["options"], key: 1}
        assert want[key] == 1, i


@pytest.mark.usefixtures("tiny_thresholds")
@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"a": "' + b"x" * 40 + b'\x01"}', "control character"),
        (b'{"a": "' + b"x" * 40 + b'\\x"}', "bad escape"),
        (b'{"a": "' + b"x" * 40 + b'\\u12g4"}', "bad escape"),
        (b'{"a": "' + b"x" * 40 + b'\xff\xfe"}', "utf-8"),
        (b'{"a": "' + b"x" * 40 + b"\xe6\xbc", "not closed"),
        (b'{"a": "' + b"x" * 40 + b'\\"}', "not closed"),
        (b'{"a": ' + b"1" * 40 + b"}", "number longer"),
        (b'{"a": "' + b"x" * 40 + b'" "b"}', "not valid JSON"),
    ],
)
def test_long_strings_that_are_not_valid_json_are_refused(body: bytes, why: str) -> None:
    with pytest.raises(BodyParseError, match=why):
        json_fields(body, ["a"])


def test_a_long_string_never_reaches_yajl() -> None:
    from vacancyd.adapters.bodyparse import LONG_STRING_BYTES, PIECE_BYTES, _pieces

    image = b"QUJD" * (LONG_STRING_BYTES // 2)
    body = b'{"model": "m", "images": ["' + image + b'"], "stream": true}'
    longs: dict[str, tuple[int, int]] = {}
    fed = [p for p in _pieces(body, longs) if p is not None]
    assert all(len(p) <= PIECE_BYTES for p in fed)
    assert sum(map(len, fed)) < len(body) - len(image) + 100
    assert [body[a + 1 : b - 1] for a, b in longs.values()] == [image]
    assert json_fields(body, ["model", "stream"]) == {"model": "m", "stream": True}
