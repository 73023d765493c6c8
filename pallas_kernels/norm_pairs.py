"""The junction before an int4 / int8 GEMV at decode: residual add, RMSNorm statistics and
float16 activation pairs in one kernel.

At batch 1 XLA runs ``h + o @ W`` followed by ``rms_norm`` and ``word_gemv``'s activation
pairs as three kernels: the sum of the GEMV's split-K partials (a wide reduction), the
residual add with the norm's mean square (a one-block reduction: latency), and the norm
applied and packed into pairs (H200, r249-r250: 3.75 us per call at 8B shapes, 4.81 at 70B,
plus two launch gaps). None of XLA's formulations makes fewer (r250). This kernel does it in
one pass over column blocks, with nothing that needs the whole row: each program sums its
columns' partials, adds the residual, and writes its groups' sums of squares; the pairs are
of ``y = h * weight`` divided by each group's largest ``|y|``, so they fit float16 whatever
the norm. The GEMV that reads them (``word_gemv`` with ``NormPairs``) multiplies each
group's products by that group's scale, and its output by ``rsqrt(mean square + eps)``,
which it makes from the groups' sums of squares. The norm is linear in ``y``, so this is
RMSNorm then the matmul; it skips the two bfloat16 roundings of HF's norm
(``weight * bf16(h * r)``), which only makes it closer to the float32 product.

``add_norm_pairs_reference`` is the same in plain jnp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, gpu_params


def half_pairs(x: jax.Array) -> jax.Array:
    """Each value of ``x`` (float32) rounded to float16 and doubled into the pair ``(x, x)``:
    int32 of ``x``'s shape (what the float16-pair GEMV multiplies two weights by at once)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(u | lax.shift_left(u, jnp.uint32(16)), jnp.int32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pairs", "scales", "sumsq"],
                   meta_fields=["eps", "dtype"])
@dataclasses.dataclass(frozen=True)
class NormPairs:
    """``rms_norm(h, weight, eps)`` for ``R`` rows of ``N`` values in ``G``-value groups, as a
    GEMV reads it: ``pairs`` int32 ``[R, N]`` (``half_pairs`` of ``y / scales``, ``y = h *
    weight`` in float32), ``scales`` float32 ``[R, N / G]`` (each group's largest ``|y|``, 1
    where all are 0), ``sumsq`` float32 ``[R, N / G]`` (each group's sum of ``h ** 2``);
    ``dtype``: ``h``'s, which a matmul of them returns by default."""

    pairs: jax.Array
    scales: jax.Array
    sumsq: jax.Array
    eps: float
    dtype: Any

    @property
    def group(self) -> int:
        """Values per group (``G``)."""
        return self.pairs.shape[-1] // self.scales.shape[-1]

    def inv_rms(self) -> jax.Array:
        """``rsqrt(mean(h ** 2) + eps)`` per row, float32 ``[R, 1]``."""
        mean_sq = jnp.sum(self.sumsq, axis=-1, keepdims=True) / self.pairs.shape[-1]
        return lax.rsqrt(mean_sq + self.eps)

    def normalized(self) -> jax.Array:
        """The normalized activations ``[R, N]`` float32 these pairs stand for (for a matmul
        that does not read pairs)."""
        halves = lax.bitcast_convert_type(
            (lax.bitcast_convert_type(self.pairs, jnp.uint32) & 0xFFFF).astype(jnp.uint16),
            jnp.float16).astype(jnp.float32)
        r, n = self.pairs.shape
        grouped = halves.reshape(r, self.scales.shape[-1], self.group) * self.scales[..., None]
        return grouped.reshape(r, n) * self.inv_rms()


def _stats_and_pairs(h: jax.Array, weight: jax.Array) -> tuple[jax.Array, ...]:
    """For one group ``h [1, G]`` (its dtype) and ``weight [G]``: pairs ``[1, G]`` int32, the
    scale and the sum of squares ``[1, 1]`` float32."""
    h32 = h.astype(jnp.float32)
    y = h32 * weight.astype(jnp.float32)[None, :]
    peak = jnp.max(jnp.abs(y), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak, 1.0)
    return half_pairs(y / scale), scale, jnp.sum(h32 * h32, axis=-1, keepdims=True)


