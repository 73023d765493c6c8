"""Shared helpers for the attention kernels: argument checks, constants, backend plumbing."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import is_quantized_kv_dtype

LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Triton's tensor-core dot needs every matrix side to be at least 16.
MIN_DOT = 16


NEG_INF = float("-inf")  # masked logits; exp2(-inf - m) is exactly 0


def interpret_here() -> bool:
    """Whether the GPU (Triton) kernels must run in the Pallas interpreter here: on any
    default backend but a GPU (CPU tests; a TPU runs its own Mosaic kernels). Read at trace
    time, like every backend choice."""
    return jax.default_backend() != "gpu"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def cdiv(a: Any, b: int) -> Any:
    """Ceiling division that works on Python ints and traced int32 scalars."""
    return (a + b - 1) // b


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (at least 1)."""
    return max(d for d in range(1, min(n, max(1, at_most)) + 1) if n % d == 0)


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


def check_kv_scales(k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array | None,
                    v_scales: jax.Array | None) -> bool:
    """One-line errors for the scales of a quantized page pool (``kv_quant``); returns
    whether the pool is quantized.

    Quantized pages (int8 / float8_e4m3fn values) need both scale pools, shaped like the
    pages without head_dim (``[kv_heads, num_pages, page_size]``); float pages take none.
    """
    quantized = is_quantized_kv_dtype(k_pages.dtype)
    check(k_pages.dtype == v_pages.dtype,
          f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must share a dtype")
    if not quantized:
        check(k_scales is None and v_scales is None,
              f"k_scales/v_scales go with int8 or float8_e4m3fn pages, not {k_pages.dtype}")
        return False
    check(k_scales is not None and v_scales is not None,
          f"{k_pages.dtype} pages need k_scales and v_scales [kv_heads, num_pages, page_size]")
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        check(sc.shape == k_pages.shape[:-1],
              f"{name} must have shape {k_pages.shape[:-1]} (the pages without head_dim), "
              f"got {sc.shape}")
    return True


def check_head_dim(head_dim: int) -> None:
    """Refuse, in one line, a head size the attention kernels have no tiling for."""
    check(
        head_dim in SUPPORTED_HEAD_DIMS,
        f"unsupported head_dim {head_dim}; supported: {SUPPORTED_HEAD_DIMS}",
    )


def check_dtype(name: str, x: jax.Array) -> None:
    """Refuse, in one line naming the operand, a dtype the kernels do not take."""
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
    """Refuse a backend other than ``"gpu"`` (Pallas Triton) or ``"tpu"`` (Mosaic TPU)."""
    check(backend in ("gpu", "tpu"), f"backend must be 'gpu' or 'tpu', got {backend!r}")


def default_scale(sm_scale: float | None, head_dim: int) -> float:
    """The logit scale: ``sm_scale`` where given, else ``1 / sqrt(head_dim)``."""
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)


def gpu_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """A Pallas Triton launch's compiler parameters (warps per program, pipeline stages)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_interpret(interpret: bool) -> Any:
    """The `interpret` argument for a Mosaic TPU pallas_call: the TPU interpreter on CPU."""
    return pltpu.InterpretParams() if interpret else False


def tpu_params(semantics: tuple[str, ...]) -> pltpu.CompilerParams:
    """A Mosaic TPU launch's compiler parameters: each grid axis' ``"parallel"`` or
    ``"arbitrary"`` semantics."""
    return pltpu.CompilerParams(dimension_semantics=semantics)


def online_softmax_step(
    acc: jax.Array, m: jax.Array, l_sum: jax.Array, s: jax.Array, v: jax.Array, *,
    masked: bool = True, v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax in the log2 domain (all kernels' inner step).

    `s` [rows, keys] are logits already scaled by scale*log2(e), masked keys at -inf; `v`
    [keys, d] with masked rows zeroed. `m`/`l_sum` are the running max and denominator,
    shaped [rows] (GPU loop carries) or [rows, 1] (TPU VMEM scratch); `acc` [rows, d] is
    float32. `masked=False` (every key of the block visible to every row) skips the guard
    for rows that have seen only masked keys (exp2(-inf - -inf) would be NaN).
    `v_scale` [1, keys] float32: per-key scales of quantized `v` values (masked keys' scales
    zeroed), applied to the softmax weights before `p @ v`, so `v` is never dequantized.
    Returns the new (acc, m, l_sum).
    """
    col = m.ndim == 2  # [rows, 1] state broadcasts as is; [rows] needs a trailing axis
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=col))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - (m_safe if col else m_safe[:, None]))
    l_sum = alpha * l_sum + jnp.sum(p, axis=1, keepdims=col)
    if v_scale is not None:
        p = p * v_scale
    acc = acc * (alpha if col else alpha[:, None]) + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
    )
    return acc, m_new, l_sum


