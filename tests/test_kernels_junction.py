"""``pallas_kernels.junction``: the junction kernel (residual add, RMSNorm statistics,
block-scaled float16 pairs) against its reference and the model's ``rms_norm``, and
``word_gemv`` reading its ``ScaledPairs`` (int4 and int8, Pallas interpreter) against RMSNorm
followed by the matmul."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_eqns
from test_kernels_word_gemv import INT4, INT8  # the formats' word_gemv arguments

from jaxinfer.model import apply_rope, rms_norm
from pallas_kernels.int4_matmul import Int4Tiles
from pallas_kernels.junction import (
    ScaledPairs,
    add_norm_pairs,
    add_norm_pairs_reference,
    silu_mul_pairs,
    silu_mul_pairs_reference,
    sum_rope,
    sum_rope_reference,
)
from pallas_kernels.matmul import Int8Tiles
from pallas_kernels.word_gemv import reads_pairs, word_gemv, word_gemv_reference

EPS = 1e-5


def _junction(splits, rows, n, seed, *, spread=3.0):
    """Split partials ``[splits, rows, n]``, a bfloat16 residual and norm weight."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    p = None if splits == 0 else jax.random.normal(k[0], (splits, rows, n), jnp.float32)
    res = (spread * jax.random.normal(k[1], (rows, n))).astype(jnp.bfloat16)
    w = (1 + 0.2 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16)
    return p, res, w


@pytest.mark.parametrize("splits, rows", [(24, 1), (112, 2), (7, 1), (0, 2)])
def test_add_norm_pairs_equals_its_reference_and_rms_norm(splits, rows):
    """The kernel gives the reference's residual, pairs and statistics (24, 112 or 7
    partials, one load each, or none); ``values()`` is the model's ``rms_norm`` of that
    residual within its bfloat16 rounding; every pair's two halves are equal and at most 1."""
    p, res, w = _junction(splits, rows, 512, seed=splits)
    h, got = add_norm_pairs(p, res, w, group=128, eps=EPS, interpret=True)
    h_ref, want = add_norm_pairs_reference(p, res, w, group=128, eps=EPS)
    np.testing.assert_array_equal(h, h_ref)
    if p is None:
        np.testing.assert_array_equal(h, res)
    else:
        o, r32 = jnp.sum(p, 0), res.astype(jnp.float32)
        err = jnp.abs(h.astype(jnp.float32) - (r32 + o))
        assert bool(jnp.all(err <= 2**-8 * (jnp.abs(o) + jnp.abs(r32 + o))))  # two roundings
    np.testing.assert_array_equal(got.pairs, want.pairs)
    np.testing.assert_allclose(got.scales, want.scales, rtol=1e-6)
    np.testing.assert_allclose(got.sumsq, want.sumsq, rtol=1e-5)
    normed = rms_norm(h, w, EPS).astype(jnp.float32)
    np.testing.assert_allclose(got.values(), normed, rtol=0,
                               atol=8e-3 * float(jnp.max(jnp.abs(normed))))
    u = jax.lax.bitcast_convert_type(got.pairs, jnp.uint32)
    np.testing.assert_array_equal(u >> 16, u & 0xFFFF)
    assert float(jnp.max(jnp.abs(got.values() / got.inv_rms()))) <= float(
        jnp.max(got.scales)) * (1 + 2**-10)


def test_scaled_pairs_hold_an_outlier_and_a_zero_group():
    """A residual row with a 1e6 outlier: its group's pairs stay within [-1, 1] (the scale
    takes the size) and still give the RMSNorm; a group of zeros gets scale 1 and zero
    pairs."""
    _, res, w = _junction(0, 1, 256, seed=3)
    res = res.at[0, 5].set(1e6).at[0, 128:].set(0)
    _, np_ = add_norm_pairs(None, res, w, group=128, eps=EPS, interpret=True)
    assert bool(jnp.all(jnp.isfinite(np_.values())))
    assert float(jnp.max(jnp.abs(np_.values() / np_.inv_rms() / np_.scales.repeat(128, 1)))
                 ) <= 1.0
    assert float(np_.scales[0, 1]) == 1.0 and not bool(jnp.any(np_.pairs[0, 128:]))
    normed = rms_norm(res, w, EPS).astype(jnp.float32)
    np.testing.assert_allclose(np_.values(), normed, atol=8e-3 * float(
        jnp.max(jnp.abs(normed))))


def _wide(tiles, **kw):
    """``tiles`` with the wide tile and x_pairs at test sizes."""
    return dataclasses.replace(tiles, wide_min_programs=4, wide_programs=8, x_pairs=True,
                               **kw)


