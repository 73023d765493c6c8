"""Attention on a mesh: the Pallas kernels run per shard inside ``shard_map``.

XLA's GSPMD partitioner cannot split a Pallas custom call, so under a mesh it would gather
q/k/v onto every device. Every shard already owns whole query heads and the K/V heads they
read (see ``sharding.rules``), and attention never mixes sequences or heads, so running the
unchanged kernel on each shard's slice is exact and needs no communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def per_shard_attention(
    fn: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    mode: Literal["prefill", "decode"],
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh | None = None,
) -> jax.Array:
    """Run ``fn(q, k, v, lengths)`` on each (data, model) shard with ``shard_map``.

    Args:
      fn: attention on local shards, same signature and shapes as ``jaxinfer.attention``.
      q: prefill ``[B, T, H, D]`` / decode ``[B, H, D]``; B split on data, H on model.
      k, v: prefill ``[B, T, KVH, D]`` / decode ``[B, KVH, S, D]``; KVH split on model.
      lengths: ``[B]`` int32, split on data.
      mode: ``"prefill"`` or ``"decode"`` (selects the layouts above).
      mesh: defaults to the context mesh (``jax.set_mesh``).

    Returns:
      Attention output shaped like ``q``, sharded like ``q``.
    """
    if mode == "prefill":
        q_spec = kv_spec = P(DATA, None, MODEL, None)
    else:
        q_spec, kv_spec = P(DATA, MODEL, None), P(DATA, MODEL, None, None)
    # check_vma=False: Pallas calls carry no varying-manual-axes annotations; the kernel is a
    # pure per-shard function so nothing needs checking.
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(DATA)),
                           out_specs=q_spec, check_vma=False)
    return mapped(q, k, v, lengths)


def mesh_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    mode: Literal["prefill", "decode"],
    backend: Literal["reference", "pallas"] = "reference",
) -> jax.Array:
    """``jaxinfer.attention.attention``, run per shard when a Pallas kernel meets a mesh.

    Without a context mesh, or for the ``"reference"`` backend (plain jnp, which GSPMD
    partitions on its own), this is exactly ``attention``.
    """
    mesh = _context_mesh() if backend == "pallas" else None
    if mesh is None:
        return attention(q, k, v, lengths, mode=mode, backend=backend)
    fn = functools.partial(attention, mode=mode, backend=backend)
    return per_shard_attention(fn, q, k, v, lengths, mode=mode)


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
) -> jax.Array:
    """Ragged paged attention (the engine's), per ``model`` shard inside ``shard_map``.

    Args:
      q: ``[T, H, D]`` packed tokens, H split on model.
      k_pages, v_pages: one layer's pool ``[KVH, num_pages, page_size, D]``, KVH split on
        model, pages whole (the engine's pool is not split on data, see
        ``sharding.rules.engine_pool_spec``).
      kv_lens, block_tables, cu_q_lens: replicated scheduler inputs.
      mesh: defaults to the context mesh; without one this is plain ``attention``.
      max_q_len: static bound on any sequence's query count, for the Pallas kernel's
        query blocks (see ``attention``); None means the token count.

    Both backends run per shard under a mesh: every shard attends with its own heads over
    the same block tables, so the result is exact and needs no communication, and GSPMD
    never sees the page gather (or the Pallas custom call it cannot split).
    """
    fn = functools.partial(_ragged, backend=backend, max_q_len=max_q_len)
    mesh = mesh if mesh is not None else _context_mesh()
    if mesh is None:
        return fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens)
    q_spec, kv_spec = P(None, MODEL, None), P(MODEL, None, None, None)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(), P(), P()),
                           out_specs=q_spec, check_vma=False)
    return mapped(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens)


def _ragged(q: jax.Array, k: jax.Array, v: jax.Array, kv_lens: jax.Array,
            block_tables: jax.Array, cu_q_lens: jax.Array, *,
            backend: Literal["reference", "pallas"],
            max_q_len: int | None = None) -> jax.Array:
    return attention(q, k, v, kv_lens, mode="ragged", backend=backend,
                     block_tables=block_tables, cu_q_lens=cu_q_lens, max_q_len=max_q_len)
