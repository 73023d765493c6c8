"""Speculative decoding: proposals, exact verification in the engine, and its counters.

Verification must emit exactly the tokens plain decoding emits. To exercise every acceptance
pattern (all accepted, a rejection at each position, the bonus token) on random tiny models,
whose outputs rarely repeat their prompts, most engine tests replace the n-gram proposer with
an oracle that proposes the plain run's own continuation, corrupted at chosen positions.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import engine as engine_module
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from jaxinfer.runner import accepted_lengths
from jaxinfer.speculative import Speculative, propose_ngram
from tests.conftest import LetterTokenizer, tiny_engine_model

SPEC = Speculative(num_tokens=4, adaptive=False)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    #                 0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    # suffix (2, 3) last occurred at 5..6, followed by 7, 8, 2, 3
    assert propose_ngram(tokens, 3, ngram_max=2, ngram_min=1) == [7, 8, 2]
    # the 3-gram (8, 2, 3) never occurred before; the 2-gram did
    assert propose_ngram(tokens, 9, ngram_max=3, ngram_min=2) == [7, 8, 2, 3]
    assert propose_ngram([4, 5, 6], 2, ngram_max=2, ngram_min=1) == []
    assert propose_ngram([4], 2, ngram_max=2, ngram_min=1) == []
    # a match at the end proposes only the tokens that exist
    assert propose_ngram([5, 6, 5], 4, ngram_max=1, ngram_min=1) == [6, 5]


def test_accepted_lengths_is_the_matching_prefix_within_the_proposals():
    samples = jnp.array([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4], [7, 2, 3, 4]])
    proposals = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    counts = jnp.array([3, 3, 2, 3])
    assert accepted_lengths(samples, proposals, counts).tolist() == [3, 1, 2, 0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="eagle"), "method='eagle' must be one of ngram"),
    (dict(num_tokens=0), "num_tokens=0 must be an integer in [1, 16]"),
    (dict(num_tokens=2.0), "num_tokens=2.0 must be an integer"),
    (dict(ngram_min=3, ngram_max=2), "ngram_min=3 must be <= ngram_max=2"),
    (dict(adaptive="yes"), "adaptive='yes' must be True or False"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(InputError, match="^speculative .*") as e:
        Speculative(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sampling_params_take_only_a_speculative():
    with pytest.raises(InputError, match="speculative='ngram' must be a jaxinfer.Speculative"):
        jaxinfer.SamplingParams(speculative="ngram")


def _model():
    return dataclasses.replace(tiny_engine_model(), tokenizer=LetterTokenizer())


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(3, 30)), [10, 11, 10, 11, 10], [40]]


def _plain(model, options, **engine_kwargs):
    e = Engine(model, verbose=False, **engine_kwargs)
    ids = [e.submit(p, **options, seed=i) for i, p in enumerate(PROMPTS)]
    return e.run(ids)


def _oracle(plain, corrupt_every):
    """A proposer that knows each prompt's plain continuation; every ``corrupt_every``-th
    proposed position (counted over the call) is replaced by a wrong token."""
    continuation = {tuple(p): r.token_ids for p, r in zip(PROMPTS, plain, strict=True)}
    calls = [0]

    def propose(tokens, k, ngram_max, ngram_min):
        for prompt, cont in continuation.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                out = list(cont[done: done + k]) + [3] * k  # past the end: any tokens
                out = out[:k]
                for j in range(k):
                    calls[0] += 1
                    if corrupt_every and calls[0] % corrupt_every == 0:
                        out[j] = (out[j] + 1) % 128
                return out
        raise AssertionError("unknown sequence")

    return propose


@pytest.mark.parametrize("options", [
    dict(max_new_tokens=24, temperature=0.0, logprobs=True),
    dict(max_new_tokens=24, temperature=0.9, top_k=20, logprobs=True),
    dict(max_new_tokens=24, temperature=1.1, repetition_penalty=1.4, logprobs=True),
    dict(max_new_tokens=30, temperature=0.0, stop=["jj"], stop_token_ids=[17, 23]),
], ids=["greedy", "sampled", "repetition_penalty", "stops"])
@pytest.mark.parametrize("corrupt_every", [0, 3, 7])
def test_verification_emits_exactly_the_plain_tokens(monkeypatch, options, corrupt_every):
    model = _model()
    plain = _plain(model, options)
    monkeypatch.setattr(engine_module, "propose_ngram", _oracle(plain, corrupt_every))
    e = Engine(model, verbose=False)
    ids = [e.submit(p, **options, seed=i, speculative=SPEC) for i, p in enumerate(PROMPTS)]
    spec = e.run(ids)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason and b.text == a.text
        if options.get("logprobs"):
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
    stats = e.stats()
    assert stats.verify_steps > 0 and stats.draft_tokens == sum(r.draft_tokens for r in spec)
    assert stats.accepted_tokens == sum(r.accepted_tokens for r in spec)
    if corrupt_every == 0:  # the oracle is right: every proposal inside the output is taken
        assert stats.acceptance_rate > 0.6
        assert stats.mean_accepted_length > 2
    else:
        assert 0 < stats.acceptance_rate < 1
    e.blocks.check_all_free()


def test_verification_with_preemption_and_a_small_pool(monkeypatch):
    model = _model()
    options = dict(max_new_tokens=30, temperature=0.8)
    sizing = dict(num_pages=16, page_size=4, max_batch=4)
    plain = _plain(model, options, **sizing)
    monkeypatch.setattr(engine_module, "propose_ngram", _oracle(plain, 5))
    e = Engine(model, verbose=False, **sizing)
    ids = [e.submit(p, **options, seed=i, speculative=SPEC) for i, p in enumerate(PROMPTS)]
    spec = e.run(ids)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert e.stats().num_preemptions > 0 and e.stats().verify_steps > 0
    e.blocks.check_all_free()


def test_ngram_speculation_end_to_end_matches_generate():
    """The real proposer, on a model whose greedy continuation falls into a loop."""
    model = dataclasses.replace(tiny_engine_model(seed=2), tokenizer=LetterTokenizer())
    prompt = [40, 41, 42] * 8
    plain = jaxinfer.generate(model, prompt, max_new_tokens=32, ignore_eos=True)[0]
    e = Engine(model, verbose=False)
    spec = e.run([e.submit(prompt, max_new_tokens=32, ignore_eos=True, speculative=SPEC)])[0]
    assert spec.token_ids == plain.token_ids
    assert spec.accepted_tokens > 10 and e.stats().mean_accepted_length > 2


def test_adaptive_speculation_measures_both_step_kinds():
    model = _model()
    prompt = [5, 6, 5, 6, 5, 6, 5]
    plain = jaxinfer.generate(model, [prompt] * 2, max_new_tokens=48, ignore_eos=True)
    e = Engine(model, verbose=False)
    spec = Speculative(num_tokens=3)  # adaptive
    ids = [e.submit(prompt, max_new_tokens=48, speculative=spec, ignore_eos=True)
           for _ in range(2)]
    assert [r.token_ids for r in e.run(ids)] == [r.token_ids for r in plain]
    stats = e.stats()
    # verify is tried first, then a decode call is measured, then the faster one runs
    assert stats.verify_steps >= 1 and stats.decode_calls >= 1
