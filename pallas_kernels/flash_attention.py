"""FlashAttention forward pass for prefill: Pallas Triton (GPU) and Mosaic TPU kernels.

The score matrix never reaches device memory: each program keeps one block of queries
on chip, streams blocks of keys/values past it and keeps a running (online) softmax in
float32. Grouped-query attention is handled in the BlockSpec index maps (q head `h`
reads kv head `h // group`), so repeated K/V is never materialised.
"""

from __future__ import annotations

import functools

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
    default_scale,
    gpu_params,
    next_pow2,
    online_softmax_finish,
    online_softmax_step,
    tpu_interpret,
    tpu_params,
)


def _validate(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None
) -> int:
    check(q.ndim == 4, f"q must be [batch, q_len, q_heads, head_dim], got shape {q.shape}")
    check(k.ndim == 4, f"k must be [batch, kv_len, kv_heads, head_dim], got shape {k.shape}")
    check(k.shape == v.shape, f"k shape {k.shape} != v shape {v.shape}")
    check(q.shape[0] == k.shape[0], f"batch mismatch: q {q.shape[0]} vs k {k.shape[0]}")
    check(q.shape[3] == k.shape[3], f"head_dim mismatch: q {q.shape[3]} vs k {k.shape[3]}")
    check(q.dtype == k.dtype == v.dtype, f"dtype mismatch: {q.dtype}, {k.dtype}, {v.dtype}")
    check_dtype("q", q)
    check_head_dim(q.shape[3])
    check(q.shape[1] > 0 and k.shape[1] > 0, "q_len and kv_len must be positive")
    if lengths is not None:
        check(
            lengths.shape == (q.shape[0],),
            f"lengths must have shape ({q.shape[0]},), got {lengths.shape}",
        )
    return check_gqa(q.shape[2], k.shape[2])


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    lengths: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp attention with the same contract as `flash_attention` (float32 math).

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
      causal: key j is visible to query i iff j <= i (both start at position 0).
      lengths: optional int [batch]; keys at index >= lengths[b] are ignored.
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype. Rows with no visible key are 0.
    """
    group = _validate(q, k, v, lengths)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = default_scale(sm_scale, d)
    qf = q.astype(jnp.float32).reshape(b, sq, hkv, group, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    kpos = jnp.arange(sk)
    mask = jnp.ones((b, sq, sk), dtype=bool)
    if causal:
        mask = mask & (kpos[None, None, :] <= jnp.arange(sq)[None, :, None])
    if lengths is not None:
        mask = mask & (kpos[None, None, :] < lengths[:, None, None])
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    vf = v.astype(jnp.float32)
    if lengths is not None:
        # Keys past the length may hold anything; 0 * NaN would leak through the matmul.
        vf = jnp.where((kpos[None, :] < lengths[:, None])[:, :, None, None], vf, 0.0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, vf)
    den = jnp.sum(p, axis=-1)  # [b, h, g, q]
    o = online_softmax_finish(o, jnp.transpose(den, (0, 3, 1, 2))[..., None])
    return o.reshape(b, sq, hq, d).astype(q.dtype)


# --------------------------------------------------------------------------- GPU (Triton)


def _flash_gpu_kernel(
    len_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, causal: bool, block_q: int,
    block_k: int, kv_len: int, num_q_blocks: int,
) -> None:
    # Heaviest causal query blocks first: they finish last otherwise and leave SMs idle.
    qi = (num_q_blocks - 1 - pl.program_id(0)) if causal else pl.program_id(0)
    q = q_ref[...]
    seq_len = jnp.minimum(len_ref[0], kv_len)
    q_lo = qi * block_q
    if causal:
        key_end = jnp.minimum(seq_len, q_lo + block_q)
        # Blocks whose every key is visible to every row (no mask needed at all).
        n_full = jnp.minimum(seq_len, q_lo + 1) // block_k
    else:
        key_end = seq_len
        n_full = seq_len // block_k
    n_blocks = cdiv(key_end, block_k)
    qpos = q_lo + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

    def step(j, carry, masked: bool):
        acc, m, l_sum = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        if masked:
            kpos = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            valid = kpos < seq_len
            if causal:
                valid = valid & (kpos <= qpos)
            s = jnp.where(valid, s, NEG_INF)
            # Keys past the length may hold anything; 0 * NaN would leak into acc.
            vrow = start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where(vrow < seq_len, v, jnp.zeros_like(v))
        return online_softmax_step(acc, m, l_sum, s, v, masked=masked)

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), NEG_INF, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    acc, _, l_sum = carry
    o_ref[...] = online_softmax_finish(acc, l_sum[:, None]).astype(o_ref.dtype)


def _flash_gpu(
    q, k, v, lengths, *, scale, causal, block_q, block_k, num_warps, num_stages, interpret
):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    block_q = max(MIN_DOT, min(block_q, next_pow2(sq)))
    block_k = max(MIN_DOT, min(block_k, next_pow2(sk)))
    sq_pad = cdiv(sq, block_q) * block_q
    sk_pad = cdiv(sk, block_k) * block_k
    # Padding copies only for lengths that are not block multiples (prefill shapes usually
    # are); padded keys sit at index >= kv_len and are masked by the length test.
    if sq_pad != sq:
        q = jnp.pad(q, ((0, 0), (0, sq_pad - sq), (0, 0), (0, 0)))
    if sk_pad != sk:
        k = jnp.pad(k, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))
    num_q_blocks = sq_pad // block_q

    def q_map(i, bi, h):
        # Must agree with the kernel's block order (heaviest causal blocks first).
        return (bi, (num_q_blocks - 1 - i) if causal else i, h, 0)

    kernel = functools.partial(
        _flash_gpu_kernel, scale=scale * LOG2E, causal=causal, block_q=block_q,
        block_k=block_k, kv_len=sk, num_q_blocks=num_q_blocks,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, b, hq),
        in_specs=[
            pl.BlockSpec((1,), lambda i, bi, h: (bi,)),
            pl.BlockSpec((None, block_q, None, d), q_map),
            pl.BlockSpec((None, sk_pad, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
            pl.BlockSpec((None, sk_pad, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, d), q_map),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=gpu_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_flash_fwd",
    )(lengths, q, k, v)
    return out[:, :sq]


# --------------------------------------------------------------------------- TPU (Mosaic)


def _flash_tpu_kernel(
    len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale: float, causal: bool,
    block_q: int, block_k: int, kv_len: int,
) -> None:
    bi, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    seq_len = jnp.minimum(len_ref[bi], kv_len)
    q_lo = qi * block_q
    k_lo = kj * block_k
    needed = k_lo < seq_len
    if causal:
        needed = jnp.logical_and(needed, k_lo < q_lo + block_q)

    @pl.when(needed)
    def _compute():
        q = q_ref[...]
        k = k_ref[...]
        v = v_ref[...]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        kpos = k_lo + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        valid = kpos < seq_len
        if causal:
            valid = valid & (kpos <= q_lo + lax.broadcasted_iota(jnp.int32, s.shape, 0))
        s = jnp.where(valid, s, NEG_INF)
        vrow = k_lo + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(vrow < seq_len, v, jnp.zeros_like(v))
        acc_sc[...], m_sc[...], l_sc[...] = online_softmax_step(
            acc_sc[...], m_sc[...], l_sc[...], s, v
        )

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = online_softmax_finish(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _flash_tpu(q, k, v, lengths, *, scale, causal, block_q, block_k, interpret):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    # Mosaic tiles the last two block dims as (8k, 128): put the sequence axis there.
    qt = jnp.transpose(q, (0, 2, 1, 3))
    kt = jnp.transpose(k, (0, 2, 1, 3))
    vt = jnp.transpose(v, (0, 2, 1, 3))
    block_q = min(block_q, cdiv(sq, 8) * 8)
    block_k = min(block_k, cdiv(sk, 8) * 8)
    sq_pad = cdiv(sq, block_q) * block_q
    sk_pad = cdiv(sk, block_k) * block_k
    if sq_pad != sq:
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, sq_pad - sq), (0, 0)))
    if sk_pad != sk:
        kt = jnp.pad(kt, ((0, 0), (0, 0), (0, sk_pad - sk), (0, 0)))
        vt = jnp.pad(vt, ((0, 0), (0, 0), (0, sk_pad - sk), (0, 0)))
    nq, nk = sq_pad // block_q, sk_pad // block_k

    def kv_map(bi, h, i, j, len_ref):
        # Steps past the last needed key block re-use the previous block index, so the
        # pipeline issues no DMA for them (their compute is skipped by pl.when).
        end = jnp.minimum(len_ref[bi], sk)
        if causal:
            end = jnp.minimum(end, (i + 1) * block_q)
        last = jnp.maximum(cdiv(end, block_k) - 1, 0)
        return (bi, h // group, jnp.minimum(j, last), 0)

    kernel = functools.partial(
        _flash_tpu_kernel, scale=scale * LOG2E, causal=causal, block_q=block_q,
        block_k=block_k, kv_len=sk,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hq, nq, nk),
        in_specs=[
            pl.BlockSpec((None, None, block_q, d), lambda bi, h, i, j, L: (bi, h, i, 0)),
            pl.BlockSpec((None, None, block_k, d), kv_map),
            pl.BlockSpec((None, None, block_k, d), kv_map),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, d), lambda bi, h, i, j, L: (bi, h, i, 0)),
        scratch_shapes=[
            pltpu.VMEM((block_q, 1), jnp.float32),
            pltpu.VMEM((block_q, 1), jnp.float32),
            pltpu.VMEM((block_q, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="jaxinfer_flash_fwd_tpu",
    )(lengths, qt, kt, vt)
    return jnp.transpose(out[:, :, :sq], (0, 2, 1, 3))


# --------------------------------------------------------------------------- public API


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal", "sm_scale", "block_q", "block_k", "num_warps", "num_stages",
        "interpret", "backend",
    ),
)
def _flash_attention_jit(
    q, k, v, lengths, *, causal, sm_scale, block_q, block_k, num_warps, num_stages,
    interpret, backend,
):
    b, sk = q.shape[0], k.shape[1]
    lengths = (
        jnp.full((b,), sk, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    )
    scale = default_scale(sm_scale, q.shape[-1])
    if backend == "tpu":
        return _flash_tpu(
            q, k, v, lengths, scale=scale, causal=causal, block_q=block_q,
            block_k=block_k, interpret=interpret,
        )
    return _flash_gpu(
        q, k, v, lengths, scale=scale, causal=causal, block_q=block_q, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    lengths: jax.Array | None = None,
    sm_scale: float | None = None,
    block_q: int = 128,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
    interpret: bool = False,
    backend: str = "gpu",
) -> jax.Array:
    """Fused multi-head attention forward (FlashAttention-2 style).

    Args:
      q: [batch, q_len, q_heads, head_dim], bfloat16/float16/float32.
      k, v: [batch, kv_len, kv_heads, head_dim], same dtype; q_heads % kv_heads == 0.
      causal: key j is visible to query i iff j <= i (queries and keys start at 0).
      lengths: optional int [batch]; keys at index >= lengths[b] are ignored. Query rows
        with no visible key return 0 (never NaN).
      sm_scale: logit scale, default 1/sqrt(head_dim).
      block_q, block_k: tile sizes along queries / keys (powers of two on GPU).
      num_warps, num_stages: Triton launch parameters (GPU only).
      interpret: run in the Pallas interpreter (GPU) or TPU interpreter (TPU) on CPU.
      backend: "gpu" (Pallas Triton) or "tpu" (Pallas Mosaic TPU).

    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype; softmax statistics in float32.
    """
    check_backend(backend)
    _validate(q, k, v, lengths)
    if num_warps is None:
        num_warps = 4 if q.shape[-1] <= 64 else 8
    return _flash_attention_jit(
        q, k, v, lengths, causal=causal, sm_scale=sm_scale, block_q=block_q,
        block_k=block_k, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, backend=backend,
    )
