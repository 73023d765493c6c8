"""The junctions between int4 / int8 GEMVs at decode, each in one kernel: a matmul's split-K
partials summed, and the next matmul's input made from them as block-scaled float16 pairs.

At batch 1 XLA runs ``h + o @ W`` followed by ``rms_norm`` and ``word_gemv``'s activation
pairs as three kernels: the sum of the GEMV's split-K partials (a wide reduction), the
residual add with the norm's mean square (a one-block reduction: latency), and the norm
applied and packed into pairs (H200, r249-r250: 3.75 us per call at 8B shapes, 4.81 at 70B,
plus two launch gaps); after gate|up, ``silu(gate) * up`` and the pairs take two. None of
XLA's formulations makes fewer (r250).

``add_norm_pairs`` does the first in one pass over column groups, with nothing that needs
the whole row: each program sums its columns' partials, adds the residual, and writes its
group's sum of squares; the pairs are of ``y = h * weight`` divided by the group's largest
``|y|``, so they fit float16 whatever the norm. The GEMV that reads them (``word_gemv`` with
``ScaledPairs``) multiplies each group's products by that group's scale, and its output by
``rsqrt(mean square + eps)``, which it makes from the groups' sums of squares. The norm is
linear in ``y``, so this is RMSNorm then the matmul; it skips the two bfloat16 roundings of
HF's norm (``weight * bf16(h * r)``), which only brings it closer to the float32 product.
``silu_mul_pairs`` sums gate|up's partials and makes ``silu(gate) * up`` as pairs the same
way (no norm).

In the engine (H200, batch 1, against XLA's junctions): 8B int4-g128 460.7 against 416 tok/s,
int8 293.2 against 291.2, 70B int4-g128 82.5 against 82.2 (r252-r260).

``*_reference``: the same in plain jnp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, gpu_params, scaled_pairs


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pairs", "scales", "sumsq"],
                   meta_fields=["eps", "dtype"])
@dataclasses.dataclass(frozen=True)
class ScaledPairs:
    """A matmul's input ``y`` (``R`` rows of ``N`` values in ``G``-value groups) as a GEMV
    reads it: ``pairs`` int32 ``[R, N]`` (``_common.half_pairs`` of ``y / scales``), ``scales``
    float32 ``[R, N / G]`` (each group's largest ``|y|``, 1 where all are 0). With ``sumsq``
    (float32 ``[R, N / G]``, each group's sum of ``h ** 2``) the input is ``rms_norm(h,
    weight, eps)`` and ``y = h * weight``; without (None), ``y`` itself. ``dtype``: the
    activations', which a matmul of them returns by default."""

    pairs: jax.Array
    scales: jax.Array
    dtype: Any
    sumsq: jax.Array | None = None
    eps: float = 0.0

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, N)``: the shape of the activations these pairs stand for."""
        return self.pairs.shape

    @property
    def group(self) -> int:
        """Values per group (``G``)."""
        return self.pairs.shape[-1] // self.scales.shape[-1]

    def inv_rms(self) -> jax.Array:
        """``rsqrt(mean(h ** 2) + eps)`` per row, float32 ``[R, 1]`` (1 without ``sumsq``)."""
        if self.sumsq is None:
            return jnp.ones((self.pairs.shape[0], 1), jnp.float32)
        mean_sq = jnp.sum(self.sumsq, axis=-1, keepdims=True) / self.pairs.shape[-1]
        return lax.rsqrt(mean_sq + self.eps)

    def values(self) -> jax.Array:
        """The activations ``[R, N]`` float32 these pairs stand for (for a matmul that does
        not read pairs)."""
        halves = lax.bitcast_convert_type(
            (lax.bitcast_convert_type(self.pairs, jnp.uint32) & 0xFFFF).astype(jnp.uint16),
            jnp.float16).astype(jnp.float32)
        r, n = self.shape
        grouped = halves.reshape(r, self.scales.shape[-1], self.group) * self.scales[..., None]
        return grouped.reshape(r, n) * self.inv_rms()


def _grouped(fn, r: int, n: int, group: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``fn`` (one group's ``[1, G]`` slices of ``arrays``, each ``[R, N]`` or ``[N]``, to
    ``[1, G]`` / ``[1, 1]`` results) over every row and group: results ``[R, N]`` / ``[R, N /
    G]``."""
    def split(a):
        a = a if a.ndim == 2 else jnp.broadcast_to(a, (r, n))
        return a.reshape(r * (n // group), 1, group)
    outs = jax.vmap(fn)(*map(split, arrays))
    return tuple(o.reshape(r, -1) for o in outs)


def _split_sum(p_ref: Any, r: int, splits: int) -> jax.Array:
    """Row ``r`` of ``p_ref [S, R, G]`` summed over its ``splits`` (S) partials: ``[1, G]``
    float32. One load per partial, unrolled so that all are in flight at once: a load of
    several partials summed over that axis reduces across threads, which was slower (H200,
    r257: 70B shapes, S=28, 2.19 us in 7 loads of 4, 1.60 us in 28 loads of 1)."""
    return sum(p_ref[pl.ds(i, 1), r, :] for i in range(splits))  # [1, G] each


def _add_norm_group(h: jax.Array, weight: jax.Array) -> tuple[jax.Array, ...]:
    """One group of ``add_norm_pairs``: ``h [1, G]``, ``weight [1, G]`` to pairs, scale and
    sum of squares."""
    h32 = h.astype(jnp.float32)
    pairs, scale = scaled_pairs(h32 * weight.astype(jnp.float32))
    return pairs, scale, jnp.sum(h32 * h32, axis=-1, keepdims=True)


def add_norm_pairs_reference(partials: jax.Array | None, residual: jax.Array,
                             weight: jax.Array, *, group: int, eps: float
                             ) -> tuple[jax.Array, ScaledPairs]:
    """``h = residual + sum(partials, 0)`` (the sum rounded to ``residual``'s dtype first, as
    a matmul's output is) and ``rms_norm(h, weight, eps)`` as ``ScaledPairs``, in plain jnp.
    ``partials [S, R, N]`` float32 (a GEMV's split-K partials) or None (``h = residual``);
    ``residual [R, N]``; ``weight [N]``; ``group`` divides ``N``. Returns ``(h [R, N] in
    residual's dtype, ScaledPairs)``."""
    h = residual
    if partials is not None:
        h = residual + jnp.sum(partials, axis=0).astype(residual.dtype)
    r, n = h.shape
    pairs, scales, sumsq = _grouped(_add_norm_group, r, n, group, h, weight)
    return h, ScaledPairs(pairs, scales, jnp.dtype(h.dtype), sumsq, eps)


def _add_norm_kernel(*refs, rows: int, splits: int, has_partials: bool) -> None:
    """One group of columns: ``p_ref [S, R, G]`` (with partials), ``res_ref [R, G]``, ``w_ref
    [G]`` in; ``h_ref [R, G]``, ``x_ref [R, G]`` int32, ``s_ref`` / ``ss_ref [R, 1]`` out."""
    p_ref, *refs = refs if has_partials else (None, *refs)
    res_ref, w_ref, h_ref, x_ref, s_ref, ss_ref = refs
    w = w_ref[...][None, :]
    for r in range(rows):  # rows are few (decode); a Triton block side must be a power of 2
        h = res_ref[pl.ds(r, 1), :]  # [1, G]
        if has_partials:
            total = _split_sum(p_ref, r, splits)
            h = (h.astype(jnp.float32) + total.astype(h.dtype).astype(jnp.float32)
                 ).astype(h.dtype)
        pairs, scale, sumsq = _add_norm_group(h, w)
        h_ref[pl.ds(r, 1), :] = h
        x_ref[pl.ds(r, 1), :] = pairs
        s_ref[pl.ds(r, 1), :] = scale
        ss_ref[pl.ds(r, 1), :] = sumsq


def _check_partials(partials: jax.Array, r: int, n: int) -> None:
    check(partials.ndim == 3 and partials.shape[1:] == (r, n)
          and partials.dtype == jnp.float32,
          f"partials {partials.shape} {partials.dtype} must be float32 [S, {r}, {n}]")


def _check_group(group: int, n: int) -> None:
    check(group > 0 and group & (group - 1) == 0 and n % group == 0,
          f"group {group} must be a power of two dividing the {n} columns")


@functools.partial(jax.jit, static_argnames=("group", "eps", "interpret"))
def add_norm_pairs(partials: jax.Array | None, residual: jax.Array, weight: jax.Array, *,
                   group: int, eps: float, interpret: bool = False
                   ) -> tuple[jax.Array, ScaledPairs]:
    """``add_norm_pairs_reference`` as one GPU kernel (module docstring): a program per group
    of ``group`` columns (a power of two), each summing its columns' split partials
    (``_split_sum``). ``interpret``: Pallas' interpreter (CPU tests)."""
    r, n = residual.shape
    _check_group(group, n)
    check(weight.shape == (n,), f"weight {weight.shape} must be ({n},)")
    has_partials = partials is not None
    operands, specs = [], []
    if has_partials:
        _check_partials(partials, r, n)
        operands.append(partials)
        specs.append(pl.BlockSpec((partials.shape[0], r, group), lambda j: (0, 0, j)))
    operands += [residual, weight]
    specs += [pl.BlockSpec((r, group), lambda j: (0, j)), pl.BlockSpec((group,), lambda j: (j,))]
    groups = n // group
    stats = jax.ShapeDtypeStruct((r, groups), jnp.float32)
    h, pairs, scales, sumsq = pl.pallas_call(
        functools.partial(_add_norm_kernel, rows=r,
                          splits=partials.shape[0] if has_partials else 0,
                          has_partials=has_partials),
        grid=(groups,),
        in_specs=specs,
        out_specs=[pl.BlockSpec((r, group), lambda j: (0, j))] * 2
        + [pl.BlockSpec((r, 1), lambda j: (0, j))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, n), residual.dtype),
                   jax.ShapeDtypeStruct((r, n), jnp.int32), stats, stats],
        compiler_params=gpu_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxinfer_add_norm_pairs",
    )(*operands)
    return h, ScaledPairs(pairs, scales, jnp.dtype(residual.dtype), sumsq, eps)


