"""Host <-> mesh transfers used by the engine (and ``compute_logits``): each is a no-op
wrapper of the single-device behaviour when ``mesh`` is None.

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


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Make ``mesh`` the context mesh while tracing (``shard_map`` of Pallas kernels uses it)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def put_replicated(mesh: Mesh | None, tree: Any) -> Any:
    """Place arrays whole on every device of ``mesh`` (``jnp.asarray`` if no mesh).

    Host arrays are transferred; device arrays (a previous step's outputs) stay on the
    device, moved only if their sharding differs.
    """
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.device_put(a if isinstance(a, jax.Array)
                                                 else np.asarray(a), replicated), tree)


def to_host(tree: Any) -> Any:
    """Numpy copies of a pytree of arrays; arrays spanning other processes are all-gathered."""
    def get(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(jax.device_get(a))

    return jax.tree.map(get, tree)
