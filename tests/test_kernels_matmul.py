"""pallas_kernels.matmul (Pallas interpreter on CPU) against its reference, and its point:
a row's result does not depend on the batch around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import matmul, matmul_reference


@pytest.mark.parametrize("m, k, n, transpose_w, dtype", [
    (1, 64, 64, False, jnp.float32), (5, 100, 70, False, jnp.float32),
    (130, 64, 128, True, jnp.float32), (7, 96, 200, False, jnp.bfloat16),
    (3, 80, 50, True, jnp.bfloat16)])
def test_matmul_equals_reference(m, k, n, transpose_w, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(m * k + n))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (n, k) if transpose_w else (k, n), jnp.float32).astype(dtype)
    got = matmul(x, w, transpose_w=transpose_w, out_dtype=jnp.float32, interpret=True)
    want = matmul_reference(x, w, transpose_w=transpose_w, out_dtype=jnp.float32)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == jnp.float32 else 1e-2,
                               atol=1e-4 if dtype == jnp.float32 else 5e-2)


def test_a_row_is_bit_identical_whatever_the_batch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(150, 192)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(192, 96)), jnp.bfloat16)
    full = np.asarray(matmul(x, w, interpret=True).astype(jnp.float32))
    for rows in ([0], [3, 77], list(range(64, 130)), [149, 0, 5]):
        alone = matmul(x[jnp.asarray(rows)], w, interpret=True).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(alone), full[rows])
    noise = x.at[1:].set(jnp.asarray(rng.normal(size=(149, 192)) * 1e3, jnp.bfloat16))
    np.testing.assert_array_equal(
        np.asarray(matmul(noise, w, interpret=True)[0].astype(jnp.float32)), full[0])


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match="contraction mismatch"):
        matmul(jnp.zeros((2, 3)), jnp.zeros((4, 5)), interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        matmul(jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), interpret=True)


def test_row_sum_equals_reference_and_is_batch_invariant():
    from pallas_kernels.matmul import row_sum, row_sum_reference

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(37, 1300)), jnp.float32)
    full = np.asarray(row_sum(x, interpret=True))
    np.testing.assert_allclose(full, row_sum_reference(x), rtol=1e-5, atol=1e-4)
    for rows in ([5], [36, 0, 17], list(range(3, 30))):
        np.testing.assert_array_equal(np.asarray(row_sum(x[jnp.asarray(rows)], interpret=True)),
                                      full[rows])


@pytest.mark.parametrize("m", [1, 20, 70])
def test_int8_matmul_equals_reference(m):
    """The tensor-core kernel at every row count (``word_rows=0``; by default up to
    WORD_ROWS rows run word_gemv's float16 pairs: tests/test_kernels_word_gemv.py), with one
    dot per row tile or 2-4 sharing each converted weight tile (``dot_rows``), then the
    default, within float16 rounding at one row."""
    from pallas_kernels.matmul import Int8Tiles, int8_matmul, int8_matmul_reference
    from pallas_kernels.word_gemv import WORD_ROWS

    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.normal(size=(m, 128)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, size=(128, 96)), jnp.int8)
    scale = jnp.asarray(rng.random((2, 96)) * 0.01, jnp.float32)
    want = int8_matmul_reference(x, q, scale)
    for dot_rows in (64, 32, 16):  # one dot per row tile, or several sharing its weight
        got = int8_matmul(x, q, scale, interpret=True,
                          tiles=Int8Tiles(word_rows=0, dot_rows=dot_rows))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="dot_rows must be 16, 32 or 64"):
        int8_matmul(x, q, scale, interpret=True, tiles=Int8Tiles(dot_rows=24))
    got = int8_matmul(x, q, scale, interpret=True)
    if m > WORD_ROWS:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-3 * float(jnp.max(jnp.abs(want)))
    with pytest.raises(ValueError, match="multiple of 64"):
        int8_matmul(x[:, :100], q[:100], scale, interpret=True)
