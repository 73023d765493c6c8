"""Weight-only int8 (``jaxinfer.quantize``): the quantizer's error bound, the int8 forward
pass equal to the dequantized model's, the engine on every layout, and the default model's
perplexity within 1% of its float weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.model import apply_layout, init_params
from jaxinfer.quantize import QuantizedWeight, quantize_params

CFG = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                           tie_word_embeddings=False)


def _dequantized(params):
    return jax.tree.map(lambda w: w.dequantize() if isinstance(w, QuantizedWeight) else w,
                        params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


@pytest.mark.parametrize("layout", ["stacked", "fast"])
def test_int8_weights_bound_their_error_and_halve_the_bytes(layout):
    params = apply_layout(init_params(CFG, jax.random.PRNGKey(0), jnp.bfloat16), layout)
    q = quantize_params(params, "int8")
    weights = [w for w in jax.tree.leaves(q, is_leaf=lambda w: isinstance(w, QuantizedWeight))
               if isinstance(w, QuantizedWeight)]
    # Every matmul weight (fast: wqkv, wo, w_gate_up, w_down per layer; stacked: the seven
    # stacked ones) and the untied output head.
    assert len(weights) == (4 * CFG.num_layers if layout == "fast" else 7) + 1
    for name in ("embed", "final_norm"):
        assert not isinstance(q[name], QuantizedWeight)
    assert isinstance(q["lm_head"], QuantizedWeight)
    w, qw = params["lm_head"].astype(jnp.float32), q["lm_head"]
    err = jnp.abs(qw.dequantize() - w)  # at most half a step of the row's group
    bound = jnp.repeat(qw.scale, qw.group, axis=0) / 2
    assert qw.scale.shape == (CFG.hidden_size // qw.group, CFG.vocab_size)
    assert bool(jnp.all(err <= bound + 1e-6))
    before = jaxinfer.Model(CFG, params, None, jnp.bfloat16).param_bytes
    after = jaxinfer.Model(CFG, q, None, jnp.bfloat16).param_bytes
    assert after < 0.6 * before


@pytest.mark.parametrize("layout", ["stacked", "fast"])
def test_int8_model_equals_its_dequantized_weights_through_the_engine(layout):
    params = apply_layout(init_params(CFG, jax.random.PRNGKey(1), jnp.float32), layout)
    q = quantize_params(params, "int8")
    int8 = jaxinfer.Model(CFG, q, None, jnp.float32, backend="reference")
    plain = jaxinfer.Model(CFG, _dequantized(q), None, jnp.float32, backend="reference")
    prompt = list(range(5, 30))
    np.testing.assert_allclose(jaxinfer.compute_logits(int8, prompt),
                               jaxinfer.compute_logits(plain, prompt), atol=2e-4, rtol=1e-4)
    prompts = [list(range(3, 3 + n)) for n in (4, 9, 17)]
    got = jaxinfer.generate(int8, prompts, max_new_tokens=8, ignore_eos=True)
    want = jaxinfer.generate(plain, prompts, max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_bad_quantize_options_are_one_line_errors():
    with pytest.raises(InputError, match="quantize='int3' must be one of int8"):
        jaxinfer.load_model("unused", quantize="int3")
    with pytest.raises(InputError, match="deterministic=True"):
        jaxinfer.load_model("unused", quantize="int8", deterministic=True)


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used to make wine. Books became cheaper, literacy spread across Europe, and "
        "ideas travelled faster than ever before. Within fifty years, presses were running in "
        "more than two hundred cities, and millions of volumes had been printed.")


@pytest.mark.slow
def test_default_model_int8_perplexity_within_one_percent(default_gguf):
    base = jaxinfer.load_model(str(default_gguf), dtype="float32")
    int8 = dataclasses.replace(base, params=quantize_params(base.params, "int8"))
    ids = base.tokenizer.encode(TEXT)

    def perplexity(model: jaxinfer.Model) -> float:
        logp = jax.nn.log_softmax(jnp.asarray(jaxinfer.compute_logits(model, ids)), axis=-1)
        return float(np.exp(-np.mean(np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]])))

    ppl = [perplexity(m) for m in (base, int8)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.01, ppl
