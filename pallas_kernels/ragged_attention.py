"""Ragged paged attention: decode tokens and prefill chunks of many sequences in one call.

Queries of all sequences are packed along one token axis; sequence s owns tokens
[cu_q_lens[s], cu_q_lens[s+1]). Its K/V (already including the new tokens) live in pages
as for `paged_attention`, `kv_lens[s]` keys long, so its local query i sits at absolute
position kv_lens[s] - q_len_s + i and sees keys j <= that position (causal against the
cache). A decode token is the q_len = 1 case; chunked prefill and speculative
verification are q_len > 1.

GPU (Triton): grid (sequence, kv head, query block). A program takes `block_q` query
tokens of one sequence times the whole q-head group of one kv head as the rows of its
tiles (GQA: each page is read once per kv head and query block), walks the pages up to
the causal bound of its last row and writes its rows into a per-sequence padded output
that the wrapper gathers back to the packed token order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    LOG2E,
    MIN_DOT,
    cdiv,
    check,
    check_dtype,
    check_gqa,
    check_head_dim,
    default_scale,
    gpu_params,
    next_pow2,
    online_softmax_finish,
    online_softmax_step,
)
from pallas_kernels.paged_attention import gather_pages

NEG_INF = float("-inf")


def _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, kernel: bool) -> int:
    """Shape checks for both paths; dtype and head_dim limits only for the kernel (`kernel`).

    The reference computes in float32 whatever its inputs, so it takes any head_dim and
    q/pages of different dtypes (the jaxinfer reference backend relies on both).
    """
    check(q.ndim == 3, f"q must be [tokens, q_heads, head_dim], got shape {q.shape}")
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
    if kernel:
        check(q.dtype == k_pages.dtype == v_pages.dtype,
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
    return check_gqa(q.shape[1], k_pages.shape[0])


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
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp ragged paged attention (float32 math), same contract as `ragged_attention`.

    Args:
      q: [tokens, q_heads, head_dim], sequences packed back to back.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      block_tables: int [num_seqs, pages_per_seq].
      kv_lens: int [num_seqs], keys per sequence including its new tokens.
      cu_q_lens: int [num_seqs + 1], cumulative query counts (cu_q_lens[0] == 0).
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Unlike the kernel, any head_dim and mixed input dtypes are accepted.

    Returns:
      [tokens, q_heads, head_dim] in q's dtype; tokens past cu_q_lens[-1] give 0.
    """
    group = _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, kernel=False)
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    scale = default_scale(sm_scale, d)
    bt = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)
    kd = gather_pages(k_pages, bt).astype(jnp.float32)  # [n, hkv, L, d]
    vd = gather_pages(v_pages, bt).astype(jnp.float32)
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


