"""Architecture presets of public Llama-family models, by name (shapes only, no weights).

Used by the roofline planner (``jaxinfer plan``) and the benchmark harness (``jaxinfer
bench``, random weights of these exact shapes). Values are copied from each model's
published ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_HF_CONFIGS: dict[str, dict[str, object]] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE_8K, "factor": 32.0},
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE_8K,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE_8K,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096),
    "llama-2-13b": dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, rms_norm_eps=1e-5,
        max_position_embeddings=4096),
    "smollm2-135m-instruct": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2),
}

PRESETS: tuple[str, ...] = tuple(_HF_CONFIGS)


def preset_config(name: str) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset name (see ``PRESETS``)."""
    key = name.lower()
    if key not in _HF_CONFIGS:
        raise InputError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return LlamaConfig.from_hf_dict({"model_type": "llama", **_HF_CONFIGS[key]})


def resolve_config(name_or_path: str) -> LlamaConfig:
    """A preset name, a ``config.json`` path, or a folder holding one, to a ``LlamaConfig``."""
    if name_or_path.lower() in _HF_CONFIGS:
        return preset_config(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(f"{name_or_path!r} is neither a model preset ({', '.join(PRESETS)}) "
                         "nor a config.json path")
    return LlamaConfig.from_json_file(path)
