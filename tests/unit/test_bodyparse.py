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