def _ragged_gpu_kernel(
    qs_ref, ql_ref, kl_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float,
    block_q: int, group_pad: int, pages_per_block: int, page_size: int, num_pages: int,
) -> None:
    qb = pl.program_id(2)
    q_start, q_len, kv_len = qs_ref[0], ql_ref[0], kl_ref[0]
    rows = block_q * group_pad
    d = q_ref.shape[-1]
    tok0 = qb * block_q
    q = q_ref[pl.ds(q_start + tok0, block_q), :, :].reshape(rows, d)
    block_k = pages_per_block * page_size
    # Absolute position of each row's token; rows past q_len see nothing (-> output 0).
    row_tok = tok0 + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) // group_pad
    row_pos = kv_len - q_len + row_tok
    row_ok = row_tok < q_len
    last_tok = jnp.minimum(tok0 + block_q, q_len) - 1
    key_end = jnp.where(tok0 < q_len, jnp.minimum(kv_len, kv_len - q_len + last_tok + 1), 0)
    n_blocks = cdiv(key_end, block_k)

    def body(j, carry):
        acc, m, l_sum = carry
        pages = jnp.clip(bt_ref[pl.ds(j * pages_per_block, pages_per_block)], 0, num_pages - 1)
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        start = j * block_k
        kpos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        valid = (kpos < kv_len) & (kpos <= row_pos) & row_ok
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * scale
        s = jnp.where(valid, s, NEG_INF)
        vpos = start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(vpos < kv_len, v, jnp.zeros_like(v))
        return online_softmax_step(acc, m, l_sum, s, v)

    acc, _, l_sum = lax.fori_loop(
        0, n_blocks, body,
        (
            jnp.zeros((rows, d), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        ),
    )
    out = online_softmax_finish(acc, l_sum[:, None])
    o_ref[...] = out.reshape(block_q, group_pad, d).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_q_len", "sm_scale", "block_q", "pages_per_block", "num_warps", "num_stages",
        "interpret",
    ),
)
def _ragged_jit(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, max_q_len,
                sm_scale, block_q, pages_per_block, num_warps, num_stages, interpret):
    t, hq, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    n, pps = block_tables.shape
    group = hq // hkv
    scale = default_scale(sm_scale, d)
    gp = next_pow2(group)
    block_q = next_pow2(max(block_q, cdiv(MIN_DOT, gp)))
    block_q = min(block_q, max(next_pow2(max_q_len), cdiv(MIN_DOT, gp)))
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    pages_per_block = next_pow2(max(pages_per_block, cdiv(MIN_DOT, page_size)))
    n_kblocks = cdiv(pps, pages_per_block)
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_kblocks * pages_per_block - pps)))
    cu = cu_q_lens.astype(jnp.int32)
    q_starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
    kv_lens = kv_lens.astype(jnp.int32)
    nqb = cdiv(max_q_len, block_q)
    # Pad tokens so a block that starts inside the last sequence never reads out of bounds,
    # and the group to a power of two for Triton; both pads are masked or dropped.
    qg = q.reshape(t, hkv, group, d)
    qg = jnp.pad(qg, ((0, nqb * block_q), (0, 0), (0, gp - group), (0, 0)))
    kernel = functools.partial(
        _ragged_gpu_kernel, scale=scale * LOG2E, block_q=block_q, group_pad=gp,
        pages_per_block=pages_per_block, page_size=page_size, num_pages=num_pages,
    )
    one = pl.BlockSpec((1,), lambda s, h, i: (s,))
    out = pl.pallas_call(
        kernel,
        grid=(n, hkv, nqb),
        in_specs=[
            one, one, one,
            pl.BlockSpec((None, bt.shape[1]), lambda s, h, i: (s, 0)),
            pl.BlockSpec((qg.shape[0], None, gp, d), lambda s, h, i: (0, h, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, d), lambda s, h, i: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, d), lambda s, h, i: (h, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, gp, d), lambda s, h, i: (s, i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n, nqb * block_q, hkv, gp, d), q.dtype),
        compiler_params=gpu_params(num_warps, num_stages),
        interpret=interpret,
        name="jaxinfer_ragged_paged",
    )(q_starts, q_lens, kv_lens, bt, qg, k_pages, v_pages)
    seq, local, real = _token_to_seq(cu, t)
    o = out[seq, jnp.clip(local, 0, nqb * block_q - 1)][:, :, :group]  # [t, hkv, group, d]
    o = jnp.where(real[:, None, None, None], o, jnp.zeros_like(o))
    return o.reshape(t, hq, d)


def ragged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int | None = None,
    sm_scale: float | None = None,
    block_q: int = 16,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Causal paged attention for a packed mix of decode tokens and prefill chunks (GPU).

    Args:
      q: [tokens, q_heads, head_dim], bfloat16/float16/float32; sequence s owns tokens
        [cu_q_lens[s], cu_q_lens[s+1]).
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (page_size a power of
        two), holding every sequence's keys including its new tokens.
      block_tables: int [num_seqs, pages_per_seq].
      kv_lens: int [num_seqs], keys per sequence (>= its query count).
      cu_q_lens: int [num_seqs + 1], cumulative query counts, cu_q_lens[0] == 0.
      max_q_len: static upper bound on any sequence's query count (default: tokens).
        Query blocks past it are not computed.
      sm_scale: logit scale, default 1/sqrt(head_dim).
      block_q: query tokens per program (raised so block_q * group >= 16 rows).
      pages_per_block: pages gathered per inner step (default 64 keys per step).
      num_warps, num_stages: Triton launch parameters.
      interpret: run under the Pallas interpreter on CPU.

    Returns:
      [tokens, q_heads, head_dim] in q's dtype; tokens past cu_q_lens[-1] give zeros.
    """
    _validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, kernel=True)
    page_size = k_pages.shape[2]
    check(page_size == next_pow2(page_size), f"page_size must be a power of two, got {page_size}")
    max_q_len = q.shape[0] if max_q_len is None else int(max_q_len)
    check(max_q_len >= 1, "max_q_len must be >= 1")
    return _ragged_jit(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, max_q_len=max_q_len,
        sm_scale=sm_scale, block_q=block_q, pages_per_block=pages_per_block,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
