"""Preallocated ragged KV cache: fixed buffers per layer plus one length per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import LlamaConfig


@struct.dataclass
class KVCache:
    """K/V buffers for every layer and batch slot, and how many positions each sequence holds.

    Layout ``[layers, batch, kv_heads, max_len, head_dim]``: kv_heads sits before the sequence
    axis so decode attention reads each (sequence, kv head) slab contiguously with no transpose
    (see ``jaxinfer.attention``). Positions at or past ``lengths[b]`` hold stale values that
    attention masks out; nothing is ever padded on the left.
    """

    k: jax.Array  # [L, B, KVH, S, D]
    v: jax.Array  # [L, B, KVH, S, D]
    lengths: jax.Array  # [B] int32, valid positions per sequence

    @property
    def batch_size(self) -> int:
        """Number of sequence slots."""
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Positions per sequence slot."""
        return self.k.shape[3]

    @classmethod
    def create(cls, config: LlamaConfig, batch_size: int, max_len: int,
               dtype: jnp.dtype = jnp.bfloat16) -> KVCache:
        """Allocate an empty cache (all lengths zero)."""
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

    @staticmethod
    def bytes_for(config: LlamaConfig, batch_size: int, max_len: int,
                  dtype: jnp.dtype = jnp.bfloat16) -> int:
        """Device bytes a cache of this size takes (K and V)."""
        per = config.num_layers * batch_size * config.num_kv_heads * max_len * config.head_dim
        return 2 * per * jnp.dtype(dtype).itemsize
