"""jaxinfer: JAX/XLA inference for Llama-family language models.

The public names below are imported on first access (module ``__getattr__``), so importing a
core submodule (``jaxinfer.config``, ``jaxinfer.errors``, ...) from a lower layer such as
``sharding`` or ``checkpoints`` does not pull in the engine, which itself imports those
layers. ``tests/test_layering.py`` holds the layer order.

Where JAX can use a CUDA GPU, importing the package adds ``xla_flags.DEFAULTS`` to
``XLA_FLAGS`` (unless the user set them), so import it before the first JAX computation.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from jaxinfer import xla_flags

xla_flags.apply_defaults()  # before any JAX backend starts: XLA reads these flags only then

_EXPORTS = {
    "LlamaConfig": "jaxinfer.config",
    "Engine": "jaxinfer.engine",
    "DataParallelEngine": "jaxinfer.replicas",
    "CheckpointError": "jaxinfer.errors",
    "ConfigError": "jaxinfer.errors",
    "InputError": "jaxinfer.errors",
    "JaxinferError": "jaxinfer.errors",
    "RequestError": "jaxinfer.errors",
    "compute_logits": "jaxinfer.generate",
    "generate": "jaxinfer.generate",
    "score": "jaxinfer.generate",
    "score_rolling": "jaxinfer.generate",
    "stream": "jaxinfer.generate",
    "stream_tokens": "jaxinfer.generate",
    "DEFAULT_MODEL": "jaxinfer.loading",
    "convert": "jaxinfer.loading",
    "load_model": "jaxinfer.loading",
    "Completion": "jaxinfer.requests",
    "Model": "jaxinfer.requests",
    "ScoreResult": "jaxinfer.requests",
    "SamplingParams": "jaxinfer.sampling",
    "Speculative": "jaxinfer.speculative",
}

__all__ = [
    "DEFAULT_MODEL", "CheckpointError", "Completion", "ConfigError", "DataParallelEngine",
    "Engine", "InputError", "JaxinferError", "LlamaConfig", "Model", "RequestError",
    "SamplingParams", "ScoreResult", "Speculative", "compute_logits",
    "convert", "generate", "load_model", "score", "score_rolling", "stream", "stream_tokens",
]

if TYPE_CHECKING:
    from jaxinfer.config import LlamaConfig
    from jaxinfer.engine import Engine
    from jaxinfer.errors import (
        CheckpointError,
        ConfigError,
        InputError,
        JaxinferError,
        RequestError,
    )
    from jaxinfer.generate import (
        compute_logits,
        generate,
        score,
        score_rolling,
        stream,
        stream_tokens,
    )
    from jaxinfer.loading import DEFAULT_MODEL, convert, load_model
    from jaxinfer.replicas import DataParallelEngine
    from jaxinfer.requests import Completion, Model, ScoreResult
    from jaxinfer.sampling import SamplingParams
    from jaxinfer.speculative import Speculative


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """``jaxinfer.generate`` names both a submodule and the public function. Python binds a
    submodule to its package's attribute when the submodule is first imported; keep the
    attribute the function, as the eager ``from jaxinfer.generate import generate`` did (the
    module stays ``sys.modules["jaxinfer.generate"]``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            self.__dict__.pop(name, None)  # the next access resolves the public name
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
