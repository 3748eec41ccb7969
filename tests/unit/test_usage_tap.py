"""Token counts read from the end of a reply, in each server's own words."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.adapters.usage import TAIL_BYTES, TokenUsage, UsageTap, read_usage


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_openai_reply_usage() -> None:
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": 3,
                "total_tokens": 15,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    ).encode()
    assert read_usage(body) == TokenUsage(12, 3)


def test_openai_stream_with_include_usage_takes_the_last_chunk() -> None:
    body = sse(
        {"choices": [{"delta": {"content": "a"}}], "usage": None},
        {"choices": [{"delta": {"content": "b"}}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
    )
    assert read_usage(body) == TokenUsage(7, 2)


def test_stream_without_usage_reports_none() -> None:
    body = sse({"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {}}]})
    assert read_usage(body) is None


def test_responses_api_final_event() -> None:
    body = (
        b"event: response.output_text.delta\n"
        + b'data: {"type":"response.output_text.delta","delta":"x"}\n\n'
        + b"event: response.completed\n"
        + b"data: "
        + json.dumps(
            {
                "type": "response.completed",
                "response": {"usage": {"input_tokens": 30, "output_tokens": 9}},
            }
        ).encode()
        + b"\n\n"
    )
    assert read_usage(body) == TokenUsage(30, 9)


def test_ollama_native_stream_last_line() -> None:
    lines = [
        {"model": "m", "response": "He", "done": False},
        {"model": "m", "response": "llo", "done": False},
        {
            "model": "m",
            "response": "",
            "done": True,
            "total_duration": 10,
            "prompt_eval_count": 26,
            "eval_count": 298,
        },
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    assert read_usage(body) == TokenUsage(26, 298)


def test_ollama_cached_prompt_has_no_prompt_count() -> None:
    body = json.dumps({"done": True, "eval_count": 4}).encode()
    assert read_usage(body) == TokenUsage(None, 4)


def test_llama_server_timings() -> None:
    body = sse(
        {"choices": [{"delta": {"content": "x"}}]},
        {
            "choices": [{"delta": {}, "finish_reason": "stop"}],
            "timings": {"prompt_n": 5, "prompt_ms": 1.5, "predicted_n": 11, "predicted_ms": 9.0},
        },
    )
    assert read_usage(body) == TokenUsage(5, 11)


def test_llama_server_native_completion_counts() -> None:
    body = json.dumps(
        {"content": "x", "stop": True, "tokens_evaluated": 8, "tokens_predicted": 16}
    ).encode()
    assert read_usage(body) == TokenUsage(8, 16)


def test_usage_object_wins_over_timings() -> None:
    body = json.dumps(
        {
            "timings": {"prompt_n": 1, "predicted_n": 1},
            "usage": {"prompt_tokens": 40, "completion_tokens": 50},
        }
    ).encode()
    assert read_usage(body) == TokenUsage(40, 50)


def test_generated_text_cannot_fake_the_counts() -> None:
    fake = '"usage": {"prompt_tokens": 999999, "completion_tokens": 999999}, "eval_count": 7'
    body = sse({"choices": [{"delta": {"content": fake}}]})
    assert read_usage(body) is None
    ndjson = json.dumps({"response": fake, "done": False}).encode() + b"\n"
    assert read_usage(ndjson) is None


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json at all",
        b'{"usage": {"prompt_tokens": "many", "completion_tokens": -1}}',
        b'{"usage": {',  # cut before it closes
        b'{"usage": [1, 2]}',
        b'{"eval_count": true}',
        b"\xff\xfe" * 100,
    ],
)
def test_malformed_replies_count_nothing(body: bytes) -> None:
    assert read_usage(body) is None


def test_tap_keeps_only_the_tail() -> None:
    tap = UsageTap()
    for _ in range(200):
        tap.feed(b"data: " + b"x" * 1000 + b"\n\n")
    tap.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n')
    assert tap.usage() == TokenUsage(3, 4)
    assert len(tap._tail) <= 2 * TAIL_BYTES


def test_tap_reads_counts_split_across_chunks() -> None:
    body = json.dumps({"done": True, "prompt_eval_count": 12, "eval_count": 34}).encode()
    tap = UsageTap()
    for i in range(0, len(body), 5):
        tap.feed(body[i : i + 5])
    assert tap.usage() == TokenUsage(12, 34)


@given(st.binary(max_size=2048))
def test_never_raises_on_any_bytes(body: bytes) -> None:
    result = read_usage(body)
    assert result is None or isinstance(result, TokenUsage)
