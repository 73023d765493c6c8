"""Weight-only matmul for a few rows (batch-1 decode) on the CUDA cores, reading the packed
weight as 32-bit words: the kernel behind ``int4_matmul`` up to ``WORD_ROWS`` rows and
``int8_matmul`` up to ``Int8Tiles.word_rows`` (one by default).

Why words: a byte-typed tile makes Triton load and convert one byte per register, and a
tensor-core dot pads one row to 16 and moves every dequantized weight into its operand
layout; both left the int4 / int8 GEMVs at ~20% of the read floor on an H100 (bench/NOTES.md
r50-r62). Here a weight ``q [R, N]`` of bytes (R byte rows) is read as ``uint32 [R, N / 4]``:
word ``j`` of a byte row holds columns ``4j .. 4j + 3``, one per byte lane (the reinterpretation
is free; the bytes do not move). Measured on an H100 (r64, r68), it reaches 24-26% of the floor at
one row against the tensor-core kernel's 19-20%: better, but the loads and conversions were
not the main limit.

Why no int-to-float conversion: each field (an 8-bit value, or a 4-bit nibble) is shifted into
the top mantissa bits of a float32 and or-ed with the exponent of 1.0, giving the float
``f = 1 + u / 2^bits`` exactly, for two integer instructions (a shift and a fused and-or) and
no conversion unit. For a group's stored value ``u`` the weight is
``w = scale * (u + offset) + zero``, so over a group ``g`` of input rows

    sum_k x_k w_k = scale * 2^bits * sum_k x_k f_k + (scale * (offset - 2^bits) + zero) * sum_k x_k

The kernel accumulates ``x * f`` for each group (one multiply-add per weight), then applies the
group's scale and the ``sum x`` term.

Float16 pairs (int4 groups of ``WordTiles.half2_min_group`` to ``HALF2_PRODUCTS *
sub_rows`` rows; int8 unless ``WordTiles.int8_half2`` is off): the float32 kernel is bound by
its instructions, about one per weight, not by its loads (r74: ~1 TB/s in the engine).
``_half2_kernel`` does two weights per instruction, as Marlin and TensorRT-LLM do: one ``lop3``
puts the fields of byte lanes 0 and 2 of a word (lanes 1 and 3: of the word shifted by 8)
into the mantissas of the float16 pair ``(1024 + u0, 1024 + u2)`` and ``sub.f16x2`` removes
the bias (exact; int8: the same ``lop3`` flips each byte's top bit, ``u = q + 128``, and the
bias is 1152, leaving ``q``); an int4 high nibble lands 4 bits up, as ``1024 + 16 u``, and
an ``fma.rn.f16x2`` by ``1/16`` and ``-64`` leaves ``u`` with no shift. ``fma.rn.f16x2``
then multiplies the pair by the row's activation and adds it to a float16 pair of sums; each
group's few sums are widened to float32 and scaled with float32 ``fma`` (float16 scales and
zeros read as two-column words). The activations are scaled by ``2^-8`` before they are
rounded to float16 (and the result by ``2^8`` at the store), so no float16 sum overflows
below ``|x|`` of about 140k for int4 and 32k for int8 (``_HALF2_X_SCALE``). PTX through
``plgpu.elementwise_inline_asm``; under the interpreter the same arithmetic in jnp (each
float16 multiply-add rounded once, as the PTX does). H100, an 8B layer at g128 and one row:
63.6 us, 57% of the read floor (r103; 61.8 us with the loads a step ahead at ~512 programs,
``Int4Tiles``' default since r126-r127; 59.5 us with small weights at 512 columns by 4 byte rows
per load and evict-first weight loads, r129-r133; r85, before the shift-free high nibbles, the
paired scale loads, the float32 ``fma`` and 1,024 programs: 77.8 us, against ``_word_kernel``'s
102.9); at g32 the r82 experiment was slower (161.5 against 133.7 us), so it stays off there.
Nsight Compute (r100) found it bound by issuing instructions, with few warps per SM: 28% of
issue slots busy at 18% achieved occupancy, most stalls waiting on global loads. int8 (g64:
four products per float16 sum at the default 16 rows per load; ``scripts/bench_int4.py
--int8``): 104.1 us per 8B layer at one row (r103; r91: 113.9, against ``int8_matmul``'s
tensor-core kernel's 121.6, but 142.3 against 122.1 at two); its float32 kernel was slower
still (r64: 174 / 255 us at one / two rows). On an H200 the kernel at the wide tile is still
bound by issued instructions (r234-r237: memory-bound up to ~4.5 per weight byte; it issues
~6.4), so XLA makes the activation pairs once per call, each program makes int4's group
sums from them, and the loop only unpacks and multiplies (``WordTiles.x_pairs``: ~4.0 per
byte; 70B int4 batch 1 81.0 against 72.2 tok/s, r243; ``x_pair_sums``: 81.8, r247).

Formats (``jaxinfer.quantize``): int8 ``q [K, N]`` int8 read with ``flip = 0x80`` (``u = q +
128``, ``offset = -128``, no zero; a byte row per input row, so a word holds one input row of
four columns); int4 ``q [K / 2, N]`` uint8 holding group row ``j`` in the low nibble and row
``j + G / 2`` in the high one (``offset = 0``, ``w = scale * v + zero``).

GPU only (Pallas Triton; the Triton interpreter on CPU for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    cdiv,
    check,
    gpu_params,
    half_pairs,
    largest_divisor,
    next_pow2,
)
from pallas_kernels.junction import ScaledPairs

WORD_ROWS = 4
"""Rows (tokens) up to which ``int4_matmul`` and ``int8_matmul`` run this kernel: each row adds
one multiply-add per weight to the integer work of unpacking it, shared by the rows."""

WIDE_BLOCK_N = 512
"""Output columns per program of ``Int4Tiles``' and ``Int8Tiles``' wide tile
(``WordTiles.wide_tile``), which runs only on weights whose columns it divides: a weight of
other columns takes the narrow tile (or, padded per call, a copy of itself: r226).
``model.one_device_layout`` pads the LM head's columns to a multiple of it once, at load."""