def key_block_step(
    acc: jax.Array, m: jax.Array, l_sum: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
    *, scale: float, valid: jax.Array | None, key_start: Any, key_end: Any,
    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of keys of an attention kernel: logits, masks, then `online_softmax_step`.

    `q` [rows, d]; `k`, `v` [keys, d] hold keys `[key_start, key_start + keys)` of a sequence
    with `key_end` keys; `valid` [rows, keys] says which logits count (the rest become -inf).
    V rows at or past `key_end` are zeroed (stale rows may hold NaN). `valid=None`: the block
    lies below `key_end` and every row sees all its keys, so nothing is masked. Quantized pages
    (`kv_quant`) pass `k_scale`, `v_scale` [keys]: the values are widened to q's dtype
    (exact for int8 and e4m3), each key's logits are multiplied by its scale, and each
    value's softmax weight by its own (past `key_end` zeroed), so no block is dequantized.
    """
    quantized = k_scale is not None
    if quantized:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    ) * scale
    if quantized:
        s = s * k_scale.astype(jnp.float32)[None, :]
    if valid is None:
        v_scale = None if v_scale is None else v_scale.astype(jnp.float32)[None, :]
        return online_softmax_step(acc, m, l_sum, s, v, masked=False, v_scale=v_scale)
    s = jnp.where(valid, s, NEG_INF)
    vpos = key_start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where(vpos < key_end, v, jnp.zeros_like(v))
    if quantized:
        spos = key_start + lax.broadcasted_iota(jnp.int32, (1, v.shape[0]), 1)
        v_scale = jnp.where(spos < key_end, v_scale.astype(jnp.float32)[None, :], 0.0)
    return online_softmax_step(acc, m, l_sum, s, v, v_scale=v_scale)


def online_softmax_finish(acc: jax.Array, l_sum: jax.Array) -> jax.Array:
    """Normalise an online-softmax accumulator; rows that saw no key give 0, never NaN."""
    safe = jnp.where(l_sum == 0.0, 1.0, l_sum)
    return acc / safe


def split_partials(b: int, hkv: int, num_splits: int, gp: int, d: int,
                   acc_rows: int | None = None) -> tuple[list[Any], list[jax.ShapeDtypeStruct]]:
    """Out specs and shapes of a split-K decode kernel on grid ``(b, hkv, num_splits)``: the
    float32 partials ``acc``, ``m`` and ``l_sum [b, hkv, splits, gp]`` that
    ``combine_splits`` merges. ``acc`` is ``[b, hkv, splits, gp, d]``, one block per
    program; with ``acc_rows`` it is one whole ``[b * hkv * splits * acc_rows, d]`` array
    into which each program stores its ``acc_rows`` real query rows (a masked store: the
    padding rows up to ``gp`` are never written)."""
    if acc_rows is None:
        acc_spec = pl.BlockSpec((None, None, None, gp, d), lambda bi, h, s: (bi, h, s, 0, 0))
        acc_shape = (b, hkv, num_splits, gp, d)
    else:
        acc_shape = (b * hkv * num_splits * acc_rows, d)
        acc_spec = pl.BlockSpec(acc_shape, lambda bi, h, s: (0, 0))
    row_spec = pl.BlockSpec((None, None, None, gp), lambda bi, h, s: (bi, h, s, 0))
    row_shape = jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32)
    return ([acc_spec, row_spec, row_spec],
            [jax.ShapeDtypeStruct(acc_shape, jnp.float32), row_shape, row_shape])


def combine_splits_reference(
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


def half_pairs(x: jax.Array) -> jax.Array:
    """Each value of ``x`` (float32) rounded to float16 and doubled into the pair ``(x, x)``:
    int32 of ``x``'s shape (what the float16-pair GEMV multiplies two weights by at once)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(u | lax.shift_left(u, jnp.uint32(16)), jnp.int32)


def scaled_pairs(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A group ``y [..., G]`` float32 as pairs ``[..., G]`` int32 (``half_pairs``) of ``y /
    scale`` and its ``scale [..., 1]``: the largest ``|y|``, 1 where all are 0, so the pairs
    fit float16 whatever ``y``'s size (``junction.ScaledPairs``)."""
    peak = jnp.max(jnp.abs(y), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak, 1.0)
    return half_pairs(y / scale), scale


def _combine_kernel(acc_ref: Any, m_ref: Any, l_ref: Any, o_ref: Any, *refs: Any,
                    out_dtype: Any) -> None:
    # One (sequence, kv head, query row): acc [splits, d], m and l [splits]. With a scale ref
    # after o_ref, the row goes out as scaled pairs (``scaled_pairs``) of its out_dtype value.
    m = m_ref[...]
    m_max = jnp.max(m)
    w = jnp.exp2(m - jnp.where(m_max == NEG_INF, 0.0, m_max))  # [splits]
    num = jnp.sum(acc_ref[...] * w[:, None], axis=0)  # [d]
    den = jnp.sum(l_ref[...] * w)
    out = online_softmax_finish(num, den).astype(out_dtype)
    if refs:
        pairs, scale = scaled_pairs(out.astype(jnp.float32)[None, :])
        o_ref[...] = pairs[0]
        refs[0][...] = scale[0]
    else:
        o_ref[...] = out


def combine_splits(acc: jax.Array, m: jax.Array, l_sum: jax.Array, group: int,
                   out_dtype: Any, interpret: bool = False, pairs: bool = False
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash-Decoding's combine (``combine_splits_reference`` over axis 2) as one Pallas
    (Triton) kernel, in ``out_dtype``; ``pairs``: each row as ``scaled_pairs`` of that
    value instead, ``(pairs [b, kv_heads, group, d] int32, scales [b, kv_heads, group, 1]
    float32)``, for an o GEMV that reads them (one head per scale group).

    ``acc [b, kv_heads, splits, rows, d]`` and ``m``/``l_sum [b, kv_heads, splits, gp]`` as
    the GPU decode kernels write them (``rows`` is ``gp`` for the contiguous kernel and
    ``group`` for the paged one; ``gp >= group``), of which the first ``group`` query rows
    are real; returns ``[b, kv_heads, group, d]``. One program per sequence, kv head and
    query row: XLA's version of the same arithmetic is five or six small kernels per layer,
    about 0.25 ms of an 8B batch-1 token on an H100 (bench/NOTES.md r37).
    """
    b, hkv, splits, _, d = acc.shape
    row = pl.BlockSpec((None, None, None, d), lambda bi, h, r: (bi, h, r, 0))
    if pairs:
        out_specs = [row, pl.BlockSpec((None, None, None, 1), lambda bi, h, r: (bi, h, r, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, group, d), jnp.int32),
                     jax.ShapeDtypeStruct((b, hkv, group, 1), jnp.float32)]
    else:
        out_specs, out_shape = row, jax.ShapeDtypeStruct((b, hkv, group, d), out_dtype)
    return pl.pallas_call(
        functools.partial(_combine_kernel, out_dtype=jnp.dtype(out_dtype)),
        grid=(b, hkv, group),
        in_specs=[
            pl.BlockSpec((None, None, splits, None, d), lambda bi, h, r: (bi, h, 0, r, 0)),
            pl.BlockSpec((None, None, splits, None), lambda bi, h, r: (bi, h, 0, r)),
            pl.BlockSpec((None, None, splits, None), lambda bi, h, r: (bi, h, 0, r)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=gpu_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxinfer_combine_splits",
    )(acc, m, l_sum)


def tpu_decode_block(
    q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, m_sc: Any, l_sc: Any, acc_sc: Any, *,
    step: Any, seq_len: Any, block: int, scale: float, ks_ref: Any = None, vs_ref: Any = None,
) -> None:
    """One key block of a TPU decode kernel whose key axis is grid axis 2.

    Keys ``[step * block, (step + 1) * block)`` of a sequence holding ``seq_len`` keys: the
    first step resets the online-softmax state, blocks at or past ``seq_len`` skip compute
    (their index maps re-use the previous block, so nothing is fetched), keys past
    ``seq_len`` are masked and their V rows zeroed (stale rows may hold NaN), the last step
    writes the normalised output. ``ks_ref``/``vs_ref``: the block's ``[block]`` scales of
    quantized K/V (``key_block_step``).
    """
    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    k_lo = step * block

    @pl.when(k_lo < seq_len)
    def _compute():
        q = q_ref[...]
        kpos = k_lo + lax.broadcasted_iota(jnp.int32, (q.shape[0], block), 1)
        acc_sc[...], m_sc[...], l_sc[...] = key_block_step(
            acc_sc[...], m_sc[...], l_sc[...], q, k_ref[...], v_ref[...], scale=scale,
            valid=kpos < seq_len, key_start=k_lo, key_end=seq_len,
            k_scale=None if ks_ref is None else ks_ref[...],
            v_scale=None if vs_ref is None else vs_ref[...],
        )

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = online_softmax_finish(acc_sc[...], l_sc[...]).astype(o_ref.dtype)

