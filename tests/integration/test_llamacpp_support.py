"""The llama.cpp test harness itself: a real ``llama-server`` serving a tiny random model.

The ``llama`` tests need the binary from ``tools/build-llama-server.sh``; they skip
without it (fail with ``VACANCYD_REQUIRE_TOOLS=1``). The other tests here cover the
harness helpers and run everywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import gguf
import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.llamacpp import (
    BINARY_ENV,
    MODEL_ALIAS,
    REQUIRE_TOOLS_ENV,
    VOCAB_ENV,
    LlamaServer,
    require_llama_server,
    running_llama_server,
)
from tests.support.tiny_gguf import TinyLlamaConfig, write_tiny_model

MAX_TOKENS = 8
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, written once per session (reading the vocab takes seconds)."""
    _, vocab = require_llama_server()
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny.gguf", vocab)


@pytest.fixture
async def llama(tmp_path: Path, tiny_model: Path) -> AsyncIterator[LlamaServer]:
    async with running_llama_server(tmp_path, model=tiny_model) as server:
        yield server


@pytest.fixture
async def openai_client(llama: LlamaServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{llama.base_url}/v1", api_key="x") as client:
        yield client


@pytest.mark.llama
async def test_models_lists_alias(llama: LlamaServer) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{llama.base_url}/v1/models") as resp,
    ):
        assert resp.status == 200
        body = await resp.json()
    ids = [m["id"] for m in body["data"]]
    assert MODEL_ALIAS in ids, (ids, llama.log_tail())


@pytest.mark.llama
async def test_chat_completion(openai_client: AsyncOpenAI, llama: LlamaServer) -> None:
    completion = await openai_client.chat.completions.create(
        model=MODEL_ALIAS, messages=PROMPT, max_tokens=MAX_TOKENS
    )
    assert completion.choices, llama.log_tail()
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= MAX_TOKENS


@pytest.mark.llama
async def test_chat_completion_stream(openai_client: AsyncOpenAI, llama: LlamaServer) -> None:
    stream = await openai_client.chat.completions.create(
        model=MODEL_ALIAS,
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) > 1, llama.log_tail()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] in ("length", "stop")


@pytest.mark.llama
async def test_server_writes_model_and_stops_on_exit(tmp_path: Path) -> None:
    async with running_llama_server(tmp_path) as server:
        process = server.process
        assert process.returncode is None
        assert server.model_path.parent == tmp_path
        assert server.model_path.stat().st_size < 8 * 2**20
    assert process.returncode is not None


def _write_vocab(path: Path, tokens: list[str]) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    try:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([int(gguf.TokenType.NORMAL)] * len(tokens))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def test_tiny_model_copies_tokenizer_and_is_deterministic(tmp_path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e"]
    vocab = _write_vocab(tmp_path / "vocab.gguf", tokens)
    cfg = TinyLlamaConfig()
    first = write_tiny_model(tmp_path / "one.gguf", vocab, cfg)
    second = write_tiny_model(tmp_path / "two.gguf", vocab, cfg)
    assert first.read_bytes() == second.read_bytes()

    reader = gguf.GGUFReader(first)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert reader.fields["llama.block_count"].contents() == cfg.n_layer
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    assert list(embd.shape) == [cfg.n_embd, len(tokens)]
    assert np.isfinite(np.asarray(embd.data, dtype=np.float32)).all()
    assert len(tensors) == 2 + 9 * cfg.n_layer


def test_require_skips_or_fails_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-such-llama-server"))
    monkeypatch.delenv(VOCAB_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_TOOLS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"tools/build-llama-server\.sh"):
        require_llama_server()
    monkeypatch.setenv(REQUIRE_TOOLS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_TOOLS_ENV):
        require_llama_server()
