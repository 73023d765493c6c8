"""CPU tests of the pallas_kernels attention kernels against their jnp references.

GPU (Triton) kernels run in Pallas interpret mode, TPU (Mosaic) kernels under the TPU
interpreter. Every case draws fresh random inputs; cache slots past a length and the
unused tail of a partly filled page hold large finite values, pages no block table
points to hold NaN, so a kernel that reads or fails to mask them fails the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    combine_splits,
    combine_splits_reference,
    decode_attention,
    decode_attention_layer,
    decode_attention_layer_reference,
    decode_attention_reference,
    dequantize_kv,
    flash_attention,
    flash_attention_reference,
    paged_attention,
    paged_attention_reference,
    paged_attention_write,
    paged_attention_write_reference,
    paged_decode_launch,
    quantize_kv,
    ragged_attention,
    ragged_attention_reference,
)

BF16_TOL = 2e-2
F32_TOL = 1e-5
_SEED = np.random.SeedSequence().entropy  # fresh inputs each run; printed on failure


def _rng(*salt: int) -> np.random.Generator:
    return np.random.default_rng([_SEED % (2**63), *salt])


def _tol(dtype) -> float:
    return BF16_TOL if dtype == jnp.bfloat16 else F32_TOL


def _assert_close(out, ref, dtype, rows_mask=None) -> None:
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert not np.isnan(out).any(), f"NaN in kernel output (seed {_SEED})"
    if rows_mask is not None:
        out, ref = out[rows_mask], ref[rows_mask]
    err = float(np.abs(out - ref).max())
    assert err < _tol(dtype), f"max |err| {err} >= {_tol(dtype)} (seed {_SEED})"


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


# --------------------------------------------------------------------------- flash

FLASH_CASES = [
    # backend, dtype, batch, q_len, kv_len, q_heads, kv_heads, head_dim, causal, ragged
    ("gpu", jnp.float32, 2, 37, 37, 4, 4, 64, True, True),
    ("gpu", jnp.bfloat16, 2, 64, 64, 8, 2, 128, True, False),
    ("gpu", jnp.float32, 3, 20, 45, 8, 1, 64, False, True),
    ("gpu", jnp.bfloat16, 1, 1, 1, 8, 1, 64, True, False),
    ("tpu", jnp.float32, 2, 24, 24, 4, 1, 64, True, True),
    ("tpu", jnp.bfloat16, 2, 16, 40, 8, 2, 128, False, True),
]


@pytest.mark.parametrize(
    "backend,dtype,b,sq,sk,hq,hkv,d,causal,ragged", FLASH_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-sq{c[3]}-sk{c[4]}-g{c[5] // c[6]}" for c in FLASH_CASES],
)
def test_flash_attention(backend, dtype, b, sq, sk, hq, hkv, d, causal, ragged):
    rng = _rng(1, b, sq, sk, hq, d)
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    lengths = None
    if ragged:
        lens = rng.integers(1, sk + 1, size=b)
        lens[0] = 1
        lens[-1] = sk
        for i, n in enumerate(lens):  # keys past the length: large finite, must be masked
            k[i, n:] = 1e4
            v[i, n:] = 1e4
        lengths = jnp.asarray(lens, jnp.int32)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    out = flash_attention(
        q, k, v, causal=causal, lengths=lengths, block_q=16, block_k=16,
        interpret=True, backend=backend,
    )
    ref = flash_attention_reference(*_f32(q, k, v), causal=causal, lengths=lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)


# --------------------------------------------------------------------------- decode

DECODE_CASES = [
    # backend, dtype, batch, q_heads, kv_heads, head_dim, max_len, num_splits, fill
    ("gpu", jnp.float32, 3, 4, 4, 64, 50, None, np.nan),
    ("gpu", jnp.bfloat16, 2, 8, 2, 128, 200, 3, 1e4),
    ("gpu", jnp.float32, 4, 8, 1, 64, 33, 2, np.nan),
    ("tpu", jnp.float32, 3, 8, 2, 64, 48, None, np.nan),
    ("tpu", jnp.bfloat16, 2, 8, 1, 128, 64, None, 1e4),
]


@pytest.mark.parametrize(
    "backend,dtype,b,hq,hkv,d,max_len,num_splits,fill", DECODE_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-L{c[6]}-g{c[3] // c[4]}" for c in DECODE_CASES],
)
def test_decode_attention(backend, dtype, b, hq, hkv, d, max_len, num_splits, fill):
    rng = _rng(2, b, hq, hkv, max_len)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k = rng.standard_normal((b, hkv, max_len, d))
    v = rng.standard_normal((b, hkv, max_len, d))
    lens = rng.integers(1, max_len + 1, size=b)
    lens[0] = 1
    lens[-1] = max_len - 1 if b > 2 else max_len
    for i, n in enumerate(lens):
        k[i, :, n:] = fill
        v[i, :, n:] = fill
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    lengths = jnp.asarray(lens, jnp.int32)
    out = decode_attention(
        q, k, v, lengths, block_k=16, num_splits=num_splits, interpret=True, backend=backend
    )
    ref = decode_attention_reference(*_f32(q, k, v), lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)


LAYER_CASES = [
    # dtype, layers, batch, q_heads, kv_heads, head_dim, max_len, num_splits, fill
    (jnp.float32, 3, 3, 4, 4, 64, 50, None, np.nan),
    (jnp.bfloat16, 2, 2, 8, 2, 128, 200, 3, 1e4),
    (jnp.float32, 4, 4, 8, 1, 64, 12, 2, np.nan),  # max_len < 16: the padded path
]


@pytest.mark.parametrize(
    "dtype,layers,b,hq,hkv,d,max_len,num_splits,fill", LAYER_CASES,
    ids=[f"{jnp.dtype(c[0]).name}-L{c[6]}-g{c[3] // c[4]}" for c in LAYER_CASES],
)
def test_decode_attention_layer(dtype, layers, b, hq, hkv, d, max_len, num_splits, fill):
    rng = _rng(6, layers, b, hq, hkv, max_len)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k = rng.standard_normal((layers, b, hkv, max_len, d))
    v = rng.standard_normal((layers, b, hkv, max_len, d))
    lens = rng.integers(1, max_len + 1, size=b)
    lens[0] = 1
    lens[-1] = max_len - 1 if b > 2 else max_len
    for i, n in enumerate(lens):  # every layer's stale rows, so a wrong layer index shows too
        k[:, i, :, n:] = fill
        v[:, i, :, n:] = fill
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    lengths = jnp.asarray(lens, jnp.int32)
    for layer in (0, layers - 1):
        out = decode_attention_layer(q, k, v, jnp.int32(layer), lengths, block_k=16,
                                     num_splits=num_splits, interpret=True)
        ref = decode_attention_layer_reference(*_f32(q, k, v), layer, lengths)
        assert out.shape == q.shape and out.dtype == q.dtype
        _assert_close(out, ref, dtype)
        # The same kernel body as decode_attention on the slice, so the same numbers.
        sliced = decode_attention(q, k[layer], v[layer], lengths, block_k=16,
                                  num_splits=num_splits, interpret=True)
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(sliced, np.float32))


def test_decode_zero_length_is_zero_not_nan():
    q = jnp.ones((2, 4, 64), jnp.float32)
    k = jnp.full((2, 1, 32, 64), jnp.nan, jnp.float32)
    out = decode_attention(q, k, k, jnp.zeros((2,), jnp.int32), block_k=16, interpret=True)
    assert not np.isnan(np.asarray(out)).any()
    assert np.abs(np.asarray(out)).max() == 0.0


def test_combine_splits_kernel_matches_reference():
    """The one-kernel Flash-Decoding combine equals the jnp one, padded query rows ignored;
    splits that saw no key (m = -inf) drop out, a row with no key at all gives 0."""
    rng = _rng(11)
    b, hkv, splits, gp, group, d = 2, 3, 8, 16, 4, 64
    acc = rng.standard_normal((b, hkv, splits, gp, d)).astype(np.float32)
    m = rng.uniform(-4, 4, (b, hkv, splits, gp)).astype(np.float32)
    lsum = rng.uniform(0.5, 3, (b, hkv, splits, gp)).astype(np.float32)
    empty = rng.random((b, hkv, splits, gp)) < 0.4
    empty[0, 1, :, 2] = True  # one row with no key in any split
    acc[empty], m[empty], lsum[empty] = 0.0, -np.inf, 0.0
    out = combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(lsum), group,
                             jnp.float32, interpret=True)
    ref = combine_splits_reference(jnp.asarray(acc[:, :, :, :group]),
                                   jnp.asarray(m[:, :, :, :group]),
                                   jnp.asarray(lsum[:, :, :, :group]), axis=2)
    assert out.shape == (b, hkv, group, d)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out)[0, 1, 2] == 0.0)


# --------------------------------------------------------------------------- paged


def _make_paged(rng, b, hkv, d, page_size, pages_per_seq, dtype, min_lens=None):
    """Shuffled page pool: used pages random with a large-finite tail, unused pages NaN."""
    num_pages = b * pages_per_seq + 5
    perm = rng.permutation(num_pages)
    k = np.full((hkv, num_pages, page_size, d), np.nan)
    v = np.full((hkv, num_pages, page_size, d), np.nan)
    lens = rng.integers(1, pages_per_seq * page_size + 1, size=b)
    lens[0] = 1
    lens[-1] = pages_per_seq * page_size - 3
    if min_lens is not None:
        lens = np.maximum(lens, np.asarray(min_lens))
    table = np.empty((b, pages_per_seq), np.int32)
    nxt = 0
    for i, n in enumerate(lens):
        for j in range(pages_per_seq):
            if j * page_size < n:
                p = perm[nxt]
                nxt += 1
                k[:, p] = rng.standard_normal((hkv, page_size, d))
                v[:, p] = rng.standard_normal((hkv, page_size, d))
                tail = n - j * page_size
                if tail < page_size:
                    k[:, p, tail:] = 1e4
                    v[:, p, tail:] = 1e4
            else:
                p = perm[-1 - (j % 5)]  # table slots past the length point at NaN pages
            table[i, j] = p
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(lens, jnp.int32))


PAGED_CASES = [
    # backend, dtype, batch, q_heads, kv_heads, head_dim, page_size, pages_per_seq, splits
    ("gpu", jnp.float32, 3, 8, 2, 64, 8, 7, None),
    ("gpu", jnp.bfloat16, 2, 8, 1, 128, 16, 5, 2),
    ("gpu", jnp.float32, 4, 4, 4, 64, 4, 9, 3),
    ("gpu", jnp.bfloat16, 3, 8, 2, 64, 8, 7, 1),  # one split: the kernel writes the output
    ("tpu", jnp.float32, 3, 8, 2, 64, 8, 5, None),
    ("tpu", jnp.bfloat16, 2, 8, 1, 128, 16, 3, None),
]


@pytest.mark.parametrize(
    "backend,dtype,b,hq,hkv,d,page_size,pps,num_splits", PAGED_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-ps{c[6]}-g{c[3] // c[4]}" for c in PAGED_CASES],
)
def test_paged_attention(backend, dtype, b, hq, hkv, d, page_size, pps, num_splits):
    rng = _rng(3, b, hq, hkv, page_size, pps)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k, v, table, lengths = _make_paged(rng, b, hkv, d, page_size, pps, dtype)
    out = paged_attention(
        q, k, v, table, lengths, pages_per_block=2, num_splits=num_splits, interpret=True,
        backend=backend,
    )
    ref = paged_attention_reference(*_f32(q, k, v), table, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)


# --------------------------------------------------------------------------- ragged

RAGGED_CASES = [
    # backend, dtype, q_heads, kv_heads, head_dim, page_size, pages_per_seq, query counts,
    # padding tokens past the last sequence. Kernels run with block_q=4 and
    # max_q_len=max(query counts).
    # GPU, GQA 4: empty sequences in the middle and at the end, decode tokens, a 7-token
    # chunk whose second block reaches into the next sequence, a 20-token chunk over 5
    # blocks; the first block (1 token) covers the next three sequences' rows.
    ("gpu", jnp.float32, 8, 2, 64, 8, 6, (1, 0, 7, 1, 20, 0, 1, 0), 2),
    # GPU, GQA 8, no padding tokens: the last blocks reach past the token axis.
    ("gpu", jnp.bfloat16, 8, 1, 128, 16, 4, (3, 1, 0, 30), 0),
    # GPU, GQA 1, all decode (max_q_len 1): block_q rises to 16 tokens for MIN_DOT rows,
    # so every block overlaps many later sequences; padding longer than a block.
    ("gpu", jnp.float32, 4, 4, 64, 4, 5, (1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1), 17),
    # TPU: decode tokens (1) beside prefill chunks of odd lengths, GQA 4/8/1, and a page
    # size that is not a power of two (allowed on TPU).
    ("tpu", jnp.float32, 8, 2, 64, 8, 5, (1, 7, 1, 13), 2),
    ("tpu", jnp.bfloat16, 8, 1, 128, 16, 3, (3, 1, 21), 2),
    ("tpu", jnp.float32, 4, 4, 64, 4, 7, (5, 1, 2), 2),
    ("tpu", jnp.bfloat16, 4, 1, 64, 12, 3, (1, 9), 2),
]


@pytest.mark.parametrize(
    "backend,dtype,hq,hkv,d,page_size,pps,q_lens,pad", RAGGED_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-ps{c[5]}-g{c[2] // c[3]}-n{len(c[7])}"
         for c in RAGGED_CASES],
)
def test_ragged_attention(backend, dtype, hq, hkv, d, page_size, pps, q_lens, pad):
    rng = _rng(4, hq, hkv, page_size, pps, len(q_lens))
    n = len(q_lens)
    # Each sequence's keys include its new tokens: kv_len >= q_len.
    k, v, table, kv_lens = _make_paged(rng, n, hkv, d, page_size, pps, dtype, min_lens=q_lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    real = int(cu[-1])
    q = jnp.asarray(rng.standard_normal((real + pad, hq, d)), dtype)
    out = ragged_attention(
        q, k, v, table, kv_lens, cu, max_q_len=max(q_lens), block_q=4, interpret=True,
        backend=backend,
    )
    # Jitted: op by op, the reference's first call costs seconds of per-op compiles.
    ref = jax.jit(ragged_attention_reference)(*_f32(q, k, v), table, kv_lens, cu)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)
    assert not np.asarray(out[real:], np.float32).any(), "padding tokens must give exactly 0"


def test_ragged_reference_any_head_dim_matches_numpy():
    # The reference serves jaxinfer's reference backend, so it takes head_dims the kernels
    # reject (16 here) and q/pages of different dtypes; checked against a per-token loop.
    rng = _rng(5)
    hq, hkv, d, page_size, pps, q_lens = 4, 2, 16, 4, 5, (1, 6, 2)
    k, v, table, kv_lens = _make_paged(rng, len(q_lens), hkv, d, page_size, pps, jnp.float32,
                                       min_lens=q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((int(cu[-1]) + 1, hq, d))
    out = ragged_attention_reference(jnp.asarray(q, jnp.bfloat16), k, v, table, kv_lens,
                                     jnp.asarray(cu, jnp.int32))
    kn, vn, tn, ln = (np.asarray(x) for x in (k, v, table, kv_lens))
    want = np.zeros(q.shape)
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
    for s, n in enumerate(q_lens):
        keys = kn[:, tn[s]].reshape(hkv, -1, d)
        vals = vn[:, tn[s]].reshape(hkv, -1, d)
        for i in range(n):
            pos = ln[s] - n + i
            for h in range(hq):
                logits = keys[h // (hq // hkv), : pos + 1] @ qb[cu[s] + i, h] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                want[cu[s] + i, h] = p @ vals[h // (hq // hkv), : pos + 1] / p.sum()
    assert out.dtype == jnp.bfloat16
    _assert_close(out, want, jnp.bfloat16)


# --------------------------------------------------------------------------- quantized pages


def _quantize_pool(k, v, kv_dtype):
    """``_make_paged``'s pools as quantized values + bfloat16 scales (``quantize_kv``). Rows
    of unused pages (NaN) get NaN scales, and NaN values where the format has them (fp8),
    so a kernel that reads them fails the comparison like the float pools' NaN pages."""
    out = []
    for x in (k, v):
        x = np.asarray(x, np.float32)
        unused = np.isnan(x).all(axis=-1)  # [kv_heads, num_pages, page_size]
        values, scales = quantize_kv(jnp.asarray(np.nan_to_num(x)), kv_dtype)
        scales = jnp.where(unused, jnp.nan, scales.astype(jnp.float32)).astype(scales.dtype)
        if jnp.dtype(kv_dtype) == jnp.float8_e4m3fn:
            values = jnp.where(unused[..., None], jnp.nan, values.astype(jnp.float32)
                               ).astype(values.dtype)
        out.append((values, scales))
    return out


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantize_kv_error_bound(kv_dtype):
    x = jnp.asarray(_rng(7).standard_normal((3, 5, 64)) * np.array([1e-3, 1, 300])[:, None, None],
                    jnp.float32).at[1, 2].set(0.0)  # a zero row keeps scale 1, values 0
    values, scales = quantize_kv(x, kv_dtype)
    assert values.dtype == kv_dtype and values.shape == x.shape
    assert scales.dtype == jnp.bfloat16 and scales.shape == x.shape[:-1]
    back = dequantize_kv(values, scales)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    if kv_dtype == jnp.int8:  # half a step of amax / 127, plus the scale's bf16 rounding
        bound = amax / 254 * 1.01
    else:  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value (or of 2^-6 scale)
        bound = jnp.abs(x) / 16 + amax / 448 * 2.0**-7 + amax * 2.0**-9
    assert bool(jnp.all(jnp.abs(back - x) <= bound)), float(jnp.max(jnp.abs(back - x) - bound))
    assert float(scales[1, 2]) == 1.0 and not np.asarray(back[1, 2]).any()


