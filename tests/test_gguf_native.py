"""Native GGUF weights (``load_gguf(native=True)``, ``load_model(quantize="native")``): the
blocks read as they are agree with the ``gguf`` package's dequantization, every layout holds
them, and the default model (Q4_1) gives the logits of its dequantized float32 load."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

import jaxinfer
from checkpoints.gguf import _unpermute, native_weight
from jaxinfer.errors import InputError
from jaxinfer.model import apply_layout
from jaxinfer.quantize import QuantizedWeight


@pytest.mark.parametrize("qtype, kind", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
def test_native_blocks_agree_with_gguf_dequantize(qtype, kind):
    t = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).normal(size=(8, 96)).astype(np.float32)  # [out, in]
    raw = quantize(w, t)  # [out, bytes]
    want = dequantize(raw, t)
    qw = native_weight(raw.reshape(-1), qtype, (8, 96))
    assert (qw.kind, qw.group, qw.shape) == (kind, 32, (96, 8))
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), want.T)
    # Q/K rows are un-permuted block row by block row, like the dequantized rows.
    permuted = native_weight(raw.reshape(-1), qtype, (8, 96), n_head=2)
    np.testing.assert_array_equal(np.asarray(permuted.dequantize()), _unpermute(want, 2).T)


def _k_blocks(qtype: str, out: int, n_in: int, seed: int) -> np.ndarray:
    """Random K-quant blocks ``[out, bytes]`` (any bytes are valid blocks) with small
    float16 super-block scales, since the ``gguf`` package cannot quantize K-quants."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(out, n_in // 256, size), dtype=np.uint8)

    def f16(v: float) -> np.ndarray:
        return np.frombuffer(np.float16(v).tobytes(), np.uint8)

    if qtype == "Q4_K":  # d, dmin first
        b[..., 0:2], b[..., 2:4] = f16(0.01), f16(0.005)
    else:  # Q6_K: d last
        b[..., -2:] = f16(0.001)
    return b.reshape(out, -1)


@pytest.mark.parametrize("qtype, method", [("Q4_K", "int4"), ("Q6_K", "int8")])
def test_k_quants_are_requantized_within_half_a_step(qtype, method):
    from checkpoints.gguf import requantized_weight

    want = dequantize(_k_blocks(qtype, 8, 512, seed=1), gguf.GGMLQuantizationType[qtype])
    qw = requantized_weight(want, "wq", method)
    assert qw.kind == method and qw.shape == (512, 8)
    step = np.repeat(np.asarray(qw.scale, np.float32), qw.group, axis=0)
    assert np.all(np.abs(np.asarray(qw.dequantize()) - want.T) <= 0.51 * step + 1e-3)


def test_native_method_per_weight_kind():
    from checkpoints.gguf import _native_method

    assert _native_method({"Q4_1"}) == _native_method({"Q4_0", "Q4_1"}) == "native"
    assert _native_method({"Q8_0"}) == "native"
    assert _native_method({"Q4_K", "Q4_0"}) == "int4"
    assert _native_method({"Q4_K", "Q6_K"}) == _native_method({"Q8_0", "Q5_K"}) == "int8"
    assert _native_method({"Q4_K", "F16"}) is None


def test_native_weights_are_the_dequantized_ones_in_every_layout():
    """Host (numpy) quantized weights, as ``load_gguf(native=True)`` returns them, through
    ``apply_layout``: slicing layers out and fusing QKV / gate|up keeps every value."""
    from jaxinfer.model import param_shapes
    from jaxinfer.quantize import pack_int4
    from sharding.testing import tiny_config, tiny_params

    cfg = tiny_config()
    rng = np.random.default_rng(0)
    host = tiny_params(cfg)
    for name, shape in param_shapes(cfg)["layers"].items():
        if "norm" not in name:
            n, d_in, d_out = shape
            scale = rng.random((n, d_in // 32, d_out)).astype(np.float16)
            host["layers"][name] = QuantizedWeight(
                q=pack_int4(rng.integers(0, 16, shape), 32, axis=1), scale=scale, zero=-scale,
                group=32, kind="int4")
    dequantize = jax.jit(lambda w: w.dequantize())
    plain = jax.tree.map(lambda w: np.asarray(dequantize(w)) if isinstance(w, QuantizedWeight)
                         else w, host, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    fast, want = apply_layout(host, "fast"), apply_layout(plain, "fast")
    for i in (0, 1):
        for k in ("wqkv", "w_gate_up", "w_down"):
            assert isinstance(fast["layers"][i][k], QuantizedWeight)
            np.testing.assert_array_equal(np.asarray(dequantize(fast["layers"][i][k])),
                                          want["layers"][i][k])


@pytest.mark.slow
def test_default_model_native_logits_equal_the_dequantized_model(default_gguf):
    from tests.test_quantize import TEXT

    native = jaxinfer.load_model(str(default_gguf), dtype="float32", quantize="native")
    plain = jaxinfer.load_model(str(default_gguf), dtype="float32")
    ids = native.tokenizer.encode(TEXT)
    got = np.asarray(jaxinfer.compute_logits(native, ids))
    np.testing.assert_allclose(got, np.asarray(jaxinfer.compute_logits(plain, ids)), atol=1e-3)
    # Q4_1: 5 bits a weight (4 + a float16 scale and zero per 32) against float32's 32.
    layer_bytes = jaxinfer.quantize.param_bytes(native.params["layers"])
    assert layer_bytes < 0.17 * jaxinfer.quantize.param_bytes(plain.params["layers"])
    logp = jax.nn.log_softmax(got, axis=-1)[np.arange(len(ids) - 1), ids[1:]]
    assert 15 < float(np.exp(-np.mean(logp))) < 30  # 20.9 with the dequantized weights
    assert all(isinstance(native.params["layers"][k], QuantizedWeight)
               for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    assert not isinstance(native.params["embed"], QuantizedWeight)  # Q8_0, but looked up


def test_native_needs_a_gguf(tmp_path):
    with pytest.raises(InputError, match="not a .gguf file"):
        jaxinfer.load_model(str(tmp_path), quantize="native")
    with pytest.raises(InputError, match="native or None"):
        jaxinfer.load_model(str(tmp_path), quantize="q4")
