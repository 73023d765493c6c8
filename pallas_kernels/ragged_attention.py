"""Ragged paged attention: decode tokens and prefill chunks of many sequences in one call.

Queries of all sequences are packed along one token axis; sequence s owns tokens
[cu_q_lens[s], cu_q_lens[s+1]). Its K/V (already including the new tokens) live in pages
as for `paged_attention`, `kv_lens[s]` keys long, so its local query i sits at absolute
position kv_lens[s] - q_len_s + i and sees keys j <= that position (causal against the
cache). A decode token is the q_len = 1 case; chunked prefill and speculative
verification are q_len > 1.

GPU (Triton): grid (query block, kv head) over the packed token axis. The wrapper cuts
every sequence's query run into `block_q`-token blocks (on device, vectorised: blocks per
sequence, cumsum, searchsorted) and hands each block its first packed row, first local
token, query count, key count and sequence as int32 inputs. The block count is static:
cdiv(tokens, block_q) + num_seqs (each sequence adds at most one partial block), capped
at num_seqs * cdiv(max_q_len, block_q); blocks past the real count have query count 0
and do nothing. A program takes its block's tokens times the whole q-head group of one
kv head as the rows of its tiles (GQA: each page is read once per kv head and block),
walks its sequence's pages up to the causal bound of its last row and stores its rows
straight into the packed [tokens, kv_heads, group, head_dim] output with a masked store,
so a block never touches the next sequence's rows. The output buffer starts as zeros
(aliased), which is what padding tokens past cu_q_lens[-1] read. Work and memory scale
with the tokens, not with num_seqs * max_q_len.

TPU (Mosaic): grid (sequence, kv head, query block, page), the page axis last and
"arbitrary". The wrapper scatters the packed queries into a per-sequence padded buffer
laid out [seq, kv_head, block_q * group rows, head_dim] (rows token-major, the q-head
group of one kv head inside; GQA reads each page once per kv head and query block).
kv_lens, q_lens and the flattened block table are scalar-prefetched into SMEM and used by
the index maps: one page per grid step through the table; steps past the causal bound of
the query block (and query blocks past the sequence's query count) re-use the previous
block index, so no DMA is issued, and their compute is skipped with `pl.when`. Online
softmax state lives in VMEM scratch. Tested only under the TPU interpreter.

Quantized pages (`kv_quant`) come with `[kv_heads, num_pages, page_size]` scale pools read
through the same block table (GPU: gathered beside the values; TPU: one more BlockSpec with
the values' index map) and are dequantized inside the dot products
(`_common.key_block_step`).
"""

from __future__ import annotations

import functools

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
    default_scale,
    gpu_params,
    key_block_step,
    next_pow2,
    online_softmax_finish,
    tpu_interpret,
    tpu_params,
)
from pallas_kernels.paged_attention import gather_dequantized


def _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, *,
              kernel: bool) -> bool:
    """Shape checks for both paths; dtype and head_dim limits only for the kernel (`kernel`).
    Returns whether the pages are quantized (`kv_quant`).

    The reference computes in float32 whatever its inputs, so it takes any head_dim and
    q/pages of different dtypes (the jaxinfer reference backend relies on both).
    """
    check(q.ndim == 3, f"q must be [tokens, q_heads, head_dim], got shape {q.shape}")
    check_page_pool(q, k_pages, v_pages)
    quantized = check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if kernel:
        check(quantized or q.dtype == k_pages.dtype,
              "q, k_pages and v_pages must share a dtype")
        check_dtype("q", q)
        check_head_dim(q.shape[2])
    check(block_tables.ndim == 2, f"block_tables must be 2-D, got {block_tables.shape}")
    n = block_tables.shape[0]
    check(kv_lens.shape == (n,), f"kv_lens must have shape ({n},), got {kv_lens.shape}")
    check(
        cu_q_lens.shape == (n + 1,),
        f"cu_q_lens must have shape ({n + 1},), got {cu_q_lens.shape}",
    )
    check_gqa(q.shape[1], k_pages.shape[0])
    return quantized


