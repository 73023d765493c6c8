"""Paged decode attention: one query token per sequence, K/V in a shared pool of pages.

Pages are [kv_heads, num_pages, page_size, head_dim] (the layout JAX's own GPU and TPU
paged kernels use): one kv head's page is a contiguous [page_size, head_dim] tile, and a
block of pages is gathered by index with one load. `block_tables[b, i]` is the physical
page that holds keys [i * page_size, (i + 1) * page_size) of sequence b.

GPU: Flash-Decoding over the page list, grid (batch, kv_heads, num_splits); each program
gathers `pages_per_block` pages per step and applies them to the whole q-head group
(GQA: each page is read once per kv head). TPU: the block table is scalar-prefetched into
SMEM and drives the K/V BlockSpec index map, one page per grid step, so the pipeline DMAs
exactly the pages the sequence owns.

Quantized pages (`kv_quant`: int8 or float8_e4m3fn values, `[kv_heads, num_pages,
page_size]` scales per token and head) are read with their scales through the same block
table and dequantized inside the dot products (`_common.key_block_step`), so a decode step
reads about half the bytes of a bfloat16 pool.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

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
    check_kv_scales,
    check_page_pool,
    combine_splits,
    default_scale,
    gpu_params,
    key_block_step,
    next_pow2,
    online_softmax_finish,
    scaled_pairs,
    split_partials,
    tpu_decode_block,
    tpu_interpret,
    tpu_params,
)
from pallas_kernels.decode_attention import decode_attention_reference
from pallas_kernels.junction import ScaledPairs
from pallas_kernels.kv_quant import dequantize_kv

# Programs the split-K factor aims at: about one per H100 SM. Each split past the keys a
# sequence has is still a program to schedule: at 528, 8B batch 1 (2 rows x 8 kv heads) ran
# 1,024 programs in 9.15 us for a ~640-key context, at 132 (256 programs) 6.90 us, and the
# combine fell from 3.32 to 2.03 us (bench/NOTES.md r78-r79). A program's pipelined K/V
# blocks take much of an SM's shared memory, which would explain the waves. One H200, the
# engine's batch 1 (r219): within ~1 us of the best split count at 192-1,000 keys, the best
# at 4,000; one split costs ~4.5 us plus ~2.3 us per 128-key block, so even a 192-key row
# gains nothing from skipping the combine. Fewer splits (8 at batch 1) shorten the combine
# (1.7 against 2.6 us) but not a long row (4,000 keys: 11.6 against 6.3 us, r277).
_TARGET_PROGRAMS = 132
# Keys per inner step when pages_per_block is not given (as the contiguous decode kernel).
_BLOCK_KEYS = 128
# From this many (sequence, kv head) pairs on, the batch alone fills the GPU, and a
# program's time is set by its own sequence's length: with one split per sequence the
# longest sequences run their blocks one after another while short ones are done. There
# the default launch splits each sequence for about _MANY_TARGET_PROGRAMS programs in all
# (~16 per SM: the load evens out), _BLOCK_KEYS_MANY keys per step, no software pipelining
# (the block loop is a few steps long; each stage holds a block in shared memory, which
# caps the programs per SM). One H200, batch 64, 8 kv heads, so 4 splits (bench/NOTES.md
# r202-r203): engine-like lengths (mean 310, max 1,108 keys) 57.0 -> 41.9 us per call; the
# 8B engine at 64 slots 4,608 -> 4,841 output tok/s (r207). From 128 pairs on as well
# (r209: 4 kv heads at 64 rows, engine-like lengths ~84 -> ~49 us with 8 splits; 2 kv
# heads ~54 -> ~50 with 8, the default's 16 not measured):
# the 8B engine at 32 slots (256 pairs, as 8B tp=2 at 64 rows per GPU) 3,400 -> 3,614 (r211).
# Where every row is short and equal there is no tail to even out: 8B tp=2 at 64 rows of
# 192 keys ran 19.0 us per layer before, 18.0 + 2.6 (combine) after, the same tok/s (r214).
_MANY_PROGRAMS = 128
_MANY_TARGET_PROGRAMS = 2048
_BLOCK_KEYS_MANY = 64
# Software pipeline stages of the default launch at any batch: one, so each block's page
# numbers are loaded a step ahead instead (``_paged_gpu_kernel``'s ``prefetch_pages``).
# Below 128 pairs it was 3 stages; one H200, the kernel alone at batch 1 (64 query / 8 KV
# heads, 32 splits, bench/NOTES.md r277): 384 keys 6.2 -> 4.9 us, 1,000 keys 6.4 -> 5.1,
# 4,000 keys 9.0 -> 6.3; in the engine at batch 1, 8B int4-g128 460.0 -> 465.0 tok/s (r276),
# 70B 85.0 -> 85.1 (r277).
_STAGES = 1


def paged_decode_launch(batch: int, kv_heads: int, page_size: int, pages_per_seq: int,
                        pages_per_block: int | None = None, num_splits: int | None = None,
                        num_stages: int | None = None) -> tuple[int, int, int]:
    """``(pages_per_block, num_splits, num_stages)`` as the GPU kernel runs them over block
    tables of ``pages_per_seq`` pages, from the caller's values where given.

    Defaults: below 128 (sequence, kv head) pairs, 128 keys per step and splits for at least
    132 programs (about one per H100 SM); from 128 pairs on, 64 keys per step and splits for
    at least 2,048 programs (16 at 128 pairs, 4 at 512, 1 from 2,048); one stage. Pages
    per block are rounded to a power of two of at least 16 keys and at most the table's
    pages; default splits are capped at the blocks a table row holds; splits are powers of
    two."""
    pairs = batch * kv_heads
    many = pairs >= _MANY_PROGRAMS
    if pages_per_block is None:
        pages_per_block = max(1, (_BLOCK_KEYS_MANY if many else _BLOCK_KEYS) // page_size)
    # At least MIN_DOT keys per step (Triton dot) and no more pages than a sequence has.
    pages_per_block = max(pages_per_block, cdiv(MIN_DOT, page_size))
    pages_per_block = min(pages_per_block, max(next_pow2(pages_per_seq),
                                               cdiv(MIN_DOT, page_size)))
    pages_per_block = next_pow2(pages_per_block)
    if num_splits is None:
        target = _MANY_TARGET_PROGRAMS if many else _TARGET_PROGRAMS
        num_splits = min(next_pow2(cdiv(target, pairs)), cdiv(pages_per_seq, pages_per_block))
    # combine_splits holds every split in one block: a power of two (Triton); the extra
    # splits get no keys and drop out of the combine.
    num_splits = next_pow2(max(1, num_splits))
    if num_stages is None:
        num_stages = _STAGES
    return pages_per_block, num_splits, num_stages


def _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales) -> bool:
    """Argument checks; returns whether the pages are quantized (``kv_quant``)."""
    check(q.ndim == 3, f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    check_page_pool(q, k_pages, v_pages)
    quantized = check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    check(quantized or q.dtype == k_pages.dtype,
          "q, k_pages and v_pages must share a dtype")
    check_dtype("q", q)
    check_head_dim(q.shape[2])
    check(
        block_tables.ndim == 2 and block_tables.shape[0] == q.shape[0],
        f"block_tables must be [batch={q.shape[0]}, pages_per_seq], got {block_tables.shape}",
    )
    check(
        lengths.shape == (q.shape[0],),
        f"lengths must have shape ({q.shape[0]},), got {lengths.shape}",
    )
    check_gqa(q.shape[1], k_pages.shape[0])
    return quantized


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Pages [kv_heads, num_pages, page_size, *rest] -> dense [batch, kv_heads, p * page_size,
    *rest] (rest: head_dim for values, nothing for scales)."""
    g = pages[:, block_tables]  # [kv_heads, batch, p, page_size, *rest]
    h, b, p, ps, *rest = g.shape
    return jnp.swapaxes(g, 0, 1).reshape(b, h, p * ps, *rest)


