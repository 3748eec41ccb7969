"""Request classification (docs/architecture.md): exact, fail-closed matching."""

from __future__ import annotations

import pytest

from vacancyd.adapters import llamacpp, openai
from vacancyd.core.classify import RouteClass, classify, remove_dot_segments

W, P, M, U = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT, RouteClass.UNRECOGNIZED


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/a/b/../c", "/a/c"),
        ("/a/./b", "/a/b"),
        ("/../../v1/models", "/v1/models"),
        ("/v1/models/..", "/v1/"),
        ("/v1/.", "/v1/"),
        ("/", "/"),
        ("/v1/models/..%2Fapi", "/v1/models/..%2Fapi"),
    ],
)
def test_remove_dot_segments(path: str, expected: str) -> None:
    assert remove_dot_segments(path) == expected


@pytest.mark.parametrize(
    ("method", "path", "query", "klass"),
    [
        ("POST", "/v1/chat/completions", "", W),
        ("POST", "/v1/embeddings", "", W),
        ("GET", "/v1/models", "", P),
        ("HEAD", "/v1/models", "", P),
        ("GET", "/v1/models/llama3", "", P),
        ("GET", "/v1/models/llama3%3A8b", "", P),
        ("GET", "/health", "", P),
        ("GET", "/health", "x=1", M),
        ("GET", "/metrics", "", M),
        ("GET", "/v1/chat/completions", "", U),
        ("POST", "/v1/chat/completions/", "", U),
        ("POST", "/v1//chat/completions", "", U),
        ("POST", "/V1/chat/completions", "", U),
        ("GET", "/v1/models/", "", U),
        ("DELETE", "/v1/models/x", "", U),
        ("POST", "/v1/x/../chat/completions", "", W),
        ("GET", "/v1/models/..%2F..%2Fmetrics", "", U),
        ("GET", "/v1/models/%2e%2e", "", U),
        ("GET", "/v1/%6dodels", "", U),
        ("GET", "/v1/models/a%00b", "", U),
        ("GET", "v1/models", "", U),
    ],
)
def test_openai_table(method: str, path: str, query: str, klass: RouteClass) -> None:
    assert classify(method, path, query, openai.TABLE).klass is klass


@pytest.mark.parametrize(
    ("method", "path", "klass"),
    [
        ("POST", "/completion", W),
        ("POST", "/v1/chat/completions", W),
        ("POST", "/tokenize", W),
        ("GET", "/slots", M),
        ("GET", "/%73lots", U),
        ("GET", "/props", M),
        ("POST", "/props", M),
        ("POST", "/slots/0", M),
        ("GET", "/v1/models/..%2Fslots", U),
        ("GET", "/models", P),
        ("GET", "/metrics", M),
    ],
)
def test_llamacpp_table(method: str, path: str, klass: RouteClass) -> None:
    assert classify(method, path, "", llamacpp.TABLE).klass is klass


def test_classification_returns_the_resolved_path_to_forward() -> None:
    c = classify("POST", "/v1/foo/../chat/completions", "", openai.TABLE)
    assert c.klass is W
    assert c.path == "/v1/chat/completions"
    assert c.route is not None and c.route.pattern == "/v1/chat/completions"


def test_borrower_reads_lists_pass_through_gets_only() -> None:
    reads = llamacpp.TABLE.borrower_reads()
    assert "/v1/models" in reads and "/health" in reads
    assert "/slots" not in reads and "/props" not in reads and "/metrics" not in reads


@pytest.mark.parametrize(
    ("method", "path", "klass"),
    [
        ("POST", "/v1/chat/completions", W),
        ("POST", "/tokenize", W),
        ("POST", "/v2/rerank", W),
        ("POST", "/pooling", W),
        ("GET", "/health", P),
        ("GET", "/ping", P),
        ("GET", "/version", P),
        ("GET", "/load", M),
        ("GET", "/metrics", M),
        ("POST", "/sleep", M),
        ("POST", "/wake_up", M),
        ("GET", "/is_sleeping", M),
        ("POST", "/collective_rpc", M),
        ("POST", "/v1/load_lora_adapter", U),
    ],
)
def test_vllm_table(method: str, path: str, klass: RouteClass) -> None:
    from vacancyd.adapters import vllm

    assert classify(method, path, "", vllm.TABLE).klass is klass