QUANT_PAGED_CASES = [
    # backend, q dtype, kv dtype, batch, q_heads, kv_heads, head_dim, page_size, pages/seq
    ("gpu", jnp.float32, jnp.int8, 3, 8, 2, 64, 8, 7),
    ("tpu", jnp.bfloat16, jnp.float8_e4m3fn, 2, 8, 1, 128, 16, 3),
]


@pytest.mark.parametrize(
    "backend,dtype,kv_dtype,b,hq,hkv,d,page_size,pps", QUANT_PAGED_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{jnp.dtype(c[2]).name}-ps{c[7]}-g{c[4] // c[5]}"
         for c in QUANT_PAGED_CASES],
)
def test_paged_attention_quantized(backend, dtype, kv_dtype, b, hq, hkv, d, page_size, pps):
    rng = _rng(8, b, hq, hkv, page_size, pps)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k, v, table, lengths = _make_paged(rng, b, hkv, d, page_size, pps, jnp.float32)
    (kq, ks), (vq, vs) = _quantize_pool(k, v, kv_dtype)
    out = paged_attention(q, kq, vq, table, lengths, k_scales=ks, v_scales=vs,
                          pages_per_block=2, num_splits=2, interpret=True, backend=backend)
    ref = paged_attention_reference(q.astype(jnp.float32), kq, vq, table, lengths,
                                    k_scales=ks, v_scales=vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)