def gather_dequantized(pages: jax.Array, scales: jax.Array | None, block_tables: jax.Array
                       ) -> jax.Array:
    """``gather_pages`` in float32: of a float pool, or of a quantized one (``scales`` given,
    ``kv_quant``) dequantized after the gather, so only the sequences' pages are widened."""
    dense = gather_pages(pages, block_tables)
    if scales is None:
        return dense.astype(jnp.float32)
    return dequantize_kv(dense, gather_pages(scales, block_tables))


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp paged decode attention: gather the pages, then dense masked attention.

    Args:
      q: [batch, q_heads, head_dim].
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      block_tables: int [batch, pages_per_seq], physical page of each logical page.
      lengths: int [batch], valid keys per sequence.
      k_scales, v_scales: [kv_heads, num_pages, page_size] scales of quantized pages
        (``kv_quant``); the gathered pages are dequantized in float32.
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Returns:
      [batch, q_heads, head_dim] in q's dtype.
    """
    _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    # Entries past a sequence's pages may be anything: clamp so the gather stays in range.
    bt = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)
    if k_scales is None:
        return decode_attention_reference(q, gather_pages(k_pages, bt), gather_pages(v_pages, bt),
                                          lengths, sm_scale=sm_scale)
    out = decode_attention_reference(
        q.astype(jnp.float32), gather_dequantized(k_pages, k_scales, bt),
        gather_dequantized(v_pages, v_scales, bt), lengths, sm_scale=sm_scale)
    return out.astype(q.dtype)


# --------------------------------------------------------------------------- GPU (Triton)


def _paged_gpu_kernel(
    len_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float, pages_per_block: int,
    page_size: int, num_pages: int, num_splits: int, quantized: bool, writes: bool,
    group: int, rows_of: tuple[tuple[int, int], ...], gp: int, q_heads: int,
    prefetch_pages: bool,
) -> None:
    """One (sequence, kv head, split) of Flash-Decoding; refs after ``v_ref``, in order:
    quantized pages' ``ks_ref, vs_ref``; with ``writes``, the new token's ``page_ref,
    offset_ref [1]``, ``nk_ref, nv_ref`` (and ``nks_ref, nvs_ref [1]`` when quantized);
    the partials ``acc_ref`` (a whole ``[batch * kv_heads * splits * group, d]`` array:
    this program stores its ``group`` rows), ``m_ref, l_ref [gp]``, or with one split the output
    ``o_ref`` itself (a whole ``[batch * q_heads, d]`` array: this program writes rows ``b *
    q_heads + h * group`` onward, ``group`` of them); with
    ``writes``, the pools again (outputs aliased to the inputs) that the new token's K/V are
    stored into.

    ``q_ref``, ``nk_ref`` and ``nv_ref`` are whole ``[rows, d]`` arrays (possibly one array
    passed three times): ``rows_of`` gives each one's ``(rows per sequence, first row)``,
    and head ``h`` of sequence ``b`` is row ``b * stride + first + h``. With
    ``prefetch_pages`` (the one-stage launch) the block loop carries the next block's page
    numbers, loaded before this block's K/V gather; otherwise each step loads its own."""
    refs = list(refs)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    if writes:
        page_ref, offset_ref, nk_ref, nv_ref = refs[:4]
        nks_ref, nvs_ref = refs[4:6] if quantized else (None, None)
        refs = refs[6 if quantized else 4:]
    finish = num_splits == 1  # nothing to combine: this program writes the output
    if finish:
        o_ref, *pool_out = refs
    else:
        acc_ref, m_ref, l_ref, *pool_out = refs
    bi, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, d = gp, q_ref.shape[1]
    # q is unpadded: this kv head's `group` query rows, and zero rows up to the `rows` a dot
    # needs (masked, so no padded copy of q is made before the kernel).
    row = lax.broadcasted_iota(jnp.int32, (rows, d), 0)
    (q_stride, q_first), *new_rows = rows_of
    q = plgpu.load(q_ref.at[pl.ds(bi * q_stride + q_first + h * group, rows), :],
                   mask=row < group, other=0.0)
    block_k = pages_per_block * page_size
    seq_len = len_ref[0]
    # With `writes` the newest key is not read from the pool (this kernel stores it there);
    # it is taken from nk_ref below.
    pool_len = seq_len - 1 if writes else seq_len
    n_blocks = cdiv(pool_len, block_k)
    per_split = cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_blocks)

    last_block = bt_ref.shape[0] // pages_per_block - 1  # the padded table's last block

    def block_pages(j):
        pages = bt_ref[pl.ds(jnp.minimum(j, last_block) * pages_per_block, pages_per_block)]
        # Table slots past the sequence may be stale or padding: keep the gather in range.
        return jnp.clip(pages, 0, num_pages - 1)

    def body(j, carry):
        acc, m, l_sum, *ahead = carry
        # With prefetch_pages the next block's page numbers are loaded before this block's
        # K/V are used: the table read and the gather it feeds are two dependent loads, and
        # so only the gather waits in each step (one H200, r204: -4% at 64 rows, -10 to -16%
        # at 128, in the one-stage launch). Under Triton's 3-stage pipelining the same loop
        # was slower (2 rows x 1,500 keys: 11.1 -> 13.4 us), so there each step loads its
        # own.
        if prefetch_pages:
            (pages,) = ahead
            ahead = [block_pages(j + 1)]
        else:
            pages = block_pages(j)
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        start = j * block_k
        kpos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        return *key_block_step(
            acc, m, l_sum, q, k, v, scale=scale, valid=kpos < pool_len, key_start=start,
            key_end=pool_len,
            k_scale=ks_ref[pages].reshape(block_k) if quantized else None,
            v_scale=vs_ref[pages].reshape(block_k) if quantized else None,
        ), *ahead

    acc, m, l_sum, *_ = lax.fori_loop(
        lo, hi, body,
        (
            jnp.zeros(q.shape, jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            *([block_pages(lo)] if prefetch_pages else []),
        ),
    )
    if writes:
        # Split 0 adds the new key, as a block of MIN_DOT copies of which one counts, and
        # stores the new K/V (values and scales) into their slot; the other splits skip both
        # (a cond, not a mask: at batch 1 most of the ~64 splits had no keys at all, and
        # each paid ~3 us for a masked block, r72). A row of length 0 attends to nothing; a
        # slot out of range (the page at or past num_pages: padding) stores nothing.
        page = page_ref[0]
        first = (split == 0) & (seq_len > 0)
        new_k, new_v = (ref[bi * stride + row0 + h, :]  # [d]
                        for ref, (stride, row0) in zip((nk_ref, nv_ref), new_rows, strict=True))

        def add_new_key(carry):
            nk = jnp.broadcast_to(new_k[None, :], (MIN_DOT, d))
            nv = jnp.broadcast_to(new_v[None, :], (MIN_DOT, d))
            col = lax.broadcasted_iota(jnp.int32, (rows, MIN_DOT), 1)
            return key_block_step(
                *carry, q, nk, nv, scale=scale, valid=col < 1, key_start=0, key_end=1,
                k_scale=jnp.broadcast_to(nks_ref[...], (MIN_DOT,)) if quantized else None,
                v_scale=jnp.broadcast_to(nvs_ref[...], (MIN_DOT,)) if quantized else None,
            )

        acc, m, l_sum = lax.cond(first, add_new_key, lambda carry: carry, (acc, m, l_sum))

        offset = offset_ref[0]

        @pl.when((split == 0) & (page >= 0) & (page < num_pages) & (offset >= 0)
                 & (offset < page_size))
        def _store():
            news = [new_k, new_v] + ([nks_ref[...], nvs_ref[...]] if quantized else [])
            for out_ref, new in zip(pool_out, news, strict=True):
                if out_ref.ndim == 2:  # a scale pool [pages, page_size], new [1]
                    out_ref[pl.ds(page, 1), pl.ds(offset, 1)] = new[None, :]
                else:  # [pages, page_size, d], new [d]
                    out_ref[page, offset, :] = new
    if finish:
        out = online_softmax_finish(acc, l_sum[:, None]).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(bi * q_heads + h * group, rows), :], out,
                    mask=row < group)
        return
    # Only the group's rows of the partial go out (gp >= 16 rows are computed for the dot):
    # at 64 rows x 8 kv heads x 4 splits the [16, 128] float32 tiles were 16 MB per layer.
    first_row = ((bi * pl.num_programs(1) + h) * num_splits + split) * group
    plgpu.store(acc_ref.at[pl.ds(first_row, rows), :], acc, mask=row < group)
    m_ref[...] = m
    l_ref[...] = l_sum