_ONE = 0x3F800000  # float32 1.0: exponent bits of the floats the fields become


@dataclasses.dataclass(frozen=True)
class WordTiles:
    """The GPU tiling (``scripts/bench_int4.py`` times it on a device)."""

    block_n: int = 0  # output columns per program (0: 256 for groups of up to 64 rows, else
    # 128, the faster of the two for each at two rows on an H100, bench/NOTES.md r64)
    sub_rows: int = 16  # byte rows per load (a divisor of a group's byte rows)
    step_rows: int = 128  # input rows per loop iteration (whole groups, unrolled)
    target_programs: int = 512  # the split-K factor aims at this many programs (~4 per SM;
    # ``Int4Tiles`` asks for 1,024, and 512 for its float16 pairs: ``half2_programs``)
    num_warps: int = 4
    num_stages: int = 3
    half2_min_group: int = 128  # int4 groups of at least this many rows run the float16-pair
    # kernel (0: never); r82 measured it faster at 128, slower at 32
    int8_half2: bool = True  # int8 runs the float16-pair kernel (False: the float32 one,
    # slower on an H100, r64 / r91)
    prefetch: bool = False  # the float16-pair kernel loads each loop step's operands one
    # step ahead (``_half2_kernel``; ``Int4Tiles`` and ``Int8Tiles`` turn it on)
    half2_programs: int = 0  # the float16-pair kernel's ``target_programs`` (0: the same)
    half2_products: int = 0  # most float16 products per float16 sum (0: ``HALF2_PRODUCTS``);
    # groups of more than this times ``sub_rows`` rows run the float32 kernel
    evict_first: bool = False  # the float16-pair kernel's weight loads hint the L2 to
    # evict their lines first (each weight byte is read once; ``Int4Tiles`` and
    # ``Int8Tiles`` turn it on)
    wide_tile: tuple[int, int] = (0, 0)  # (block_n, sub_rows) for a float16-pair weight
    # whose columns it divides (a padded weight would be copied on every call: the LM head,
    # r226) and that makes at least ``wide_min_programs`` programs at it ((0, 0): off; fewer
    # programs leave SMs idle: 1B qkv and o, r137). It runs ``wide_programs`` programs and no
    # loads ahead (H200, 70B gate|up: 71.3 us against 85.8 for the narrow tile with loads
    # ahead; loads ahead at this tile, 110-119 us; r224-r225)
    wide_min_programs: int = 256
    wide_programs: int = 2048
    x_pairs: bool = False  # the wide tile's activations reach the kernel as float16 pairs
    # ``(x, x)`` (int32 words, scaled by ``_HALF2_X_SCALE``) and, with zeros, each group's
    # activation sum, both made by XLA once per call, instead of being converted and packed
    # per load and field in the loop (offline SASS, 70B gate|up: 1,028 loop instructions per
    # group against 1,543, 48 registers against 113; r238). The kernel is bound by issued
    # instructions (r234-r237), so this saves time per weight byte. While XLA also made the
    # group sums (a reduction kernel per call) or the pairs, small weights lost: x_pairs only
    # from 32 MiB had been the rule (H200, 8B int4 batch 1 with x_pairs on every wide-tile
    # weight 373.7 against 406.5 tok/s, r244; int8 down to 20 MiB, 8B qkv: 292.0 against
    # 291.3, r248). With ``x_pair_sums`` and the junction kernels making the pairs, every
    # wide-tile weight gains (int4: r247; int8: 8B batch 1 295.7 / 295.6 against 292.8 /
    # 293.4 tok/s, r263-r264), so the rule is gone
    x_pair_sums: bool = False  # with x_pairs and zeros, each program sums its groups'
    # activations itself (the pairs' float16 values widened and summed in float32 across
    # the program's threads, once per group), where XLA's group sums are a reduction kernel
    # of their own that cannot fuse into the RMSNorm making x; XLA then only makes the
    # pairs, elementwise (``Int4Tiles``, with x_pairs on every wide-tile weight: H200, 70B
    # batch 1 81.8 against 81.0 tok/s, 8B 416.6 against 408.8, r247)
    x_pairs_step_rows: int = 256  # input rows per loop iteration with x_pairs (H200, 70B
    # at one row, 2 groups of 128 against 1: gate|up 68.4 against 83.8 us, down 36.3 against
    # 39.3, qkv 16.5 against 17.5; without x_pairs 73.2, 42.5, 17.6; r242)
    wide_max_rows: int = 2  # calls of more rows keep the narrow tile (H200, 70B gate|up: the
    # wide tile 73.1 / 112.3 / 217.6 us at 1 / 2 / 4 rows, the narrow one 85.8 / 138.0 /
    # 202.9; down at 4 rows 114.3 against 93.4; r224-r225, r229). Its splits of K are not
    # capped: 8, 16 or 32 partials at most made 70B layers slower (r230: 198.5 / 155.8 /
    # 154.0 against 148.4 us; 70B batch 1 at 16, 69.4 against 71.6 tok/s)