def _silu_mul_group(gate: jax.Array, up: jax.Array, dtype: Any) -> tuple[jax.Array, ...]:
    """One group of ``silu_mul_pairs``: summed ``gate``, ``up [1, G]`` float32, each rounded
    to ``dtype`` as a matmul's output is, to pairs and scale of ``silu(gate) * up``."""
    g = gate.astype(dtype).astype(jnp.float32)
    u = up.astype(dtype).astype(jnp.float32)
    return scaled_pairs(g / (1 + jnp.exp(-g)) * u)


def silu_mul_pairs_reference(partials: jax.Array, *, group: int, dtype: Any) -> ScaledPairs:
    """``silu(gate) * up`` as ``ScaledPairs`` (no norm), in plain jnp, from gate|up's split-K
    partials ``[S, R, 2F]`` float32 (gate the first ``F`` columns, up the rest; each sum
    rounded to ``dtype``, the activations'); ``group`` divides ``F``."""
    total = jnp.sum(partials, axis=0)
    r, f = total.shape[0], total.shape[1] // 2
    pairs, scales = _grouped(functools.partial(_silu_mul_group, dtype=dtype), r, f, group,
                             total[:, :f], total[:, f:])
    return ScaledPairs(pairs, scales, jnp.dtype(dtype))


def _silu_mul_kernel(g_ref, u_ref, x_ref, s_ref, *, rows: int, splits: int, dtype: Any) -> None:
    """One group of columns: gate and up partials ``[S, R, G]`` in; ``x_ref [R, G]`` int32 and
    ``s_ref [R, 1]`` out."""
    for r in range(rows):
        pairs, scale = _silu_mul_group(_split_sum(g_ref, r, splits),
                                       _split_sum(u_ref, r, splits), dtype)
        x_ref[pl.ds(r, 1), :] = pairs
        s_ref[pl.ds(r, 1), :] = scale