def _paged_gpu(q, k_pages, v_pages, block_tables, lengths, scales, new, *, scale,
               pages_per_block, num_splits, num_warps, num_stages, interpret, out_pairs):
    """The GPU kernel, and the combine when keys are split. ``new``: ``()`` or the write's
    ``(write_pages, write_offsets, k_new, v_new[, k_new_scales, v_new_scales])`` (see
    ``paged_attention_write``); returns ``out`` or ``(out, *pools written)``, ``out`` as
    ``_out_pairs`` with ``out_pairs`` (the combine writes them)."""
    b, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    group = hq // hkv
    pps = block_tables.shape[1]
    pages_per_block, num_splits, num_stages = paged_decode_launch(
        b, hkv, page_size, pps, pages_per_block, num_splits, num_stages)
    n_blocks_max = cdiv(pps, pages_per_block)
    # Pad the table so every block's slice of it is in bounds (padding is masked by length).
    bt = jnp.pad(
        block_tables.astype(jnp.int32), ((0, 0), (0, n_blocks_max * pages_per_block - pps))
    )
    gp = max(MIN_DOT, next_pow2(group))
    writes = bool(new)
    if writes:
        write_pages, write_offsets, k_new, v_new, *new_scales = new
    if writes and not scales:
        # One operand for q and the new K/V: XLA builds it in one fusion with the RoPE of q
        # and k (three separate operands took three fusions, r72), the kernel reads rows.
        heads = hq + 2 * hkv
        q_op = jnp.concatenate([q, k_new, v_new], axis=1).reshape(b * heads, d)
        operands_qkv = [q_op, q_op, q_op]
        rows_of = ((heads, 0), (heads, hq), (heads, hq + hkv))
    else:
        q_op = q.reshape(b * hq, d)
        operands_qkv = [q_op] + ([k_new.reshape(b * hkv, d), v_new.reshape(b * hkv, d)]
                                 if writes else [])
        rows_of = ((hq, 0), (hkv, 0), (hkv, 0))
    kernel = functools.partial(
        _paged_gpu_kernel, scale=scale * LOG2E, pages_per_block=pages_per_block,
        page_size=page_size, num_pages=num_pages, num_splits=num_splits,
        quantized=bool(scales), writes=writes, group=group, rows_of=rows_of, gp=gp,
        q_heads=hq, prefetch_pages=num_stages == 1,
    )
    pool = pl.BlockSpec((None, num_pages, page_size, d), lambda bi, h, s: (h, 0, 0, 0))
    scale_pool = pl.BlockSpec((None, num_pages, page_size), lambda bi, h, s: (h, 0, 0))
    per_seq = pl.BlockSpec((1,), lambda bi, h, s: (bi,))
    in_specs = [
        per_seq,
        pl.BlockSpec((None, bt.shape[1]), lambda bi, h, s: (bi, 0)),
        pl.BlockSpec(q_op.shape, lambda bi, h, s: (0, 0)),
        pool, pool, *[scale_pool] * len(scales),
    ]
    if num_splits == 1:  # the kernel normalises and writes q's rows: no partials, no combine
        out_specs = [pl.BlockSpec((b * hq, d), lambda bi, h, s: (0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b * hq, d), q.dtype)]
    else:
        out_specs, out_shape = split_partials(b, hkv, num_splits, gp, d, acc_rows=group)
    results = len(out_specs)
    operands = [lengths, bt, operands_qkv[0], k_pages, v_pages, *scales]
    aliases = {}
    if writes:
        whole = [pl.BlockSpec(x.shape, lambda bi, h, s: (0, 0)) for x in operands_qkv[1:]]
        head_scale = pl.BlockSpec((None, None, 1), lambda bi, h, s: (bi, h, 0))
        in_specs += [per_seq, per_seq, *whole, *[head_scale] * len(scales)]
        operands += [write_pages.astype(jnp.int32), write_offsets.astype(jnp.int32),
                     *operands_qkv[1:],
                     *[x[..., None].astype(p.dtype) for x, p in zip(new_scales, scales,
                                                                    strict=True)]]
        pools = [k_pages, v_pages, *scales]
        out_specs += [pool, pool, *[scale_pool] * len(scales)]
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools]
        aliases = {3 + i: results + i for i in range(len(pools))}
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=gpu_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_paged_decode",
    )(*operands)
    written = outs[results:]
    if num_splits == 1:
        out = outs[0].reshape(b, hq, d)
        if out_pairs:
            out = _out_pairs(out)
    else:  # [b, hkv, group, d] from the splits' partials
        acc = outs[0].reshape(b, hkv, num_splits, group, d)
        out = combine_splits(acc, *outs[1:3], group, q.dtype, interpret, pairs=out_pairs)
        out = _head_pairs(*out, q.dtype) if out_pairs else out.reshape(b, hq, d)
    return (out, *written) if writes else out


