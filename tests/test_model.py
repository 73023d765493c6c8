"""Model, cache and step loop against HF transformers on tiny random configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxinfer
from jaxinfer import steps
from jaxinfer.kv_cache import KVCache
from jaxinfer.model import init_params


def _hf_greedy(torch_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_match_transformers(tiny_hf):
    path, torch_model = tiny_hf
    model = jaxinfer.load_model(path, dtype="float32", backend="reference")
    ids = np.random.default_rng(1).integers(0, 128, size=77).tolist()
    ours = jaxinfer.compute_logits(model, ids)
    with torch.no_grad():
        ref = torch_model(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape == (77, 128)
    assert np.abs(ours - ref).max() < 1e-4 * np.abs(ref).max()


def test_greedy_matches_transformers(tiny_hf):
    path, torch_model = tiny_hf
    model = jaxinfer.load_model(path, dtype="float32", backend="reference")
    prompt = np.random.default_rng(2).integers(3, 128, size=9).tolist()
    (out,) = jaxinfer.generate(model, [prompt], max_new_tokens=20, stop_token_ids=[])
    assert out.token_ids[: len(out.token_ids)] == _hf_greedy(torch_model, prompt, 20)[
        : len(out.token_ids)]
    assert out.finish_reason == "stop" or len(out.token_ids) == 20


def test_ragged_batch_equals_each_alone(gqa_model):
    model, torch_model = gqa_model
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (1, 5, 17, 33, 8)]
    budgets = [6, 19, 3, 11, 25]
    params = [jaxinfer.SamplingParams(max_new_tokens=m) for m in budgets]
    batch = jaxinfer.generate(model, prompts, sampling=params)
    for prompt, p, got in zip(prompts, params, batch, strict=True):
        (alone,) = jaxinfer.generate(model, [prompt], sampling=p)
        assert got.token_ids == alone.token_ids
        assert got.finish_reason == alone.finish_reason
        hf = _hf_greedy(torch_model, prompt, p.max_new_tokens)
        # eos (id 2) ends ours early; up to there the tokens are HF's
        assert got.token_ids == hf[: len(got.token_ids)]
        if got.finish_reason == "length":
            assert len(got.token_ids) == p.max_new_tokens


def test_bfloat16_close_to_float32(tiny_hf):
    path, _ = tiny_hf
    ids = list(range(3, 40))
    f32 = jaxinfer.compute_logits(jaxinfer.load_model(path, dtype="float32"), ids)
    bf16 = jaxinfer.compute_logits(jaxinfer.load_model(path, dtype="bfloat16"), ids)
    assert bf16.dtype == np.float32
    assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()


def test_prompt_lengths_compile_a_bounded_number_of_programs(gqa_model):
    model, _ = gqa_model
    before = steps.prefill._cache_size()
    loop_before = steps.decode_loop._cache_size()
    for n in range(1, 60, 3):  # 20 different prompt lengths
        jaxinfer.generate(model, [list(range(3, 3 + n))], max_new_tokens=4)
    # lengths 1..58 fall in prompt buckets 16, 32, 64 (and cache buckets 64, 128)
    assert steps.prefill._cache_size() - before <= 3
    assert steps.decode_loop._cache_size() - loop_before <= 2


def test_decode_step_hlo_has_no_cache_transpose():
    cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    cache = KVCache.create(cfg, 3, 128, jnp.float32)
    state = _dummy_state(3, cfg.vocab_size)
    hlo = steps.decode_step.lower(params, cache, state, config=cfg, backend="reference",
                                  dtype=jnp.float32).compile().as_text()
    cache_elems = 3 * 2 * 128 * 8  # one layer's [B, KVH, S, D]
    for line in hlo.splitlines():
        if " transpose(" in line or " copy(" in line:
            shape = line.split("=")[1].split("{")[0].split("[")[-1].split("]")[0]
            dims = [int(d) for d in shape.split(",") if d.strip().isdigit()]
            assert int(np.prod(dims or [0])) < cache_elems, f"cache-sized transpose/copy: {line}"


def _dummy_state(b: int, vocab: int) -> steps.DecodeState:
    from jaxinfer.sampling import SamplingArrays, SamplingParams

    return steps.DecodeState(
        tokens=jnp.arange(b, dtype=jnp.int32), num_generated=jnp.ones((b,), jnp.int32),
        done=jnp.zeros((b,), bool), out_tokens=jnp.zeros((b, 8), jnp.int32),
        out_logprobs=jnp.zeros((b, 8)), seen=jnp.zeros((b, vocab), bool),
        max_new_tokens=jnp.full((b,), 8, jnp.int32), stop_ids=jnp.full((b, 4), -1, jnp.int32),
        sampling=SamplingArrays.from_params([SamplingParams(seed=0)] * b))


def test_steps_donate_the_cache(gqa_model):
    model, _ = gqa_model
    cfg = model.config
    cache = KVCache.create(cfg, 2, 64, jnp.float32)
    old_k = cache.k
    tokens = jnp.ones((2, 16), jnp.int32)
    cache, _ = steps.prefill(model.params, cache, tokens, jnp.array([3, 16], jnp.int32),
                             config=cfg, backend="reference", dtype=jnp.float32)
    assert old_k.is_deleted()
    assert cache.lengths.tolist() == [3, 16]


def test_compile_time_does_not_grow_with_depth():
    def lowered_ops(layers: int) -> int:
        cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8)
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
        cache = KVCache.create(cfg, 1, 64, jnp.float32)
        text = steps.prefill.lower(params, cache, jnp.ones((1, 16), jnp.int32),
                                   jnp.array([16], jnp.int32), config=cfg,
                                   dtype=jnp.float32).as_text()
        return len(text.splitlines())

    assert lowered_ops(2) == lowered_ops(12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=""), "prompt is empty"),
        (dict(prompts=[[]]), "prompt is empty"),
        (dict(prompts=[[5, 999]]), "outside the vocabulary"),
        (dict(prompts=[[5] * 600]), "context"),
        (dict(prompts=[[5, 6]], max_new_tokens=600), "lower max_new_tokens"),
        (dict(prompts=[[5]], temperature=-1.0), "temperature"),
        (dict(prompts=[[5]], top_p=0.0), "top_p"),
        (dict(prompts=[[5]], top_p=1.5), "top_p"),
        (dict(prompts=[[5]], top_k=-2), "top_k"),
        (dict(prompts=[[5]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[5]], bogus=3), "unknown sampling option 'bogus'"),
        (dict(prompts=[[5]], stop="x"), "stop strings need a tokenizer"),
    ],
)
def test_bad_input_is_one_line_error(gqa_model, kwargs, message):
    model, _ = gqa_model
    prompts = kwargs.pop("prompts")
    with pytest.raises(jaxinfer.InputError, match=message) as info:
        jaxinfer.generate(model, prompts, **kwargs)
    assert "\n" not in str(info.value)


def test_unknown_model_name_is_one_line_error():
    with pytest.raises(jaxinfer.InputError, match="unknown model 'no-such-model'"):
        jaxinfer.load_model("no-such-model")


def test_config_rejects_unsupported_fields():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    for extra, field in [({"sliding_window": 4096}, "sliding_window"),
                         ({"attention_bias": True}, "attention_bias"),
                         ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
                         ({"frobnicate": 1}, "frobnicate"),
                         ({"model_type": "gpt2"}, "model_type")]:
        with pytest.raises(jaxinfer.ConfigError, match=field):
            jaxinfer.LlamaConfig.from_hf_dict({**base, **extra})
    # Mistral-style config without a sliding window is fine
    cfg = jaxinfer.LlamaConfig.from_hf_dict({**base, "model_type": "mistral",
                                             "sliding_window": None})
    assert cfg.num_kv_heads == 2


def test_pallas_backend_gives_the_same_tokens():
    cfg = jaxinfer.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=160,
                               num_layers=2, num_heads=4, num_kv_heads=1, head_dim=64,
                               max_position_embeddings=256)
    params = init_params(cfg, jax.random.PRNGKey(4), jnp.float32)
    model = jaxinfer.Model(cfg, params, None, dtype=jnp.float32, backend="reference")
    pallas = dataclasses.replace(model, backend="pallas")
    prompts = [[3, 14, 15, 92, 65, 35], list(range(3, 40)), [7]]
    params = [jaxinfer.SamplingParams(max_new_tokens=n) for n in (5, 3, 6)]
    ref = jaxinfer.generate(model, prompts, sampling=params)
    got = jaxinfer.generate(pallas, prompts, sampling=params)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    np.testing.assert_allclose(jaxinfer.compute_logits(pallas, prompts[1]),
                               jaxinfer.compute_logits(model, prompts[1]), atol=1e-4)