def add_norm_pairs_reference(partials: jax.Array | None, residual: jax.Array,
                             weight: jax.Array, *, group: int, eps: float
                             ) -> tuple[jax.Array, NormPairs]:
    """``h = residual + sum(partials, 0)`` (the sum rounded to ``residual``'s dtype first, as
    a matmul's output is) and its ``NormPairs``, in plain jnp. ``partials [S, R, N]`` float32
    (a GEMV's split-K partials) or None (``h = residual``); ``residual [R, N]``; ``weight
    [N]``; ``group`` divides ``N``. Returns ``(h [R, N] in residual's dtype, NormPairs)``."""
    h = residual
    if partials is not None:
        h = residual + jnp.sum(partials, axis=0).astype(residual.dtype)
    r, n = h.shape
    hg = h.reshape(r * (n // group), group)
    wg = jnp.tile(weight.reshape(n // group, group), (r, 1))
    pairs, scales, sumsq = jax.vmap(lambda a, b: _stats_and_pairs(a[None], b))(hg, wg)
    return h, NormPairs(pairs.reshape(r, n), scales.reshape(r, n // group),
                        sumsq.reshape(r, n // group), eps, jnp.dtype(h.dtype))


def _kernel(*refs, rows: int, chunk: int, chunks: int, has_partials: bool) -> None:
    """One group of columns: ``p_ref [S, R, G]`` (with partials), ``res_ref [R, G]``, ``w_ref
    [G]`` in; ``h_ref [R, G]``, ``x_ref [R, G]`` int32, ``s_ref`` / ``ss_ref [R, 1]`` out."""
    if has_partials:
        p_ref, res_ref, w_ref, h_ref, x_ref, s_ref, ss_ref = refs
    else:
        res_ref, w_ref, h_ref, x_ref, s_ref, ss_ref = refs
    w = w_ref[...]
    for r in range(rows):  # rows are few (decode); a Triton block side must be a power of 2
        h = res_ref[pl.ds(r, 1), :]  # [1, G]
        if has_partials:
            def body(i, acc, r=r):  # chunks of split partials in flight together
                return acc + jnp.sum(p_ref[pl.ds(i * chunk, chunk), r, :], axis=0)[None, :]
            total = lax.fori_loop(0, chunks, body, jnp.zeros(h.shape, jnp.float32))
            h = (h.astype(jnp.float32) + total.astype(h.dtype).astype(jnp.float32)
                 ).astype(h.dtype)
        pairs, scale, sumsq = _stats_and_pairs(h, w)
        h_ref[pl.ds(r, 1), :] = h
        x_ref[pl.ds(r, 1), :] = pairs
        s_ref[pl.ds(r, 1), :] = scale
        ss_ref[pl.ds(r, 1), :] = sumsq


@functools.partial(jax.jit, static_argnames=("group", "eps", "interpret"))
def add_norm_pairs(partials: jax.Array | None, residual: jax.Array, weight: jax.Array, *,
                   group: int, eps: float, interpret: bool = False
                   ) -> tuple[jax.Array, NormPairs]:
    """``add_norm_pairs_reference`` as one GPU kernel (module docstring): a program per group
    of ``group`` columns (a power of two), each summing its columns' split partials in chunks
    of the largest power of two up to 16 that divides their number (a Triton block's side is a
    power of two). ``interpret``: Pallas' interpreter (CPU tests)."""
    r, n = residual.shape
    check(group & (group - 1) == 0 and n % group == 0,
          f"group {group} must be a power of two dividing the {n} columns")
    check(weight.shape == (n,), f"weight {weight.shape} must be ({n},)")
    has_partials = partials is not None
    operands, specs, chunk, chunks = [], [], 1, 0
    if has_partials:
        check(partials.shape[1:] == (r, n) and partials.dtype == jnp.float32,
              f"partials {partials.shape} {partials.dtype} must be float32 [S, {r}, {n}]")
        chunk = min(partials.shape[0] & -partials.shape[0], 16)  # a power of two dividing S
        chunks = partials.shape[0] // chunk
        operands.append(partials)
        specs.append(pl.BlockSpec((partials.shape[0], r, group), lambda j: (0, 0, j)))
    operands += [residual, weight]
    specs += [pl.BlockSpec((r, group), lambda j: (0, j)), pl.BlockSpec((group,), lambda j: (j,))]
    groups = n // group
    stats = jax.ShapeDtypeStruct((r, groups), jnp.float32)
    h, pairs, scales, sumsq = pl.pallas_call(
        functools.partial(_kernel, rows=r, chunk=chunk, chunks=chunks,
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
    return h, NormPairs(pairs, scales, sumsq, eps, jnp.dtype(residual.dtype))
