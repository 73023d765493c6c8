"""Batch-1 int4 GEMV over the transposed packed layout ``[N, K / 2]``: an experiment for the
layout question of bench/NOTES.md (ninth session), not yet used by the model.

``int4_matmul`` reads ``q [K / 2, N]``: a program's 16-byte load holds 16 columns' bytes of
one byte row, so every weight of a load needs a different output accumulator. Here each
output column's packed bytes are contiguous (``qt [N, K / 2]``, GGUF's own order, with
``scale``/``zero`` as ``[N, K / G]``): one 16-byte load holds 32 weights of a single column,
whose products are summed in registers. Fields become floats as in ``word_gemv`` (a shift
and an and-or per weight, no int-to-float conversion).

Nibble order within a group as ``jaxinfer.quantize``: byte ``j`` of a group holds row ``j``
(low nibble) and row ``j + G / 2`` (high nibble). Word ``w`` of a group (bytes ``4w .. 4w +
3``) therefore meets rows ``4w + b`` and ``G / 2 + 4w + b`` for its byte lane ``b``: strided
slices of ``x``.

GPU only (Pallas Triton; the Triton interpreter on CPU for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, check, gpu_params, largest_divisor, next_pow2
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.word_gemv import WORD_ROWS, field_as_float


def int4_gemv_nk_reference(x: jax.Array, qt: jax.Array, scale_t: jax.Array,
                           zero_t: jax.Array) -> jax.Array:
    """``int4_gemv_nk`` in plain jnp: the ``int4_matmul`` reference on the transposed
    operands, ``[M, N]`` float32."""
    return int4_matmul_reference(x, qt.T, scale_t.T, zero_t.T, out_dtype=jnp.float32)


def _nk_kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, group: int, groups_per_step: int,
               steps_per_split: int) -> None:
    """One ``[rows, block_n]`` partial over this program's split of K.

    x_ref ``[rows, K]``; q_ref ``[block_n, K / 8]`` uint32 (a column's packed bytes per row);
    s_ref, z_ref ``[block_n, K / G]``; o_ref ``[rows, block_n]``.
    """
    rows = x_ref.shape[0]
    block_n = q_ref.shape[0]
    gw = group // 8  # words per group and column
    half = group // 2
    split = pl.program_id(1)
    f32 = jnp.float32

    def body(step, acc):  # acc[r]: [block_n, gw] float32, summed over its words at the end
        acc = list(acc)
        first = (split * steps_per_split + step) * groups_per_step
        for j in range(groups_per_step):  # unrolled: independent loads in flight together
            g = first + j
            w = q_ref[:, pl.ds(g * gw, gw)]  # [block_n, gw] uint32
            d = [None] * rows
            x_sum = [None] * rows
            for b in range(4):
                for h in range(2):
                    f = field_as_float(w, 19 - (8 * b + 4 * h), 4)  # [block_n, gw]
                    for r in range(rows):
                        xv = x_ref[pl.ds(r, 1), pl.ds(g * group + h * half + b, gw, stride=4)
                                   ].astype(f32)  # [1, gw]
                        d[r] = xv * f if d[r] is None else d[r] + xv * f
                        x_sum[r] = xv if x_sum[r] is None else x_sum[r] + xv
            s = s_ref[:, pl.ds(g, 1)].astype(f32)  # [block_n, 1]
            const = z_ref[:, pl.ds(g, 1)].astype(f32) - 16.0 * s
            for r in range(rows):
                acc[r] = acc[r] + (16.0 * s) * d[r] + const * x_sum[r]
        return acc

    init = [jnp.zeros((block_n, gw), f32) for _ in range(rows)]
    acc = lax.fori_loop(0, steps_per_split, body, init)
    for r in range(rows):
        o_ref[pl.ds(r, 1), :] = jnp.sum(acc[r], axis=1)[None, :].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "step_rows", "target_programs",
                                             "num_warps", "num_stages", "interpret"))
def _nk_jit(x, qt, scale_t, zero_t, *, block_n, step_rows, target_programs, num_warps,
            num_stages, interpret):
    m, k = x.shape
    n, groups = scale_t.shape
    group = k // groups
    block_n = min(block_n, next_pow2(max(n, 2)))
    col_blocks = cdiv(n, block_n)
    np_ = col_blocks * block_n
    groups_per_step = largest_divisor(groups, step_rows // group)
    steps = groups // groups_per_step
    splits = largest_divisor(steps, target_programs // col_blocks)
    if np_ != n:  # padded columns: zero scales and zeros make them 0; sliced off below
        pad = ((0, np_ - n), (0, 0))
        qt, scale_t, zero_t = jnp.pad(qt, pad), jnp.pad(scale_t, pad), jnp.pad(zero_t, pad)
    words = lax.bitcast_convert_type(qt.reshape(np_, k // 8, 4), jnp.uint32)  # [N, K / 8]
    cols = pl.BlockSpec((block_n, groups), lambda j, t: (j, 0))
    partial = pl.pallas_call(
        functools.partial(_nk_kernel, group=group, groups_per_step=groups_per_step,
                          steps_per_split=steps // splits),
        grid=(col_blocks, splits),
        in_specs=[pl.BlockSpec((m, k), lambda j, t: (0, 0)),
                  pl.BlockSpec((block_n, k // 8), lambda j, t: (j, 0)), cols, cols],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, t: (t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, np_), jnp.float32),
        compiler_params=gpu_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxinfer_int4_gemv_nk",
    )(x, words, scale_t, zero_t)
    return jnp.sum(partial, axis=0)[:, :n]


def int4_gemv_nk(x: jax.Array, qt: jax.Array, scale_t: jax.Array, zero_t: jax.Array, *,
                 block_n: int = 64, step_rows: int = 256, target_programs: int = 512,
                 num_warps: int = 4, num_stages: int = 3, interpret: bool = False
                 ) -> jax.Array:
    """``x [M, K]`` (M <= ``WORD_ROWS``) times the int4 weight stored transposed: ``qt [N, K /
    2]`` uint8, ``scale_t``, ``zero_t [N, K / G]`` (``G`` a power of two, at least 32):
    ``[M, N]`` float32. The tiling arguments are ``scripts/bench_int4.py``'s to sweep."""
    check(x.ndim == 2 and x.shape[0] <= WORD_ROWS and qt.ndim == 2 and qt.dtype == jnp.uint8,
          f"int4_gemv_nk takes x [M <= {WORD_ROWS}, K] and uint8 qt [N, K / 2], got x "
          f"{x.shape}, qt {qt.shape} {qt.dtype}")
    k = x.shape[1]
    n, groups = scale_t.shape
    group = k // max(groups, 1)
    check(qt.shape == (n, k // 2) and zero_t.shape == scale_t.shape and k % groups == 0
          and group >= 32 and group & (group - 1) == 0,
          f"int4_gemv_nk needs qt [N, K / 2] and scale_t, zero_t [N, K / G] with G a power of "
          f"two >= 32; got x {x.shape}, qt {qt.shape}, scale_t {scale_t.shape}")
    return _nk_jit(x, qt, scale_t, zero_t, block_n=block_n, step_rows=step_rows,
                   target_programs=target_programs, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret)
