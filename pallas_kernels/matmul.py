"""Batch-invariant matmul and row sum: every output row depends only on its own input row.

A library GEMM picks its algorithm (tile sizes, split-K) from the shapes, so the same row of
``x @ w`` can round differently when the batch around it has another size, and bf16 greedy
decoding then flips a near-tie. This kernel fixes the tiling: each program computes a
``BLOCK_M x BLOCK_N`` tile by walking K in ``BLOCK_K`` steps, in order, with float32
accumulation, whatever ``M`` is. Rows are padded to a multiple of ``BLOCK_M``; padding never
mixes into a real row. ``row_sum`` does the same for reductions (RMSNorm statistics,
log-sum-exp): XLA picks a reduction's strategy, and may fuse it into a Triton kernel, by
the shapes around it. What they cost is recorded in bench/NOTES.md (deterministic mode).

GPU only (Pallas Triton; the Triton interpreter on CPU for tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, check, check_dtype, gpu_params
from pallas_kernels.junction import ScaledPairs
from pallas_kernels.word_gemv import WIDE_BLOCK_N, WordTiles, reads_pairs, word_gemv

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
                     out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x [M, K] @ w [K, N]`` (``w [N, K]`` with ``transpose_w``) with float32 accumulation,
    in ``out_dtype`` (default ``x.dtype``)."""
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
    out = lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def _matmul_kernel(x_ref, w_ref, o_ref, *, k_blocks: int, transpose_w: bool) -> None:
    def body(i, acc):
        x = x_ref[:, pl.ds(i * BLOCK_K, BLOCK_K)]  # [BLOCK_M, BLOCK_K]
        if transpose_w:
            w = w_ref[:, pl.ds(i * BLOCK_K, BLOCK_K)]  # [BLOCK_N, BLOCK_K]
            dims = (((1,), (1,)), ((), ()))
        else:
            w = w_ref[pl.ds(i * BLOCK_K, BLOCK_K), :]  # [BLOCK_K, BLOCK_N]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "interpret"))
def _matmul_jit(x, w, *, transpose_w, out_dtype, interpret):
    m, k = x.shape
    n = w.shape[0] if transpose_w else w.shape[1]
    mp, np_, kp = (cdiv(m, BLOCK_M) * BLOCK_M, cdiv(n, BLOCK_N) * BLOCK_N,
                   cdiv(k, BLOCK_K) * BLOCK_K)
    # Zero padding: padded K terms add exact zeros, padded rows/columns are sliced off.
    xp = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    w = w.astype(x.dtype)
    if transpose_w:
        wp = jnp.pad(w, ((0, np_ - n), (0, kp - k)))
        w_spec = pl.BlockSpec((BLOCK_N, kp), lambda i, j: (j, 0))
    else:
        wp = jnp.pad(w, ((0, kp - k), (0, np_ - n)))
        w_spec = pl.BlockSpec((kp, BLOCK_N), lambda i, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, k_blocks=kp // BLOCK_K, transpose_w=transpose_w),
        grid=(mp // BLOCK_M, np_ // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, kp), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        compiler_params=gpu_params(num_warps=4, num_stages=3),
        interpret=interpret,
        name="jaxinfer_invariant_matmul",
    )(xp, wp)
    return out[:m, :n]


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
           out_dtype: jnp.dtype | None = None, interpret: bool = False) -> jax.Array:
    """Batch-invariant ``x [M, K] @ w [K, N]`` (``w [N, K]`` with ``transpose_w``).

    Args:
      x: ``[M, K]`` bfloat16/float16/float32; ``w`` is cast to its dtype.
      transpose_w: ``w`` is ``[N, K]`` (a tied embedding used as the output head).
      out_dtype: result dtype (default ``x.dtype``); accumulation is always float32.
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      ``[M, N]``; row ``i`` is bit-identical for any ``M`` and any other rows.
    """
    check(x.ndim == 2 and w.ndim == 2, f"matmul takes 2-D operands, got {x.shape} @ {w.shape}")
    k_w = w.shape[1] if transpose_w else w.shape[0]
    check(x.shape[1] == k_w, f"contraction mismatch: x {x.shape} vs w {w.shape}"
          + (" (transposed)" if transpose_w else ""))
    check_dtype("x", x)
    return _matmul_jit(x, w, transpose_w=transpose_w, out_dtype=jnp.dtype(out_dtype or x.dtype),
                       interpret=interpret)


