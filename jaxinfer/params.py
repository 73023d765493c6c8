"""The parameter pytree of a Llama model: its stored layout and random initialisation.

A core module (no model code): checkpoints and the sharding rules need the shapes, and the
model (``jaxinfer.model``, which documents the layout) runs them.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import LlamaConfig

Params = dict[str, Any]


TRANSPOSE_ROWS = 128
"""Rows of ``src`` per block in ``transpose_copy``: 64-128 ran fastest on the CI machine
(bf16 8192x2048 to 128256x4096: 17-711 ms; 512 ran 2.5-6x slower)."""

HOST_THREADS = 8
"""Most threads a loader's numpy work uses (numpy releases the GIL while it copies and
computes): two ran a bf16 14336x4096 transpose 1.9x faster than one on the 2-core CI machine;
more than a few saturate a host's memory bandwidth."""


def host_threads(items: int) -> int:
    """Threads for ``items`` independent pieces of host array work: at most ``HOST_THREADS``,
    the CPUs this process may run on, and ``items`` (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(HOST_THREADS, cpus or 1, items))


def transpose_copy(src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``src.T`` of a 2-D host array ``src [rows, cols]`` copied into ``out [cols, rows]``
    (a new C-contiguous array of ``src``'s dtype when None; another dtype casts in the same
    pass), returned. Checkpoints store matmul weights as torch's ``[out, in]``; our layout is
    ``[in, out]``. numpy's own transposed copy walks ``out`` a column at a time: on the CI
    machine it moved bf16 at ~0.14 GB/s (7.7 s for an 8B model's 1 GB head), and blocks of
    ``TRANSPOSE_ROWS`` rows run 5-10x faster (0.71 s), on ``host_threads`` threads."""
    rows, cols = src.shape
    if out is None:
        out = np.empty((cols, rows), src.dtype)
    if out.shape != (cols, rows):
        raise ValueError(f"transpose_copy: out has shape {out.shape}, src.T {(cols, rows)}")
    starts = range(0, rows, TRANSPOSE_ROWS)

    def copy_blocks(first: int, last: int) -> None:  # blocks [first, last) of `starts`
        for i in starts[first:last]:
            out[:, i:i + TRANSPOSE_ROWS] = src[i:i + TRANSPOSE_ROWS].T

    n = host_threads(len(starts))
    if n == 1:
        copy_blocks(0, len(starts))
        return out
    bounds = [len(starts) * k // n for k in range(n + 1)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(copy_blocks, bounds[:-1], bounds[1:]))  # re-raises a thread's error
    return out


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
