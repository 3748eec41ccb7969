"""Token counts a server reports for one borrowed exchange, read from the end of its reply.

Every server kind vacancyd fronts says how many tokens a request used, each in its own
words, and always at the end of the reply:

* OpenAI-compatible servers (vLLM, llama-server's ``/v1`` routes, Ollama's ``/v1`` routes,
  LiteLLM): a ``usage`` object ``{"prompt_tokens", "completion_tokens", ...}`` in the JSON
  reply, or in the last streamed chunk when the borrower asked for
  ``stream_options: {"include_usage": true}`` (earlier chunks carry ``"usage": null``).
  The Responses API names them ``input_tokens``/``output_tokens``, in its final
  ``response.completed`` event.
* Ollama's native routes: ``prompt_eval_count`` and ``eval_count`` in the reply, or in the
  last NDJSON line (``"done": true``) of a stream.
* llama-server: a ``timings`` object (``prompt_n``, ``predicted_n``) in the reply or the
  final streamed chunk; its native ``/completion`` also says ``tokens_evaluated`` and
  ``tokens_predicted``.

The proxy must not parse every streamed chunk to learn this (that would cost the borrower
latency on every token), so :class:`UsageTap` keeps only the last :data:`TAIL_BYTES` of the
reply body, and :func:`read_usage` looks for the newest of these fields in that tail when the
exchange ends. Generated text cannot fake a field: inside a JSON string every quote is
escaped, and a match preceded by a backslash is ignored. A compressed reply
(``Content-Encoding``) is not read at all: its tokens are unknown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: Bytes of the reply's end kept per exchange: the final chunk or NDJSON line with the
#: counts is a few hundred bytes; this leaves room for a long last message before it.
TAIL_BYTES = 64 * 1024

_DECODER = json.JSONDecoder()
#: ``"name":`` not preceded by a backslash (which would put it inside a JSON string).
_USAGE = re.compile(rb'(?<!\\)"usage"\s*:\s*(?=\{)')
_TIMINGS = re.compile(rb'(?<!\\)"timings"\s*:\s*(?=\{)')
_COUNT = re.compile(
    rb'(?<!\\)"(prompt_eval_count|eval_count|tokens_evaluated|tokens_predicted)"\s*:\s*(\d{1,12})'
)


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Tokens one exchange used, as its server reported them (None: not reported)."""

    prompt: int | None
    completion: int | None


class UsageTap:
    """The last :data:`TAIL_BYTES` of one reply body, fed chunk by chunk as it is forwarded.

    ``feed`` costs one copy of the chunk; nothing is parsed until :meth:`usage`.
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        """Keep ``chunk`` as the newest part of the reply."""
        tail = self._tail
        tail += chunk
        if len(tail) > 2 * TAIL_BYTES:
            del tail[: len(tail) - TAIL_BYTES]

    def usage(self) -> TokenUsage | None:
        """What the reply said about its tokens (see :func:`read_usage`)."""
        return read_usage(bytes(self._tail[-TAIL_BYTES:]))


def read_usage(tail: bytes) -> TokenUsage | None:
    """The newest token counts in the end of a reply body, or None when it names none.

    ``tail`` is the whole body or its last bytes (a JSON document, SSE ``data:`` lines or
    NDJSON lines; a cut at the front is fine). An OpenAI ``usage`` object wins over
    Ollama's counts, which win over llama-server's ``timings``; within each, the last one in
    the body wins. Never raises on malformed input: what cannot be read is not counted.
    """
    found = _last_object(_USAGE, tail)
    if found is not None:
        prompt = _count(found, "prompt_tokens", "input_tokens")
        completion = _count(found, "completion_tokens", "output_tokens")
        if prompt is not None or completion is not None:
            return TokenUsage(prompt, completion)
    counts: dict[bytes, int] = {}
    for match in _COUNT.finditer(tail):
        counts[match.group(1)] = int(match.group(2))
    if b"eval_count" in counts or b"prompt_eval_count" in counts:
        return TokenUsage(counts.get(b"prompt_eval_count"), counts.get(b"eval_count"))
    timings = _last_object(_TIMINGS, tail)
    if timings is not None:
        prompt = _count(timings, "prompt_n")
        completion = _count(timings, "predicted_n")
        if prompt is not None or completion is not None:
            return TokenUsage(prompt, completion)
    if b"tokens_evaluated" in counts or b"tokens_predicted" in counts:
        return TokenUsage(counts.get(b"tokens_evaluated"), counts.get(b"tokens_predicted"))
    return None


def _last_object(pattern: re.Pattern[bytes], tail: bytes) -> dict[str, object] | None:
    """The last JSON object in ``tail`` named by ``pattern`` that parses (null ones skipped)."""
    starts = [m.end() for m in pattern.finditer(tail)]
    for start in reversed(starts):
        try:
            value, _ = _DECODER.raw_decode(tail[start:].decode("utf-8", "replace"))
        except ValueError:
            continue
        if isinstance(value, dict) and value:
            return value
    return None


def _count(obj: dict[str, object], *names: str) -> int | None:
    """The first of ``names`` in ``obj`` that holds a non-negative integer."""
    for name in names:
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
