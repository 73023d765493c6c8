"""jaxinfer: JAX/XLA inference for Llama-family language models."""

from jaxinfer.config import LlamaConfig
from jaxinfer.engine import Engine
from jaxinfer.errors import CheckpointError, ConfigError, InputError, JaxinferError
from jaxinfer.generate import compute_logits, generate, score, score_rolling, stream, stream_tokens
from jaxinfer.loading import DEFAULT_MODEL, convert, load_model
from jaxinfer.requests import Completion, Model, ScoreResult
from jaxinfer.sampling import SamplingParams

__all__ = [
    "DEFAULT_MODEL", "CheckpointError", "Completion", "ConfigError", "Engine", "InputError",
    "JaxinferError", "LlamaConfig", "Model", "SamplingParams", "compute_logits", "convert",
    "ScoreResult", "generate", "load_model", "score", "score_rolling", "stream",
    "stream_tokens",
]