WRITE_CASES = [
    # backend, q dtype, kv dtype (None: the pool in q's dtype), batch, q_heads, kv_heads,
    # head_dim, page_size, pages/seq, splits (None: the default)
    ("gpu", jnp.float32, None, 4, 8, 2, 64, 8, 7, None),
    ("gpu", jnp.bfloat16, None, 3, 8, 1, 128, 16, 5, 2),
    ("gpu", jnp.float32, None, 3, 4, 4, 64, 4, 9, 3),  # one query row per kv head
    ("gpu", jnp.float32, jnp.int8, 3, 8, 2, 64, 8, 7, 2),
    ("gpu", jnp.float32, None, 3, 8, 2, 64, 8, 7, 1),  # one split: no combine
    ("gpu", jnp.float32, jnp.int8, 3, 4, 4, 64, 8, 5, 1),
    ("gpu", jnp.bfloat16, jnp.float8_e4m3fn, 3, 8, 1, 128, 16, 3, None),
    ("tpu", jnp.float32, None, 3, 8, 2, 64, 8, 5, None),
]


@pytest.mark.parametrize(
    "backend,dtype,kv_dtype,b,hq,hkv,d,page_size,pps,num_splits", WRITE_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{c[2] and jnp.dtype(c[2]).name}-ps{c[7]}"
         f"-g{c[4] // c[5]}" for c in WRITE_CASES],
)
def test_paged_attention_write(backend, dtype, kv_dtype, b, hq, hkv, d, page_size, pps,
                               num_splits):
    """The kernel stores each row's new K/V at its slot and attends over them, as the store
    followed by paged attention does. The slot holds NaN before the call, so a kernel that
    read the new key from the pool (instead of its input) gives NaN. Row 1 is inactive
    (length 0, its page out of range): it stores nothing and gives zeros."""
    _check_paged_write(backend, dtype, kv_dtype, b, hq, hkv, d, page_size, pps, num_splits,
                       pages_per_block=2)