def _out_pairs(out: jax.Array) -> ScaledPairs:
    """``out [b, q_heads, head_dim]`` as ``ScaledPairs`` ``[b, q_heads * head_dim]``, one
    scale per head (XLA's elementwise op where no combine kernel writes them)."""
    return _head_pairs(*scaled_pairs(out.astype(jnp.float32)), out.dtype)


def _head_pairs(pairs: jax.Array, scales: jax.Array, dtype: Any) -> ScaledPairs:
    """Per-head ``pairs [b, ..., head_dim]`` and ``scales [b, ..., 1]`` (heads in the middle
    axes) as ``ScaledPairs`` ``[b, q_heads * head_dim]`` of ``dtype`` activations."""
    b = pairs.shape[0]
    return ScaledPairs(pairs.reshape(b, -1), scales.reshape(b, -1), jnp.dtype(dtype))


# --------------------------------------------------------------------------- TPU (Mosaic)


def _paged_tpu_kernel(
    len_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float, page_size: int, quantized: bool,
) -> None:
    # Quantized pages bring their scales: refs = (ks_ref, vs_ref, o_ref, m_sc, l_sc, acc_sc).
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    o_ref, m_sc, l_sc, acc_sc = refs[-4:]
    tpu_decode_block(q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, step=pl.program_id(2),
                     seq_len=len_ref[pl.program_id(0)], block=page_size, scale=scale,
                     ks_ref=ks_ref, vs_ref=vs_ref)


