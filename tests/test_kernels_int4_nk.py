"""pallas_kernels.int4_gemv_nk (Pallas interpreter on CPU), the transposed-layout int4 GEMV
experiment: against its reference (the int4_matmul reference on the transposed operands),
over row counts, group sizes, tilings and odd column counts, and its GPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_gemv_nk import int4_gemv_nk, int4_gemv_nk_reference


def _operands(m, k, n, group, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    qt = jnp.asarray(rng.integers(0, 256, size=(n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.random((n, k // group)) * 0.02, jnp.float16)
    zero = jnp.asarray(-rng.random((n, k // group)) * 0.15, jnp.float16)
    return x, qt, scale, zero


@pytest.mark.parametrize("m, k, n, group, tiles", [
    (1, 256, 200, 32, {}),
    (2, 512, 64, 128, {}),
    (4, 384, 70, 64, dict(block_n=16, step_rows=64, target_programs=4096)),
    (1, 1024, 48, 32, dict(block_n=128, step_rows=1024, target_programs=1, num_warps=8)),
])
def test_int4_gemv_nk_equals_the_reference(m, k, n, group, tiles):
    x, qt, scale, zero = _operands(m, k, n, group, seed=m + k + n)
    got = int4_gemv_nk(x, qt, scale, zero, interpret=True, **tiles)
    np.testing.assert_allclose(got, int4_gemv_nk_reference(x, qt, scale, zero),
                               rtol=1e-5, atol=1e-4)


def test_bad_operands_are_one_line_errors():
    x, qt, scale, zero = _operands(1, 256, 32, 32, seed=0)
    with pytest.raises(ValueError, match="M <= "):
        int4_gemv_nk(jnp.zeros((9, 256)), qt, scale, zero, interpret=True)
    with pytest.raises(ValueError, match="power of"):
        int4_gemv_nk(x, qt, scale[:, :3], zero[:, :3], interpret=True)


def test_lowers_to_triton_for_cuda_at_8b_shapes():
    from jax import export

    no_check = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for m, k, n, group in ((1, 4096, 6144, 128), (2, 14336, 4096, 32)):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        qt = jax.ShapeDtypeStruct((n, k // 2), jnp.uint8)
        s = jax.ShapeDtypeStruct((n, k // group), jnp.float16)
        exported = export.export(jax.jit(int4_gemv_nk), platforms=["cuda"],
                                 disabled_checks=no_check)(x, qt, s, s)
        assert "jaxinfer_int4_gemv_nk" in exported.mlir_module()
