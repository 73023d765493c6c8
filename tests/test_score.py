"""``jaxinfer.score`` / ``score_rolling`` through the engine: equal to a direct computation
from ``compute_logits``, shared contexts served by the prefix cache, one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.requests import Model
from tests.conftest import tiny_engine_model


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_engine_model(context=96, seed=1)


def direct(model: Model, ctx: list[int], cont: list[int]) -> tuple[np.ndarray, bool]:
    """Per-token logprobs of ``cont`` and its greedy flag from one full forward pass."""
    logits = jaxinfer.compute_logits(model, ctx + cont).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return logp[rows, cont], bool(np.all(logits[rows].argmax(-1) == cont))


def test_score_equals_direct_and_shares_contexts(model):
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 128, size=n).tolist() for n in (1, 5, 37)]
    pairs = [(c, rng.integers(3, 128, size=int(k)).tolist()) for c in contexts
             for k in rng.integers(1, 9, size=4)]
    greedy_cont = []  # a continuation that is the model's own greedy output
    for _ in range(4):
        greedy_cont.append(int(np.argmax(jaxinfer.compute_logits(
            model, contexts[2] + greedy_cont)[-1])))
    pairs.append((contexts[2], greedy_cont))
    results = jaxinfer.score(model, pairs)
    for (ctx, cont), r in zip(pairs, results, strict=True):
        want, greedy = direct(model, ctx, cont)
        np.testing.assert_allclose(r.token_logprobs, want, atol=1e-4)
        assert r.logprob == pytest.approx(float(want.sum()), abs=1e-3)
        assert r.greedy == greedy
        assert (r.context_token_ids, r.continuation_token_ids) == (ctx, cont)
    assert results[-1].greedy
    # The 37-token context spans 2 full 16-token pages: later continuations map them.
    assert max(r.cached_tokens for r in results[8:12]) == 32


def test_score_rolling_equals_window_sums(model):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 128, size=150).tolist()  # longer than the 96-token context
    r = jaxinfer.score_rolling(model, ids, max_length=64, stride=24)
    assert len(r.token_logprobs) == len(ids) - 1
    # Window 1 scores tokens 1..63 with everything before; later ones keep 40 tokens of context.
    want = list(direct(model, ids[:1], ids[1:64])[0])
    end = 64
    while end < len(ids):
        new_end = min(len(ids), end + 24)
        begin = max(0, new_end - 64)
        want += list(direct(model, ids[begin:end], ids[end:new_end])[0])
        end = new_end
    np.testing.assert_allclose(r.token_logprobs, want, atol=1e-4)
    ppl = np.exp(-r.logprob / len(r.token_logprobs))
    assert 1 < ppl < 10 * model.config.vocab_size


def test_score_bad_input_is_one_line_error(model):
    with pytest.raises(InputError, match="pair"):
        jaxinfer.score(model, [[1, 2, 3]])
    with pytest.raises(InputError, match="no .context, continuation. pairs"):
        jaxinfer.score(model, [])
    with pytest.raises(InputError, match="context of 96"):
        jaxinfer.score(model, [(list(range(3, 90)), list(range(3, 20)))])
    with pytest.raises(InputError, match="stride"):
        jaxinfer.score_rolling(model, list(range(3, 50)), max_length=32, stride=32)
    # 0 is refused, not read as "the default"; a float or bool is no token count.
    for kwargs, why in (({"max_length": 0}, r"max_length=0 must be in \[2, 96\]"),
                        ({"stride": 0}, r"stride=0 must be in \[1, max_length=96\)"),
                        ({"max_length": 64.0}, "max_length=64.0 must be a whole number"),
                        ({"stride": True}, "stride=True must be a whole number")):
        with pytest.raises(InputError, match=why):
            jaxinfer.score_rolling(model, list(range(3, 50)), **kwargs)
    with pytest.raises(InputError, match="vocabulary"):
        jaxinfer.score(model, [([3, 4], [500])])
