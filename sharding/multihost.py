"""Several hosts (processes) forming one mesh, through ``jax.distributed``.

Every process runs the same program (SPMD): call ``initialize`` first, before anything else
touches JAX devices, then ``make_mesh`` over ``jax.devices()``, which now lists every
process's devices. Each process owns the shards on its local devices; host inputs are built
from identical numpy data on every process and outputs are all-gathered
(``sharding.placement``), so ``generate`` returns the full result on every process.

    python prog.py --coordinator host0:1234 --num-processes 2 --process-id 0   # on host 0
    python prog.py --coordinator host0:1234 --num-processes 2 --process-id 1   # on host 1

On CPU (tests), each process forces its local device count with ``XLA_FLAGS``; collectives
between processes use gloo.
"""

from __future__ import annotations

import jax

from jaxinfer.errors import InputError


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` when more than one process is asked for; else a no-op.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: total processes (hosts); ``None`` or 1 = single process.
      process_id: this process's index in ``[0, num_processes)``.
    """
    if num_processes is None or num_processes == 1:
        return
    if coordinator is None or process_id is None or not 0 <= process_id < num_processes:
        raise InputError(f"multi-host needs --coordinator HOST:PORT and --process-id in "
                         f"[0, {num_processes}) (got {coordinator!r}, {process_id!r})")
    # Only affects CPU devices (tests, CPU clusters); GPUs/TPUs use NCCL/ICI regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def is_primary() -> bool:
    """Whether this is process 0 (the one that writes files and prints)."""
    return jax.process_index() == 0