def test_paged_decode_launch_splits_a_batch_that_fills_the_gpu():
    """Below 128 (sequence, kv head) pairs: 128 keys per step, splits (a power of two) for at
    least 132 programs; from 128 pairs on (batch 16 x 8 kv heads, batch 64 x 2): 64 keys,
    splits for at least 2,048 programs (tables of 512 pages: no cap); one stage at every
    batch."""
    assert paged_decode_launch(1, 8, 16, 512) == (8, 32, 1)
    assert paged_decode_launch(15, 8, 16, 512) == (8, 2, 1)
    assert paged_decode_launch(127, 1, 16, 512) == (8, 2, 1)
    assert paged_decode_launch(128, 1, 16, 512) == (4, 16, 1)
    assert paged_decode_launch(64, 2, 16, 512) == (4, 16, 1)
    assert paged_decode_launch(32, 8, 16, 512) == (4, 8, 1)
    assert paged_decode_launch(64, 4, 16, 512) == (4, 8, 1)
    assert paged_decode_launch(64, 8, 16, 512) == (4, 4, 1)
    assert paged_decode_launch(65, 8, 16, 512) == (4, 4, 1)  # 3.9 rounds up
    assert paged_decode_launch(128, 8, 16, 512) == (4, 2, 1)
    assert paged_decode_launch(512, 8, 16, 512) == (4, 1, 1)
    assert paged_decode_launch(64, 8, 128, 512) == (1, 4, 1)
    # A 16-page table holds two 8-page blocks: the default splits stop there; given values
    # are rounded up to powers of two (pages per block to at least 16 keys), not capped.
    assert paged_decode_launch(1, 8, 16, 16) == (8, 2, 1)
    assert paged_decode_launch(1, 8, 4, 512, pages_per_block=3, num_splits=3,
                               num_stages=2) == (4, 4, 2)


