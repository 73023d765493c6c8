"""Random bf16 Llama weights created directly in shards (benchmarks of 70B-sized models).

``jaxinfer.model.init_params`` draws float32 noise for the whole model on one device, which
cannot hold a 70B model (141 GB in bf16, 282 GB as float32). ``random_params`` instead runs one
small ``jax.jit`` per parameter with ``out_shardings`` from ``sharding.rules``: with JAX's
partitionable threefry (the default since 0.5) each device generates only the values of its
own shard, in the target dtype, so neither a host copy nor a full-size device array exists.
Values are scaled like ``init_params`` (1/sqrt(fan_in), norms near 1) but differ from its
draws; they are meant for speed measurements, not for comparing tokens with ``init_params``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.config import LlamaConfig
from jaxinfer.params import param_shapes
from sharding.mesh import mesh_sizes
from sharding.rules import kv_repeat_factor, param_shardings


def random_params(config: LlamaConfig, mesh: Mesh, dtype: Any = jnp.bfloat16, seed: int = 0
                  ) -> tuple[LlamaConfig, dict[str, Any]]:
    """Random params of ``config`` placed on ``mesh`` as ``shard_params`` would place them.

    When the model axis exceeds the K/V heads, ``wk``/``wv`` are drawn with the repeated head
    count (``kv_repeat_factor``) directly; the returned config reports that count, as after
    ``shard_params``. Returns ``(config, params)`` in the stacked layout.
    """
    _, model_size = mesh_sizes(mesh)
    repeat = kv_repeat_factor(config, model_size)
    if repeat > 1:
        config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * repeat)
    shapes = param_shapes(config)
    shardings = param_shardings(config, mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shardings = treedef.flatten_up_to(shardings)
    dt = jnp.dtype(dtype)
    base = jax.random.PRNGKey(seed)
    leaves = []
    for i, ((path, shape), sharding) in enumerate(zip(flat, flat_shardings, strict=True)):
        is_norm = "norm" in jax.tree_util.keystr(path)
        scale = 0.1 if is_norm else 1.0 / math.sqrt(shape[-2])
        draw = _drawer(tuple(shape), scale, is_norm, dt.name, sharding)
        with jax.threefry_partitionable(True):
            leaves.append(draw(jax.random.fold_in(base, i)))
    return config, jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=64)
def _drawer(shape: tuple[int, ...], scale: float, is_norm: bool, dtype: str,
            sharding: Any) -> Any:
    """A jitted ``key -> array`` of random values, generated shard by shard (cached per shape)."""
    dt = jnp.dtype(dtype)

    def draw(key: jax.Array) -> jax.Array:
        noise = jax.random.normal(key, shape, dt) * jnp.asarray(scale, dt)
        return noise + jnp.asarray(1.0, dt) if is_norm else noise

    return jax.jit(draw, out_shardings=sharding)