def _token_to_seq(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per packed token: its sequence, its index within that sequence, and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    real = t < cu_q_lens[-1]
    seq = jnp.minimum(seq, cu_q_lens.shape[0] - 2)
    return seq, t - cu_q_lens[seq], real


def ragged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp ragged paged attention (float32 math), same contract as `ragged_attention`.

    Args:
      q: [tokens, q_heads, head_dim], sequences packed back to back.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      block_tables: int [num_seqs, pages_per_seq].
      kv_lens: int [num_seqs], keys per sequence including its new tokens.
      cu_q_lens: int [num_seqs + 1], cumulative query counts (cu_q_lens[0] == 0).
      k_scales, v_scales: [kv_heads, num_pages, page_size] scales of quantized pages
        (`kv_quant`); the sequences' gathered pages are dequantized in float32.
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Unlike the kernel, any head_dim and mixed input dtypes are accepted.

    Returns:
      [tokens, q_heads, head_dim] in q's dtype; tokens past cu_q_lens[-1] give 0.
    """
    _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales,
              kernel=False)
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    group = hq // hkv
    scale = default_scale(sm_scale, d)
    bt = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)
    kd = gather_dequantized(k_pages, k_scales, bt)  # [n, hkv, L, d] float32
    vd = gather_dequantized(v_pages, v_scales, bt)
    seq, local, real = _token_to_seq(cu_q_lens, t)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    qpos = kv_lens[seq] - q_lens[seq] + local  # [t]
    kpos = jnp.arange(kd.shape[2])
    valid = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < kv_lens[seq][:, None])
    valid = valid & real[:, None]
    k_tok = jnp.where(valid[:, None, :, None], kd[seq], 0.0)  # [t, hkv, L, d]
    v_tok = jnp.where(valid[:, None, :, None], vd[seq], 0.0)
    qf = q.astype(jnp.float32).reshape(t, hkv, group, d)
    s = jnp.einsum("thgd,thkd->thgk", qf, k_tok) * scale
    s = jnp.where(valid[:, None, None, :], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    o = jnp.einsum("thgk,thkd->thgd", p, v_tok)
    o = online_softmax_finish(o, jnp.sum(p, axis=-1, keepdims=True))
    return o.reshape(t, hq, d).astype(q.dtype)


# --------------------------------------------------------------------------- GPU (Triton)


def _gpu_blocks(
    cu: jax.Array, kv_lens: jax.Array, *, num_tokens: int, block_q: int, max_q_len: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Split every sequence's query run into `block_q`-token blocks of the packed token axis.

    Returns five int32 [NB] arrays, one entry per block b: its first packed row, its first
    local token (within its sequence), its sequence's query count and key count, and the
    sequence id. NB = min(cdiv(tokens, block_q) + seqs, seqs * cdiv(max_q_len, block_q)) is
    a static bound on the real block count (each sequence adds at most one partial block);
    blocks past the real count get query count 0, so their program computes and writes
    nothing. A sequence's blocks past max_q_len are not formed (its rows there stay 0).
    """
    n = cu.shape[0] - 1
    max_blocks = cdiv(max_q_len, block_q)  # per sequence
    num_blocks = min(cdiv(num_tokens, block_q) + n, n * max_blocks)
    q_lens = cu[1:] - cu[:-1]  # [n]
    per_seq = jnp.minimum(cdiv(q_lens, block_q), max_blocks)  # [n]
    ends = jnp.cumsum(per_seq)  # [n], one past each sequence's last block
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # Sequence of block b: the first whose end is past b; empty sequences (no blocks) are
    # skipped. compare_all is one [NB, n] fusion, cheaper on GPU than a log-step scan.
    seq = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
    live = seq < n
    seq = jnp.minimum(seq, n - 1)
    tok0 = jnp.where(live, (b - ends[seq] + per_seq[seq]) * block_q, 0)
    q_len = jnp.where(live, q_lens[seq], 0)
    return cu[seq] + tok0, tok0, q_len, kv_lens[seq], seq


def _ragged_gpu_kernel(
    start_ref, tok0_ref, ql_ref, kl_ref, seq_ref, bt_ref, q_ref, k_ref, v_ref, *refs,
    scale: float, block_q: int, group_pad: int, pages_per_block: int, page_size: int,
    num_pages: int, bt_cols: int, quantized: bool,
) -> None:
    # refs = ([ks_ref, vs_ref,] o_init_ref, o_ref); o_init_ref is the zero-filled buffer
    # aliased to o_ref (rows no block writes stay 0).
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    o_ref = refs[-1]
    start, tok0, q_len, kv_len = start_ref[0], tok0_ref[0], ql_ref[0], kl_ref[0]
    bt_row = seq_ref[0] * bt_cols
    rows = block_q * group_pad
    d = q_ref.shape[-1]
    # Rows of the block that belong to its sequence; the rest may be the next sequence's
    # tokens (or past the token axis) and are neither loaded nor stored.
    blk = (block_q, group_pad, d)
    mine = tok0 + lax.broadcasted_iota(jnp.int32, blk, 0) < q_len
    q = plgpu.load(q_ref.at[pl.ds(start, block_q)], mask=mine, other=0.0).reshape(rows, d)
    block_k = pages_per_block * page_size
    # Absolute position of each row's token; rows past q_len see nothing (-> output 0).
    row_tok = tok0 + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) // group_pad
    row_pos = kv_len - q_len + row_tok
    row_ok = row_tok < q_len
    last_tok = jnp.minimum(tok0 + block_q, q_len) - 1
    key_end = jnp.where(tok0 < q_len, jnp.minimum(kv_len, kv_len - q_len + last_tok + 1), 0)
    n_ksteps = cdiv(key_end, block_k)
    # Prompt chunks: key blocks that the block's first token (so every row) sees whole come
    # first, with no masks (rows past q_len compute garbage there that is never stored);
    # then the blocks that cross the causal diagonal or kv_len. Decode tokens (q_len 1)
    # take the masked loop only (H100 r96: their unmasked loop ran slower).
    first_keys = jnp.minimum(kv_len - q_len + tok0 + 1, kv_len)
    n_whole = jnp.where((tok0 < q_len) & (q_len > 1),
                        jnp.minimum(first_keys // block_k, n_ksteps), 0)

    def step(j, carry, masked: bool):
        acc, m, l_sum = carry
        pages = bt_ref[pl.ds(bt_row + j * pages_per_block, pages_per_block)]
        pages = jnp.clip(pages, 0, num_pages - 1)
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        start_k = j * block_k
        valid = None
        if masked:
            kpos = start_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            valid = (kpos < kv_len) & (kpos <= row_pos) & row_ok
        return key_block_step(
            acc, m, l_sum, q, k, v, scale=scale, valid=valid, key_start=start_k,
            key_end=kv_len,
            k_scale=ks_ref[pages].reshape(block_k) if quantized else None,
            v_scale=vs_ref[pages].reshape(block_k) if quantized else None,
        )

    carry = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_whole, functools.partial(step, masked=False), carry)
    acc, _, l_sum = lax.fori_loop(n_whole, n_ksteps, functools.partial(step, masked=True),
                                  carry)
    out = online_softmax_finish(acc, l_sum[:, None]).reshape(blk).astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(start, block_q)], out, mask=mine)


