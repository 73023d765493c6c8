"""The one model configuration type, read from an HF ``config.json`` dict or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError

# Fields we read, fields that are harmless metadata, and fields whose non-default value would
# change the computation in a way this implementation does not support.
_KNOWN_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "hidden_act", "model_type", "attention_bias", "mlp_bias", "sliding_window",
    "pretraining_tp", "rope_parameters",
}
_IGNORED_FIELDS = {
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "_name_or_path", "is_llama_config",
    "rope_interleaved", "max_window_layers", "use_sliding_window", "transformers.js_config",
    "output_attentions", "output_hidden_states", "return_dict", "auto_map", "quantization_config",
    "_attn_implementation_autoset", "torchscript", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder", "add_cross_attention",
    "num_beams", "bad_words_ids", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "finetuning_task", "prefix", "tokenizer_class", "layer_types",
}
_SUPPORTED_MODEL_TYPES = {"llama", "mistral"}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder. Hashable, so it can be a static jit argument.

    ``rope_scaling`` is ``None`` or a tuple of sorted ``(key, value)`` pairs of a ``llama3``
    scaling dict (kept as a tuple to stay hashable).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix the config"
            )

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one K/V head (1 for MHA, >1 for GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """``rope_scaling`` as a dict, or None."""
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = d * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from an HF ``config.json`` dict; unsupported settings raise ``ConfigError``."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; jaxinfer runs Llama-architecture "
                f"models ({', '.join(sorted(_SUPPORTED_MODEL_TYPES))})"
            )
        unknown = sorted(k for k in cfg if k not in _KNOWN_FIELDS | _IGNORED_FIELDS)
        if unknown:
            raise ConfigError(
                f"config field {unknown[0]!r} is not understood by jaxinfer; remove it if it is "
                "metadata, otherwise this model is not supported"
            )
        if cfg.get("sliding_window") not in (None, 0):
            raise ConfigError(
                f"config field 'sliding_window'={cfg['sliding_window']} is not supported "
                "(only full attention); set it to null if the model never uses it"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ConfigError(f"config field {flag!r}=true is not supported (no bias terms)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field 'hidden_act'={cfg['hidden_act']!r} is not supported "
                              "(only 'silu')")
        if cfg.get("pretraining_tp", 1) != 1:
            raise ConfigError("config field 'pretraining_tp' must be 1")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if name not in cfg:
                raise ConfigError(f"config is missing required field {name!r}")

        rope_scaling, rope_theta = _parse_rope(cfg)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None
                                                                      else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> LlamaConfig:
        """Read an HF ``config.json``."""
        try:
            cfg = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read model config {path}: {e}") from None
        return cls.from_hf_dict(cfg)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form of this config (round-trips through ``from_hf_dict``)."""
        return {
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }


def _parse_rope(cfg: dict[str, Any]) -> tuple[tuple[tuple[str, Any], ...] | None, float]:
    """Return (hashable llama3 scaling or None, rope_theta), rejecting what we cannot compute."""
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    # transformers >= 5 may write the same information as ``rope_parameters``.
    params = cfg.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", theta))
        if params.get("rope_type", "default") != "default":
            scaling = params
    if not scaling:
        return None, theta
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None, theta
    if kind != "llama3":
        raise ConfigError(
            f"config field 'rope_scaling' has type {kind!r}; only 'llama3' scaling is supported"
        )
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ConfigError(f"config field 'rope_scaling' (llama3) is missing {missing[0]!r}")
    return tuple(sorted((k, float(scaling[k])) for k in needed)) + (("rope_type", "llama3"),), theta
