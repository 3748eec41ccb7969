"""Reading vacancyd's own error bodies in either of their shapes (vacancyd.core.refusal)."""

from __future__ import annotations

from typing import Any


def error_fields(payload: Any) -> dict[str, Any]:
    """The fields of a vacancyd error body, ``message`` included, whichever shape it has:
    the OpenAI envelope ``{"error": {"message", "code", ...}}`` or the flat native one
    ``{"error": "<sentence>", "code", ...}`` (Ollama's ``/api/`` routes). Raises
    AssertionError for anything else."""
    assert isinstance(payload, dict) and "error" in payload, payload
    error = payload["error"]
    if isinstance(error, dict):
        return error
    assert isinstance(error, str), payload
    return {**payload, "message": error}
