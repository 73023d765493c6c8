"""Speculative decoding: proposals, exact verification in the engine, and its counters.

Verification must emit exactly the tokens plain decoding emits. To exercise every acceptance
pattern (all accepted, a rejection at each position, the bonus token) on random tiny models,
whose outputs rarely repeat their prompts, the host-path tests replace the host's n-gram
proposer with an oracle that proposes the plain run's own continuation, corrupted at chosen
positions. Requests asking for top log-probabilities verify through host-built steps
(``runner.verify_step``); the others run the device loop (``runner.ngram_steps``), tested
with the real proposer on prompts and models whose outputs repeat.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import engine as engine_module
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from jaxinfer.quantize import quantize_params
from jaxinfer.runner import accepted_lengths
from jaxinfer.speculative import NGRAM_WINDOW, Speculative, propose_ngram, propose_ngram_rows
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
    # only the last NGRAM_WINDOW tokens are searched
    inside = [7, 8] + [1] * (NGRAM_WINDOW - 3) + [7]  # NGRAM_WINDOW tokens
    assert propose_ngram(inside, 2, ngram_max=1, ngram_min=1) == [8, 1]
    assert propose_ngram([7, *inside[1:-1], 1, 7], 2, ngram_max=1, ngram_min=1) == []


def test_device_ngram_proposals_equal_the_host_reference():
    """``propose_ngram_rows`` (the device loop's proposer) against ``propose_ngram`` on
    random rows over a 4-token vocabulary (many matches), with per-row settings."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        b, n_hist = 6, 40
        history = np.full((b, n_hist), -1, np.int32)
        length = rng.integers(0, n_hist + 1, b)
        k = rng.integers(0, 6, b)
        n_max = rng.integers(1, 4, b)
        n_min = np.minimum(rng.integers(1, 4, b), n_max)
        for r in range(b):
            history[r, : length[r]] = rng.integers(0, 4, length[r])
        got, num = propose_ngram_rows(jnp.asarray(history), jnp.asarray(length),
                                      jnp.asarray(k), jnp.asarray(n_max), jnp.asarray(n_min),
                                      width=5, longest=3)
        for r in range(b):
            want = propose_ngram(history[r, : length[r]], int(k[r]), int(n_max[r]),
                                 int(n_min[r]))[: k[r]]
            assert np.asarray(got[r, : num[r]]).tolist() == want


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
    (dict(method="draft"), "method='draft' needs a draft model"),
    (dict(draft=object()), "method='ngram' takes no draft model"),
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
# One pool shape and slot count for every engine here: they share their compiled programs
# (compiling, not running, is what these tests spend their time on). 256 tokens: the
# preemption tests overflow it.
SIZING = dict(num_pages=16, max_batch=4)


def _plain(model, options, prompts=PROMPTS, **engine_kwargs):
    e = Engine(model, verbose=False, **{**SIZING, **engine_kwargs})
    ids = [e.submit(p, **options, seed=i) for i, p in enumerate(prompts)]
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
@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_verification_emits_exactly_the_plain_tokens(monkeypatch, options, corrupt_every):
    model = _model()
    options = {**options, "top_logprobs": 2}  # the host-built verify steps
    plain = _plain(model, options)
    monkeypatch.setattr(engine_module, "propose_ngram", _oracle(plain, corrupt_every))
    e = Engine(model, verbose=False, **SIZING)
    ids = [e.submit(p, **options, seed=i, speculative=SPEC) for i, p in enumerate(PROMPTS)]
    spec = e.run(ids)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason and b.text == a.text
        if options.get("logprobs"):
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        assert [sorted(t) for t in b.top_logprobs] == [sorted(t) for t in a.top_logprobs]
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
    # Overflows the pool; top log-probabilities: the host-built verify steps.
    options = dict(max_new_tokens=60, temperature=0.8, ignore_eos=True, top_logprobs=1)
    plain = _plain(model, options)
    monkeypatch.setattr(engine_module, "propose_ngram", _oracle(plain, 5))
    e = Engine(model, verbose=False, **SIZING)
    ids = [e.submit(p, **options, seed=i, speculative=SPEC) for i, p in enumerate(PROMPTS)]
    spec = e.run(ids)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert e.stats().num_preemptions > 0 and e.stats().verify_steps > 0
    e.blocks.check_all_free()


REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 10, 11, 10, 11, 10], [40, 41, 42] * 5, [40]]