def _ragged_gpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scales, *, max_q_len,
                scale, block_q, pages_per_block, num_warps, num_stages, interpret):
    t, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    n, pps = block_tables.shape
    group = hq // hkv
    gp = next_pow2(group)
    # Rows of a tile are block_q tokens x the (padded) q-head group: at least MIN_DOT for
    # the tensor-core dot, and no more tokens than the longest query run needs (a
    # decode-only step, max_q_len 1, gets the fewest tokens that still fill MIN_DOT rows).
    block_q = next_pow2(max(block_q, cdiv(MIN_DOT, gp)))
    block_q = min(block_q, max(next_pow2(max_q_len), cdiv(MIN_DOT, gp)))
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    pages_per_block = next_pow2(max(pages_per_block, cdiv(MIN_DOT, page_size)))
    bt_cols = cdiv(pps, pages_per_block) * pages_per_block
    # Flat [n * bt_cols]: a program's sequence is data (its block's), not a grid index, so
    # it slices its own row. Padding columns name page 0, whose keys lie past kv_len
    # (masked, V rows zeroed).
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, bt_cols - pps))).reshape(-1)
    cu = cu_q_lens.astype(jnp.int32)
    blocks = _gpu_blocks(cu, kv_lens.astype(jnp.int32), num_tokens=t, block_q=block_q,
                         max_q_len=max_q_len)
    num_blocks = blocks[0].shape[0]
    # Group padded to a power of two for Triton (a free reshape when group is one already).
    qg = q.reshape(t, hkv, group, d)
    if gp != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    kernel = functools.partial(
        _ragged_gpu_kernel, scale=scale * LOG2E, block_q=block_q, group_pad=gp,
        pages_per_block=pages_per_block, page_size=page_size, num_pages=num_pages,
        bt_cols=bt_cols, quantized=bool(scales),
    )
    one = pl.BlockSpec((1,), lambda b, h: (b,))
    # Every program of kv head h sees the whole packed token axis of q and of the output
    # and picks its rows with a masked dynamic slice.
    tokens = pl.BlockSpec((t, None, gp, d), lambda b, h: (0, h, 0, 0))
    pool = pl.BlockSpec((None, num_pages, page_size, d), lambda b, h: (h, 0, 0, 0))
    scale_pool = pl.BlockSpec((None, num_pages, page_size), lambda b, h: (h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, hkv),
        in_specs=[
            one, one, one, one, one,
            pl.BlockSpec((bt.shape[0],), lambda b, h: (0,)),
            tokens, pool, pool, *[scale_pool] * len(scales), tokens,
        ],
        out_specs=tokens,
        out_shape=jax.ShapeDtypeStruct((t, hkv, gp, d), q.dtype),
        # Output starts as zeros: padding tokens past cu_q_lens[-1] (and rows of a
        # sequence past max_q_len) belong to no block and must read 0.
        input_output_aliases={9 + len(scales): 0},
        compiler_params=gpu_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_ragged_paged",
    )(*blocks, bt, qg, k_pages, v_pages, *scales, jnp.zeros((t, hkv, gp, d), q.dtype))
    return out[:, :, :group].reshape(t, hq, d)


