"""XLA flags jaxinfer needs process-wide, added to ``XLA_FLAGS`` when ``jaxinfer`` is imported.

Most of XLA's options are per program (``runner``'s compiler options). The choice of
all-reduce kernel is not: XLA reads it from ``XLA_FLAGS`` when the GPU backend starts, and
the same name passed as a compiler option leaves XLA's own one-shot kernels in place (2x
H200, r169-r170: the dumped options of the decode loop said "off", its thunks still held 130
``kCollectiveKernel``). Those kernels cannot be captured in a CUDA graph, so a
tensor-parallel decode iteration ran as 34 graphs between 66 host-launched all-reduces; with
NCCL's all-reduces (7.1 against 6.7 us each) the iteration is one graph
(``runner.TP_DEVICE_LOOP_GRAPHS``). 8B tp=2 batch 1: 262.1 tok/s without the flag, 292.6
with it (r170).

No JAX import here: the flags must be in the environment before JAX starts a backend, and
``import jaxinfer`` starts none. The flags are GPU flags: they are added only where JAX can
use a CUDA GPU (a ``jax_cuda*`` plugin is installed and ``JAX_PLATFORMS`` allows it).
"""

from __future__ import annotations

import os
import pkgutil
from collections.abc import Mapping, MutableMapping

DEFAULTS = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": "false"}
"""Flag -> value; a flag the user already put in ``XLA_FLAGS`` keeps the user's value."""


def cuda_possible(environ: Mapping[str, str]) -> bool:
    """Whether JAX could start a CUDA backend here: a ``jax_cuda*`` plugin is installed and
    ``environ["JAX_PLATFORMS"]`` (if set) names ``cuda`` or ``gpu``."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return False
    return any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules())


def apply_defaults(environ: MutableMapping[str, str] | None = None,
                   cuda: bool | None = None) -> list[str]:
    """Append each of ``DEFAULTS`` that ``environ["XLA_FLAGS"]`` (default: the process
    environment) does not name yet, where ``cuda`` (default: ``cuda_possible``) and
    ``XLA_FLAGS`` is not a flags file's name; return the flags added, as written. Takes
    effect for backends started afterwards: import ``jaxinfer`` before the first JAX
    computation."""
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "")
    if current.strip() and not current.lstrip().startswith("-"):
        return []  # XLA reads a value not starting with "-" as the name of a flags file
    named = {word.lstrip("-").split("=", 1)[0] for word in current.split()}
    added = [f"--{flag}={value}" for flag, value in DEFAULTS.items() if flag not in named]
    # cuda_possible scans sys.path (~20 ms of every import): only when a flag is missing
    if not added or not (cuda_possible(env) if cuda is None else cuda):
        return []
    env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