@pytest.mark.parametrize("rows, group", [(1, 128), (2, 128), (1, 64)])
def test_word_gemv_reads_pairs_as_rms_norm_then_matmul(rows, group):
    """int4 at the wide tile with x_pairs and x_pair_sums: ``word_gemv(ScaledPairs)`` is RMSNorm
    (float32) then the reference matmul, to float16 rounding; the pallas_call takes the pairs
    (int32) with the group scales and sums of squares, and no XLA sums. With a group that
    differs from the weight's (64 against 128) or at the narrow tile, the activations are
    rebuilt first and the result is the same."""
    k, n = 1024, 1024
    p, res, w = _junction(16, rows, k, seed=10 + rows)
    h, pairs = add_norm_pairs(p, res, w, group=group, eps=EPS, interpret=True)
    rng = np.random.default_rng(rows)
    q = jnp.asarray(rng.integers(0, 256, size=(k // 2, n)), jnp.uint8)
    scale = jnp.asarray(rng.random((k // 128, n)) * 0.02, jnp.float16)
    zero = jnp.asarray(-rng.random((k // 128, n)) * 0.15, jnp.float16)
    x32 = rms_norm(h.astype(jnp.float32), w.astype(jnp.float32), EPS)
    want = word_gemv_reference(x32, q, scale, zero, **INT4)
    peak = float(jnp.max(jnp.abs(want)))
    tiles = _wide(Int4Tiles().word, x_pair_sums=True)
    for t in (tiles, dataclasses.replace(tiles, wide_tile=(0, 0))):
        got = word_gemv(pairs, q, scale, zero, interpret=True, tiles=t, **INT4)
        assert float(jnp.max(jnp.abs(got - want))) <= 3e-3 * peak
    eqn = _pallas_eqn(lambda a: word_gemv(a, q, scale, zero, interpret=True, tiles=tiles,
                                          **INT4), pairs)
    dtypes = [str(v.aval.dtype) for v in eqn.invars]
    if group == 128:
        assert dtypes == ["int32", "uint32", "int32", "int32", "float32", "float32"]
    else:
        assert dtypes[0] == "int32" and len(dtypes) == 4  # XLA's pairs of the rebuilt x


@pytest.mark.parametrize("pair_group", [64, 128])
def test_word_gemv_norm_pairs_int8_and_partials(pair_group):
    """int8 (no zeros) reads ``ScaledPairs`` the same way, also with one pair scale per two of
    its 64-row groups (the attention's combine scales a 128-value head at once, for o);
    ``partials=True`` returns the float32 split-K partials, whose sum is the result (the
    junction after an o or down GEMV takes them)."""
    k, n = 1024, 512
    _, res, w = _junction(0, 1, k, seed=20)
    _, pairs = add_norm_pairs(None, res, w, group=pair_group, eps=EPS, interpret=True)
    rng = np.random.default_rng(20)
    q = jnp.asarray(rng.integers(-128, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.random((k // 64, n)) * 0.02, jnp.float32)
    tiles = _wide(Int8Tiles().word, x_pairs_step_rows=64)
    x32 = rms_norm(res.astype(jnp.float32), w.astype(jnp.float32), EPS)
    want = word_gemv_reference(x32, q, scale, None, **INT8)
    got = word_gemv(pairs, q, scale, None, interpret=True, tiles=tiles, **INT8)
    assert float(jnp.max(jnp.abs(got - want))) <= 3e-3 * float(jnp.max(jnp.abs(want)))
    eqn = _pallas_eqn(lambda a: word_gemv(a, q, scale, None, interpret=True, tiles=tiles,
                                          **INT8), pairs)  # the pairs, not rebuilt values
    assert [str(v.aval.dtype) for v in eqn.invars] == [
        "int32", "uint32", "float32", "float32", "float32"]  # pairs, q, scale, gs, sumsq
    parts = word_gemv(pairs, q, scale, None, interpret=True, tiles=tiles, partials=True, **INT8)
    assert parts.dtype == jnp.float32 and parts.ndim == 3 and parts.shape[0] > 1
    np.testing.assert_allclose(jnp.sum(parts, 0), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pair_group, read", [(128, True), (192, False)])
def test_word_gemv_reads_pairs_of_a_power_of_two_multiple_of_its_groups(pair_group, read):
    """Plain ``ScaledPairs`` (one scale per ``pair_group`` values, as the attention's combine
    makes per head) reach the int8 kernel as they are where their group is a power-of-two
    multiple of the weight's 64 rows; three groups' worth is rebuilt into activations
    first. Either way the product is the activations'."""
    from pallas_kernels._common import scaled_pairs

    k, n = 768, 512
    rng = np.random.default_rng(40)
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.float32)
    pairs, scales = scaled_pairs(x.reshape(1, k // pair_group, pair_group))
    given = ScaledPairs(pairs.reshape(1, k), scales.reshape(1, -1), jnp.dtype(jnp.float32))
    q = jnp.asarray(rng.integers(-128, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.random((k // 64, n)) * 0.02, jnp.float32)
    tiles = _wide(Int8Tiles().word, x_pairs_step_rows=64)
    want = word_gemv_reference(given.values(), q, scale, None, **INT8)
    got = word_gemv(given, q, scale, None, interpret=True, tiles=tiles, **INT8)
    assert float(jnp.max(jnp.abs(got - want))) <= 3e-3 * float(jnp.max(jnp.abs(want)))
    eqn = _pallas_eqn(lambda a: word_gemv(a, q, scale, None, interpret=True, tiles=tiles,
                                          **INT8), given)
    assert len(eqn.invars) == (4 if read else 3)  # with the pair scales, or XLA's pairs


def test_gemv_partials_into_the_junction_into_the_next_gemv():
    """Two GEMVs joined by the junction: ``h + x @ W1`` (int4, partials unsummed), RMSNorm, then
    ``@ W2``, against the same in float32 jnp."""
    k = n = 1024
    rng = np.random.default_rng(30)
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.float32)
    ws = [(jnp.asarray(rng.integers(0, 256, size=(k // 2, n)), jnp.uint8),
           jnp.asarray(rng.random((k // 128, n)) * 0.02, jnp.float16),
           jnp.asarray(-rng.random((k // 128, n)) * 0.15, jnp.float16)) for _ in range(2)]
    _, res, w = _junction(0, 1, n, seed=31)
    tiles = _wide(Int4Tiles().word, x_pair_sums=True)
    parts = word_gemv(x, *ws[0], interpret=True, tiles=tiles, partials=True, **INT4)
    h, pairs = add_norm_pairs(parts, res, w, group=128, eps=EPS, interpret=True)
    got = word_gemv(pairs, *ws[1], interpret=True, tiles=tiles, **INT4)
    h_want = res.astype(jnp.float32) + word_gemv_reference(x, *ws[0], **INT4)
    np.testing.assert_allclose(h.astype(jnp.float32), h_want, rtol=1e-2, atol=0.05)
    want = word_gemv_reference(rms_norm(h_want, w.astype(jnp.float32), EPS), *ws[1], **INT4)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-2 * float(jnp.max(jnp.abs(want)))


def test_add_norm_pairs_rejects_bad_shapes():
    """One line on what is wrong, before any device work."""
    p, res, w = _junction(4, 1, 256, seed=40)
    with pytest.raises(ValueError, match="power of two dividing"):
        add_norm_pairs(p, res, w, group=96, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="weight"):
        add_norm_pairs(p, res, w[:128], group=128, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="partials"):
        add_norm_pairs(p[:, :, :128], res, w, group=128, eps=EPS, interpret=True)


def _pallas_eqn(fn, *args):
    """The one pallas_call equation ``fn(*args)`` traces to."""
    calls = [e for e in all_eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1, calls
    return calls[0]


def test_norm_pairs_is_a_pytree_with_a_static_eps():
    """``ScaledPairs`` passes through jit: its arrays are leaves, eps is static."""
    _, res, w = _junction(0, 1, 256, seed=50)
    _, a = add_norm_pairs_reference(None, res, w, group=128, eps=EPS)
    assert len(jax.tree.leaves(a)) == 3
    b = jax.jit(lambda t: t)(a)
    assert isinstance(b, ScaledPairs) and b.eps == EPS and b.group == 128
    assert b.dtype == jnp.bfloat16  # the residual's: what a matmul of them returns


@pytest.mark.parametrize("splits, rows", [(16, 1), (56, 2), (1, 1)])
def test_silu_mul_pairs_equals_its_reference_and_the_model(splits, rows):
    """gate|up's split partials to ``silu(gate) * up`` as pairs: the kernel gives the
    reference's pairs and scales; ``values()`` is the model's bfloat16 ``silu(g) * u`` of the
    summed halves within bfloat16 rounding; no sums of squares (no norm)."""
    f = 256
    p = jax.random.normal(jax.random.PRNGKey(splits), (splits, rows, 2 * f), jnp.float32)
    got = silu_mul_pairs(p, group=128, dtype=jnp.bfloat16, interpret=True)
    want = silu_mul_pairs_reference(p, group=128, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(got.pairs, want.pairs)
    np.testing.assert_allclose(got.scales, want.scales, rtol=1e-6)
    assert got.sumsq is None and got.dtype == jnp.bfloat16 and got.group == 128
    gu = jnp.sum(p, 0).astype(jnp.bfloat16)
    model = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(jnp.float32)
    np.testing.assert_allclose(got.values(), model, rtol=0,
                               atol=8e-3 * float(jnp.max(jnp.abs(model))))


def test_word_gemv_reads_unnormalized_pairs_and_silu_feeds_down():
    """gate|up (int4, partials) -> ``silu_mul_pairs`` -> down reading the pairs (no norm: the
    output is not rescaled), against silu(x @ Wg) * (x @ Wu) @ Wd in float32. 70B's down has
    224 groups (not a power of two): it reads pairs without sums of squares, not with."""
    k, f = 1024, 1024
    rng = np.random.default_rng(60)
    x = jnp.asarray(rng.normal(size=(1, k)), jnp.float32)

    def int4(rows, cols):
        return (jnp.asarray(rng.integers(0, 256, size=(rows // 2, cols)), jnp.uint8),
                jnp.asarray(rng.random((rows // 128, cols)) * 0.02, jnp.float16),
                jnp.asarray(-rng.random((rows // 128, cols)) * 0.15, jnp.float16))
    gate_up, down = int4(k, 2 * f), int4(f, 512)
    tiles = _wide(Int4Tiles().word, x_pair_sums=True)
    parts = word_gemv(x, *gate_up, interpret=True, tiles=tiles, partials=True, **INT4)
    act = silu_mul_pairs(parts, group=128, dtype=jnp.float32, interpret=True)
    eqn = _pallas_eqn(lambda a: word_gemv(a, *down, interpret=True, tiles=tiles, **INT4), act)
    assert [str(v.aval.dtype) for v in eqn.invars] == [
        "int32", "uint32", "int32", "int32", "float32"]  # pairs, q, scale, zero, group scales
    got = word_gemv(act, *down, interpret=True, tiles=tiles, **INT4)
    gu = word_gemv_reference(x, *gate_up, **INT4)
    want = word_gemv_reference(jax.nn.silu(gu[:, :f]) * gu[:, f:], *down, **INT4)
    assert float(jnp.max(jnp.abs(got - want))) <= 3e-3 * float(jnp.max(jnp.abs(want)))
    q, s, z = (jax.ShapeDtypeStruct((28672 // 2, 8192), jnp.uint8),
               *[jax.ShapeDtypeStruct((224, 8192), jnp.float16)] * 2)  # shapes suffice
    assert reads_pairs(1, q, s, z, tiles=Int4Tiles().word, norm=False, **INT4)
    assert not reads_pairs(1, q, s, z, tiles=Int4Tiles().word, norm=True, **INT4)


@pytest.mark.parametrize("splits, rows", [(32, 1), (16, 2), (7, 1)])
def test_sum_rope_equals_its_reference_and_the_models_rope(splits, rows):
    """The QKV partials summed and Q, K rotated in one kernel: the reference's result (to one
    bfloat16 step: the kernel sums in chunks), and ``apply_rope`` of the summed product for Q
    and K heads, V's heads as summed."""
    nh, nkv, d = 4, 2, 64
    p = jax.random.normal(jax.random.PRNGKey(splits), (splits, rows, (nh + 2 * nkv) * d))
    pos = jnp.asarray([[5, 1000]])[:, :rows]
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    freqs = pos[0].astype(jnp.float32)[:, None] * inv
    kw = dict(head_dim=d, rotated_heads=nh + nkv, dtype=jnp.bfloat16)
    got = sum_rope(p, jnp.cos(freqs), jnp.sin(freqs), interpret=True, **kw)
    want = sum_rope_reference(p, jnp.cos(freqs), jnp.sin(freqs), **kw)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2**-7)
    x = jnp.sum(p, 0).astype(jnp.bfloat16).reshape(1, rows, nh + 2 * nkv, d)
    model = jnp.concatenate([apply_rope(x[:, :, :nh + nkv], pos, inv), x[:, :, nh + nkv:]],
                            axis=2).reshape(rows, -1).astype(jnp.float32)
    np.testing.assert_allclose(got.astype(jnp.float32), model, rtol=0,
                               atol=2**-6 * float(jnp.max(jnp.abs(model))))
    v = slice((nh + nkv) * d, None)
    np.testing.assert_allclose(got[:, v].astype(jnp.float32), model[:, v], rtol=2**-7)
