"""Shared helpers for the attention kernels: argument checks, constants, backend plumbing."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Triton's tensor-core dot needs every matrix side to be at least 16.
MIN_DOT = 16


NEG_INF = float("-inf")  # masked logits; exp2(-inf - m) is exactly 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def cdiv(a: Any, b: int) -> Any:
    """Ceiling division that works on Python ints and traced int32 scalars."""
    return (a + b - 1) // b


def check(cond: bool, msg: str) -> None:
    """Raise a one-line ValueError when `cond` is false (argument validation)."""
    if not cond:
        raise ValueError(msg)


def check_page_pool(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> None:
    """One-line errors for a K/V page pool that does not match ``q [..., q_heads, head_dim]``."""
    check(
        k_pages.ndim == 4,
        "k_pages must be [kv_heads, num_pages, page_size, head_dim], "
        f"got shape {k_pages.shape}",
    )
    check(k_pages.shape == v_pages.shape, f"k_pages {k_pages.shape} != v_pages {v_pages.shape}")
    check(
        q.shape[2] == k_pages.shape[3],
        f"head_dim mismatch: q {q.shape[2]} vs pages {k_pages.shape[3]}",
    )


def check_head_dim(head_dim: int) -> None:
    check(
        head_dim in SUPPORTED_HEAD_DIMS,
        f"unsupported head_dim {head_dim}; supported: {SUPPORTED_HEAD_DIMS}",
    )


def check_dtype(name: str, x: jax.Array) -> None:
    check(
        jnp.dtype(x.dtype) in SUPPORTED_DTYPES,
        f"{name} has unsupported dtype {x.dtype}; use bfloat16, float16 or float32",
    )


def check_gqa(q_heads: int, kv_heads: int) -> int:
    """Validate grouped-query head counts and return the group size."""
    check(kv_heads > 0, "kv_heads must be positive")
    check(
        q_heads % kv_heads == 0,
        f"q_heads ({q_heads}) must be divisible by kv_heads ({kv_heads})",
    )
    return q_heads // kv_heads


def check_backend(backend: str) -> None:
    check(backend in ("gpu", "tpu"), f"backend must be 'gpu' or 'tpu', got {backend!r}")


def default_scale(sm_scale: float | None, head_dim: int) -> float:
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)


def gpu_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_interpret(interpret: bool) -> Any:
    """The `interpret` argument for a Mosaic TPU pallas_call: the TPU interpreter on CPU."""
    return pltpu.InterpretParams() if interpret else False


def tpu_params(semantics: tuple[str, ...]) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def online_softmax_step(
    acc: jax.Array, m: jax.Array, l_sum: jax.Array, s: jax.Array, v: jax.Array, *,
    masked: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax in the log2 domain (all kernels' inner step).

    `s` [rows, keys] are logits already scaled by scale*log2(e), masked keys at -inf; `v`
    [keys, d] with masked rows zeroed. `m`/`l_sum` are the running max and denominator,
    shaped [rows] (GPU loop carries) or [rows, 1] (TPU VMEM scratch); `acc` [rows, d] is
    float32. `masked=False` (every key of the block visible to every row) skips the guard
    for rows that have seen only masked keys (exp2(-inf - -inf) would be NaN).
    Returns the new (acc, m, l_sum).
    """
    col = m.ndim == 2  # [rows, 1] state broadcasts as is; [rows] needs a trailing axis
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=col))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - (m_safe if col else m_safe[:, None]))
    l_sum = alpha * l_sum + jnp.sum(p, axis=1, keepdims=col)
    acc = acc * (alpha if col else alpha[:, None]) + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
    )
    return acc, m_new, l_sum


def online_softmax_finish(acc: jax.Array, l_sum: jax.Array) -> jax.Array:
    """Normalise an online-softmax accumulator; rows that saw no key give 0, never NaN."""
    safe = jnp.where(l_sum == 0.0, 1.0, l_sum)
    return acc / safe


def combine_splits(
    acc: jax.Array, m: jax.Array, l_sum: jax.Array, axis: int
) -> jax.Array:
    """Merge split-K partial results (Flash-Decoding's combine step).

    `acc` holds unnormalised sum_j 2^(s_j - m) v_j per split, `m` the running max (log2
    domain) and `l_sum` the matching denominator. Splits that saw no key carry m = -inf,
    l = 0, acc = 0 and drop out with weight 0; a row with no key at all gives 0.
    """
    m_max = jnp.max(m, axis=axis, keepdims=True)
    m_max = jnp.where(jnp.isneginf(m_max), 0.0, m_max)
    w = jnp.exp2(m - m_max)
    num = jnp.sum(acc * w[..., None], axis=axis)
    den = jnp.sum(l_sum * w, axis=axis)
    return online_softmax_finish(num, den[..., None])


def tpu_decode_block(
    q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, m_sc: Any, l_sc: Any, acc_sc: Any, *,
    step: Any, seq_len: Any, block: int, scale: float,
) -> None:
    """One key block of a TPU decode kernel whose key axis is grid axis 2.

    Keys ``[step * block, (step + 1) * block)`` of a sequence holding ``seq_len`` keys: the
    first step resets the online-softmax state, blocks at or past ``seq_len`` skip compute
    (their index maps re-use the previous block, so nothing is fetched), keys past
    ``seq_len`` are masked and their V rows zeroed (stale rows may hold NaN), the last step
    writes the normalised output.
    """
    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    k_lo = step * block

    @pl.when(k_lo < seq_len)
    def _compute():
        v = v_ref[...]
        s = lax.dot_general(
            q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        kpos = k_lo + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(kpos < seq_len, s, NEG_INF)
        vpos = k_lo + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(vpos < seq_len, v, jnp.zeros_like(v))
        acc_sc[...], m_sc[...], l_sc[...] = online_softmax_step(
            acc_sc[...], m_sc[...], l_sc[...], s, v
        )

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = online_softmax_finish(acc_sc[...], l_sc[...]).astype(o_ref.dtype)

