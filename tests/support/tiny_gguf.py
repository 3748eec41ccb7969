"""Write a tiny random-weight llama-architecture GGUF model for tests.

The model is useless as a language model (its weights are random) but it is a
well-formed ``llama`` model that a real ``llama-server`` loads and serves, so the
OpenAI-compatible HTTP surface can be exercised end to end in about a second.

Its tokenizer is copied from a *vocab-only* GGUF (llama.cpp ships several under
``models/``; ``tools/build-llama-server.sh`` caches ``ggml-vocab-llama-spm.gguf``,
a 32000-token SentencePiece vocabulary). With the default sizes the file is about
4.8 MiB, nearly all of it the f16 token-embedding table (vocab x n_embd). Reading that
vocab takes a few seconds of CPU, so it is parsed once per process and memoised.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

ARCH = "llama"


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Hyperparameters of the tiny model (sizes are element counts, not bytes)."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    n_ctx_train: int = 512
    """Training context length, in tokens (servers may use less via ``-c``)."""
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    seed: int = 1234
    """Seed for the weights: the same config and vocab always give the same bytes."""
    init_std: float = 0.02
    """Standard deviation of the normally distributed matrix weights."""


_TokenizerKV = tuple[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]


@functools.lru_cache(maxsize=4)
def _read_tokenizer(vocab_gguf: Path, mtime_ns: int, size: int) -> _TokenizerKV:
    """Every ``tokenizer.*`` key of a vocab GGUF as ``(name, value, type, array sub-type)``.

    Parsing a 32000-token vocab with :class:`gguf.GGUFReader` takes seconds, so the result
    is memoised per process; ``mtime_ns`` and ``size`` are only part of the cache key.
    """
    reader = gguf.GGUFReader(vocab_gguf)
    out: list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        out.append((name, field.contents(), main_type, sub_type))
    return tuple(out)


def _copy_tokenizer(vocab_gguf: Path, writer: gguf.GGUFWriter) -> int:
    """Copy every ``tokenizer.*`` key of ``vocab_gguf`` to ``writer``; return the vocab size."""
    stat = vocab_gguf.stat()
    n_vocab = 0
    for name, value, main_type, sub_type in _read_tokenizer(
        vocab_gguf.resolve(), stat.st_mtime_ns, stat.st_size
    ):
        writer.add_key_value(name, value, main_type, sub_type=sub_type)
        if name == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(value)
    if n_vocab == 0:
        raise ValueError(f"{vocab_gguf} has no {gguf.Keys.Tokenizer.LIST} array")
    return n_vocab


def write_tiny_model(path: Path, vocab_gguf: Path, config: TinyLlamaConfig | None = None) -> Path:
    """Write a tiny random-weight llama model to ``path`` and return ``path``.

    ``vocab_gguf`` is a vocab-only GGUF file whose ``tokenizer.*`` metadata (tokens,
    scores, token types, special token ids, chat template if any) is copied verbatim.
    Matrices are f16, norm weights f32 (all ones). Output is deterministic for a given
    ``config.seed`` and vocab file.
    """
    cfg = config or TinyLlamaConfig()
    if cfg.n_embd % cfg.n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    head_dim = cfg.n_embd // cfg.n_head
    kv_dim = head_dim * cfg.n_head_kv

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, ARCH)
    try:
        writer.add_name("vacancyd-tiny-random")
        n_vocab = _copy_tokenizer(vocab_gguf, writer)
        writer.add_vocab_size(n_vocab)
        writer.add_context_length(cfg.n_ctx_train)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_ff)
        writer.add_head_count(cfg.n_head)
        writer.add_head_count_kv(cfg.n_head_kv)
        writer.add_layer_norm_rms_eps(cfg.rms_eps)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(cfg.rope_freq_base)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

        rng = np.random.default_rng(cfg.seed)

        def matrix(rows: int, cols: int) -> npt.NDArray[np.float16]:
            # numpy shape is (rows, cols) = (out, in); GGUF stores it reversed (ne0 = in).
            weights = rng.normal(0.0, cfg.init_std, size=(rows, cols))
            return weights.astype(np.float16)

        def ones(n: int) -> npt.NDArray[np.float32]:
            return np.ones(n, dtype=np.float32)

        # No output.weight: llama.cpp then ties the LM head to token_embd.
        writer.add_tensor("token_embd.weight", matrix(n_vocab, cfg.n_embd))
        writer.add_tensor("output_norm.weight", ones(cfg.n_embd))
        for i in range(cfg.n_layer):
            blk = f"blk.{i}"
            writer.add_tensor(f"{blk}.attn_norm.weight", ones(cfg.n_embd))
            writer.add_tensor(f"{blk}.attn_q.weight", matrix(cfg.n_embd, cfg.n_embd))
            writer.add_tensor(f"{blk}.attn_k.weight", matrix(kv_dim, cfg.n_embd))
            writer.add_tensor(f"{blk}.attn_v.weight", matrix(kv_dim, cfg.n_embd))
            writer.add_tensor(f"{blk}.attn_output.weight", matrix(cfg.n_embd, cfg.n_embd))
            writer.add_tensor(f"{blk}.ffn_norm.weight", ones(cfg.n_embd))
            writer.add_tensor(f"{blk}.ffn_gate.weight", matrix(cfg.n_ff, cfg.n_embd))
            writer.add_tensor(f"{blk}.ffn_up.weight", matrix(cfg.n_ff, cfg.n_embd))
            writer.add_tensor(f"{blk}.ffn_down.weight", matrix(cfg.n_embd, cfg.n_ff))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
