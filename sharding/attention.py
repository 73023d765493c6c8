"""Attention on a mesh: the attention kernels run per shard inside ``shard_map``.

XLA's GSPMD partitioner cannot split a Pallas custom call, so under a mesh it would gather
q/k/v onto every device. Every shard already owns whole query heads and the K/V heads they
read (see ``sharding.rules``), and attention never mixes sequences or heads, so running the
unchanged kernel on each shard's slice is exact and needs no communication.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.attention import attention
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


def mesh_ragged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    *,
    backend: Literal["reference", "pallas"] = "reference",
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh | None = None,
    max_q_len: int | None = None,
    deterministic: bool = False,
) -> jax.Array:
    """Ragged paged attention (the engine's), per ``model`` shard inside ``shard_map``.

    Args:
      q: ``[T, H, D]`` packed tokens, H split on model.
      k_pages, v_pages: one layer's pool ``[KVH, num_pages, page_size, D]``, KVH split on
        model, pages whole (the engine's pool is not split on data, see
        ``sharding.rules.engine_pool_spec``); or ``QuantizedPages``, split alike.
      kv_lens, block_tables, cu_q_lens: replicated scheduler inputs.
      mesh: defaults to the context mesh; without one this is plain ``attention``.
      max_q_len: static bound on any sequence's query count, for the Pallas kernel's
        query blocks (see ``attention``); None means the token count.
      deterministic: batch-invariant kernel choice (see ``attention``).

    Both backends run per shard under a mesh: every shard attends with its own heads over
    the same block tables, so the result is exact and needs no communication, and GSPMD
    never sees the page gather (or the Pallas custom call it cannot split).
    """
    fn = functools.partial(attention, backend=backend, max_q_len=max_q_len,
                           deterministic=deterministic)
    mesh = mesh if mesh is not None else _context_mesh()
    if mesh is None:
        return fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens)
    # P(MODEL) splits the head axis of every leaf: pages, and a quantized pool's scales.
    q_spec, kv_spec = P(None, MODEL, None), P(MODEL)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(), P(), P()),
                           out_specs=q_spec, check_vma=False)
    return mapped(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens)
