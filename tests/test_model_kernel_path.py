"""The model's decode path through the int4 / int8 Pallas kernels, run in the Pallas
interpreter on CPU (``backend="pallas"``, ``model.gemv_kernels``): against the XLA path of the
same weights, with and without the junctions (``_add_norm``: ``add_norm_pairs`` joining each
matmul's split partials to the next matmul's input)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_eqns

import jaxinfer
from jaxinfer import model
from jaxinfer.model import apply_layout, forward_ragged, init_params
from jaxinfer.quantize import QuantizedWeight, quantize_params

CFG = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                           max_position_embeddings=256, tie_word_embeddings=False)


def _decode_one(params, backend):
    """One decode token (position 3 after three written ones) through ``forward_ragged``:
    the final hidden state ``[1, hidden]`` and the jaxpr's pallas_call names."""
    kvh, d = CFG.num_kv_heads, CFG.head_dim
    key = jax.random.PRNGKey(7)
    pool = [jax.random.normal(jax.random.fold_in(key, i), (kvh, 4, 16, d), jnp.float32)
            for i in range(CFG.num_layers)]
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    args = (i32(5), i32(3), pool, pool, i32(0), i32(3), i32(0, 1, 2, 3)[None], i32(4),
            i32(0, 1))

    def step(p, *a):
        return forward_ragged(p, CFG, *a, backend=backend, dtype=jnp.float32)[0]

    names = [e.params["name"] for e in all_eqns(jax.make_jaxpr(step)(params, *args))
             if e.primitive.name == "pallas_call"]
    return jax.jit(step)(params, *args), names


def _force_junctions(monkeypatch):
    """Every quantized kernel weight treated as reading ``NormPairs`` (the default tiles only
    read them for weights far larger than a CPU test's): the junction kernel then runs, and
    the GEMV rebuilds the activations from the pairs (``NormPairs.normalized``)."""
    monkeypatch.setattr(model, "_reads_norm_pairs", lambda w, rows, kernels: kernels and (
        isinstance(w, QuantizedWeight)))


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_kernel_decode_path_equals_the_xla_path(method, monkeypatch):
    """One decode token: the Pallas kernels (interpreted) give the XLA path's hidden state,
    with ``add_norm_pairs`` twice per layer when junctions apply and never otherwise."""
    params = quantize_params(apply_layout(init_params(CFG, jax.random.PRNGKey(1), jnp.float32),
                                          "fast"), method)
    want, names = _decode_one(params, "reference")
    assert not any("word_gemv" in n or "add_norm_pairs" in n for n in names)
    got, names = _decode_one(params, "pallas")
    assert any("word_gemv" in n for n in names) and "jaxinfer_add_norm_pairs" not in names
    # int8 sums its products in float16 pairs (word_gemv): ~1e-3 of the largest output
    np.testing.assert_allclose(got, want, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    _force_junctions(monkeypatch)
    joined, names = _decode_one(params, "pallas")
    assert names.count("jaxinfer_add_norm_pairs") == 2 * CFG.num_layers
    # float16 pairs of the normalized activations: float16 rounding, not float32's
    np.testing.assert_allclose(joined, want, atol=1e-2 * float(jnp.max(jnp.abs(want))))


def test_junctions_need_the_kernels_and_leave_other_weights_alone(monkeypatch):
    """Plain weights and the reference backend (no kernels) run no junction, even where
    every quantized weight would read pairs."""
    _force_junctions(monkeypatch)
    plain = apply_layout(init_params(CFG, jax.random.PRNGKey(2), jnp.float32), "fast")
    _, names = _decode_one(plain, "pallas")
    assert "jaxinfer_add_norm_pairs" not in names
    q = quantize_params(plain, "int4")
    _, names = _decode_one(q, "reference")
    assert "jaxinfer_add_norm_pairs" not in names
