"""Host <-> mesh transfers used by ``generate`` (and the engine): each is a no-op wrapper of the
single-device behaviour when ``mesh`` is None.

Multi-host note: with ``jax.distributed`` every process runs the same program on the same
host-side inputs (single-program multiple-data). Global arrays are built from each process's
identical numpy copy (``jax.device_put`` only transfers the shards a process owns) and brought
back with an all-gather, so every process sees the full result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import LlamaConfig
from jaxinfer.kv_cache import KVCache
from sharding.mesh import DATA, mesh_sizes
from sharding.rules import create_cache


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Make ``mesh`` the context mesh while tracing (``shard_map`` of Pallas kernels uses it)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def round_batch(mesh: Mesh | None, batch: int) -> int:
    """``batch`` rounded up to a multiple of the data-parallel size."""
    data, _ = mesh_sizes(mesh)
    return -(-batch // data) * data


def put_batch(mesh: Mesh | None, tree: Any) -> Any:
    """Place host arrays (leaves ``[B, ...]``) with B split over data; ``jnp.asarray`` if no mesh.

    ``B`` must be a multiple of the data size (see ``round_batch``).
    """
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(
        lambda a: jax.device_put(np.asarray(a), NamedSharding(
            mesh, P(DATA, *([None] * (np.ndim(a) - 1))))), tree)


def put_batch_from_primary(mesh: Mesh | None, tree: Any) -> Any:
    """``put_batch`` of process 0's values: for host data that may differ between processes.

    Sampling keys of requests without a seed are drawn at random on each host; every process
    must feed the same global array, so multi-process runs take process 0's draw.
    """
    if mesh is not None and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, tree))
    return put_batch(mesh, tree)


def put_replicated(mesh: Mesh | None, tree: Any) -> Any:
    """Place host arrays whole on every device of ``mesh`` (``jnp.asarray`` if no mesh)."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a), NamedSharding(mesh, P())), tree)


def new_cache(mesh: Mesh | None, config: LlamaConfig, batch: int, max_len: int, dtype: Any
              ) -> KVCache:
    """An empty ``KVCache`` ``[L, batch, kv_heads, max_len, D]``, in shards on ``mesh``."""
    if mesh is None:
        return KVCache.create(config, batch, max_len, dtype)
    return create_cache(config, batch, max_len, dtype, mesh)


def to_host(tree: Any) -> Any:
    """Numpy copies of a pytree of arrays; arrays spanning other processes are all-gathered."""
    def get(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(jax.device_get(a))

    return jax.tree.map(get, tree)