@functools.partial(jax.jit, static_argnames=("group", "dtype", "interpret"))
def silu_mul_pairs(partials: jax.Array, *, group: int, dtype: Any,
                   interpret: bool = False) -> ScaledPairs:
    """``silu_mul_pairs_reference`` as one GPU kernel: a program per group of ``group`` output
    columns, reading that group's gate and up partials. ``interpret``: Pallas' interpreter."""
    check(partials.ndim == 3 and partials.shape[2] % 2 == 0,
          f"partials {partials.shape} must be [S, R, 2F] (gate, then up)")
    s, r, f2 = partials.shape
    f = f2 // 2
    _check_partials(partials, r, f2)
    _check_group(group, f)
    groups = f // group
    pairs, scales = pl.pallas_call(
        functools.partial(_silu_mul_kernel, rows=r, splits=s, dtype=jnp.dtype(dtype)),
        grid=(groups,),
        in_specs=[pl.BlockSpec((s, r, group), lambda j: (0, 0, j)),
                  pl.BlockSpec((s, r, group), lambda j: (0, 0, j + groups))],
        out_specs=[pl.BlockSpec((r, group), lambda j: (0, j)),
                   pl.BlockSpec((r, 1), lambda j: (0, j))],
        out_shape=[jax.ShapeDtypeStruct((r, f), jnp.int32),
                   jax.ShapeDtypeStruct((r, groups), jnp.float32)],
        compiler_params=gpu_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxinfer_silu_mul_pairs",
    )(partials, partials)
    return ScaledPairs(pairs, scales, jnp.dtype(dtype))