@pytest.mark.parametrize("b,splits,stages", [(2, 8, 1), (64, 4, 1)])
def test_paged_decode_default_launch_reaches_triton(b, splits, stages):
    """Lowered for a GPU (jax.export on this CPU machine), ``paged_attention_write``'s
    default launch is ``paged_decode_launch``'s: at 2 rows (the engine's batch 1) 32 splits
    capped at the 8 blocks of 128 keys a 1,024-key table holds; at 64 rows x 8 kv heads 4
    splits; one stage at both."""
    import re

    from jax import export

    hq, hkv, d, pages, page_size = 32, 8, 128, 4 * b * 16, 16
    spec = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    args = [spec((b, hq, d), dt), spec((b, hkv, d), dt), spec((b, hkv, d), dt),
            spec((hkv, pages, page_size, d), dt), spec((hkv, pages, page_size, d), dt),
            spec((b, 64), jnp.int32), spec((b,), jnp.int32), spec((b,), jnp.int32),
            spec((b,), jnp.int32)]
    no_check = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(paged_attention_write), platforms=["cuda"],
                         disabled_checks=no_check)(*args).mlir_module()
    launch = re.search(r'grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32,'
                       r'.*?name = "jaxinfer_paged_decode", num_stages = (\d+)', text, re.S)
    assert launch is not None
    assert tuple(int(g) for g in launch.groups()) == (b, hkv, splits, stages)


