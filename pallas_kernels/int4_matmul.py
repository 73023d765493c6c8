"""Weight-only int4 matmul for decode rows: the packed weight is unpacked and dequantized
inside the kernel, so only its bytes (half a byte per weight) and its scales are read.

Weight format (``jaxinfer.quantize``, kind ``"int4"``): ``q [K / 2, N]`` uint8 holds two
4-bit values ``v`` in 0..15 per byte; ``scale``, ``zero [K / G, N]`` (float16 or float32)
give ``w = scale * v + zero`` per group of ``G`` input rows and column. Within a group, byte
row ``j`` holds input row ``j`` (low nibble) and row ``j + G / 2`` (high nibble), GGUF's
Q4_0 / Q4_1 order. So a group's low nibbles multiply the first half of the group's slice of
``x`` and its high nibbles the second half: two contiguous slices, no interleaving.

Up to ``WORD_ROWS`` rows (one row for groups of 32) go to
``pallas_kernels.word_gemv``, which reads the packed bytes as 32-bit words and unpacks them on
the CUDA cores. More rows run the tensor-core kernel here: per group it takes
``d = x_lo @ lo + x_hi @ hi`` (float32) and adds ``d * scale + sum(x over the group) * zero``,
so the scale and zero multiply a ``[rows, N]`` result instead of every weight. A decode GEMV
has too few column blocks to fill a GPU, so, like ``pallas_kernels.int8_matmul``'s decode
path, K is also split over programs, each writing a float32 partial that is summed afterwards.

GPU only (Pallas Triton; the Triton interpreter on CPU for tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MIN_DOT,
    cdiv,
    check,
    check_dtype,
    gpu_params,
    largest_divisor,
)
from pallas_kernels.junction import ScaledPairs
from pallas_kernels.word_gemv import (
    WIDE_BLOCK_N,
    WORD_ROWS,
    WordTiles,
    reads_pairs,
    word_gemv,
)

INT4_GEMV_ROWS = 64
"""Rows (tokens of a step) up to which ``model._dense`` runs an int4 weight through this
kernel; larger steps dequantize and run XLA's GEMM."""


@dataclasses.dataclass(frozen=True)
class Int4Tiles:
    """The GPU kernel's tiling (``scripts/bench_int4.py`` sweeps it on a device)."""

    block_n: int = 128  # output columns per program
    step_rows: int = 128  # input rows each loop iteration covers (several groups when G < it)
    target_programs: int = 512  # the split-K factor aims at this many programs (~4 per SM)
    num_warps: int = 4
    num_stages: int = 3
    # Up to this many rows ``word_gemv`` runs (0: always the dot); groups of 32 rows only for
    # one row: at two, the dot kernel was as fast (H100, 8B layer: 252 vs 259 us, r68).
    word_rows: int = WORD_ROWS
    # ``word_gemv``'s tiling (H100, one row, per 8B layer): the float32 kernel (g32, g64)
    # at ~1,024 programs; the float16-pair kernel (g128) at ~512 with its loads a step
    # ahead, 61.8 us against 63.8 at 1,024 without (r126; 8B batch 1 350.1 against 340.4
    # tok/s, r127). Without loads ahead 1,024 had beaten 512 (68.3 / 65.0 against 80.9 /
    # 75.0 us, r101 / r102). Weights that make 256-512 programs of one group at 512 columns
    # (8B qkv, o; 1B gate|up, down) took 4 byte rows per load there (32 float16 products per
    # sum), and weight loads are evict-first: 8B 59.5 against 61.9 us per layer at one row,
    # 85.0 / 85.3 at two, 120.6 / 123.0 at four (r133), 8B batch 1 356.6 against 348.4 tok/s
    # (r132); 70B 182.9 against 191.1 us per layer (r137, evict-first only). H200 (r223-r227):
    # that wide tile for every weight it divides that makes 256 programs, in calls of up to 2
    # rows, at ~2,048 programs with no loads ahead: 70B gate|up 71.3 against 85.8 us; 70B
    # batch 1 71.2 against 66.7 tok/s, 8B 393.9 against 382.0 (the narrow tile, loads ahead
    # at ~512, keeps the LM head, 1B qkv and o, and 4-row calls). Weights of 32 MiB and up
    # took ``WordTiles.x_pairs`` at 2 groups per loop step: 70B batch 1 81.0 against 72.2
    # tok/s, 8B 409.0 against 397.8 (H200, r243). With ``x_pair_sums`` (XLA makes only the
    # pairs, elementwise) every wide-tile weight takes them: 70B 81.8 against 81.0, 8B 416.6
    # against 408.8 (H200, r247).
    word: WordTiles = WordTiles(target_programs=1024, half2_programs=512, prefetch=True,
                                half2_products=32, evict_first=True, wide_tile=(WIDE_BLOCK_N, 4),
                                x_pairs=True, x_pair_sums=True)