def _rope_head(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array,
               rotate: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """One head's halves ``[1, D / 2]`` float32 (each rounded to ``dtype`` first, as a
    matmul's output is) rotated by ``cos``, ``sin`` where ``rotate`` (a traced bool), else as
    they are: the halves in ``dtype``."""
    x1 = x1.astype(dtype).astype(jnp.float32)
    x2 = x2.astype(dtype).astype(jnp.float32)
    r1 = jnp.where(rotate, x1 * cos - x2 * sin, x1)
    r2 = jnp.where(rotate, x2 * cos + x1 * sin, x2)
    return r1.astype(dtype), r2.astype(dtype)


def sum_rope_reference(partials: jax.Array, cos: jax.Array, sin: jax.Array, *,
                       head_dim: int, rotated_heads: int, dtype: Any) -> jax.Array:
    """The fused QKV product from its split-K ``partials [S, T, H * D]`` float32, summed and
    rounded to ``dtype``, its first ``rotated_heads`` heads (Q's and K's) rotated by ``cos``
    and ``sin [T, D / 2]`` float32 (non-interleaved halves, as ``model.apply_rope``), in plain
    jnp: ``[T, H * D]`` in ``dtype``."""
    s, t, n = partials.shape
    x = jnp.sum(partials, axis=0).reshape(t, n // head_dim, 2, head_dim // 2)
    heads = jnp.arange(n // head_dim)[None, :, None] < rotated_heads
    r1, r2 = _rope_head(x[:, :, 0], x[:, :, 1], cos[:, None], sin[:, None], heads, dtype)
    return jnp.stack([r1, r2], axis=2).reshape(t, n)


def _sum_rope_kernel(p1_ref, p2_ref, cos_ref, sin_ref, o_ref, *, rows: int, splits: int,
                     rotated_heads: int, dtype: Any) -> None:
    """One head: its two halves' partials ``[S, T, D / 2]`` and ``cos``, ``sin [T, D / 2]`` in;
    ``o_ref [T, D]`` out."""
    rotate = pl.program_id(0) < rotated_heads
    half = p1_ref.shape[-1]
    for r in range(rows):
        r1, r2 = _rope_head(_split_sum(p1_ref, r, splits),
                            _split_sum(p2_ref, r, splits),
                            cos_ref[pl.ds(r, 1), :], sin_ref[pl.ds(r, 1), :], rotate, dtype)
        o_ref[pl.ds(r, 1), pl.ds(0, half)] = r1
        o_ref[pl.ds(r, 1), pl.ds(half, half)] = r2


@functools.partial(jax.jit, static_argnames=("head_dim", "rotated_heads", "dtype", "interpret"))
def sum_rope(partials: jax.Array, cos: jax.Array, sin: jax.Array, *, head_dim: int,
             rotated_heads: int, dtype: Any, interpret: bool = False) -> jax.Array:
    """``sum_rope_reference`` as one GPU kernel, a program per head: where XLA summed the QKV
    GEMV's partials in one kernel and rotated Q and K while packing them for the paged
    attention kernel in another. ``interpret``: Pallas' interpreter."""
    check(partials.ndim == 3 and partials.dtype == jnp.float32
          and partials.shape[2] % head_dim == 0,
          f"partials {partials.shape} {partials.dtype} must be float32 [S, T, heads * "
          f"{head_dim}]")
    s, t, n = partials.shape
    half = head_dim // 2
    check(cos.shape == sin.shape == (t, half), f"cos {cos.shape} and sin {sin.shape} must be "
          f"[{t}, {half}]")
    heads = n // head_dim
    return pl.pallas_call(
        functools.partial(_sum_rope_kernel, rows=t, splits=s,
                          rotated_heads=rotated_heads, dtype=jnp.dtype(dtype)),
        grid=(heads,),
        in_specs=[pl.BlockSpec((s, t, half), lambda j: (0, 0, 2 * j)),
                  pl.BlockSpec((s, t, half), lambda j: (0, 0, 2 * j + 1)),
                  pl.BlockSpec((t, half), lambda j: (0, 0)),
                  pl.BlockSpec((t, half), lambda j: (0, 0))],
        out_specs=pl.BlockSpec((t, head_dim), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((t, n), dtype),
        compiler_params=gpu_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxinfer_sum_rope",
    )(partials, partials, cos.astype(jnp.float32), sin.astype(jnp.float32))
