"""Tiny random Llama models (no HF download) for the multi-device tests and local demos.

``write_tiny_model`` writes a converted folder (orbax params + config + a byte-level
tokenizer with a chat template) that ``jaxinfer.load_model`` and ``scripts/batch_eval.py``
accept, so sharded loading, generation and batch evaluation are exercised end to end on CPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.config import LlamaConfig
from jaxinfer.params import param_shapes

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "<|assistant|>")
BOS_ID, EOS_ID = 256, 257  # after the 256 byte tokens


def tiny_config(num_heads: int = 8, num_kv_heads: int = 2, **overrides: Any) -> LlamaConfig:
    """A 2-layer GQA config (hidden 64, head_dim 8, vocab 264) small enough to compile fast."""
    fields: dict[str, Any] = dict(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64 // num_heads,
        max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_params(config: LlamaConfig, seed: int = 0) -> dict[str, Any]:
    """Random float32 numpy params (numpy RNG: no JAX compilation), scaled like ``init_params``."""
    rng = np.random.default_rng(seed)

    def leaf(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
        noise = rng.standard_normal(shape).astype(np.float32)
        if "norm" in path[-1]:
            return 1.0 + 0.1 * noise
        return noise / np.float32(math.sqrt(shape[-2]))

    def build(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        return {k: build(v, (*path, k)) if isinstance(v, dict) else leaf((*path, k), v)
                for k, v in tree.items()}

    return build(param_shapes(config), ())


def byte_tokenizer() -> Any:
    """A ``jaxinfer.tokenizer.Tokenizer`` over the 256 bytes plus ``<s>``/``</s>``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from jaxinfer.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_id=BOS_ID, eos_ids=[EOS_ID], chat_template=CHAT_TEMPLATE,
                     add_bos=True)


def write_tiny_model(directory: str | Path, config: LlamaConfig | None = None, seed: int = 0
                     ) -> Path:
    """Write a converted model folder with random weights; returns its path."""
    from checkpoints.orbax_io import save_converted

    config = config or tiny_config()
    return save_converted(directory, config, tiny_params(config, seed), byte_tokenizer(),
                          overwrite=True)