# --------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_key_end(i, q_len, kv_len, block_q: int):
    """Keys needed by query block i: up to the causal bound of its last real token.

    A block past the query count is treated like the last real block, so its index map
    points at the same pages as the step before it (no DMA); its compute is skipped.
    """
    tok_end = jnp.clip((i + 1) * block_q, 1, jnp.maximum(q_len, 1))
    return jnp.clip(kv_len - q_len + tok_end, 0, kv_len)


def _ragged_tpu_kernel(
    kl_ref, ql_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_q: int,
    group: int, page_size: int, quantized: bool,
) -> None:
    # Quantized pages bring their scales: refs = (ks_ref, vs_ref, o_ref, m_sc, l_sc, acc_sc).
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    o_ref, m_sc, l_sc, acc_sc = refs[-4:]
    si, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    kv_len, q_len = kl_ref[si], ql_ref[si]
    tok0 = qi * block_q
    k_lo = j * page_size
    key_end = _tpu_key_end(qi, q_len, kv_len, block_q)

    @pl.when(jnp.logical_and(tok0 < q_len, k_lo < key_end))
    def _compute():
        q = q_ref[...]
        shape = (q.shape[0], page_size)  # [rows, keys]
        row_tok = tok0 + lax.broadcasted_iota(jnp.int32, shape, 0) // group
        kpos = k_lo + lax.broadcasted_iota(jnp.int32, shape, 1)
        valid = (kpos < kv_len) & (kpos <= kv_len - q_len + row_tok) & (row_tok < q_len)
        acc_sc[...], m_sc[...], l_sc[...] = key_block_step(
            acc_sc[...], m_sc[...], l_sc[...], q, k_ref[...], v_ref[...], scale=scale,
            valid=valid, key_start=k_lo, key_end=kv_len,
            k_scale=ks_ref[...] if quantized else None,
            v_scale=vs_ref[...] if quantized else None,
        )

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = online_softmax_finish(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _ragged_tpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scales, *, max_q_len,
                scale, block_q, interpret):
    t, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    n, pps = block_tables.shape
    group = hq // hkv
    # Rows of a tile are block_q tokens x the q-head group: keep them a multiple of 8
    # (Mosaic's sublane tile) and no larger than the longest query run needs.
    block_q = max(1, min(block_q, max_q_len))
    while (block_q * group) % 8:
        block_q += 1
    rows = block_q * group
    nqb = cdiv(max_q_len, block_q)
    padded = nqb * block_q
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), pps * page_size)
    # Packed tokens -> per-sequence padded buffer [n, hkv, padded * group, d]; pad rows 0.
    local = jnp.arange(padded, dtype=jnp.int32)
    idx = jnp.clip(cu[:-1, None] + local[None, :], 0, t - 1)
    qg = q.reshape(t, hkv, group, d)[idx]  # [n, padded, hkv, group, d]
    qg = jnp.where((local[None, :] < q_lens[:, None])[..., None, None, None], qg,
                   jnp.zeros_like(qg))
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(n, hkv, padded * group, d)
    # SMEM pads 2-D arrays heavily; a flat table is the compact form.
    bt_flat = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1).reshape(-1)

    def q_map(s, h, i, j, kl_ref, ql_ref, bt_ref):
        # Blocks past the query count re-use the last real block (no DMA).
        return (s, h, jnp.minimum(i, jnp.maximum(cdiv(ql_ref[s], block_q) - 1, 0)), 0)

    def kv_map(s, h, i, j, kl_ref, ql_ref, bt_ref):
        # Past the causal bound of the block, keep pointing at its last needed page.
        key_end = _tpu_key_end(i, ql_ref[s], kl_ref[s], block_q)
        last = jnp.maximum(cdiv(key_end, page_size) - 1, 0)
        return (h, bt_ref[s * pps + jnp.minimum(j, last)], 0, 0)

    def scale_map(*args):  # the same page's [page_size] scales
        return kv_map(*args)[:3]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(n, hkv, nqb, pps),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), q_map),
            pl.BlockSpec((None, None, page_size, d), kv_map),
            pl.BlockSpec((None, None, page_size, d), kv_map),
            *[pl.BlockSpec((None, None, page_size), scale_map)] * len(scales),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda s, h, i, j, *_: (s, h, i, 0)),
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(
            _ragged_tpu_kernel, scale=scale * LOG2E, block_q=block_q, group=group,
            page_size=page_size, quantized=bool(scales),
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="jaxinfer_ragged_paged_tpu",
    )(kv_lens, q_lens, bt_flat, qg, k_pages, v_pages, *scales)
    out = jnp.transpose(out.reshape(n, hkv, padded, group, d), (0, 2, 1, 3, 4))
    seq, tok, real = _token_to_seq(cu, t)
    o = out[seq, jnp.clip(tok, 0, padded - 1)]  # [t, hkv, group, d]
    o = jnp.where(real[:, None, None, None], o, jnp.zeros_like(o))
    return o.reshape(t, hq, d)


