"""pallas_kernels.add_rms_norm (Pallas interpreter on CPU) against its reference and against
jaxinfer.model.rms_norm, and the model's use of it: a Pallas-backend decode step equals the
reference backend's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import rms_norm
from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_reference


@pytest.mark.parametrize("m, d, dtype", [(1, 256, jnp.float32), (3, 1024, jnp.bfloat16),
                                         (64, 128, jnp.float32)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_equals_the_reference_and_the_model_norm(m, d, dtype, add):
    rng = np.random.default_rng(m + d)
    x = jnp.asarray(rng.normal(size=(m, d)) * 3, dtype)
    r = jnp.asarray(rng.normal(size=(m, d)), dtype) if add else None
    w = jnp.asarray(rng.normal(size=(d,)), dtype)
    h, normed = add_rms_norm(x, r, w, 1e-5, interpret=True)
    want_h, want = add_rms_norm_reference(x, r, w, 1e-5)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    assert h.dtype == normed.dtype == dtype and normed.shape == (m, d)
    np.testing.assert_array_equal(h, want_h)  # the same add, rounded the same
    np.testing.assert_allclose(normed.astype(jnp.float32), want.astype(jnp.float32), **tol)
    np.testing.assert_allclose(want.astype(jnp.float32),
                               rms_norm(want_h, w, 1e-5).astype(jnp.float32), **tol)


def test_bad_operands_are_one_line_errors():
    x = jnp.zeros((2, 96))
    with pytest.raises(ValueError, match="power of two"):
        add_rms_norm(x, None, jnp.zeros(96), 1e-5, interpret=True)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm(jnp.zeros((2, 64)), jnp.zeros((3, 64)), jnp.zeros(64), 1e-5,
                     interpret=True)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(jnp.zeros((2, 64)), None, jnp.zeros(32), 1e-5, interpret=True)


def test_the_model_runs_the_kernel_in_pallas_decode_steps_only():
    """A decode-sized step with the Pallas backend traces the kernel (twice per layer), a
    step past NORM_ROWS does not, and the reference backend never does."""
    from jaxinfer.model import add_norm

    h = jnp.ones((1, 2, 64))
    w = jnp.ones(64)

    def kernels(backend, t):
        jaxpr = jax.make_jaxpr(lambda h: add_norm(h, h, w, 1e-5, backend))(
            jnp.ones((1, t, 64)))
        return str(jaxpr).count("pallas_call")

    assert kernels("pallas", 2) == 1 and kernels("pallas", 65) == 0
    assert kernels("reference", 2) == 0
    got = add_norm(h, 2 * h, w, 1e-5, "pallas")
    want = add_norm(h, 2 * h, w, 1e-5, "reference")
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[0], want[0])
