"""Decode attention over a contiguous, preallocated KV cache (one new query token per sequence).

Cache layout is [batch, kv_heads, max_len, head_dim]: kv heads before the sequence axis so
that one (sequence, kv head) slice is a contiguous [max_len, head_dim] matrix and decode
never transposes the cache.

GPU: Flash-Decoding. The grid is (batch, kv_heads, num_splits); each program streams its
share of the valid keys once and applies them to all q heads of its group at once (GQA:
each K/V block is read once per kv head). Partial results (acc, max, sum) are merged by a
small combine step. TPU: one program per (sequence, kv head) walks key blocks along an
"arbitrary" grid axis with the online softmax kept in VMEM scratch; blocks past the length
are neither fetched nor computed.

`decode_attention_layer` is the GPU kernel reading one layer of a whole
[layers, batch, kv_heads, max_len, head_dim] cache in place (layer index as an input).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    LOG2E,
    MIN_DOT,
    NEG_INF,
    cdiv,
    check,
    check_backend,
    check_dtype,
    check_gqa,
    check_head_dim,
    combine_splits,
    default_scale,
    gpu_params,
    next_pow2,
    online_softmax_finish,
    online_softmax_step,
    prev_pow2,
    split_partials,
    tpu_decode_block,
    tpu_interpret,
    tpu_params,
)

# Enough programs to give each of the H100's 132 SMs about four (latency hiding).
_TARGET_PROGRAMS = 528


def _validate(q: jax.Array, k_cache: Any, v_cache: Any, lengths: jax.Array) -> int:
    check(q.ndim == 3, f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    check(
        k_cache.ndim == 4,
        f"k_cache must be [batch, kv_heads, max_len, head_dim], got shape {k_cache.shape}",
    )
    check(k_cache.shape == v_cache.shape, f"k_cache {k_cache.shape} != v_cache {v_cache.shape}")
    check(
        q.shape[0] == k_cache.shape[0],
        f"batch mismatch: q {q.shape[0]} vs cache {k_cache.shape[0]}",
    )
    check(
        q.shape[2] == k_cache.shape[3],
        f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}",
    )
    check(q.dtype == k_cache.dtype == v_cache.dtype, "q, k_cache and v_cache must share a dtype")
    check_dtype("q", q)
    check_head_dim(q.shape[2])
    check(
        lengths.shape == (q.shape[0],),
        f"lengths must have shape ({q.shape[0]},), got {lengths.shape}",
    )
    return check_gqa(q.shape[1], k_cache.shape[1])


def decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp decode attention (float32 math), same contract as `decode_attention`.

    Args:
      q: [batch, q_heads, head_dim].
      k_cache, v_cache: [batch, kv_heads, max_len, head_dim].
      lengths: int [batch], number of valid keys; positions >= lengths[b] never contribute
        (they may hold NaN).
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Returns:
      [batch, q_heads, head_dim] in q's dtype; a sequence of length 0 gives 0.
    """
    group = _validate(q, k_cache, v_cache, lengths)
    b, hq, d = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    scale = default_scale(sm_scale, d)
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # [b, max_len]
    kf = jnp.where(valid[:, None, :, None], k_cache.astype(jnp.float32), 0.0)
    vf = jnp.where(valid[:, None, :, None], v_cache.astype(jnp.float32), 0.0)
    qf = q.astype(jnp.float32).reshape(b, hkv, group, d)
    s = jnp.einsum("bhgd,bhkd->bhgk", qf, kf) * scale
    s = jnp.where(valid[:, None, None, :], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    o = jnp.einsum("bhgk,bhkd->bhgd", p, vf)
    o = online_softmax_finish(o, jnp.sum(p, axis=-1, keepdims=True))
    return o.reshape(b, hq, d).astype(q.dtype)


# --------------------------------------------------------------------------- GPU (Triton)


def _decode_gpu_kernel(*refs, scale: float, block_k: int, max_len: int, num_splits: int,
                       layered: bool) -> None:
    """Flash-Decoding program for one (sequence, kv head, split).

    refs: ``[layer_ref,] len_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref``. With
    ``layered`` the K/V refs are ``[layers, max_len, head_dim]`` views of the whole cache
    and ``layer_ref[0]`` picks the layer by address arithmetic (nothing is loaded until the
    indexed reads); otherwise they are ``[max_len, head_dim]``.
    """
    if layered:
        layer_ref, *refs = refs
        layer = (layer_ref[0],)
    else:
        layer = ()
    len_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    split = pl.program_id(2)
    q = q_ref[...]  # [group_pad, d]
    rows = q.shape[0]
    seq_len = jnp.minimum(len_ref[0], max_len)
    # Splits divide the *valid* blocks, so a short sequence in a long cache still spreads
    # its work across all splits instead of leaving most of them idle.
    n_blocks = cdiv(seq_len, block_k)
    per_split = cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_blocks)

    def body(j, carry):
        acc, m, l_sum = carry
        nominal = j * block_k
        # The last block may overhang max_len (not a block multiple): slide it back to end
        # at max_len and mask the keys that the previous block already covered.
        start = jnp.minimum(nominal, max_len - block_k)
        k = k_ref[(*layer, pl.ds(start, block_k), slice(None))]
        v = v_ref[(*layer, pl.ds(start, block_k), slice(None))]
        kpos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        valid = (kpos >= nominal) & (kpos < seq_len)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        s = jnp.where(valid, s, NEG_INF)
        vpos = start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        # Masked cache slots may hold NaN: zero them, since 0 * NaN = NaN.
        v = jnp.where((vpos >= nominal) & (vpos < seq_len), v, jnp.zeros_like(v))
        return online_softmax_step(acc, m, l_sum, s, v)

    acc, m, l_sum = lax.fori_loop(
        lo, hi, body,
        (
            jnp.zeros(q.shape, jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        ),
    )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def default_num_splits(batch: int, kv_heads: int, max_len: int, block_k: int) -> int:
    """Split count that gives about _TARGET_PROGRAMS programs, capped by the block count."""
    want = next_pow2(cdiv(_TARGET_PROGRAMS, batch * kv_heads))
    return max(1, min(want, cdiv(max_len, block_k)))


def _decode_gpu(q, k_cache, v_cache, lengths, layer=None, *, scale, block_k, num_splits,
                num_warps, num_stages, interpret):
    """Split-K decode on GPU. ``layer`` given: the caches are whole ``[L, B, KVH, S, D]``
    caches and the kernel reads that layer in place (no per-layer copy for the call)."""
    layered = layer is not None
    b, hq, d = q.shape
    hkv, max_len = k_cache.shape[-3], k_cache.shape[-2]
    group = hq // hkv
    if max_len < MIN_DOT:
        # Tiny caches only (tests): pad to the smallest dot size; the pad is masked.
        pad = [(0, 0)] * k_cache.ndim
        pad[-2] = (0, MIN_DOT - max_len)
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
        max_len = MIN_DOT
    block_k = max(MIN_DOT, min(block_k, prev_pow2(max_len)))
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, max_len, block_k)
    # combine_splits holds every split in one block: a power of two (Triton); the extra
    # splits get no keys and drop out of the combine.
    num_splits = next_pow2(num_splits)
    # Pad the q-head group to the minimum dot height; the padded rows are discarded.
    gp = max(MIN_DOT, next_pow2(group))
    qg = q.reshape(b, hkv, group, d)
    if gp != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    kernel = functools.partial(
        _decode_gpu_kernel, scale=scale * LOG2E, block_k=block_k, max_len=max_len,
        num_splits=num_splits, layered=layered,
    )
    if layered:
        # Every layer of this (sequence, kv head): the kernel indexes the layer itself.
        layer_in = [jnp.asarray(layer, jnp.int32).reshape(1)]
        layer_spec = [pl.BlockSpec((1,), lambda bi, h, s: (0,))]
        cache_spec = pl.BlockSpec((k_cache.shape[0], None, None, max_len, d),
                                  lambda bi, h, s: (0, bi, h, 0, 0))
    else:
        layer_in, layer_spec = [], []
        cache_spec = pl.BlockSpec((None, None, max_len, d), lambda bi, h, s: (bi, h, 0, 0))
    out_specs, out_shape = split_partials(b, hkv, num_splits, gp, d)
    acc, m, l_sum = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=[
            *layer_spec,
            pl.BlockSpec((1,), lambda bi, h, s: (bi,)),
            pl.BlockSpec((None, None, gp, d), lambda bi, h, s: (bi, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=gpu_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_decode_layer_splitk" if layered else "jaxinfer_decode_splitk",
    )(*layer_in, lengths, qg, k_cache, v_cache)
    out = combine_splits(acc, m, l_sum, group, q.dtype, interpret)  # [b, hkv, group, d]
    return out.reshape(b, hq, d)


# --------------------------------------------------------------------------- TPU (Mosaic)


def _decode_tpu_kernel(
    len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale: float, block_k: int,
    max_len: int,
) -> None:
    tpu_decode_block(q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, step=pl.program_id(2),
                     seq_len=jnp.minimum(len_ref[pl.program_id(0)], max_len), block=block_k,
                     scale=scale)


def _tpu_block_k(max_len: int, block_k: int) -> int:
    if max_len % block_k == 0:
        return block_k
    # The cache is not a block multiple: use the largest multiple of 8 dividing it.
    for cand in range(min(block_k, max_len) // 8 * 8, 7, -8):
        if max_len % cand == 0:
            return cand
    return max_len


def _decode_tpu(q, k_cache, v_cache, lengths, *, scale, block_k, interpret):
    b, hq, d = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    block_k = _tpu_block_k(max_len, block_k)
    nk = max_len // block_k
    qg = q.reshape(b, hkv, group, d)

    def kv_map(bi, h, j, len_ref):
        # Re-use the last valid block index past the length: no DMA for skipped steps.
        last = jnp.maximum(cdiv(jnp.minimum(len_ref[bi], max_len), block_k) - 1, 0)
        return (bi, h, jnp.minimum(j, last), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, nk),
        in_specs=[
            pl.BlockSpec((None, None, group, d), lambda bi, h, j, L: (bi, h, 0, 0)),
            pl.BlockSpec((None, None, block_k, d), kv_map),
            pl.BlockSpec((None, None, block_k, d), kv_map),
        ],
        out_specs=pl.BlockSpec((None, None, group, d), lambda bi, h, j, L: (bi, h, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(
            _decode_tpu_kernel, scale=scale * LOG2E, block_k=block_k, max_len=max_len
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="jaxinfer_decode_tpu",
    )(lengths, qg, k_cache, v_cache)
    return out.reshape(b, hq, d)


# --------------------------------------------------------------------------- public API


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "block_k", "num_splits", "num_warps", "num_stages", "interpret", "backend",
    ),
)
def _decode_attention_jit(q, k_cache, v_cache, lengths, *, sm_scale, block_k, num_splits,
                          num_warps, num_stages, interpret, backend):
    lengths = lengths.astype(jnp.int32)
    scale = default_scale(sm_scale, q.shape[-1])
    if backend == "tpu":
        return _decode_tpu(
            q, k_cache, v_cache, lengths, scale=scale, block_k=block_k, interpret=interpret
        )
    return _decode_gpu(
        q, k_cache, v_cache, lengths, scale=scale, block_k=block_k, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    block_k: int = 128,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
    backend: str = "gpu",
) -> jax.Array:
    """Single-token decode attention over a contiguous KV cache (Flash-Decoding on GPU).

    Args:
      q: [batch, q_heads, head_dim], bfloat16/float16/float32 (one new token per sequence).
      k_cache, v_cache: [batch, kv_heads, max_len, head_dim], q's dtype;
        q_heads % kv_heads == 0.
      lengths: int [batch], valid keys per sequence; slots >= lengths[b] never contribute
        and may hold garbage or NaN.
      sm_scale: logit scale, default 1/sqrt(head_dim).
      block_k: keys per inner step (a power of two on GPU).
      num_splits: split-K factor along the sequence (GPU); default fills about 4 programs
        per SM of an H100.
      num_warps, num_stages: Triton launch parameters (GPU only).
      interpret: run under the Pallas (GPU) or TPU interpreter on CPU.
      backend: "gpu" (Pallas Triton) or "tpu" (Pallas Mosaic TPU).

    Returns:
      [batch, q_heads, head_dim] in q's dtype; a sequence of length 0 gives zeros.
    """
    check_backend(backend)
    _validate(q, k_cache, v_cache, lengths)
    check(num_splits is None or num_splits >= 1, "num_splits must be >= 1")
    return _decode_attention_jit(
        q, k_cache, v_cache, lengths, sm_scale=sm_scale, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, backend=backend,
    )



def _validate_layered(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: Any,
                      lengths: jax.Array) -> int:
    check(
        k_all.ndim == 5,
        f"k_all must be [layers, batch, kv_heads, max_len, head_dim], got shape {k_all.shape}",
    )
    check(k_all.shape == v_all.shape, f"k_all {k_all.shape} != v_all {v_all.shape}")
    check(jnp.ndim(layer) == 0, f"layer must be a scalar, got shape {jnp.shape(layer)}")
    one = jax.ShapeDtypeStruct(k_all.shape[1:], k_all.dtype)  # one layer, without slicing
    return _validate(q, one, jax.ShapeDtypeStruct(v_all.shape[1:], v_all.dtype), lengths)


def decode_attention_layer_reference(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    layer: jax.Array | int,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """`decode_attention_reference` on layer ``layer`` of whole caches ``[L, B, KVH, S, D]``."""
    _validate_layered(q, k_all, v_all, layer, lengths)
    return decode_attention_reference(q, k_all[layer], v_all[layer], lengths, sm_scale=sm_scale)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "num_splits", "num_warps", "num_stages", "interpret"),
)
def _decode_attention_layer_jit(q, k_all, v_all, layer, lengths, *, sm_scale, block_k,
                                num_splits, num_warps, num_stages, interpret):
    return _decode_gpu(
        q, k_all, v_all, lengths.astype(jnp.int32), layer,
        scale=default_scale(sm_scale, q.shape[-1]), block_k=block_k, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


def decode_attention_layer(
    q: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    layer: jax.Array | int,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    block_k: int = 128,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """`decode_attention` (GPU) of one layer, read in place from the whole cache.

    Passing ``k_cache[layer]`` to a Pallas kernel makes XLA copy that layer's cache into a
    fresh buffer for the custom call (``B * KVH * S * D`` elements, twice, every layer and
    step: at batch 8 and 8k context more bytes than the attention itself reads). Here the
    kernel gets the whole cache and the layer as a scalar input instead; same kernel body
    and combine as `decode_attention`.

    Args:
      q: [batch, q_heads, head_dim], one new token per sequence.
      k_all, v_all: [layers, batch, kv_heads, max_len, head_dim], q's dtype.
      layer: scalar int, the layer to read (may be traced, e.g. inside a layer scan).
      lengths: int [batch], valid keys per sequence; slots >= lengths[b] never contribute.
      sm_scale, block_k, num_splits, num_warps, num_stages, interpret: as `decode_attention`.

    Returns:
      [batch, q_heads, head_dim] in q's dtype; a sequence of length 0 gives zeros.
    """
    _validate_layered(q, k_all, v_all, layer, lengths)
    check(num_splits is None or num_splits >= 1, "num_splits must be >= 1")
    return _decode_attention_layer_jit(
        q, k_all, v_all, layer, lengths, sm_scale=sm_scale, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
