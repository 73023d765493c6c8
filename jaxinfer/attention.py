"""The one attention entry point. Backends: ``"reference"`` (plain jnp) and ``"pallas"``.

The modes share the entry point but differ in where K/V come from:

* ``"prefill"``: q ``[batch, q_len, q_heads, head_dim]`` against the chunk's own fresh
  k/v ``[batch, q_len, kv_heads, head_dim]``, causal, keys past ``lengths[b]`` ignored.
* ``"decode"``: q ``[batch, q_heads, head_dim]`` (one new token per sequence) against the
  cache k/v ``[batch, kv_heads, max_len, head_dim]``; keys at index ``>= lengths[b]`` ignored.
* ``"ragged"`` (the paged engine): q ``[tokens, q_heads, head_dim]`` packing prefill chunks
  and decode tokens of many sequences, against one layer's page pool k/v ``[kv_heads,
  num_pages, page_size, head_dim]`` through ``block_tables``; ``lengths`` are the keys per
  sequence including its new tokens, ``cu_q_lens`` the cumulative query counts.

The decode cache keeps kv_heads before the sequence axis so that the score and value
contractions have their batch dimensions (batch, kv_heads) leading: XLA then emits a batched
GEMV over the cache as stored, never a transpose of the whole cache.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxinfer.errors import InputError
from pallas_kernels._common import SUPPORTED_HEAD_DIMS

Backend = Literal["reference", "pallas", "auto"]
Mode = Literal["prefill", "decode", "ragged"]
_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def resolve_backend(backend: Backend, head_dim: int) -> Literal["reference", "pallas"]:
    """Map ``"auto"`` to the best backend for the default JAX platform and head size.

    ``"auto"`` picks the Pallas kernels on GPU when they support ``head_dim``; an explicit
    ``"pallas"`` with an unsupported head size is an error rather than a silent fallback.
    """
    if backend == "auto":
        use = jax.default_backend() == "gpu" and head_dim in SUPPORTED_HEAD_DIMS
        return "pallas" if use else "reference"
    if backend not in ("reference", "pallas"):
        raise InputError(f"unknown attention backend {backend!r}; use 'reference', 'pallas' "
                         "or 'auto'")
    if backend == "pallas" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"the pallas attention backend supports head_dim {SUPPORTED_HEAD_DIMS}, "
                         f"not {head_dim}; use backend='reference'")
    return backend


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    mode: Mode,
    backend: Literal["reference", "pallas"] = "reference",
    block_tables: jax.Array | None = None,
    cu_q_lens: jax.Array | None = None,
    max_q_len: int | None = None,
) -> jax.Array:
    """Scaled dot-product attention with GQA, per-sequence lengths, float32 softmax.

    Args:
      q: prefill ``[B, T, H, D]`` or decode ``[B, H, D]``.
      k, v: prefill ``[B, T, KVH, D]`` or decode ``[B, KVH, S, D]``; ``H % KVH == 0``.
      lengths: ``[B]`` int32, number of valid keys per sequence.
      mode: ``"prefill"`` (causal within the chunk), ``"decode"`` or ``"ragged"`` (q
        ``[T, H, D]``, k/v pages ``[KVH, num_pages, page_size, D]``, causal against the cache).
      backend: ``"reference"`` or ``"pallas"`` (the kernels in ``pallas_kernels``).
      block_tables: ragged only, ``[S, pages_per_seq]`` int32 physical page of each page.
      cu_q_lens: ragged only, ``[S + 1]`` int32 cumulative query counts.
      max_q_len: ragged only, static bound on any sequence's query count (default ``T``),
        passed to the Pallas kernel, which sizes its query blocks by it (1 for a
        decode-only step); the reference ignores it.

    Returns:
      Same shape and dtype as ``q``.
    """
    if mode == "ragged":
        if block_tables is None or cu_q_lens is None:
            raise ValueError("ragged attention needs block_tables and cu_q_lens")
        import pallas_kernels

        if backend == "pallas":
            return pallas_kernels.ragged_attention(q, k, v, block_tables, lengths, cu_q_lens,
                                                   max_q_len=max_q_len,
                                                   interpret=jax.default_backend() != "gpu")
        # Any head_dim here (the kernels' restriction does not apply to the reference).
        return pallas_kernels.ragged_attention_reference(q, k, v, block_tables, lengths,
                                                         cu_q_lens)
    if backend == "pallas":
        import pallas_kernels

        # Off-GPU the Triton kernels run in Pallas interpret mode (slow, but exact): tests use it.
        interpret = jax.default_backend() != "gpu"
        if mode == "prefill":
            return pallas_kernels.flash_attention(q, k, v, causal=True, lengths=lengths,
                                                  interpret=interpret)
        return pallas_kernels.decode_attention(q, k, v, lengths, interpret=interpret)
    if mode == "prefill":
        return _prefill_reference(q, k, v, lengths)
    return _decode_reference(q, k, v, lengths)


def _prefill_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    # scores [B, KVH, G, Tq, Tk]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores *= d**-0.5
    pos = jnp.arange(t)
    visible = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _decode_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    b, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32)
    scores *= d**-0.5
    visible = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, h, d).astype(q.dtype)


# --------------------------------------------------------------------------- layer-indexed decode

# When True, the model's Pallas decode path reads layer ``i`` of the whole cache inside the
# kernel (``decode_attention_layer``); when False it passes the slice ``k_all[i]``, which XLA
# materialises as a per-layer copy of the cache before the custom call. The benchmark flips
# it (then clears JAX's caches) to measure both; tracing reads it, so it is not per call.
DECODE_LAYER_KERNEL = True


def decode_attention_layer(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    layer: jax.Array | int,
    lengths: jax.Array,
    *,
    backend: Literal["reference", "pallas"] = "pallas",
    block_k: int = 128,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """Decode attention of one layer, reading that layer straight out of the whole cache.

    Args:
      q: ``[B, H, D]``, one new token per sequence.
      k_all, v_all: the whole cache ``[L, B, KVH, S, D]``.
      layer: scalar int, the layer to read (traced inside the layer scan).
      lengths: ``[B]`` int32 valid keys per sequence.
      backend: ``"pallas"`` runs the Triton kernel on GPU (the Pallas interpreter
        elsewhere); ``"reference"`` is ``attention`` on the slice ``k_all[layer]``.

    Returns:
      ``[B, H, D]`` like ``q``.

    A thin dispatch to ``pallas_kernels.decode_attention_layer`` (whose docstring says
    why passing ``k_all[layer]`` to a kernel costs a copy of the layer's cache).
    """
    import pallas_kernels
    from pallas_kernels._common import MIN_DOT

    max_len, d = k_all.shape[-2:]
    if backend != "pallas" or max_len < MIN_DOT:
        # Tiny caches (tests) would need padding, i.e. a copy: use the plain path there.
        return attention(q, k_all[layer], v_all[layer], lengths, mode="decode",
                         backend=backend)
    return pallas_kernels.decode_attention_layer(
        q, k_all, v_all, layer, lengths, sm_scale=d**-0.5, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=jax.default_backend() != "gpu")
