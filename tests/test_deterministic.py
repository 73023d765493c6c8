"""Deterministic mode (``load_model(deterministic=True)``): in bfloat16, a request's tokens
and log-probabilities are bit-identical whatever else is in the batch, where it sits in it,
and how the steps are shaped (prefill chunks, decode calls, padding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from jaxinfer.params import init_params

pytestmark = pytest.mark.slow  # the Pallas kernels run in the interpreter on CPU


@pytest.fixture(scope="module")
def model() -> jaxinfer.Model:
    cfg = jaxinfer.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                               max_position_embeddings=64)
    params = init_params(cfg, jax.random.PRNGKey(3), jnp.bfloat16)
    return jaxinfer.Model(config=cfg, params=params, tokenizer=None, dtype=jnp.bfloat16,
                          deterministic=True)


def _run(model, prompts, options, arrivals, **engine_kw):
    engine = Engine(model, num_pages=40, page_size=4, max_seq_len=48, verbose=False,
                    **engine_kw)
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, a in enumerate(arrivals):
            if a == step:
                ids[i] = engine.submit(prompts[i], logprobs=True, ignore_eos=True, **options[i])
        engine.step()
        step += 1
    return [engine.result(ids[i]) for i in range(len(prompts))]


def test_bf16_outputs_are_bit_identical_whatever_the_batch(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, int(n)).tolist() for n in rng.integers(1, 20, 3)]
    options = [dict(max_new_tokens=int(rng.integers(3, 6)), seed=i,
                    temperature=[0.0, 0.9][i % 2]) for i in range(3)]
    alone = [_run(model, [p], [o], [0], max_batch=1, max_tokens_per_step=16,
                  decode_steps=1)[0] for p, o in zip(prompts, options, strict=True)]
    together = _run(model, prompts, options, rng.integers(0, 4, 3).tolist(), max_batch=8,
                    max_tokens_per_step=32, decode_steps=5)
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        assert np.array_equal(np.asarray(a.logprobs, np.float32),
                              np.asarray(b.logprobs, np.float32))


def test_deterministic_mode_refuses_what_it_cannot_run(model):
    import dataclasses

    with pytest.raises(InputError, match="runs the Pallas kernels"):
        Engine(dataclasses.replace(model, backend="reference"), num_pages=8, verbose=False)
    with pytest.raises(InputError, match="runs the Pallas kernels"):
        jaxinfer.load_model("unused-path", deterministic=True, backend="reference")
