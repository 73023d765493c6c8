"""Device meshes for inference: a 2-D ``(data, model)`` mesh over the devices JAX sees.

``data`` holds independent replicas of the model, each taking a slice of the batch; ``model``
splits each replica's weights and KV cache (tensor parallelism, Megatron style). The same mesh
works on GPUs, TPU chips, forced CPU devices and across hosts (after ``jax.distributed``
initialisation ``jax.devices()`` lists every process's devices).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.errors import InputError

DATA = "data"
MODEL = "model"


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None
              ) -> Mesh:
    """A ``Mesh`` of shape ``(data, model)`` with axes ``("data", "model")``.

    Args:
      data: data-parallel replicas (the batch is split over them).
      model: tensor-parallel shards per replica.
      devices: devices to use, default ``jax.devices()`` (all processes' devices when running
        multi-host); the first ``data * model`` of them are taken.

    Returns:
      The mesh. Devices of one model replica are adjacent in device order, so on a multi-GPU
      host the tensor-parallel collectives (one all-reduce per attention and per MLP block)
      stay on the fastest links and data replicas span hosts.
    """
    for name, value in (("data", data), ("model", model)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"mesh size {name}={value!r} must be a positive integer")
    devs = list(jax.devices() if devices is None else devices)
    need = data * model
    if need > len(devs):
        raise InputError(f"a data={data} x model={model} mesh needs {need} devices but only "
                         f"{len(devs)} are available ({devs[0].platform if devs else 'none'}); "
                         "lower --dp/--tp")
    grid = np.array(devs[:need], dtype=object).reshape(data, model)
    # Auto axes: XLA's GSPMD partitioner propagates shardings from the weights and cache
    # through the forward pass, so the model code needs no per-op annotations.
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(grid, (DATA, MODEL), axis_types=auto)


def mesh_sizes(mesh: Mesh | None) -> tuple[int, int]:
    """``(data, model)`` sizes of a mesh made by ``make_mesh`` (``(1, 1)`` for ``None``)."""
    if mesh is None:
        return 1, 1
    return int(mesh.shape[DATA]), int(mesh.shape[MODEL])


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` holds devices of other processes (a multi-host mesh)."""
    return mesh is not None and any(d.process_index != jax.process_index()
                                    for d in mesh.devices.flat)
