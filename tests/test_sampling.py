"""Every sampling option, on the sampling function directly and through ``generate``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxinfer
from jaxinfer.sampling import (
    SamplingArrays,
    SamplingParams,
    apply_penalties,
    apply_repetition_penalty,
    sample,
)

PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def _draw(n: int, **options) -> np.ndarray:
    """n draws from one row with distribution PROBS, each with a different step index."""
    logits = jnp.asarray(np.log(PROBS), jnp.float32)[None].repeat(n, axis=0)
    s = SamplingArrays.from_params([SamplingParams(seed=11, **options)] * n)
    tokens, *_ = sample(logits, s, jnp.zeros((n, 4), jnp.int32), jnp.arange(n, dtype=jnp.int32))
    return np.asarray(tokens)


@pytest.mark.parametrize(
    "options, allowed",
    [
        (dict(temperature=1.0, top_k=2), {0, 1}),
        (dict(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 + 0.3 covers 0.7
        (dict(temperature=1.0, top_p=0.5), {0}),
        (dict(temperature=1.0, min_p=0.4), {0, 1}),  # keep p >= 0.2
        (dict(temperature=1.0, top_k=3, top_p=0.9), {0, 1, 2}),
        (dict(temperature=1.0), {0, 1, 2, 3}),
    ],
)
def test_filters_never_emit_tokens_outside_their_set(options, allowed):
    drawn = _draw(2000, **options)
    assert set(drawn.tolist()) == allowed


def test_temperature_sampling_follows_the_distribution():
    for temperature in (1.0, 0.5):
        drawn = _draw(4000, temperature=temperature)
        expected = PROBS ** (1 / temperature)
        expected /= expected.sum()
        freq = np.bincount(drawn, minlength=4) / len(drawn)
        assert np.abs(freq - expected).max() < 0.03, (temperature, freq, expected)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    ids = rng.integers(0, 50, size=(3, 12))
    seen = np.zeros((3, 50), bool)
    np.put_along_axis(seen, ids, True, axis=1)
    ours = apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen),
                                    jnp.full((3,), 1.3))
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), torch.tensor(logits))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)


def test_repetition_penalty_generation_matches_transformers(gqa_model):
    model, torch_model = gqa_model
    prompt = [5, 9, 9, 17, 5, 40]
    (out,) = jaxinfer.generate(model, [prompt], max_new_tokens=16, repetition_penalty=1.5,
                               ignore_eos=True)
    with torch.no_grad():
        ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt):].tolist() and len(out.token_ids) == 16
    (plain,) = jaxinfer.generate(model, [prompt], max_new_tokens=16)
    assert plain.token_ids != out.token_ids


def test_top_k_one_equals_greedy(gqa_model):
    model, _ = gqa_model
    prompt = [3, 14, 15, 92, 65]
    (greedy,) = jaxinfer.generate(model, [prompt], max_new_tokens=12)
    (topk1,) = jaxinfer.generate(model, [prompt], max_new_tokens=12, temperature=1.5, top_k=1,
                                 seed=1)
    assert topk1.token_ids == greedy.token_ids


def test_seeds_reproduce_and_differ(gqa_model):
    model, _ = gqa_model
    prompt = [3, 14, 15]
    opts = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    a = jaxinfer.generate(model, [prompt], seed=5, **opts)[0].token_ids
    b = jaxinfer.generate(model, [prompt], seed=5, **opts)[0].token_ids
    c = jaxinfer.generate(model, [prompt], seed=6, **opts)[0].token_ids
    assert a == b and len(a) == len(c) == 24
    assert a != c


def test_options_are_per_sequence_in_one_batch(gqa_model):
    model, _ = gqa_model
    prompts = [[3, 14, 15], [9, 26, 53, 58], [97, 93], [23, 84, 62, 64, 33]]
    params = [
        SamplingParams(max_new_tokens=10),
        SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.8, seed=7),
        SamplingParams(max_new_tokens=9, temperature=1.2, top_k=5, min_p=0.05, seed=8,
                       repetition_penalty=1.2),
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=9, logprobs=True),
    ]
    together = jaxinfer.generate(model, prompts, sampling=params)
    for prompt, p, got in zip(prompts, params, together, strict=True):
        (alone,) = jaxinfer.generate(model, [prompt], sampling=p)
        assert got.token_ids == alone.token_ids


def test_logprobs_are_the_models_log_softmax(gqa_model):
    model, _ = gqa_model
    prompt = [3, 14, 15, 92]
    (out,) = jaxinfer.generate(model, [prompt], max_new_tokens=6, temperature=1.0, seed=3,
                               logprobs=True, ignore_eos=True)
    assert len(out.token_ids) == 6
    full = prompt + out.token_ids
    logits = jaxinfer.compute_logits(model, full)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(out.token_ids)]
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)
    (no_lp,) = jaxinfer.generate(model, [prompt], max_new_tokens=6)
    assert no_lp.logprobs is None


def test_stop_token_ids_and_max_new_tokens(gqa_model):
    model, _ = gqa_model
    prompt = [3, 14, 15, 92]
    (free,) = jaxinfer.generate(model, [prompt], max_new_tokens=10, ignore_eos=True)
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    (stopped,) = jaxinfer.generate(model, [prompt], max_new_tokens=10, stop_token_ids=[stop_at],
                                   ignore_eos=True)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first]
    (short,) = jaxinfer.generate(model, [prompt], max_new_tokens=3, ignore_eos=True)
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"


def test_timings_are_reported(gqa_model):
    model, _ = gqa_model
    (out,) = jaxinfer.generate(model, [[3, 4, 5]], max_new_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5
    assert out.time_to_first_token > 0
    assert out.time_per_output_token > 0  # the later tokens came from a later device call


def test_request_keys_are_jax_keys_of_their_seed():
    import jax

    from jaxinfer.sampling import prng_key_data

    for seed in (0, 7, 2**31 + 3, 2**32 - 1):  # 32-bit seeds: exactly jax.random.PRNGKey's
        want = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        np.testing.assert_array_equal(prng_key_data(seed), want)
    assert not np.array_equal(prng_key_data(5), prng_key_data(5 + 2**32))  # 63-bit seeds differ


def test_greedy_sampler_equals_the_stochastic_one_on_greedy_rows():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    seen = jnp.asarray(rng.random((6, 50)) < 0.2)
    counts = seen.astype(jnp.int32)  # in the prompt: what the repetition penalty reads
    steps = jnp.arange(6, dtype=jnp.int32)
    greedy_rows = [SamplingParams(seed=i, repetition_penalty=1.5) for i in range(6)]
    mixed_rows = [SamplingParams(seed=i, temperature=[0, 1.5][i % 2], repetition_penalty=1.5)
                  for i in range(6)]
    fast, fast_lp, *_ = sample(logits, SamplingArrays.from_params(greedy_rows), counts, steps,
                               False)
    full, full_lp, *_ = sample(logits, SamplingArrays.from_params(greedy_rows), counts, steps,
                               True)
    mixed, *_ = sample(logits, SamplingArrays.from_params(mixed_rows), counts, steps, True)
    want = np.argmax(apply_repetition_penalty(logits, seen, jnp.full(6, 1.5)), axis=-1)
    np.testing.assert_array_equal(fast, want)
    np.testing.assert_array_equal(full, want)
    np.testing.assert_array_equal(np.asarray(mixed)[::2], want[::2])
    np.testing.assert_array_equal(fast_lp, full_lp)


def test_penalties_follow_the_openai_formula():
    rng = np.random.default_rng(1)
    b, v = 5, 40
    logits = rng.normal(size=(b, v)).astype(np.float32)
    in_prompt = rng.random((b, v)) < 0.3
    generated = rng.integers(0, 4, size=(b, v)) * (rng.random((b, v)) < 0.4)
    counts = (2 * generated + in_prompt).astype(np.int32)  # the engine's token-count table
    rows = [SamplingParams(presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp)
            for pp, fp, rp in ((0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, 2.0, 1.0),
                               (-0.7, 1.3, 1.0), (0.5, -2.0, 1.4))]
    s = SamplingArrays.from_params(rows)
    ours = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), s))
    want = logits.copy()
    for i, sp in enumerate(rows):
        seen = in_prompt[i] | (generated[i] > 0)  # HF's penalty: prompt and output
        row = np.where(want[i] > 0, want[i] / sp.repetition_penalty,
                       want[i] * sp.repetition_penalty)
        want[i] = np.where(seen, row, want[i])
        # OpenAI: output tokens only, c[j] = times j was generated.
        want[i] -= sp.presence_penalty * (generated[i] > 0) + sp.frequency_penalty * generated[i]
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ours[0], logits[0])  # defaults change nothing
    tokens, *_ = sample(jnp.asarray(logits), s, jnp.asarray(counts), jnp.arange(b), False)
    np.testing.assert_array_equal(tokens, want.argmax(-1))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("presence, frequency", [(0.6, 1.5), (-0.5, -1.0)])
def test_penalised_greedy_generation_equals_a_reference_loop(gqa_model, presence, frequency):
    """Through the engine (first token in a mixed step, the rest in decode loops) against a
    host loop over compute_logits that applies OpenAI's formula to the generated tokens."""
    model, _ = gqa_model
    prompt = [5, 9, 9, 17, 5, 40, 9]  # repeated prompt tokens are not penalised
    (out,) = jaxinfer.generate(model, [prompt], max_new_tokens=14, ignore_eos=True,
                               presence_penalty=presence, frequency_penalty=frequency)
    want: list[int] = []
    for _ in range(14):
        logits = jaxinfer.compute_logits(model, prompt + want)[-1]
        c = np.bincount(np.asarray(want, int), minlength=len(logits))
        want.append(int(np.argmax(logits - presence * (c > 0) - frequency * c)))
    assert out.token_ids == want
    if frequency > 0:  # a big penalty spreads the output over more distinct tokens
        (plain,) = jaxinfer.generate(model, [prompt], max_new_tokens=14, ignore_eos=True)
        assert len(set(out.token_ids)) > len(set(plain.token_ids))