@pytest.mark.parametrize("options", [
    dict(max_new_tokens=24, temperature=0.0, logprobs=True),
    dict(max_new_tokens=24, temperature=0.9, top_k=20, logprobs=True),
    dict(max_new_tokens=24, temperature=1.1, repetition_penalty=1.4, presence_penalty=0.3,
         logprobs=True),
    dict(max_new_tokens=30, temperature=0.0, stop=["jj"], stop_token_ids=[17, 23]),
], ids=["greedy", "sampled", "penalties", "stops"])
@pytest.mark.parametrize("seed", [2, 5])
def test_device_ngram_loop_emits_exactly_the_plain_tokens(options, seed):
    """The device loop with the real proposer: models that fall into loops accept runs of
    proposals, the others reject them at various positions; stop tokens and strings inside an
    accepted run end the request where plain decoding ends it."""
    model = dataclasses.replace(tiny_engine_model(seed=seed), tokenizer=LetterTokenizer())
    plain = _plain(model, options, REPEATING)
    e = Engine(model, verbose=False, **SIZING)
    spec = e.run([e.submit(p, **options, seed=i, speculative=SPEC)
                  for i, p in enumerate(REPEATING)])
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason and b.text == a.text
        if options.get("logprobs"):
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
    stats = e.stats()
    assert stats.verify_steps > 0 and stats.decode_calls == 0  # only the n-gram loop ran
    assert stats.draft_tokens == sum(r.draft_tokens for r in spec) > 0
    assert stats.accepted_tokens == sum(r.accepted_tokens for r in spec)
    assert stats.accepted_tokens < stats.draft_tokens  # rejections
    if options["temperature"] == 0:  # and accepted runs (penalties discourage repeats)
        assert stats.accepted_tokens > 0
    e.blocks.check_all_free()


def test_device_ngram_loop_with_preemption_and_mixed_rows():
    """A small pool preempts speculating rows mid-run; a request without speculation shares
    the loop's calls (it decodes one token per iteration)."""
    model = dataclasses.replace(tiny_engine_model(seed=2), tokenizer=LetterTokenizer())
    options = dict(max_new_tokens=60, temperature=0.8, ignore_eos=True)
    plain = _plain(model, options, REPEATING)
    e = Engine(model, verbose=False, **SIZING)
    spec = e.run([e.submit(p, **options, seed=i, speculative=None if i == 1 else SPEC)
                  for i, p in enumerate(REPEATING)])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[1].draft_tokens == 0
    assert e.stats().num_preemptions > 0 and e.stats().verify_steps > 0
    e.blocks.check_all_free()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_loops_fill_max_seq_len_exactly(method):
    """Requests whose prompt and max_new_tokens fill the engine's max_seq_len: the loops
    propose fewer tokens near the end and write no K/V past the reserved positions."""
    model = dataclasses.replace(tiny_engine_model(seed=2), tokenizer=LetterTokenizer())
    prompts = [[40, 41, 42] * 7, [10, 11] * 9, [5, 6, 7, 8] * 4]
    kw = dict(num_pages=16, max_batch=4, page_size=4, max_seq_len=48, verbose=False)
    options = [dict(max_new_tokens=48 - len(p), ignore_eos=True) for p in prompts]
    e = Engine(model, **kw)
    plain = e.run([e.submit(p, **o) for p, o in zip(prompts, options, strict=True)])
    spec = Speculative(num_tokens=4, adaptive=False, method=method,
                       draft=model if method == "draft" else None)
    e = Engine(model, **kw)
    out = e.run([e.submit(p, **o, speculative=spec)
                 for p, o in zip(prompts, options, strict=True)])
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert all(len(p) + len(r.token_ids) == 48 for p, r in zip(prompts, out, strict=True))
    assert e.stats().verify_steps > 0 and e.stats().accepted_tokens > 0
    e.blocks.check_all_free()


def test_ngram_speculation_end_to_end_matches_generate():
    """The real proposer, on a model whose greedy continuation falls into a loop."""
    model = dataclasses.replace(tiny_engine_model(seed=2), tokenizer=LetterTokenizer())
    prompts = [[40, 41, 42] * 8, [40, 41, 42] * 7]
    plain = _plain(model, dict(max_new_tokens=32, ignore_eos=True), prompts)
    e = Engine(model, verbose=False, **SIZING)
    spec = e.run([e.submit(p, max_new_tokens=32, ignore_eos=True, speculative=SPEC)
                  for p in prompts])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[0].accepted_tokens > 10 and e.stats().mean_accepted_length > 2


def test_adaptive_speculation_measures_both_step_kinds():
    model = _model()
    prompt = [5, 6, 5, 6, 5, 6, 5]
    plain = _plain(model, dict(max_new_tokens=48, ignore_eos=True), [prompt] * 2)
    # run() decodes whole calls of decode_steps: 8 leaves room for both kinds of call
    e = Engine(model, verbose=False, decode_steps=8, **SIZING)
    spec = Speculative(num_tokens=4)  # adaptive
    ids = [e.submit(prompt, max_new_tokens=48, speculative=spec, ignore_eos=True)
           for _ in range(2)]
    assert [r.token_ids for r in e.run(ids)] == [r.token_ids for r in plain]
    stats = e.stats()
    # verify is tried first, then a decode call is measured, then the faster one runs
    assert stats.verify_steps >= 1 and stats.decode_calls >= 1


