"""pallas_kernels.int4_matmul (Pallas interpreter on CPU) against its dequantize-then-matmul
reference over decode row counts, odd column counts and group sizes; and against the
``jaxinfer.quantize`` format it reads."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import Int4Tiles, int4_matmul, int4_matmul_reference
from pallas_kernels.word_gemv import HALF2_PRODUCTS


def _operands(m: int, k: int, n: int, group: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32).astype(dtype)
    q = jnp.asarray(rng.integers(0, 256, size=(k // 2, n)), jnp.uint8)
    scale = jnp.asarray(rng.random((k // group, n)) * 0.02, jnp.float16)
    zero = jnp.asarray(-rng.random((k // group, n)) * 0.15, jnp.float16)
    return x, q, scale, zero


# (rows, K, N, group, dtype): rows 1..64 (one 16-row tile, then 64-row tiles), N not a
# multiple of the 128-column block, K of 1..12 groups (several groups per loop step, splits).
SHAPES = [(1, 256, 200, 32, jnp.float32), (17, 576, 96, 64, jnp.float32),
          (64, 384, 257, 128, jnp.float32), (7, 320, 131, 32, jnp.bfloat16),
          (70, 128, 64, 64, jnp.float32),
          (1, 512, 130, 128, jnp.float32)]  # one row, groups summed per group


@pytest.mark.parametrize("m, k, n, group, dtype", SHAPES)
def test_int4_matmul_equals_reference(m, k, n, group, dtype):
    x, q, scale, zero = _operands(m, k, n, group, dtype, seed=m * k + n)
    got = int4_matmul(x, q, scale, zero, out_dtype=jnp.float32, interpret=True)
    want = int4_matmul_reference(x, q, scale, zero, out_dtype=jnp.float32)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # bf16: the reference rounds the dequantized weight to bf16, the kernel scales in float32.
    # A few rows at groups of 128+ run word_gemv's float16 pairs: ~1e-3 of the largest output.
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    word = Int4Tiles().word
    if (m <= Int4Tiles().word_rows
            and word.half2_min_group <= group <= HALF2_PRODUCTS * word.sub_rows):
        tol = dict(rtol=0, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    np.testing.assert_allclose(got, want, **tol)


@pytest.mark.parametrize("m", [1, 5])  # one row: word_gemv (unless word_rows=0); five: the dot
@pytest.mark.parametrize("tiles", [
    Int4Tiles(block_n=256, step_rows=256, target_programs=64, num_warps=8, num_stages=4),
    Int4Tiles(block_n=64, step_rows=32, target_programs=2048, num_warps=2, num_stages=2),
    Int4Tiles(word_rows=0),  # few rows through the dot kernel
])
def test_int4_matmul_tilings_equal_the_reference(tiles, m):
    """The tilings ``scripts/bench_int4.py`` sweeps: wider and narrower column blocks, loop
    steps of one or several groups, more or fewer K splits (a partial column block too)."""
    x, q, scale, zero = _operands(m, 1024, 300, 32, jnp.float32, seed=5)
    got = int4_matmul(x, q, scale, zero, out_dtype=jnp.float32, interpret=True, tiles=tiles)
    want = int4_matmul_reference(x, q, scale, zero, out_dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_int4_matmul_reads_quantized_weights():
    from jaxinfer.quantize import quantize_weight

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(256, 48)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 256)), jnp.float32)
    qw = quantize_weight(w, "wq", "int4-g64")
    got = int4_matmul(x, qw.q, qw.scale, qw.zero, interpret=True)
    np.testing.assert_allclose(got, x @ qw.dequantize(), rtol=1e-5, atol=1e-4)


def test_bad_operands_are_one_line_errors():
    x, q, scale, zero = _operands(2, 64, 32, 32, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="uint8"):
        int4_matmul(x, q.astype(jnp.int8), scale, zero, interpret=True)
    with pytest.raises(ValueError, match="power of two, at least 32"):
        int4_matmul(x, q, jnp.zeros((4, 32)), jnp.zeros((4, 32)), interpret=True)
    with pytest.raises(ValueError, match="K = 2"):
        int4_matmul(x[:, :48], q, scale, zero, interpret=True)
    with pytest.raises(ValueError, match="must both be"):
        int4_matmul(x, q, scale, zero[:1], interpret=True)


def test_kernel_lowers_to_triton_for_cuda_at_8b_shapes():
    """Lowering for a GPU (on this CPU machine, through jax.export) runs every Pallas Triton
    lowering rule the kernel needs: uint8 masks and shifts, int-to-float casts, dots."""
    import jax
    from jax import export

    f = jax.jit(lambda x, q, s, z: int4_matmul(x, q, s, z))
    no_check = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for m, k, n, group in ((16, 4096, 6144, 32), (48, 14336, 4096, 128)):  # the dot kernel
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((k // 2, n), jnp.uint8)
        s = jax.ShapeDtypeStruct((k // group, n), jnp.float16)
        exported = export.export(f, platforms=["cuda"], disabled_checks=no_check)(x, q, s, s)
        assert "jaxinfer_int4_matmul" in exported.mlir_module()