def test_top_logprobs_are_the_models_most_likely_tokens(gqa_model):
    model, _ = gqa_model
    prompt = [3, 14, 15, 92]
    outs = jaxinfer.generate(model, [prompt] * 2, sampling=[
        SamplingParams(max_new_tokens=7, logprobs=True, top_logprobs=5, ignore_eos=True),
        SamplingParams(max_new_tokens=7, logprobs=True, top_logprobs=20, ignore_eos=True,
                       temperature=1.0, seed=4, frequency_penalty=1.0)])
    for out, k in zip(outs, (5, 20), strict=True):
        assert len(out.top_logprobs) == len(out.token_ids) == 7
        ref = _log_softmax(jaxinfer.compute_logits(model, prompt + out.token_ids))
        for i, (tok, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
            row = ref[len(prompt) - 1 + i]  # the raw distribution, before penalties/sampling
            ids, values = list(top), np.array(list(top.values()))
            assert len(set(ids)) == k and np.all(np.diff(values) <= 0)  # most likely first
            np.testing.assert_allclose(values, row[ids], atol=1e-4)  # each token's logprob
            np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=1e-4)  # the top k
            if out is outs[0]:  # greedy: the chosen token is the most likely one
                assert next(iter(top)) == tok and top[tok] == pytest.approx(out.logprobs[i])
    (plain,) = jaxinfer.generate(model, [prompt], max_new_tokens=3)
    assert plain.top_logprobs is None