def _paged_tpu(q, k_pages, v_pages, block_tables, lengths, scales, *, scale, interpret):
    b, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    group = hq // hkv
    pps = block_tables.shape[1]
    qg = q.reshape(b, hkv, group, d)
    # SMEM pads 2-D arrays heavily; a flat table is the compact form.
    bt_flat = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)

    def kv_map(bi, h, j, len_ref, bt_ref):
        # Past the length, keep pointing at the last valid page: no new DMA is issued.
        last = jnp.maximum(cdiv(len_ref[bi], page_size) - 1, 0)
        return (h, bt_ref[bi * pps + jnp.minimum(j, last)], 0, 0)

    def scale_map(*args):  # the same page's [page_size] scales
        return kv_map(*args)[:3]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, hkv, pps),
        in_specs=[
            pl.BlockSpec((None, None, group, d), lambda bi, h, j, L, T: (bi, h, 0, 0)),
            pl.BlockSpec((None, None, page_size, d), kv_map),
            pl.BlockSpec((None, None, page_size, d), kv_map),
            *[pl.BlockSpec((None, None, page_size), scale_map)] * len(scales),
        ],
        out_specs=pl.BlockSpec((None, None, group, d), lambda bi, h, j, L, T: (bi, h, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_paged_tpu_kernel, scale=scale * LOG2E, page_size=page_size,
                          quantized=bool(scales)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="jaxinfer_paged_decode_tpu",
    )(lengths, bt_flat, qg, k_pages, v_pages, *scales)
    return out.reshape(b, hq, d)


# --------------------------------------------------------------------------- public API


def _check_launch(k_pages: jax.Array, num_splits: int | None, backend: str) -> None:
    """The checks of a launch's options after the operands', for both public kernels."""
    check(num_splits is None or num_splits >= 1, "num_splits must be >= 1")
    page_size = k_pages.shape[2]
    check(backend == "tpu" or page_size == next_pow2(page_size),
          f"page_size must be a power of two on GPU, got {page_size}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "pages_per_block", "num_splits", "num_warps", "num_stages", "interpret",
        "backend", "out_pairs",
    ),
)
def _paged_attention_jit(q, k_pages, v_pages, block_tables, lengths, scales, new, *,
                         sm_scale, pages_per_block, num_splits, num_warps, num_stages,
                         interpret, backend, out_pairs=False):
    lengths = jnp.minimum(
        lengths.astype(jnp.int32), block_tables.shape[1] * k_pages.shape[2]
    )
    scale = default_scale(sm_scale, q.shape[-1])
    if backend == "tpu":
        pools = (k_pages, v_pages, *scales)
        if new:  # the TPU kernel reads the pools as they are: store the new token first
            pools = tuple(store_new_tokens(p, x, new[0], new[1])
                          for p, x in zip(pools, new[2:], strict=True))
        out = _paged_tpu(q, pools[0], pools[1], block_tables, lengths, pools[2:], scale=scale,
                         interpret=interpret)
        out = _out_pairs(out) if out_pairs else out
        return (out, *pools) if new else out
    return _paged_gpu(
        q, k_pages, v_pages, block_tables, lengths, scales, new, scale=scale,
        pages_per_block=pages_per_block, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, out_pairs=out_pairs,
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    interpret: bool = False,
    backend: str = "gpu",
) -> jax.Array:
    """Paged decode attention with split-K (Flash-Decoding) and GQA grouping.

    Args:
      q: [batch, q_heads, head_dim], bfloat16/float16/float32, one token per sequence.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], q's dtype, or int8 /
        float8_e4m3fn values with `k_scales`/`v_scales` (`kv_quant`); page_size a power of
        two on GPU; q_heads % kv_heads == 0.
      block_tables: int [batch, pages_per_seq]; entry i is the physical page holding keys
        [i*page_size, (i+1)*page_size) of the sequence. Entries past the length are never
        used for values (they are clamped into range before any gather).
      lengths: int [batch], valid keys per sequence (<= pages_per_seq * page_size).
      k_scales, v_scales: [kv_heads, num_pages, page_size] per-token scales of quantized
        pages (bfloat16 or float32), read through the same block table.
      sm_scale: logit scale, default 1/sqrt(head_dim).
      pages_per_block: pages gathered per inner step on GPU, rounded so a step has at least
        16 keys (larger steps overflow shared memory); default ``paged_decode_launch``'s.
      num_splits: split-K factor (GPU); default ``paged_decode_launch``'s, capped at the
        blocks a row of ``block_tables`` holds.
      num_warps: Triton launch parameter (GPU only), default 4.
      num_stages: Triton pipeline stages (GPU only); default ``paged_decode_launch``'s. With
        one stage the kernel loads each block's page numbers a step ahead of its gather
        instead (``_paged_gpu_kernel``'s ``prefetch_pages``).
      interpret: run under the Pallas (GPU) or TPU interpreter on CPU.
      backend: "gpu" (Pallas Triton) or "tpu" (Pallas Mosaic TPU).

    Returns:
      [batch, q_heads, head_dim] in q's dtype; a sequence of length 0 gives zeros.
    """
    check_backend(backend)
    quantized = _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    _check_launch(k_pages, num_splits, backend)
    return _paged_attention_jit(
        q, k_pages, v_pages, block_tables, lengths, (k_scales, v_scales) if quantized else (),
        (), sm_scale=sm_scale,
        pages_per_block=pages_per_block, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, backend=backend,
    )