# ---------------------------------------------------------------- draft-model speculation
def _draft_run(model, draft, options, prompts=PROMPTS, adaptive=False):
    e = Engine(model, verbose=False, **SIZING)
    spec = Speculative(method="draft", draft=draft, num_tokens=4, adaptive=adaptive)
    return e, e.run([e.submit(p, **options, seed=i, speculative=spec)
                     for i, p in enumerate(prompts)])


@pytest.mark.parametrize("top", [0, 2], ids=["loop", "verify_steps"])
@pytest.mark.parametrize("kind", ["self", "random"])
def test_draft_model_greedy_output_equals_plain(kind, top):
    """Stop strings, stop ids and max_new_tokens end the requests; the draft catches up
    on the prompts (one of them shared through the prefix cache) before it proposes. A
    draft that is the target accepts every proposal: its K/V were right. Without top
    log-probabilities the device loop runs (``runner.draft_steps``), with them one verify
    step per round trip after ``runner.draft_step``."""
    model = _model()
    options = dict(max_new_tokens=30, temperature=0.0, stop=["jj"], stop_token_ids=[17, 23],
                   logprobs=True, top_logprobs=top)
    prompts = [*PROMPTS, list(range(3, 30))]  # admitted later: a prefix-cache hit
    plain = _plain(model, options, prompts, **SIZING)
    draft = model if kind == "self" else tiny_engine_model(seed=3)  # same shapes: programs
    e, spec = _draft_run(model, draft, options, prompts)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason and b.text == a.text
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
    assert {r.finish_reason for r in plain} == {"stop", "length"}
    stats = e.stats()
    assert stats.draft_tokens == sum(r.draft_tokens for r in spec) > 0
    assert stats.accepted_tokens == sum(r.accepted_tokens for r in spec)
    assert stats.verify_steps > 0
    assert (stats.draft_seconds > 0) == bool(top)  # verify steps time their drafts
    assert top or stats.decode_calls == 0  # the loop speculates from the first call
    if kind == "self":
        assert stats.acceptance_rate == 1.0
    e.blocks.check_all_free()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_compiles_nothing_after_warmup(method):
    """``warmup(speculative=...)`` compiles every program a speculating request runs:
    steps take their inputs as host arrays, and a program traced for device arrays would
    compile again on the first request (tens of seconds for an 8B model on a GPU)."""
    from jaxinfer import runner

    if method == "draft":
        model, prompts = _model(), PROMPTS
        spec = Speculative(method="draft", draft=tiny_engine_model(seed=3), num_tokens=4,
                           adaptive=False)
        programs = (runner.mixed_step, runner.decode_steps, runner.draft_steps,
                    runner.draft_step)
    else:
        model = dataclasses.replace(tiny_engine_model(seed=2), tokenizer=LetterTokenizer())
        prompts, spec = REPEATING, SPEC
        programs = (runner.mixed_step, runner.decode_steps, runner.ngram_steps)
    e = Engine(model, verbose=False, **SIZING)
    e.warmup(speculative=spec)
    sizes = [f._cache_size() for f in programs]
    warm = e.stats().num_programs
    e.run([e.submit(p, max_new_tokens=40, speculative=spec, seed=i)
           for i, p in enumerate(prompts)])
    assert e.stats().verify_steps > 0
    assert e.stats().num_programs == warm
    assert [f._cache_size() for f in programs] == sizes


@pytest.mark.slow
def test_int4_draft_sampled_output_equals_plain_with_preemption():
    """The target's int4 copy drafts for seeded sampling through a small pool: preempted
    sequences restart their draft's K/V."""
    model = _model()
    options = dict(max_new_tokens=60, temperature=0.8, top_k=30, ignore_eos=True)
    plain = _plain(model, options)
    int4 = dataclasses.replace(model, params=quantize_params(model.params, "int4"))
    e, spec = _draft_run(model, int4, options)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = e.stats()
    assert stats.num_preemptions > 0 and stats.verify_steps > 0
    assert 0 < stats.acceptance_rate < 1  # greedy proposals against sampled tokens
    e.blocks.check_all_free()


def test_adaptive_draft_speculation_tries_both_step_kinds():
    """Adaptive mode tries the draft loop and a decode call (the loop's first call is
    measured after ``warmup`` compiled it), then runs the faster; after a decode call the
    draft catches up on its tokens."""
    model = _model()
    prompts = [[5, 6, 5, 6, 5, 6, 5]] * 2
    options = dict(max_new_tokens=120, ignore_eos=True)
    plain = _plain(model, options, prompts, **SIZING)
    e = Engine(model, verbose=False, decode_steps=8, **SIZING)  # several calls in run()
    spec = Speculative(method="draft", draft=model, num_tokens=4)
    e.warmup(speculative=spec)
    out = e.run([e.submit(p, **options, seed=i, speculative=spec)
                 for i, p in enumerate(prompts)])
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert e.stats().verify_steps >= 1 and e.stats().decode_calls >= 1