def word_gemv_reference(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None,
                        *, bits: int, offset: int, flip: int) -> jax.Array:
    """``word_gemv`` in plain jnp: the fields of ``q [K * bits / 8, N]`` unpacked to their
    input rows (field ``i`` of a group's byte row ``j`` is the group's row ``i * G * bits / 8 +
    j``), dequantized in float32 and multiplied with float32 accumulation: ``[M, N]`` float32."""
    groups, n = scale.shape
    u = q.astype(jnp.uint8) ^ jnp.uint8(flip)  # [groups * byte_rows, N]
    u = u.reshape(groups, 1, -1, n)  # [groups, 1, byte_rows, N]
    mask = (1 << bits) - 1
    fields = [(u >> (bits * i)) & mask for i in range(8 // bits)]
    v = jnp.concatenate(fields, axis=1).astype(jnp.float32)  # [groups, fields, byte_rows, N]
    w = (v.reshape(groups, -1, n) + offset) * scale[:, None].astype(jnp.float32)
    if zero is not None:
        w = w + zero[:, None].astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.reshape(-1, n), precision=lax.Precision.HIGHEST)


def field_as_float(w: jax.Array, shift: int, bits: int) -> jax.Array:
    """The ``bits``-wide field that ``shift`` (left if positive) moves to the top of a float32
    mantissa, as the float ``1 + field / 2^bits``: words ``uint32 [...]`` to float32 ``[...]``."""
    moved = (lax.shift_left(w, jnp.uint32(shift)) if shift >= 0
             else lax.shift_right_logical(w, jnp.uint32(-shift)))
    mask = ((1 << bits) - 1) << (23 - bits)
    return lax.bitcast_convert_type((moved & jnp.uint32(mask)) | jnp.uint32(_ONE), jnp.float32)


def _store_column_sums(run, rows: int, sub: int, o_ref, scale: Any = 1.0) -> None:
    """Run ``run(init)`` (the kernel's loop) from zero accumulators ``acc[r][c]`` (row ``r``,
    byte lane ``c``; ``[sub, words]`` float32 each), then store each one's column sums times
    ``scale`` (a number, or a list of one ``[1, 1]`` value per row) into ``o_ref [rows,
    block_n]`` (lane ``c`` holds every fourth column from ``c``)."""
    words = o_ref.shape[1] // 4
    acc = run([[jnp.zeros((sub, words), jnp.float32) for _ in range(4)] for _ in range(rows)])
    for r in range(rows):
        row_scale = scale[r] if isinstance(scale, list) else scale
        for c in range(4):
            o_ref[pl.ds(r, 1), pl.ds(c, words, stride=4)] = (
                (jnp.sum(acc[r][c], axis=0)[None, :] * row_scale).astype(o_ref.dtype))


def _word_kernel(x_ref, q_ref, s_ref, *refs, bits: int, offset: int, flip: int, group: int,
                 sub: int, groups_per_step: int, steps_per_split: int) -> None:
    """One ``[rows, block_n]`` partial over this program's split of K (the result itself,
    in its dtype, when K is not split).

    x_ref ``[rows, K]``; q_ref ``[R, block_n / 4]`` uint32 words; s_ref and, for a format
    with zeros, z_ref ``[K / G, block_n]``; o_ref ``[rows, block_n]``. Everything is done
    here, so a call is this one kernel plus, when K is split, the sum of the partials: at a
    few rows each extra XLA op around it was a launch-bound kernel.
    """
    z_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    rows = x_ref.shape[0]
    words = q_ref.shape[1]
    split = pl.program_id(1)
    byte_rows = group * bits // 8  # byte rows per group
    fields = 8 // bits  # fields per byte: field i holds group rows i * byte_rows + j
    lanes = [(c, i) for c in range(4) for i in range(fields)]  # (byte lane, field)
    f32 = jnp.float32

    def body(step, acc):  # acc[r][c]: [sub, words] float32
        acc = [list(a) for a in acc]
        first = (split * steps_per_split + step) * groups_per_step
        for j in range(groups_per_step):  # unrolled: independent loads in flight together
            g = first + j
            d = [[None] * 4 for _ in range(rows)]  # this group's sum of x * f
            x_sum = [None] * rows  # [sub, 1]: summed over the group's loads and fields
            for t in range(byte_rows // sub):
                w = q_ref[pl.ds(g * byte_rows + t * sub, sub), :]  # [sub, words] uint32
                if flip:
                    w = w ^ jnp.uint32(flip * 0x01010101)
                xv = [[x_ref[r, pl.ds(g * group + i * byte_rows + t * sub, sub)]
                       .astype(f32)[:, None] for i in range(fields)]
                      for r in range(rows)]  # [sub, 1] each
                for r in range(rows):
                    for v in xv[r]:
                        x_sum[r] = v if x_sum[r] is None else x_sum[r] + v
                for c, i in lanes:
                    f = field_as_float(w, 23 - bits - (8 * c + bits * i), bits)
                    for r in range(rows):
                        p = xv[r][i] * f
                        d[r][c] = p if d[r][c] is None else d[r][c] + p
            for c in range(4):
                cols = pl.ds(c, words, stride=4)  # the columns of byte lane c
                s = s_ref[pl.ds(g, 1), cols].astype(f32)  # [1, words]
                const = s * float(offset - (1 << bits))
                if z_ref is not None:
                    const = const + z_ref[pl.ds(g, 1), cols].astype(f32)
                for r in range(rows):
                    # Both terms stay [sub, words]: the sum over the sub rows is taken once,
                    # after the loop, instead of a cross-thread reduction per group.
                    acc[r][c] = acc[r][c] + (s * float(1 << bits)) * d[r][c] + const * x_sum[r]
        return acc

    _store_column_sums(lambda init: lax.fori_loop(0, steps_per_split, body, init), rows, sub,
                       o_ref)


HALF2_PRODUCTS = 8
"""Most float16 products a float16 sum of ``_half2_kernel`` takes by default
(``WordTiles.half2_products`` sets it per tiling; ``G / sub_rows``: one per load and field of a
group, i.e. nibble half for int4, byte for int8); groups with more run the float32 kernel, since
each product added moves the overflow bound down and the rounding error up."""

_HALF2_X_SCALE = 2.0**-8
"""Activations are multiplied by this (exactly: a power of two) before they are rounded to
float16, and the sums divided by it after. A float16 sum of ``p`` products (at most
``WordTiles.half2_products``, default ``HALF2_PRODUCTS``) of a field ``|v|`` and ``|x| * 2^-8``
stays below 65504 while ``|x| < 65504 * 256 / (|v| * p)``: int4 (``u <= 15``) 140k at ``p = 8``,
35k at the 32 products of ``Int4Tiles``' wide tile (4 byte rows per load); int8 (``|q| <=
128``) 32k at the default ``p = G / sub_rows = 64 / 16 = 4``, 16k at ``p = 8`` (``sub_rows`` 8),
and a lone product overflows only past 131k. int8 keeps this scale (at least 16k at any tiling,
32k at the default): a smaller one would raise the bounds but push the float16 normal range up
(at ``2^-8`` it holds down to ``|x| = 2^-14 * 256 = 0.016``; below that activations round to
absolute steps of ``2^-24 * 256 = 1.5e-5``, subnormals, instead of relative ones; each halving
of the scale doubles both). A per-row maximum would be exact for any range, but its reductions
made the kernel slower than the float32 one (H100 r84)."""

_F16_BIAS = {4: 0x64006400, 8: 0x64806480}
"""Per field width, the float16 pair ``(1024, 1024)`` (int4) or ``(1152, 1152)`` (int8).
``(t & mask) ^ bias`` puts the fields of ``t`` under the exponent of 1024 (its ``0x64``
bytes, where the mask is 0) and, for int8, flips each byte's top bit (the ``0x80`` of 1152):
the signed byte ``q`` becomes ``u = q + 128``, so the float16 is ``1024 + u``; subtracting
the bias leaves the nibble ``u`` or ``q``, exactly."""


_F16_SIXTEENTH_MINUS_64 = (0x2C002C00, 0xD400D400)
"""The float16 pairs ``(1/16, 1/16)`` and ``(-64, -64)``: ``(1024 + 16 u) / 16 - 64 = u``."""


def _field_pairs(w: jax.Array, bits: int, high: bool, emulate: bool) -> jax.Array:
    """The ``bits``-wide fields at bit 0 (``high``: the int4 nibble at bit 4) and bit 16 (20)
    of each int32 word, as a float16 pair of their values (4: a nibble ``u``; 8: an int8
    ``q``; int32 ``[...]``), exactly: one ``lop3`` puts the fields under the exponent of 1024
    (``_F16_BIAS``) and one ``sub.f16x2`` removes it; a high nibble lands 4 bits up, as
    ``1024 + 16 u``, and one ``fma.rn.f16x2`` by ``1/16`` and ``-64`` leaves ``u``, so no
    shift is needed for it (Marlin's trick). Callers shift words by 8 for byte lanes 1 and
    3. ``emulate``: the same in jnp (interpreter). For int8 a ``prmt`` (byte permute) per
    pair would do the 1024s, but the top-bit flip would then cost an instruction of its own
    per word: two instructions per pair either way, and this form is int4's."""
    check(not high or bits == 4, "only int4 fields have a high nibble")
    mask, bias = ((1 << bits) - 1) * 0x00010001 << (4 if high else 0), _F16_BIAS[bits]
    scale, shift = _F16_SIXTEENTH_MINUS_64
    if emulate:
        u = lax.bitcast_convert_type(w, jnp.uint32)
        t = lax.bitcast_convert_type((u & jnp.uint32(mask)) ^ jnp.uint32(bias), jnp.float16)
        if high:  # the PTX's constants, one rounding: exact, (1024 + 16 u) / 16 - 64
            c, d = (lax.bitcast_convert_type(jnp.uint32(k), jnp.float16)[0]
                    .astype(jnp.float32) for k in (scale, shift))
            v = (t.astype(jnp.float32) * c + d).astype(jnp.float16)
        else:
            v = t - jnp.float16(1024 + 128 * (bits == 8))
        return lax.bitcast_convert_type(v, jnp.int32)
    remove = (f"mov.b32 c, {scale:#x};\n mov.b32 d, {shift:#x};\n fma.rn.f16x2 $0, t, c, d; }}"
              if high else f"mov.b32 c, {bias:#x};\n sub.rn.f16x2 $0, t, c; }}")
    asm = ("{ .reg .b32 t, c, d;\n"
           f"lop3.b32 t, $1, {mask:#x}, {bias:#x}, 0x6A;\n"  # (w & mask) ^ bias
           + remove)
    # Triton's inline asm takes signless integers: int32 in and out, the same bits.
    return plgpu.elementwise_inline_asm(
        asm, args=[w], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.int32)])[0]