def store_new_tokens(pages: jax.Array, new: jax.Array, write_pages: jax.Array,
                     write_offsets: jax.Array) -> jax.Array:
    """``pages [kv_heads, num_pages, page_size, *rest]`` with ``new [batch, kv_heads, *rest]``
    stored at slot ``(write_pages[b], write_offsets[b])``; pages at or past ``num_pages``
    are dropped (padding rows). The plain-jnp form of ``paged_attention_write``'s store."""
    return pages.at[:, write_pages, write_offsets].set(
        jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")


def _validate_write(q, k_new, v_new, k_pages, write_pages, write_offsets, k_new_scales,
                    v_new_scales, quantized) -> None:
    b, _, d = q.shape
    shape = (b, k_pages.shape[0], d)
    check(k_new.shape == shape and v_new.shape == shape,
          f"k_new and v_new must be [batch, kv_heads, head_dim] = {shape}, got {k_new.shape} "
          f"and {v_new.shape}")
    check(k_new.dtype == k_pages.dtype and v_new.dtype == k_pages.dtype,
          f"k_new and v_new must be in the pool's dtype {k_pages.dtype} (quantize them first, "
          f"kv_quant.quantize_kv), got {k_new.dtype} and {v_new.dtype}")
    check(write_pages.shape == (b,) and write_offsets.shape == (b,),
          f"write_pages and write_offsets must have shape ({b},), got {write_pages.shape} and "
          f"{write_offsets.shape}")
    given = k_new_scales is not None and v_new_scales is not None
    check(given == quantized, "k_new_scales and v_new_scales go with quantized pages, and "
          "only with them")
    check(not given or (k_new_scales.shape == shape[:2] and v_new_scales.shape == shape[:2]),
          f"k_new_scales and v_new_scales must be [batch, kv_heads] = {shape[:2]}")


def paged_attention_write_reference(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
    block_tables: jax.Array, lengths: jax.Array, write_pages: jax.Array,
    write_offsets: jax.Array, *, k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None, k_new_scales: jax.Array | None = None,
    v_new_scales: jax.Array | None = None, sm_scale: float | None = None,
) -> tuple[jax.Array, ...]:
    """``paged_attention_write`` in plain jnp: ``store_new_tokens`` into each pool, then
    ``paged_attention_reference``. Returns ``(out, k_pages, v_pages[, k_scales, v_scales])``."""
    quantized = _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    _validate_write(q, k_new, v_new, k_pages, write_pages, write_offsets, k_new_scales,
                    v_new_scales, quantized)
    pools = [k_pages, v_pages] + ([k_scales, v_scales] if quantized else [])
    news = [k_new, v_new] + ([k_new_scales, v_new_scales] if quantized else [])
    pools = [store_new_tokens(p, x, write_pages, write_offsets)
             for p, x in zip(pools, news, strict=True)]
    scales = {"k_scales": pools[2], "v_scales": pools[3]} if quantized else {}
    out = paged_attention_reference(q, pools[0], pools[1], block_tables, lengths, **scales,
                                    sm_scale=sm_scale)
    return (out, *pools)


def paged_attention_write(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
    block_tables: jax.Array, lengths: jax.Array, write_pages: jax.Array,
    write_offsets: jax.Array, *, k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None, k_new_scales: jax.Array | None = None,
    v_new_scales: jax.Array | None = None, sm_scale: float | None = None,
    pages_per_block: int | None = None, num_splits: int | None = None, num_warps: int = 4,
    num_stages: int | None = None, interpret: bool = False, backend: str = "gpu",
    out_pairs: bool = False,
) -> tuple[Any, ...]:
    """A decode step's attention that also stores the step's K/V: each sequence's new key
    and value go to their slot, and the sequence attends over its pages including them.

    The same result as ``store_new_tokens`` into every pool followed by ``paged_attention``,
    in one kernel on GPU: the program that attends a sequence's first key block stores the
    new K/V into the (aliased) pools and takes the new key from its input, never from the
    pool (the block holding the slot is masked there), so no result depends on a slot
    while it is written. At batch 1 this removes the two scatters before the attention
    kernel (bench/NOTES.md, tenth session). TPU: the store, then ``paged_attention``.

    Args:
      q, k_pages, v_pages, block_tables, k_scales, v_scales, sm_scale and the tiling: as
        ``paged_attention``.
      k_new, v_new: ``[batch, kv_heads, head_dim]`` in the pool's dtype (quantized pools:
        ``kv_quant.quantize_kv``'s values, with ``k_new_scales``/``v_new_scales [batch,
        kv_heads]``).
      lengths: int [batch], keys per sequence including the new one, which is the last key
        (0: the row attends to nothing and gives zeros).
      write_pages, write_offsets: int [batch], the new token's slot: a page in ``[0,
        num_pages]`` (``num_pages``: padding, nothing stored) and an offset in ``[0,
        page_size)``.

      out_pairs: return ``out`` as ``junction.ScaledPairs`` ``[batch, q_heads * head_dim]``
        (one scale per head), for an o GEMV that reads them: on GPU the combine kernel
        writes them, so no op sits between attention and that GEMV.

    Returns:
      ``(out [batch, q_heads, head_dim], k_pages, v_pages)``, then ``k_scales, v_scales``
      for quantized pools. Donate the pools to the enclosing ``jit`` so the store is in place.
    """
    check_backend(backend)
    quantized = _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    _validate_write(q, k_new, v_new, k_pages, write_pages, write_offsets, k_new_scales,
                    v_new_scales, quantized)
    _check_launch(k_pages, num_splits, backend)
    scales = (k_scales, v_scales) if quantized else ()
    new = (write_pages, write_offsets, k_new, v_new,
           *((k_new_scales, v_new_scales) if quantized else ()))
    return _paged_attention_jit(
        q, k_pages, v_pages, block_tables, lengths, scales, new, sm_scale=sm_scale,
        pages_per_block=pages_per_block, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, backend=backend, out_pairs=out_pairs,
    )