def test_draft_loop_runs_in_the_drafts_row_bucket(monkeypatch):
    """A draft whose every matmul takes one row (an int4 copy, on a GPU; faked here through
    ``_few_rows``, since on this CPU every model keeps two) runs the draft loop of a lone
    request in a one-row call, compiled by ``warmup``, while the target's decode calls keep
    two rows (``Engine.draft_row_buckets``): the same greedy tokens. Adaptive mode weighs
    the one-row loop against the two-row decode calls, and a new draft starts unmeasured."""
    model, draft = _model(), tiny_engine_model(seed=3)
    monkeypatch.setattr(Engine, "_few_rows",
                        lambda self, *models: (1, 2, 4) if models[0] is draft else (2,))
    options = dict(max_new_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 5, 6, 5, 6, 5]]
    plain = _plain(model, options, prompts, **SIZING)
    e = Engine(model, verbose=False, **SIZING)
    spec = Speculative(method="draft", draft=draft, num_tokens=4)
    e.warmup(speculative=spec)
    assert e.row_buckets[0] == 2 and e.draft_row_buckets[:3] == (1, 2, 4)
    warm = e.stats().num_programs
    out = e.run([e.submit(p, **options, speculative=spec) for p in prompts])
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert set(e._loop_gain["draft"]) == {1} and e.stats().verify_steps > 0
    assert e.stats().num_programs == warm  # warmup compiled the one-row loop
    e.blocks.check_all_free()
    # 3 tokens per row and 10 ms per iteration in one row, against decode calls of two rows
    e._loop_s["draft"][1], e._loop_gain["draft"][1] = 0.010, 3.0
    e._iteration_s[2] = 0.005  # 200 tokens/s: the loop's 300 win
    assert e._loop_pays("draft", 1, 2)
    e._iteration_s[2] = 0.002  # 500 tokens/s: the decode call wins
    assert not e._loop_pays("draft", 1, 2)
    e.warmup(speculative=dataclasses.replace(spec, draft=model))  # another draft: unmeasured
    assert not e._loop_s.get("draft") and not e._loop_gain.get("draft")


def test_draft_model_must_share_the_vocabulary_and_engine_stays_idle():
    model = _model()
    cfg = dataclasses.replace(model.config, vocab_size=96)
    other = jaxinfer.Model(config=cfg, params=model.params, tokenizer=None, dtype=jnp.float32,
                           backend="reference")
    e = Engine(model, verbose=False, **SIZING)
    spec = Speculative(method="draft", draft=other)
    with pytest.raises(InputError, match="^the draft model's vocabulary has 96 tokens but the "
                       "target's has 128; a draft must use the target's tokenizer$"):
        e.submit([5, 6, 7], speculative=spec)
    with pytest.raises(InputError, match="draft must be a jaxinfer.Model"):
        e.submit([5, 6, 7], speculative=Speculative(method="draft", draft="tiny"))
    assert not e.has_unfinished() and e.stats().num_programs == 0


def test_a_draft_shares_the_pool_budget_and_attaches_to_an_idle_engine():
    model = _model()
    e = Engine(model, verbose=False, kv_cache_bytes=2**20)
    pages, old_pool = e.num_pages, e.pool
    e.submit([5, 6, 7], speculative=Speculative(method="draft", draft=model))
    assert e.num_pages == pages // 2  # the same bytes per page for both pools
    # The old pool was freed before the new pools were made: two at once do not fit a device.
    assert all(x.is_deleted() for x in jax.tree.leaves(old_pool))
    other = dataclasses.replace(model)
    with pytest.raises(InputError, match="attaches a new draft model only while idle"):
        e.submit([5, 6, 7], speculative=Speculative(method="draft", draft=other))


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "draft"], "--speculative draft needs --draft-model M"),
    (["--draft-model", "smollm2-135m-instruct"], "--speculative draft needs --draft-model M"),
    (["--speculative", "ngram", "--draft-quantize", "int4"], "--draft-quantize needs"),
    (["--speculative", "draft", "--draft-model", "no-such-draft", "--tp", "2"],
     "--speculative draft runs on one device"),
    (["--speculative", "draft", "--draft-model", "no-such-draft", "--dp", "2"],
     "--speculative draft runs on one device"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
])
def test_cli_draft_flags_are_checked_before_loading(capsys, flags, message):
    from jaxinfer import cli

    assert cli.main(["generate", "--prompt", "hi", "--model", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer: error: ") and message in err and err.count("\n") == 1