def test_paged_attention_write_default_launch_for_a_full_batch():
    """The launch a batch of 64 sequences over 8 kv heads gets by default (4 splits of
    64-key steps, one stage, as the engine's decode steps run it at 64 slots) gives the
    reference's results on lengths from 0 to 256 keys. Only the launch depends on the batch,
    so 4 sequences over 2 kv heads run it (64 x 8 took ~45 s in the interpreter)."""
    launch = paged_decode_launch(64, 8, 16, 16)
    assert launch == (4, 4, 1)
    pages_per_block, num_splits, num_stages = launch
    _check_paged_write("gpu", jnp.float32, None, 4, 2, 2, 64, 16, 16, num_splits,
                       pages_per_block=pages_per_block, num_stages=num_stages)


@pytest.mark.parametrize("num_stages", [1, 3])
@pytest.mark.parametrize("kv_dtype", [None, jnp.int8], ids=["f32", "int8"])
def test_paged_gpu_kernel_loads_page_numbers_ahead_or_per_step(kv_dtype, num_stages):
    """Under the one-stage launch the GPU kernel loads each block's page numbers a step ahead
    (carried through its loop; past the table's last block it repeats that block's); under
    3 stages each step loads its own. Both give the reference's results and stores over
    splits of several blocks (tables of 26 pages of 4 keys in blocks of 16 keys: the last
    row's 100 keys are 2 splits of up to 4 blocks; the table padded to 28 pages, read ahead past
    its last block)."""
    _check_paged_write("gpu", jnp.float32, kv_dtype, 3, 8, 2, 64, 4, 26, 2,
                       pages_per_block=4, num_stages=num_stages)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_attention_one_stage_reads_pages_ahead_without_a_write(num_splits):
    """``paged_attention`` (no write) under the one-stage launch, with one split (the kernel
    writes the output) and two (partials and the combine), over tables of several blocks
    per split."""
    rng = _rng(11, num_splits)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    k, v, table, lengths = _make_paged(rng, 3, 2, 64, 4, 26, jnp.float32)
    out = paged_attention(q, k, v, table, lengths, pages_per_block=4, num_splits=num_splits,
                          num_stages=1, interpret=True)
    _assert_close(out, paged_attention_reference(q, k, v, table, lengths), jnp.float32)


