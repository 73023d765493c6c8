"""The parameter pytree of a Llama model: its stored layout and random initialisation.

A core module (no model code): checkpoints and the sharding rules need the shapes, and the
model (``jaxinfer.model``, which documents the layout) runs them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import LlamaConfig

Params = dict[str, Any]


def param_shapes(config: LlamaConfig) -> Params:
    """The expected shape of every parameter, as a pytree of tuples."""
    c = config
    n, d, f = c.num_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: Params = {
        "embed": (c.vocab_size, d),
        "layers": {
            "attn_norm": (n, d), "wq": (n, d, q), "wk": (n, d, kv), "wv": (n, d, kv),
            "wo": (n, q, d), "mlp_norm": (n, d),
            "w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d),
        },
        "final_norm": (d,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (d, c.vocab_size)
    return shapes


def init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> Params:
    """Random parameters of the right shapes for tests and benchmarks (never all zeros).

    Matrices are scaled by 1/sqrt(fan_in) and norm weights drawn near 1, so activations stay
    in a realistic range through many layers.
    """
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for k, (path, shape) in zip(keys, flat, strict=True):
        noise = jax.random.normal(k, shape, jnp.float32)
        if "norm" in jax.tree_util.keystr(path):
            leaves.append((1.0 + 0.1 * noise).astype(dtype))
        else:
            leaves.append((noise / math.sqrt(shape[-2])).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)