def int4_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array, *,
                          out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x [M, K] @ w`` for the packed int4 weight ``q [K / 2, N]`` with ``scale``, ``zero
    [K / G, N]`` (format in the module docstring), dequantized in float32 first, then
    multiplied in ``x.dtype`` with float32 accumulation; result in ``out_dtype`` (default
    ``x.dtype``)."""
    groups, n = scale.shape
    half = q.shape[0] // groups
    v = q.reshape(groups, half, n)
    v = jnp.concatenate([v & 15, v >> 4], axis=1).astype(jnp.float32)  # [K / G, G, N]
    w = (v * scale[:, None].astype(jnp.float32) + zero[:, None].astype(jnp.float32))
    out = lax.dot_general(x, w.reshape(2 * q.shape[0], n).astype(x.dtype),
                          (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def _int4_kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, group: int, groups_per_step: int,
                 steps_per_split: int) -> None:
    """One ``[rows, block_n]`` float32 partial over this program's split of K."""
    split = pl.program_id(2)
    half = group // 2
    dims = (((1,), (0,)), ((), ()))

    def body(i, acc):
        first = (split * steps_per_split + i) * groups_per_step
        for j in range(groups_per_step):  # unrolled: independent loads in flight together
            g = first + j
            b = q_ref[pl.ds(g * half, half), :]  # [G / 2, block_n] uint8
            x_lo = x_ref[:, pl.ds(g * group, half)]  # [rows, G / 2]
            x_hi = x_ref[:, pl.ds(g * group + half, half)]
            d = (lax.dot_general(x_lo, (b & 15).astype(x_lo.dtype), dims,
                                 preferred_element_type=jnp.float32)
                 + lax.dot_general(x_hi, (b >> 4).astype(x_hi.dtype), dims,
                                   preferred_element_type=jnp.float32))  # [rows, block_n]
            x_sum = (jnp.sum(x_lo.astype(jnp.float32), axis=1, keepdims=True)
                     + jnp.sum(x_hi.astype(jnp.float32), axis=1, keepdims=True))  # [rows, 1]
            acc = (acc + d * s_ref[pl.ds(g, 1), :].astype(jnp.float32)
                   + x_sum * z_ref[pl.ds(g, 1), :].astype(jnp.float32))
        return acc

    o_ref[...] = lax.fori_loop(0, steps_per_split, body, jnp.zeros(o_ref.shape, jnp.float32))


def _word_rows(m: int, group: int, tiles: Int4Tiles) -> bool:
    """Whether ``m`` rows run ``word_gemv`` (groups of 32 rows only for one row)."""
    return m <= (tiles.word_rows if group > 32 else min(tiles.word_rows, 1))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tiles", "partials"))
