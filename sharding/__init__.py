"""Tensor/data parallelism for jaxinfer on a ``(data, model)`` device mesh, single- or multi-host.

``make_mesh`` builds the mesh, ``sharding.rules`` holds the partition rules for the params and
KV cache, ``sharding.attention`` runs the Pallas kernels per shard, ``sharding.placement`` moves
inputs/outputs between host and mesh, and ``sharding.multihost`` wraps ``jax.distributed``.
"""

# jaxinfer imports sharding submodules (model -> sharding.attention, generate ->
# sharding.placement); loading it first means those run before this package's own imports.
import jaxinfer  # noqa: F401  isort: skip
from sharding.mesh import DATA, MODEL, make_mesh, mesh_sizes
from sharding.rules import (
    cache_shardings,
    create_cache,
    expand_kv_heads,
    kv_repeat_factor,
    param_shardings,
    param_specs,
    shard_params,
    stored_shardings,
    valid_model_sizes,
)

__all__ = [
    "DATA", "MODEL", "cache_shardings", "create_cache", "expand_kv_heads", "kv_repeat_factor",
    "make_mesh", "mesh_sizes", "param_shardings", "param_specs", "shard_params",
    "stored_shardings", "valid_model_sizes",
]
