"""Tensor/data parallelism for jaxinfer on a ``(data, model)`` device mesh, single- or multi-host.

``make_mesh`` builds the mesh, ``sharding.rules`` holds the partition rules for the params and
the engine's page pool, ``sharding.attention`` runs attention per shard, ``sharding.placement``
moves inputs/outputs between host and mesh, and ``sharding.multihost`` wraps
``jax.distributed``.
"""

from sharding.mesh import DATA, MODEL, make_mesh, mesh_sizes
from sharding.rules import (
    expand_kv_heads,
    kv_repeat_factor,
    param_shardings,
    param_specs,
    shard_params,
    stored_shardings,
    valid_model_sizes,
)

__all__ = [
    "DATA", "MODEL", "expand_kv_heads", "kv_repeat_factor",
    "make_mesh", "mesh_sizes", "param_shardings", "param_specs", "shard_params",
    "stored_shardings", "valid_model_sizes",
]