# --------------------------------------------------------------------------- public API


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_q_len", "sm_scale", "block_q", "pages_per_block", "num_warps", "num_stages",
        "interpret", "backend",
    ),
)
def _ragged_jit(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scales, *, max_q_len,
                sm_scale, block_q, pages_per_block, num_warps, num_stages, interpret,
                backend):
    if backend == "tpu":
        return _ragged_tpu(
            q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scales, max_q_len=max_q_len,
            scale=default_scale(sm_scale, q.shape[-1]), block_q=block_q,
            interpret=interpret,
        )
    return _ragged_gpu(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scales, max_q_len=max_q_len,
        scale=default_scale(sm_scale, q.shape[-1]), block_q=block_q,
        pages_per_block=pages_per_block, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
    )


def ragged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    max_q_len: int | None = None,
    sm_scale: float | None = None,
    block_q: int = 16,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    backend: str = "gpu",
) -> jax.Array:
    """Causal paged attention for a packed mix of decode tokens and prefill chunks.

    Args:
      q: [tokens, q_heads, head_dim], bfloat16/float16/float32; sequence s owns tokens
        [cu_q_lens[s], cu_q_lens[s+1]).
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (page_size a power of
        two on GPU), holding every sequence's keys including its new tokens: q's dtype, or
        int8 / float8_e4m3fn values with `k_scales`/`v_scales` (`kv_quant`).
      block_tables: int [num_seqs, pages_per_seq].
      kv_lens: int [num_seqs], keys per sequence (>= its query count).
      cu_q_lens: int [num_seqs + 1], cumulative query counts, cu_q_lens[0] == 0.
      k_scales, v_scales: [kv_heads, num_pages, page_size] per-token scales of quantized
        pages, read through the same block table.
      max_q_len: static upper bound on any sequence's query count (default: tokens).
        It sizes the query block (a decode-only step, 1, gets the smallest) and caps the
        number of blocks; a sequence's queries past it are not computed (GPU: they read
        0). Each distinct value compiles its own kernel, so pass a bucket.
      sm_scale: logit scale, default 1/sqrt(head_dim).
      block_q: query tokens per program. GPU: raised to a power of two so that
        block_q * group >= 16 rows, then capped at max_q_len (rounded up to a power of
        two) unless that would leave fewer than 16 rows; each block holds one
        sequence's tokens, so a sequence costs cdiv(q_len, block_q) programs per kv
        head. TPU: capped at max_q_len, then raised until block_q * group is a multiple
        of 8 (the tile has block_q * group rows); each sequence's queries are padded to
        a multiple of block_q.
      pages_per_block: pages gathered per inner step on GPU (default 64 keys per step).
        The TPU kernel always takes one page (page_size keys) per grid step.
      num_warps, num_stages: Triton launch parameters (GPU only).
      interpret: run under the Pallas (GPU) or TPU interpreter on CPU.
      backend: "gpu" (Pallas Triton) or "tpu" (Pallas Mosaic TPU).

    Returns:
      [tokens, q_heads, head_dim] in q's dtype; tokens past cu_q_lens[-1] give zeros.
    """
    check_backend(backend)
    quantized = _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales,
                          v_scales, kernel=True)
    page_size = k_pages.shape[2]
    check(
        backend == "tpu" or page_size == next_pow2(page_size),
        f"page_size must be a power of two on GPU, got {page_size}",
    )
    max_q_len = q.shape[0] if max_q_len is None else int(max_q_len)
    check(max_q_len >= 1, "max_q_len must be >= 1")
    check(block_q >= 1, "block_q must be >= 1")
    return _ragged_jit(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
        (k_scales, v_scales) if quantized else (), max_q_len=max_q_len,
        sm_scale=sm_scale, block_q=block_q, pages_per_block=pages_per_block,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, backend=backend,
    )