ROW_BLOCK = 16  # rows per program
COL_BLOCK = 512  # columns summed per inner step


def row_sum_reference(x: jax.Array) -> jax.Array:
    """``x [M, N]`` summed over its rows' columns, in float32: ``[M]``."""
    return jnp.sum(x.astype(jnp.float32), axis=-1)


def _row_sum_kernel(x_ref, o_ref, *, col_blocks: int) -> None:
    def body(i, acc):
        return acc + jnp.sum(x_ref[:, pl.ds(i * COL_BLOCK, COL_BLOCK)].astype(jnp.float32),
                             axis=1)

    o_ref[...] = lax.fori_loop(0, col_blocks, body, jnp.zeros((ROW_BLOCK,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _row_sum_jit(x, *, interpret):
    m, n = x.shape
    mp, np_ = cdiv(m, ROW_BLOCK) * ROW_BLOCK, cdiv(n, COL_BLOCK) * COL_BLOCK
    xp = jnp.pad(x.astype(jnp.float32), ((0, mp - m), (0, np_ - n)))  # zeros add nothing
    out = pl.pallas_call(
        functools.partial(_row_sum_kernel, col_blocks=np_ // COL_BLOCK),
        grid=(mp // ROW_BLOCK,),
        in_specs=[pl.BlockSpec((ROW_BLOCK, np_), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROW_BLOCK,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((mp,), jnp.float32),
        compiler_params=gpu_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxinfer_invariant_row_sum",
    )(xp)
    return out[:m]


def row_sum(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Batch-invariant float32 sum of each row of ``x [M, N]``: ``[M]``, row ``i``
    bit-identical for any ``M`` and any other rows (fixed column blocks, summed in order)."""
    check(x.ndim == 2, f"row_sum takes a 2-D array, got shape {x.shape}")
    check_dtype("x", x)
    return _row_sum_jit(x, interpret=interpret)


def int8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, *,
                          out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x [M, K] @ (q [K, N] int8 * scale [K / G, N])`` (one scale per group of ``G = K /
    scale.shape[0]`` rows and column), float32 accumulation, in ``out_dtype``."""
    g = q.shape[0] // scale.shape[0]
    w = (q.astype(jnp.float32).reshape(scale.shape[0], g, -1) * scale[:, None, :]).reshape(q.shape)
    return matmul_reference(x, w.astype(x.dtype), out_dtype=out_dtype)


# At most this many rows take the split-K path (decode batches). From 17 rows its 64-row tile
# reads the int8 weight at ~1.4 TB/s on one H200 (8B layer at 64 rows: 174 us against a bf16
# GEMM's 133), whatever the launch settings, the conversion (float16, by a magic-number add),
# the operand order or the groups per loop step (bench/NOTES.md r290-r294); 16 rows: 2.3 TB/s.
GEMV_ROWS = 64
GEMV_BLOCK_N = 128
_TARGET_PROGRAMS = 512  # about 4 per H100 SM


@dataclasses.dataclass(frozen=True)
class Int8Tiles:
    """Which kernel ``int8_matmul`` runs for a few rows, and how its tensor-core kernel
    splits a row tile into dots (``scripts/bench_int4.py --int8``)."""

    # Up to this many rows ``word_gemv`` runs (0: always the tensor-core kernel). Per 8B
    # layer on an H100 its float16-pair kernel takes 113.9 us at one row against the
    # tensor-core kernel's 121.6, but 142.3 against 122.1 at two (bench/NOTES.md r91).
    word_rows: int = 1
    # ``word_gemv``'s tiling (``int8_half2``: pairs or float32): one 64-row group per loop
    # step, loaded a step ahead, 105.0 us per 8B layer at one row against 110.1 with its
    # defaults (H100, r101; r126, with the last step after the loop: 113.0 against 108.1
    # without, inside that run's ~5% spread per shape: not changed on one sample); weight
    # loads evict-first: 109.8 against 113.3 us (r144, two samples each; qkv 1.2 us slower,
    # gate|up and down 2.5 and 1.9 faster), 8B batch 1 215.1 against 210.9 tok/s (r145).
    # H200: the wide tile (512 columns x 8 byte rows per load, ~1,024 programs, no loads
    # ahead; 8 float16 products per sum, so no float16 sum overflows below |x| of 16k,
    # ``word_gemv._HALF2_X_SCALE``) for the weights it divides: 8B layer 80.6 us at one row
    # (r235; 256 x 8: 88.6), 8B batch 1 280.6 against 248.9 tok/s (r236). They take
    # ``WordTiles.x_pairs`` at 2 groups per loop step: at first only those of 32 MiB and up
    # (8B gate|up, down; 291.3 against 279.8 tok/s, r244); with the junction kernels making
    # the pairs, the 8B qkv and o too (their junctions join: 295.7 / 295.6 against 292.8 /
    # 293.4 tok/s, r263-r264)
    word: WordTiles = WordTiles(step_rows=64, prefetch=True, evict_first=True,
                                wide_tile=(WIDE_BLOCK_N, 8), wide_programs=1024, x_pairs=True,
                                x_pairs_step_rows=128)
    # Rows per dot in the tensor-core kernel's row tile (16, 32 or 64; at most the tile): each
    # converted weight tile feeds ``tile / dot_rows`` dots. 64 (one dot per tile) by default;
    # 16 keeps 64-row tiles on 16-row MMAs, which the 16-row tile runs 1.6x faster per
    # weight byte than the 64-row one (one H200, bench/NOTES.md r290-r294; 16 not timed).
    dot_rows: int = 64


def _int8_kernel(x_ref, q_ref, s_ref, o_ref, *, blocks_per_split: int, dot_rows: int) -> None:
    """One ``[rows, block_n]`` float32 partial: this program's split of the K blocks, each
    group's converted weight tile multiplied by ``rows / dot_rows`` row blocks of x."""
    split = pl.program_id(2)
    parts = o_ref.shape[0] // dot_rows

    def body(i, accs):
        kb = split * blocks_per_split + i
        q = q_ref[pl.ds(kb * BLOCK_K, BLOCK_K), :]  # [BLOCK_K, block_n]
        # [BLOCK_K, block_n] times this group's scales [1, block_n]
        w = q.astype(x_ref.dtype) * s_ref[pl.ds(kb, 1), :].astype(x_ref.dtype)
        return tuple(
            acc + lax.dot_general(x_ref[pl.ds(p * dot_rows, dot_rows),
                                        pl.ds(kb * BLOCK_K, BLOCK_K)],  # [dot_rows, BLOCK_K]
                                  w, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
            for p, acc in enumerate(accs))

    zeros = tuple(jnp.zeros((dot_rows, o_ref.shape[1]), jnp.float32) for _ in range(parts))
    accs = lax.fori_loop(0, blocks_per_split, body, zeros)
    for p, acc in enumerate(accs):
        o_ref[pl.ds(p * dot_rows, dot_rows), :] = acc


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tiles", "partials"))
def _int8_jit(x, q, scale, *, out_dtype, interpret, tiles, partials):
    m, k = x.shape
    n = q.shape[1]
    if m <= tiles.word_rows:
        return word_gemv(x, q, scale, None, bits=8, offset=-128, flip=0x80,
                         interpret=interpret, tiles=tiles.word, out_dtype=out_dtype,
                         partials=partials)
    if isinstance(x, ScaledPairs):
        x = x.values().astype(out_dtype)
    k_blocks = k // BLOCK_K
    if m <= GEMV_ROWS:
        # Decode rows: one row tile (the smallest tensor-core tile that holds them), and K
        # split over programs too, since a weight-streaming GEMV has too few column blocks to
        # fill the GPU; each split writes a float32 partial, summed after.
        rows, block_n = (16 if m <= 16 else GEMV_ROWS), GEMV_BLOCK_N
        want = max(1, _TARGET_PROGRAMS // cdiv(n, block_n))
        splits = max(d for d in range(1, min(want, k_blocks) + 1) if k_blocks % d == 0)
    else:
        rows, block_n, splits = BLOCK_M, BLOCK_N, 1
    mp, np_ = cdiv(m, rows) * rows, cdiv(n, block_n) * block_n
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    qp = jnp.pad(q, ((0, 0), (0, np_ - n)))
    sp = jnp.pad(scale.astype(jnp.float32), ((0, 0), (0, np_ - n)))
    partial = pl.pallas_call(
        functools.partial(_int8_kernel, blocks_per_split=k_blocks // splits,
                          dot_rows=min(tiles.dot_rows, rows)),
        grid=(mp // rows, np_ // block_n, splits),
        in_specs=[pl.BlockSpec((rows, k), lambda i, j, t: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j, t: (0, j)),
                  pl.BlockSpec((k_blocks, block_n), lambda i, j, t: (0, j))],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda i, j, t: (t, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, np_), jnp.float32),
        compiler_params=gpu_params(num_warps=4, num_stages=3),
        interpret=interpret,
        name="jaxinfer_int8_matmul",
    )(xp, qp, sp)
    if partials:
        return partial[:, :m, :n]
    return jnp.sum(partial, axis=0)[:m, :n].astype(out_dtype)


def int8_reads_pairs(m: int, q: jax.Array, scale: jax.Array, *, norm: bool,
                     tiles: Int8Tiles = Int8Tiles()) -> bool:
    """Whether ``int8_matmul`` of ``m`` rows by this weight reads ``ScaledPairs`` (``norm``:
    with sums of squares) as they are (``word_gemv.reads_pairs``); shapes suffice."""
    return m <= tiles.word_rows and reads_pairs(
        m, q, scale, None, bits=8, offset=-128, flip=0x80, tiles=tiles.word, norm=norm)


def int8_matmul(x: jax.Array | ScaledPairs, q: jax.Array, scale: jax.Array, *,
                out_dtype: jnp.dtype | None = None, interpret: bool = False,
                tiles: Int8Tiles = Int8Tiles(), partials: bool = False) -> jax.Array:
    """``x [M, K] @ w`` for an int8 weight ``q [K, N]`` with one scale per ``BLOCK_K`` (64)
    rows and column, ``scale [K / 64, N]``: the weight is dequantized tile by tile inside the
    kernel, so only int8 bytes (and the scales) are read from memory. Up to ``GEMV_ROWS``
    rows (decode) also split K over programs; more rows run 64 x 64 output tiles.

    Up to ``tiles.word_rows`` rows (one by default) run ``pallas_kernels.word_gemv``
    instead, by default its float16-pair kernel: the int8 products summed four at a time in
    float16 (activations scaled by 2^-8; finite for ``|x|`` up to about 32k), then in
    float32, so within ~1e-3 of the largest output rather than 1e-5. Per 8B layer on an
    H100 it is 6% faster than this tensor-core kernel at one row and 17% slower at two
    (``scripts/bench_int4.py --int8``, bench/NOTES.md r91); ``Int8Tiles(word_rows=0)`` keeps
    the tensor-core kernel for every row count.

    ``x`` may be ``ScaledPairs`` and ``partials`` asks for the split-K partials, as for
    ``int4_matmul`` (``int8_reads_pairs``)."""
    check(len(x.shape) == 2 and q.ndim == 2, f"int8_matmul takes 2-D operands, got "
          f"{x.shape} @ {q.shape}")
    check(q.dtype == jnp.int8, f"q must be int8, got {q.dtype}")
    check(x.shape[1] == q.shape[0] and q.shape[0] % BLOCK_K == 0
          and scale.shape == (q.shape[0] // BLOCK_K, q.shape[1]),
          f"int8_matmul needs K a multiple of {BLOCK_K} and scale [K / {BLOCK_K}, N]; got x "
          f"{x.shape}, q {q.shape}, scale {scale.shape}")
    check(tiles.dot_rows in (16, 32, 64),
          f"Int8Tiles.dot_rows must be 16, 32 or 64, got {tiles.dot_rows}")
    if not isinstance(x, ScaledPairs):
        check_dtype("x", x)
    dtype = out_dtype or x.dtype
    return _int8_jit(x, q, scale, out_dtype=jnp.dtype(dtype), interpret=interpret, tiles=tiles,
                     partials=partials)
