"""Checkpoint formats: HF safetensors folders, GGUF files, and orbax-converted folders.

Every loader returns ``(LlamaConfig, params)`` where ``params`` is the jaxinfer params pytree
(see ``checkpoints.hf.PARAM_SHAPES``) holding numpy arrays; the caller casts and places them.
"""

from checkpoints.gguf import load_gguf
from checkpoints.hf import expected_shapes, load_hf_checkpoint
from checkpoints.orbax_io import load_converted, restore_params, save_converted, save_params

__all__ = [
    "expected_shapes",
    "load_converted",
    "load_gguf",
    "load_hf_checkpoint",
    "restore_params",
    "save_converted",
    "save_params",
]