def _int4_jit(x, q, scale, zero, *, out_dtype, interpret, tiles, partials):
    m, k = x.shape
    groups, n = scale.shape
    group = k // groups
    if _word_rows(m, group, tiles):
        return word_gemv(x, q, scale, zero, bits=4, offset=0, flip=0, interpret=interpret,
                         tiles=tiles.word, out_dtype=out_dtype, partials=partials)
    if isinstance(x, ScaledPairs):
        x = x.values().astype(out_dtype)
    rows = 16 if m <= 16 else INT4_GEMV_ROWS  # the smallest tensor-core tile holding them
    block_n = tiles.block_n
    groups_per_step = largest_divisor(groups, tiles.step_rows // group)
    steps = groups // groups_per_step
    col_blocks = cdiv(n, block_n)
    splits = largest_divisor(steps, tiles.target_programs // col_blocks)
    mp, np_ = cdiv(m, rows) * rows, col_blocks * block_n
    # Padded rows and columns are sliced off the result (zero scales: padded columns are 0).
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    qp = jnp.pad(q, ((0, 0), (0, np_ - n)))
    sp = jnp.pad(scale, ((0, 0), (0, np_ - n)))
    zp = jnp.pad(zero, ((0, 0), (0, np_ - n)))
    partial = pl.pallas_call(
        functools.partial(_int4_kernel, group=group, groups_per_step=groups_per_step,
                          steps_per_split=steps // splits),
        grid=(mp // rows, col_blocks, splits),
        in_specs=[pl.BlockSpec((rows, k), lambda i, j, t: (i, 0)),
                  pl.BlockSpec((k // 2, block_n), lambda i, j, t: (0, j)),
                  pl.BlockSpec((groups, block_n), lambda i, j, t: (0, j)),
                  pl.BlockSpec((groups, block_n), lambda i, j, t: (0, j))],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda i, j, t: (t, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, np_), jnp.float32),
        compiler_params=gpu_params(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="jaxinfer_int4_matmul",
    )(xp, qp, sp, zp)
    if partials:
        return partial[:, :m, :n]
    return jnp.sum(partial, axis=0)[:m, :n].astype(out_dtype)


def int4_reads_pairs(m: int, q: jax.Array, scale: jax.Array, zero: jax.Array, *, norm: bool,
                     tiles: Int4Tiles = Int4Tiles()) -> bool:
    """Whether ``int4_matmul`` of ``m`` rows by this weight reads ``ScaledPairs`` (``norm``:
    with sums of squares) as they are (``word_gemv.reads_pairs``); shapes suffice."""
    group = 2 * q.shape[0] // scale.shape[0]
    return _word_rows(m, group, tiles) and reads_pairs(
        m, q, scale, zero, bits=4, offset=0, flip=0, tiles=tiles.word, norm=norm)


def int4_matmul(x: jax.Array | ScaledPairs, q: jax.Array, scale: jax.Array, zero: jax.Array,
                *, out_dtype: jnp.dtype | None = None, interpret: bool = False,
                tiles: Int4Tiles = Int4Tiles(), partials: bool = False) -> jax.Array:
    """``x [M, K] @ w`` for a packed int4 weight (module docstring): ``q [K / 2, N]`` uint8,
    ``scale`` and ``zero [K / G, N]`` float16 or float32, ``G`` (``K / scale.shape[0]``) a
    power of two of at least 32 (a tensor-core dot needs 16 rows per nibble half; Triton
    blocks are powers of two).

    Meant for decode steps (up to ``INT4_GEMV_ROWS`` rows; it runs any M, tiled by 64 rows).
    Returns ``[M, N]`` in ``out_dtype`` (default ``x.dtype``), float32 accumulation.
    ``tiles``: the GPU kernel's tiling (default: bench/NOTES.md r50-r51 on an H100).

    ``x`` may be ``ScaledPairs`` (``junction.add_norm_pairs``), read as they are where
    ``int4_reads_pairs`` says so, else turned back into activations (``out_dtype``
    defaults to their ``dtype``). ``partials``: the float32 split-K partials ``[splits, M, N]``,
    unsummed (``[1, M, N]`` where K is not split), for ``add_norm_pairs`` to sum.
    """
    check(len(x.shape) == 2 and q.ndim == 2, f"int4_matmul takes 2-D operands, got x "
          f"{x.shape}, q {q.shape}")
    check(q.dtype == jnp.uint8, f"q must be uint8 (two int4 values per byte), got {q.dtype}")
    check(scale.shape == zero.shape and scale.ndim == 2 and scale.shape[1] == q.shape[1],
          f"scale {scale.shape} and zero {zero.shape} must both be [K / G, N] for q {q.shape}")
    k = x.shape[1]
    groups = scale.shape[0]
    group = k // groups
    check(k == 2 * q.shape[0] and k % groups == 0 and group >= 2 * MIN_DOT
          and group & (group - 1) == 0,
          f"int4_matmul needs x [M, K] with K = 2 * q.shape[0] split into groups of a power of "
          f"two, at least {2 * MIN_DOT}, rows; got x {x.shape}, q {q.shape}, {groups} groups")
    if not isinstance(x, ScaledPairs):
        check_dtype("x", x)
    dtype = out_dtype or x.dtype
    return _int4_jit(x, q, scale, zero, out_dtype=jnp.dtype(dtype), interpret=interpret,
                     tiles=tiles, partials=partials)
