"""Attention on a mesh: the attention kernels run per shard inside ``shard_map``.

XLA's GSPMD partitioner cannot split a Pallas custom call, so under a mesh it would gather
q/k/v onto every device. Every shard already owns whole query heads and the K/V heads they
read (see ``sharding.rules``), and attention never mixes sequences or heads, so running the
unchanged kernel on each shard's slice is exact and needs no communication.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.attention import write_and_attend
from sharding.mesh import DATA, MODEL


def _context_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh set with ``jax.set_mesh`` if it has our axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names or MODEL not in mesh.axis_names:
        return None
    return mesh


def model_split() -> bool:
    """Whether the context mesh splits the model axis: a Pallas custom call traced there
    would have its operands gathered whole onto every device (GSPMD cannot split it)."""
    mesh = _context_mesh()
    return mesh is not None and mesh.shape[MODEL] > 1


def gather_vocab(logits: jax.Array) -> jax.Array:
    """Constrain logits ``[B, ..., vocab]`` to batch-on-data, vocab whole, under a context mesh.

    The vocab-split LM head leaves logits split over "model"; sampling sorts and scans the
    vocab axis, which GSPMD handles slowly (and compiles slowly) when that axis is split.
    Gathering ``B x vocab`` floats once per step is cheap next to the weights read per step.
    No-op without a context mesh.
    """
    if _context_mesh() is None:
        return logits
    lead = [None] * (logits.ndim - 2)
    # Pin the matmul output to vocab-split first: with only the final constraint GSPMD may
    # instead all-gather the [hidden, vocab] head weight on every step (1 GiB for 70B).
    logits = jax.lax.with_sharding_constraint(logits, P(DATA, *lead, MODEL))
    return jax.lax.with_sharding_constraint(logits, P(DATA, *lead, None))


def mesh_write_and_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: Any,
    v_pages: Any,
    layer: int | jax.Array | None,
    batch: dict[str, jax.Array],
    *,
    backend: Literal["reference", "pallas"] = "reference",
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh | None = None,
    max_q_len: int | None = None,
    deterministic: bool = False,
    out_pairs: bool = False,
) -> tuple[Any, Any, Any]:
    """``jaxinfer.attention.write_and_attend`` (store the step's K/V, then ragged paged
    attention), per ``model`` shard inside ``shard_map``.

    Args:
      q: ``[T, H, D]`` packed tokens, H split on model; ``k``, ``v``: ``[T, KVH, D]``.
      k_pages, v_pages: one layer's pool ``[KVH, num_pages, page_size, D]`` (``layer``
        None) or the stacked ``[L, KVH, ...]`` pool with ``layer`` its index; KVH split on
        model, pages whole (the engine's pool is not split on data, see
        ``sharding.rules.engine_pool_spec``); or ``QuantizedPages``, split alike.
      batch: the step's replicated scheduler inputs (``write_and_attend``).
      mesh: defaults to the context mesh; without one this is plain ``write_and_attend``.
      max_q_len, deterministic: as ``write_and_attend``.
      out_pairs: as ``write_and_attend``, without a mesh only (on a mesh ``out`` is an array).

    Every shard stores and attends with its own heads over the same block tables, so the
    result is exact and needs no communication, and GSPMD never sees the page scatter and
    gather (or the Pallas custom call it cannot split).
    """
    fn = functools.partial(write_and_attend, backend=backend, max_q_len=max_q_len,
                           deterministic=deterministic)
    mesh = mesh if mesh is not None else _context_mesh()
    if mesh is None:
        return fn(q, k, v, k_pages, v_pages, layer, batch, out_pairs=out_pairs)
    # The head axis of every pool leaf (pages, and a quantized pool's scales) is split:
    # axis 0 of a layer's pool, axis 1 of a stacked one.
    heads = P(None, MODEL, None)
    pool = P(MODEL) if layer is None else P(None, MODEL)
    if layer is None:
        def per_shard(q, k, v, k_pages, v_pages, batch):
            return fn(q, k, v, k_pages, v_pages, None, batch)
        operands = (q, k, v, k_pages, v_pages, batch)
        in_specs = (heads, heads, heads, pool, pool, P())
    else:
        per_shard = fn
        operands = (q, k, v, k_pages, v_pages, jnp.asarray(layer, jnp.int32), batch)
        in_specs = (heads, heads, heads, pool, pool, P(), P())
    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs,
                           out_specs=(heads, pool, pool), check_vma=False)
    return mapped(*operands)
