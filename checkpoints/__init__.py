"""Checkpoint formats: HF safetensors folders, GGUF files, and orbax-converted folders.

Every loader returns ``(LlamaConfig, params)`` where ``params`` is the jaxinfer params pytree
(see ``jaxinfer.model.param_shapes``) holding numpy arrays; the caller casts and places them.
"""

from checkpoints.gguf import load_gguf
from checkpoints.hf import load_hf_checkpoint
from checkpoints.orbax_io import load_converted, restore_params, save_converted, save_params

__all__ = [
    "load_converted",
    "load_gguf",
    "load_hf_checkpoint",
    "restore_params",
    "save_converted",
    "save_params",
]