def _fma_pairs(a: jax.Array, b: jax.Array, c: jax.Array, emulate: bool) -> jax.Array:
    """``a * b + c`` on float16 pairs held in int32 words, rounded once (``fma.rn.f16x2``;
    emulated in float32, where the product of two float16 values is exact)."""
    if emulate:
        a32, b32, c32 = (lax.bitcast_convert_type(v, jnp.float16).astype(jnp.float32)
                         for v in (a, b, c))
        return lax.bitcast_convert_type((a32 * b32 + c32).astype(jnp.float16), jnp.int32)
    return plgpu.elementwise_inline_asm(
        "fma.rn.f16x2 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


def _fma_f32(a: jax.Array, b: jax.Array, c: jax.Array, emulate: bool) -> jax.Array:
    """``a * b + c`` in float32, broadcast to ``c``'s shape: one ``fma.rn.f32`` on the GPU
    (Triton left ``x * y + z`` as a multiply and an add, r100's SASS); two roundings in the
    interpreter."""
    a, b = jnp.broadcast_to(a, c.shape), jnp.broadcast_to(b, c.shape)
    if emulate:
        return a * b + c
    return plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float32)])[0]


def _widen(a: jax.Array, half: int, emulate: bool) -> jax.Array:
    """The low (``half`` 0) or high float16 of each pair, as float32."""
    if emulate:
        return lax.bitcast_convert_type(a, jnp.float16)[..., half].astype(jnp.float32)
    asm = ("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $1;\n"
           f" cvt.f32.f16 $0, {'hi' if half else 'lo'}; }}")
    return plgpu.elementwise_inline_asm(
        asm, args=[a], constraints="=f,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _half2_kernel(x_ref, q_ref, s_ref, *refs, bits: int, group: int, sub: int,
                  groups_per_step: int, steps_per_split: int, pair_scales: bool,
                  prefetch: bool, evict_first: bool, x_pairs: bool, x_pair_sums: bool,
                  scaled: int, norm_eps: float | None, emulate: bool) -> None:
    """``_word_kernel`` with float16 pair arithmetic (module docstring) for int4 (with zeros)
    or int8 (no zeros): refs as there, except that with ``pair_scales`` the float16 scales
    and zeros come as int32 words ``[K / G, block_n / 2]`` (word ``m`` holds columns ``2m``
    and ``2m + 1``): two 4-byte loads give a weight word's four columns, where lane-strided
    loads take four 2-byte ones. Per row and group, two pair accumulators: byte lanes 0/2 and
    1/3 of each word, one product per load and field; each group's sums are widened and
    scaled in float32 (float16 would round small products to subnormals), and the result is
    multiplied by ``1 / _HALF2_X_SCALE`` once, at the store.

    ``prefetch``: each loop step issues the next step's loads (words, activations, scales)
    before it computes on the ones the previous step issued, and the last step's compute
    follows the loop (H100, r101-r103, when the last step still reloaded itself: 2-4% faster
    for int8 at one group per step, slower for int4 g128; r126, as now: int4 g128 at ~512
    programs 61.8 against 63.8 us per 8B layer, ``Int4Tiles``' default; int8 113.0 against
    108.1 without, within that run's ~5% spread per shape, so int8 keeps it).

    ``x_pairs`` (``WordTiles.x_pairs``): x_ref holds the activations as float16 pairs
    (``half_pairs`` of ``x * _HALF2_X_SCALE``, int32 ``[rows, K]``) and, with zeros, a ref
    after z_ref holds each group's sum of ``x * _HALF2_X_SCALE / sub`` (float32 ``[rows, K /
    G]``): added to each of an accumulator's ``sub`` rows, it sums to the group's term.
    With ``x_pair_sums`` (``WordTiles.x_pair_sums``) there is no such ref: each group's sum
    is made from its pairs (low halves widened, summed in float32) as the group is loaded.

    ``scaled`` (x given as ``ScaledPairs``, with x_pairs and, for int4, x_pair_sums; else 0):
    x_ref holds their pairs and a ref before o_ref their group scales (float32 ``[rows, K /
    (scaled * G)]``, one per ``scaled`` weight groups): each group's products are multiplied
    by its scale. With ``norm_eps`` (their ``sumsq``) a
    last ref holds the groups' sums of squares, and the result is multiplied by ``rsqrt(sum
    of squares / K + norm_eps)`` at the store."""
    *z_refs, o_ref = refs
    gs_ref = ss_ref = None
    if norm_eps is not None:
        *z_refs, ss_ref = z_refs
    if scaled:
        *z_refs, gs_ref = z_refs
    z_ref, xsum_ref = (z_refs + [None, None])[:2]
    rows, words = x_ref.shape[0], q_ref.shape[1]
    byte_rows = group * bits // 8
    loads = byte_rows // sub
    fields = 8 // bits  # field i of a group's byte row j is its row i * byte_rows + j
    split = pl.program_id(1)
    f32 = jnp.float32

    def load_words(rows):  # uint32 [sub, words]
        if evict_first:
            return plgpu.load(q_ref.at[rows, :], eviction_policy="evict_first")
        return q_ref[rows, :]

    def lane_values(ref, g):
        """The group's scales (or zeros) ``[4 lanes] [1, words]`` float32, lane ``c`` holding
        columns ``c, c + 4, ...``."""
        if pair_scales:
            w01, w23 = (ref[pl.ds(g, 1), pl.ds(h, words, stride=2)] for h in (0, 1))
            return [_widen(w01, 0, emulate), _widen(w01, 1, emulate),
                    _widen(w23, 0, emulate), _widen(w23, 1, emulate)]
        return [ref[pl.ds(g, 1), pl.ds(c, words, stride=4)].astype(f32) for c in range(4)]

    def load(step):
        """What ``step`` reads, per group: words ``[loads] [sub, words]`` int32; activations
        ``[rows][loads][fields] [sub, 1]`` float32, scaled by ``_HALF2_X_SCALE`` (exact; with
        ``x_pairs`` int32 pairs); scales and zeros (or None) as ``lane_values``; with
        ``x_pairs`` and zeros, the activation sums ``[rows] [1, 1]`` (else None)."""
        first = (split * steps_per_split + step) * groups_per_step
        out = []
        for j in range(groups_per_step):
            g = first + j
            w = [lax.bitcast_convert_type(load_words(pl.ds(g * byte_rows + t * sub, sub)),
                                          jnp.int32) for t in range(loads)]
            xs = [[[x_ref[r, pl.ds(g * group + i * byte_rows + t * sub, sub)][:, None]
                    for i in range(fields)] for t in range(loads)] for r in range(rows)]
            if not x_pairs:
                xs = [[[v.astype(f32) * _HALF2_X_SCALE for v in f] for f in t] for t in xs]
            sums = (None if xsum_ref is None else
                    [xsum_ref[r, pl.ds(g, 1)][None, :] for r in range(rows)])
            if x_pair_sums and z_ref is not None:
                sums = [(jnp.sum(_widen(x_ref[r, pl.ds(g * group, group)], 0, emulate))
                         / sub).reshape(1, 1) for r in range(rows)]
            z = None if z_ref is None else lane_values(z_ref, g)
            gs = (None if gs_ref is None else
                  [gs_ref[r, pl.ds(g // scaled, 1)].reshape(1, 1) for r in range(rows)])
            out.append((w, xs, lane_values(s_ref, g), z, sums, gs))
        return out

    def compute(data, acc):  # acc[r][c]: [sub, words] float32
        acc = [list(a) for a in acc]
        for w, xs, s, z, sums, gs in data:
            a02 = [jnp.zeros((sub, words), jnp.int32)] * rows  # float16 pairs: lanes 0, 2
            a13 = [jnp.zeros((sub, words), jnp.int32)] * rows  # lanes 1, 3
            x_sum = sums or [None] * rows  # [sub, 1] (or [1, 1]) float32, for the zeros
            for t in range(loads):
                # Lanes 0 and 2 are at bits 0 and 16 of a word, lanes 1 and 3 8 bits up;
                # field 1 (int4's high nibble) 4 bits above field 0.
                w8 = lax.shift_right_logical(w[t], jnp.int32(8))
                p02 = [_field_pairs(w[t], bits, i == 1, emulate) for i in range(fields)]
                p13 = [_field_pairs(w8, bits, i == 1, emulate) for i in range(fields)]
                for r in range(rows):
                    for i in range(fields):
                        xi = xs[r][t][i]
                        if z is not None and not x_pairs:
                            x_sum[r] = xi if x_sum[r] is None else x_sum[r] + xi
                        xp = jnp.broadcast_to(xi if x_pairs else half_pairs(xi),
                                              (sub, words))
                        a02[r] = _fma_pairs(p02[i], xp, a02[r], emulate)
                        a13[r] = _fma_pairs(p13[i], xp, a13[r], emulate)
            for r in range(rows):
                parts = (_widen(a02[r], 0, emulate), _widen(a13[r], 0, emulate),
                         _widen(a02[r], 1, emulate), _widen(a13[r], 1, emulate))  # lanes 0-3
                # ScaledPairs: the group's scale folded into its weight scales and sum
                sr = s if gs is None else [v * gs[r] for v in s]
                xr = x_sum[r] if gs is None or x_sum[r] is None else x_sum[r] * gs[r]
                for c in range(4):
                    acc[r][c] = _fma_f32(sr[c], parts[c], acc[r][c], emulate)
                    if z is not None:
                        acc[r][c] = _fma_f32(z[c], xr, acc[r][c], emulate)
        return acc

    if prefetch:
        def body(step, carry):
            acc, data = carry
            return compute(data, acc), load(step + 1)

        def run(init):  # the last step computes after the loop: nothing is loaded twice
            if steps_per_split == 1:
                return compute(load(0), init)
            acc, data = lax.fori_loop(0, steps_per_split - 1, body, (init, load(0)))
            return compute(data, acc)
    else:
        def run(init):
            return lax.fori_loop(0, steps_per_split,
                                 lambda step, acc: compute(load(step), acc), init)

    scale: Any = 1.0 if scaled else 1 / _HALF2_X_SCALE
    if ss_ref is not None:  # rsqrt(mean square + eps) per row, from the groups' sums
        k = x_ref.shape[1]
        scale = [lax.rsqrt(jnp.sum(ss_ref[pl.ds(r, 1), :], axis=1, keepdims=True) / k
                           + norm_eps) for r in range(rows)]
    _store_column_sums(run, rows, sub, o_ref, scale)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """How ``word_gemv`` runs one call (``_launch``)."""

    half2: bool  # the float16-pair kernel (else the float32 one)
    block_n: int
    sub: int
    programs: int
    groups_per_step: int
    prefetch: bool
    x_pairs: bool
    reads_pairs: bool  # takes ``ScaledPairs`` as they are
    reads_norm: bool  # and their sums of squares (all groups in one load)

    def reads(self, norm: bool) -> bool:
        """Whether this launch takes ``ScaledPairs`` as they are, with sums of squares
        (``norm``) or without."""
        return self.reads_norm if norm else self.reads_pairs


def _launch(m: int, k: int, n: int, groups: int, bits: int, offset: int, flip: int,
            has_zero: bool, tiles: WordTiles) -> _Launch:
    """The kernel, tile and step ``word_gemv`` runs ``[m, k] @ [k, n]`` (``groups`` groups of
    rows) with, from the format and ``tiles`` (their docstrings say why)."""
    group = k // groups
    byte_rows = group * bits // 8
    sub = min(tiles.sub_rows, byte_rows)
    check(byte_rows % sub == 0, f"WordTiles.sub_rows {tiles.sub_rows} must divide a group's "
          f"{byte_rows} byte rows")
    block_n = min(tiles.block_n or (256 if group <= 64 else 128), next_pow2(max(n, 4)))
    int4_pairs = ((bits, offset, flip) == (4, 0, 0) and has_zero
                  and 0 < tiles.half2_min_group <= group)
    int8_pairs = (bits, offset, flip) == (8, -128, 0x80) and not has_zero and tiles.int8_half2
    products = tiles.half2_products or HALF2_PRODUCTS
    half2 = (int4_pairs or int8_pairs) and group <= products * sub
    programs = tiles.half2_programs if half2 and tiles.half2_programs else tiles.target_programs
    groups_per_step = largest_divisor(groups, tiles.step_rows // group)
    steps = groups // groups_per_step
    prefetch, x_pairs = tiles.prefetch, False
    if half2 and tiles.wide_tile != (0, 0):
        wide_n, wide_sub = tiles.wide_tile
        wide_n = min(wide_n, next_pow2(max(n, 4)))
        if (m <= tiles.wide_max_rows and group <= products * wide_sub
                and byte_rows % wide_sub == 0 and n % wide_n == 0
                and steps * (n // wide_n) >= tiles.wide_min_programs):
            block_n, sub, programs, prefetch = wide_n, wide_sub, tiles.wide_programs, False
            x_pairs = tiles.x_pairs
            if x_pairs:
                groups_per_step = largest_divisor(groups, tiles.x_pairs_step_rows // group)
    reads = x_pairs and (not has_zero or tiles.x_pair_sums)
    return _Launch(half2, block_n, sub, programs, groups_per_step, prefetch, x_pairs, reads,
                   reads and groups & (groups - 1) == 0)  # a Triton block side: a power of 2


def reads_pairs(m: int, q: jax.Array, scale: jax.Array, zero: jax.Array | None, *,
                bits: int, offset: int, flip: int, tiles: WordTiles, norm: bool) -> bool:
    """Whether ``word_gemv`` of ``m`` rows by this weight (``q``, ``scale``, ``zero`` as
    there; shapes suffice) reads ``ScaledPairs`` with groups of ``K / scale.shape[0]`` rows
    (or a power-of-two multiple of them) as they are (``norm``: with sums of squares,
    ``add_norm_pairs``): the wide tile with ``x_pairs``, and ``x_pair_sums`` for int4.
    Elsewhere it would rebuild the activations, and a junction kernel gains nothing."""
    groups, n = scale.shape
    k = q.shape[0] * 8 // bits
    launch = _launch(m, k, n, groups, bits, offset, flip, zero is not None, tiles)
    return launch.reads(norm)


@functools.partial(jax.jit, static_argnames=("bits", "offset", "flip", "interpret", "tiles",
                                             "out_dtype", "partials"))
def word_gemv(x: jax.Array | ScaledPairs, q: jax.Array, scale: jax.Array,
              zero: jax.Array | None, *, bits: int, offset: int, flip: int, interpret: bool,
              tiles: WordTiles, out_dtype: jnp.dtype = jnp.float32, partials: bool = False
              ) -> jax.Array:
    """``x [M, K]`` (M <= ``WORD_ROWS``) times the weight whose bytes are ``q [K * bits / 8,
    N]`` (uint8 or int8; formats in the module docstring), ``scale`` (and ``zero``, or None)
    ``[K / G, N]``: ``[M, N]`` in ``out_dtype``, float32 accumulation. Callers check the
    operands (``int4_matmul``, ``int8_matmul``); ``G * bits / 8`` must be a multiple of
    ``tiles.sub_rows``. The float16-pair kernel runs where ``tiles`` and the format allow
    (module docstring; its pallas_call is named ``..._half2``), else the float32 one.

    ``x`` may be ``ScaledPairs`` (``junction``: activations, RMSNorm'd or not, as
    block-scaled float16 pairs): the kernel reads them as they are where it reads pairs
    (``x_pairs`` with ``x_pair_sums``, or int8, and groups of a power-of-two multiple of
    the weight's rows: one scale per head suits o's groups of half a head); elsewhere
    they are turned back into activations first (``ScaledPairs.values``). ``partials``:
    return the float32 split-K partials ``[splits, M, N]`` unsummed (for a kernel after this
    one that sums them, ``add_norm_pairs``)."""
    given = x if isinstance(x, ScaledPairs) else None
    m, k = x.shape
    groups, n = scale.shape
    group = k // groups
    launch = _launch(m, k, n, groups, bits, offset, flip, zero is not None, tiles)
    block_n, sub, programs = launch.block_n, launch.sub, launch.programs
    groups_per_step, half2, x_pairs = launch.groups_per_step, launch.half2, launch.x_pairs
    steps = groups // groups_per_step
    per = given.group // group if given is not None else 0  # weight groups per pair scale
    if given is not None and not (given.group == per * group and per & (per - 1) == 0
                                  and launch.reads(given.sumsq is not None)):
        x, given = given.values(), None  # this launch does not read them
    col_blocks = cdiv(n, block_n)
    np_ = col_blocks * block_n
    if np_ != n:  # padded columns: zero scales and zeros make them 0; sliced off below
        q = jnp.pad(q, ((0, 0), (0, np_ - n)))
        scale = jnp.pad(scale, ((0, 0), (0, np_ - n)))
        zero = None if zero is None else jnp.pad(zero, ((0, 0), (0, np_ - n)))
    words = lax.bitcast_convert_type(q.reshape(q.shape[0], np_ // 4, 4), jnp.uint32)
    specs = [pl.BlockSpec((m, k), lambda j, t: (0, 0)),
             pl.BlockSpec((q.shape[0], block_n // 4), lambda j, t: (0, j)),
             pl.BlockSpec((groups, block_n), lambda j, t: (0, j))]
    operands = [x if given is None else given.pairs, words, scale]
    if zero is not None:
        specs.append(pl.BlockSpec((groups, block_n), lambda j, t: (0, j)))
        operands.append(zero)
    splits = largest_divisor(steps, programs // col_blocks)
    pair_scales = half2 and zero is not None and scale.dtype == zero.dtype == jnp.float16
    if pair_scales:  # float16 scales and zeros as int32 words of two columns
        operands[2:] = [lax.bitcast_convert_type(a.reshape(groups, np_ // 2, 2), jnp.int32)
                        for a in (scale, zero)]
        specs[2:] = [pl.BlockSpec((groups, block_n // 2), lambda j, t: (0, j))] * 2
    if given is not None:  # the pairs as given, with their group scales (and sums of squares)
        stats = [a for a in (given.scales, given.sumsq) if a is not None]
        specs += [pl.BlockSpec(a.shape, lambda j, t: (0, 0)) for a in stats]
        operands += stats
    elif x_pairs:  # XLA makes the pairs (and, without x_pair_sums, the group sums), fused
        # into x's producer where it can
        xs = x.astype(jnp.float32) * _HALF2_X_SCALE  # [m, k]
        operands[0] = half_pairs(xs)
        if zero is not None and not tiles.x_pair_sums:
            specs.append(pl.BlockSpec((m, groups), lambda j, t: (0, 0)))
            operands.append(jnp.sum(xs.reshape(m, groups, group), axis=-1) / sub)
    if half2:
        kernel = functools.partial(
            _half2_kernel, bits=bits, group=group, sub=sub, groups_per_step=groups_per_step,
            steps_per_split=steps // splits, pair_scales=pair_scales, prefetch=launch.prefetch,
            evict_first=tiles.evict_first, x_pairs=x_pairs,
            x_pair_sums=x_pairs and tiles.x_pair_sums,
            scaled=0 if given is None else per,
            norm_eps=None if given is None or given.sumsq is None else given.eps,
            emulate=interpret)
    else:
        kernel = functools.partial(
            _word_kernel, bits=bits, offset=offset, flip=flip, group=group, sub=sub,
            groups_per_step=groups_per_step, steps_per_split=steps // splits)
    partial = pl.pallas_call(
        kernel,
        grid=(col_blocks, splits),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, t: (t, 0, j)),
        # Unsplit: the result in its dtype, no XLA op after the kernel.
        out_shape=jax.ShapeDtypeStruct(
            (splits, m, np_), jnp.float32 if splits > 1 or partials else out_dtype),
        compiler_params=gpu_params(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"jaxinfer_word_gemv_{bits}bit" + ("_half2" if half2 else ""),
    )(*operands)
    if partials:
        return partial if np_ == n else partial[:, :, :n]
    out = partial[0] if splits == 1 else jnp.sum(partial, axis=0).astype(out_dtype)
    return out if np_ == n else out[:, :n]