def _check_paged_write(backend, dtype, kv_dtype, b, hq, hkv, d, page_size, pps, num_splits,
                       pages_per_block, num_stages=None):
    """``test_paged_attention_write``'s check for one configuration."""
    rng = _rng(10, b, hq, hkv, page_size, pps)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
    k, v, table, lengths = _make_paged(rng, b, hkv, d, page_size, pps, jnp.float32)
    k, v, lengths = (np.array(x) for x in (k, v, lengths))
    lengths[1] = 0
    last = np.maximum(lengths - 1, 0)
    pages = np.asarray(table)[np.arange(b), last // page_size]
    pages[1] = k.shape[1]  # out of range: dropped
    offsets = last % page_size
    for i in (0, *range(2, b)):
        k[:, pages[i], offsets[i]] = np.nan
        v[:, pages[i], offsets[i]] = np.nan
    k_new = rng.standard_normal((b, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((b, hkv, d)).astype(np.float32)
    if kv_dtype is None:
        pools = [jnp.asarray(k, dtype), jnp.asarray(v, dtype)]
        news = [jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype)]
        kw_pools, kw_news = {}, {}
    else:
        (kq, ks), (vq, vs) = _quantize_pool(k, v, kv_dtype)
        (nk, nks), (nv, nvs) = (quantize_kv(jnp.asarray(x), kv_dtype) for x in (k_new, v_new))
        pools, news = [kq, vq], [nk, nv]
        kw_pools, kw_news = {"k_scales": ks, "v_scales": vs}, {"k_new_scales": nks,
                                                               "v_new_scales": nvs}
    args = (*news, *pools, table, jnp.asarray(lengths), jnp.asarray(pages),
            jnp.asarray(offsets, jnp.int32))
    out, *written = paged_attention_write(q, *args, **kw_pools, **kw_news,
                                          pages_per_block=pages_per_block,
                                          num_splits=num_splits, num_stages=num_stages,
                                          interpret=True, backend=backend)
    wide = _f32(*news, *pools) if kv_dtype is None else [*news, *pools]  # reference: float32
    ref, *ref_written = paged_attention_write_reference(q.astype(jnp.float32), *wide,
                                                        *args[4:], **kw_pools, **kw_news)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)
    assert not np.asarray(out[1], np.float32).any()
    assert len(written) == len(ref_written) == (2 if kv_dtype is None else 4)
    for got, want in zip(written, ref_written, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


QUANT_RAGGED_CASES = [
    # backend, q dtype, kv dtype, q_heads, kv_heads, head_dim, page_size, pages/seq, query
    # counts, padding tokens (as RAGGED_CASES: empty sequences in the middle and at the end,
    # decode tokens, chunks that cross blocks and pages; a page size that is not a power of
    # two on TPU)
    ("gpu", jnp.float32, jnp.float8_e4m3fn, 8, 2, 64, 8, 6, (1, 0, 7, 1, 20, 0, 1, 0), 2),
    ("tpu", jnp.float32, jnp.int8, 4, 1, 64, 12, 3, (1, 9), 2),
]


@pytest.mark.parametrize(
    "backend,dtype,kv_dtype,hq,hkv,d,page_size,pps,q_lens,pad", QUANT_RAGGED_CASES,
    ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{jnp.dtype(c[2]).name}-ps{c[6]}-g{c[3] // c[4]}"
         f"-n{len(c[8])}" for c in QUANT_RAGGED_CASES],
)
def test_ragged_attention_quantized(backend, dtype, kv_dtype, hq, hkv, d, page_size, pps,
                                    q_lens, pad):
    rng = _rng(9, hq, hkv, page_size, pps, len(q_lens))
    k, v, table, kv_lens = _make_paged(rng, len(q_lens), hkv, d, page_size, pps, jnp.float32,
                                       min_lens=q_lens)
    (kq, ks), (vq, vs) = _quantize_pool(k, v, kv_dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    real = int(cu[-1])
    q = jnp.asarray(rng.standard_normal((real + pad, hq, d)), dtype)
    out = ragged_attention(q, kq, vq, table, kv_lens, cu, k_scales=ks, v_scales=vs,
                           max_q_len=max(q_lens), block_q=4, interpret=True, backend=backend)
    ref = jax.jit(ragged_attention_reference)(q.astype(jnp.float32), kq, vq, table, kv_lens,
                                              cu, k_scales=ks, v_scales=vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)
    assert not np.asarray(out[real:], np.float32).any(), "padding tokens must give exactly 0"
    # The reference dequantizes: equal to the float reference on the dequantized pools.
    deq = [jnp.nan_to_num(dequantize_kv(x, sc)) for x, sc in ((kq, ks), (vq, vs))]
    plain = jax.jit(ragged_attention_reference)(q.astype(jnp.float32), *deq, table, kv_lens, cu)
    np.testing.assert_allclose(np.asarray(ref[:real]), np.asarray(plain[:real]), atol=1e-5)


# --------------------------------------------------------------------------- bad arguments


def _raises(fn, match):
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


def test_bad_arguments_raise_one_line_value_error():
    q = jnp.zeros((2, 8, 6, 64), jnp.float32)
    k = jnp.zeros((2, 8, 4, 64), jnp.float32)
    _raises(lambda: flash_attention(q, k, k), "divisible")
    _raises(lambda: flash_attention(q, k[:, :, :2, :32], k[:, :, :2, :32]), "head_dim")
    _raises(lambda: flash_attention(q[..., :48], k[:, :, :2, :48], k[:, :, :2, :48]),
            "unsupported head_dim")
    _raises(lambda: flash_attention(q, k[:, :, :2], k[:, :4, :2]), "shape")
    _raises(lambda: flash_attention(q[:, :, :4], k, k, backend="cuda"), "backend")
    qd = jnp.zeros((2, 8, 64), jnp.float32)
    cache = jnp.zeros((2, 2, 32, 64), jnp.float32)
    _raises(lambda: decode_attention(qd, cache, cache, jnp.ones((3,), jnp.int32)), "lengths")
    cache4 = jnp.zeros((2, 4, 32, 64), jnp.float32)
    _raises(lambda: decode_attention(qd[:, :6], cache4, cache4, jnp.ones((2,), jnp.int32)),
            "divisible")
    _raises(lambda: decode_attention(qd, cache[:1], cache[:1], jnp.ones((2,), jnp.int32)),
            "batch")
    _raises(lambda: decode_attention_layer(qd, cache, cache, 0, jnp.ones((2,), jnp.int32)),
            "k_all")
    _raises(lambda: decode_attention_layer(qd, cache[None], cache[None], 0,
                                           jnp.ones((3,), jnp.int32)), "lengths")
    pages = jnp.zeros((2, 10, 16, 64), jnp.float32)
    table = jnp.zeros((2, 4), jnp.int32)
    _raises(lambda: paged_attention(qd, pages, pages[:1], table, jnp.ones((2,), jnp.int32)),
            "k_pages")
    _raises(lambda: paged_attention(qd, pages, pages, table[:1], jnp.ones((2,), jnp.int32)),
            "block_tables")
    odd = jnp.zeros((2, 10, 12, 64), jnp.float32)
    _raises(lambda: paged_attention(qd, odd, odd, table, jnp.ones((2,), jnp.int32)),
            "power of two")
    q8 = pages.astype(jnp.int8)
    scales = jnp.ones(pages.shape[:-1], jnp.bfloat16)
    _raises(lambda: paged_attention(qd, q8, q8, table, jnp.ones((2,), jnp.int32)),
            "need k_scales and v_scales")
    _raises(lambda: paged_attention(qd, pages, pages, table, jnp.ones((2,), jnp.int32),
                                    k_scales=scales, v_scales=scales), "go with int8")
    _raises(lambda: ragged_attention(qd, q8, q8, table, jnp.ones((2,), jnp.int32),
                                     jnp.asarray([0, 1, 2], jnp.int32), k_scales=scales,
                                     v_scales=scales[:, :3]), "v_scales must have shape")


@pytest.mark.parametrize("kv_dtype", [None, jnp.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_write_lowers_to_triton_for_cuda(kv_dtype, num_splits):
    """Lowering for a GPU (jax.export on this CPU machine) runs the Triton lowering rules the
    storing kernel needs (masked q load and output store, scalar-indexed stores into aliased
    pools) at 8B decode shapes (32 q heads over 8 kv heads, two rows), with the output
    written by the kernel (one split) or by the combine."""
    from jax import export

    b, hq, hkv, d, pages, page_size = 2, 32, 8, 128, 64, 16
    dt = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    pool_dt = dt if kv_dtype is None else kv_dtype
    args = [spec((b, hq, d), dt), spec((b, hkv, d), pool_dt), spec((b, hkv, d), pool_dt),
            spec((hkv, pages, page_size, d), pool_dt), spec((hkv, pages, page_size, d), pool_dt),
            spec((b, 8), jnp.int32), spec((b,), jnp.int32), spec((b,), jnp.int32),
            spec((b,), jnp.int32)]
    if kv_dtype is None:
        def f(*a):
            return paged_attention_write(*a, num_splits=num_splits)
    else:
        args += [spec((hkv, pages, page_size), dt)] * 2 + [spec((b, hkv), dt)] * 2

        def f(*a):
            return paged_attention_write(*a[:9], k_scales=a[9], v_scales=a[10],
                                         k_new_scales=a[11], v_new_scales=a[12],
                                         num_splits=num_splits)
    no_check = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=no_check)(*args)
    assert "jaxinfer_paged_decode" in exported.mlir_module()


@pytest.mark.parametrize("backend, num_splits", [("gpu", 2), ("gpu", 1), ("tpu", None)])
def test_paged_attention_write_returns_scaled_pairs(backend, num_splits):
    """``out_pairs``: the output as ``ScaledPairs`` ``[batch, q_heads * head_dim]``, one scale
    per head (the combine kernel writes them when keys are split; XLA otherwise), standing
    for the plain output to float16 rounding; the pools are written the same."""
    from pallas_kernels import ScaledPairs

    b, hq, hkv, d, page_size, pps = 3, 8, 2, 64, 8, 5
    rng = _rng(12, b, hq, hkv, page_size, pps)
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
    k, v, table, lengths = _make_paged(rng, b, hkv, d, page_size, pps, jnp.bfloat16)
    new = [jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16) for _ in range(2)]
    last = np.asarray(lengths) - 1
    args = (*new, k, v, table, lengths, jnp.asarray(np.asarray(table)[np.arange(b),
                                                                      last // page_size]),
            jnp.asarray(last % page_size, jnp.int32))
    kw = dict(num_splits=num_splits, interpret=True, backend=backend)
    out, *written = paged_attention_write(q, *args, **kw)
    pairs, *written_p = paged_attention_write(q, *args, out_pairs=True, **kw)
    assert isinstance(pairs, ScaledPairs) and pairs.sumsq is None and pairs.group == d
    assert pairs.pairs.shape == (b, hq * d) and pairs.dtype == jnp.bfloat16
    want = np.asarray(out, np.float32).reshape(b, hq * d)
    np.testing.assert_allclose(pairs.values(), want, rtol=2**-10, atol=1e-6)
    for got, ref in zip(written_p, written, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
