"""Structured output (``response_format``): validation, grammar-exact outputs, EOS and
finish reasons, and unconstrained requests unaffected by constrained ones in the same engine.

Most tests run a tiny random model with a byte-level tokenizer of its own (256 one-byte
tokens, an EOS and a BOS; the model's vocabulary is padded past the tokenizer's); the default model
checks JSON-schema outputs end to end (``tests/test_smollm2.py``, slow).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.params import init_params
from jaxinfer.requests import make_requests
from jaxinfer.sampling import SamplingParams, apply_token_mask
from jaxinfer.structured import TokenMatcher, compile_format, fill_masks, mask_words
from tests.conftest import byte_tokenizer

EOS = 256  # byte_tokenizer's
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
YES_NO = 'root ::= ("yes" | "no") "!"'  # GBNF


@pytest.fixture(scope="module")
def model() -> jaxinfer.Model:
    """Float32 random weights over 300 ids (ids 258.. are padding the tokenizer never makes)."""
    cfg = jaxinfer.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=112,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               max_position_embeddings=256, eos_token_ids=(EOS,))
    params = init_params(cfg, jax.random.PRNGKey(3), jnp.float32)
    return jaxinfer.Model(config=cfg, params=params, tokenizer=byte_tokenizer(),
                          dtype=jnp.float32, backend="reference", max_batch=8)


@pytest.mark.parametrize("value, message", [
    ("json", "must be a dict with a 'type'"),
    ({"type": "xml"}, "type 'xml' is unknown"),
    ({"type": "json_object", "schema": {}}, "unknown key 'schema'"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "with the JSON schema as a dict"),
    ({"type": "json_schema", "json_schema": {"schema": {"x": float("nan")}}}, "is not JSON"),
    ({"type": "regex", "pattern": ""}, "non-empty string"),
    ({"type": "grammar", "grammar": 3}, "non-empty string"),
])
def test_malformed_response_formats_are_one_line_input_errors(value, message):
    with pytest.raises(InputError, match=re.escape(message)) as e:
        SamplingParams(response_format=value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value, message", [
    ({"type": "regex", "pattern": "a(b"}, "response_format regex does not compile"),
    ({"type": "grammar", "grammar": "start: foo"}, "response_format grammar does not compile"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}},
     "response_format json_schema does not compile"),
])
def test_formats_that_do_not_compile_are_one_line_input_errors(model, value, message):
    with pytest.raises(InputError, match=message) as e:
        jaxinfer.generate(model, "hi", response_format=value)
    assert "\n" not in str(e.value)


def test_format_needs_a_tokenizer_and_end_of_sequence(model):
    no_tok = jaxinfer.Model(config=model.config, params=model.params, tokenizer=None,
                            dtype=jnp.float32, backend="reference")
    with pytest.raises(InputError, match="needs a model with a tokenizer"):
        make_requests(no_tok, [[1, 2]], False, None, {"response_format": {"type": "json_object"}})
    with pytest.raises(InputError, match="cannot be combined with response_format"):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)
    assert SamplingParams(response_format={"type": "text"}).response_format is None


def test_masks_allow_exactly_the_grammar_and_eos_where_it_may_end(model):
    tok = model.tokenizer
    vocab = model.config.vocab_size
    grammar = compile_format(SamplingParams(response_format={
        "type": "regex", "pattern": "ab+"}).response_format, tok, vocab)
    matcher = TokenMatcher(grammar, tok, vocab)
    masks = np.zeros((2, mask_words(vocab)), np.int32)
    a, b = tok.encode("a", add_bos=False)[0], tok.encode("b", add_bos=False)[0]
    for want, then in (({a}, a), ({b}, b), ({b, EOS}, None)):
        fill_masks([(matcher, 1)], masks)
        assert not masks[0].any()  # rows not named are left alone
        bits = np.unpackbits(masks[1].view(np.uint8), bitorder="little")[:vocab]
        assert set(np.flatnonzero(bits).tolist()) == want
        # The device applies the same mask: everything else becomes -inf.
        logits = jnp.zeros((2, vocab), jnp.float32)
        kept = np.isfinite(np.asarray(apply_token_mask(logits, jnp.asarray(masks))))
        assert set(np.flatnonzero(kept[1]).tolist()) == want and not kept[0].any()
        if then is not None:
            matcher.consume(then)
    with pytest.raises(ValueError, match="not allowed"):
        matcher.consume(a)


def test_eos_ends_a_grammar_only_where_it_may_end(model):
    # "ab+" may end after any b: EOS is allowed there only, and a sampled EOS ends the
    # output (not part of it) with reason "stop"; max_new_tokens cuts it with "length".
    fmt = {"type": "regex", "pattern": "ab+"}
    params = [SamplingParams(max_new_tokens=n, response_format=fmt, temperature=1.0, seed=s)
              for n, s in ((12, 0), (12, 1), (12, 2), (2, 3))]
    outs = jaxinfer.generate(model, ["x"] * len(params), sampling=params)
    for p, out in zip(params, outs, strict=True):
        assert re.fullmatch("ab+", out.text), out.text
        assert (out.finish_reason == "stop") == (len(out.token_ids) < p.max_new_tokens)
    assert outs[-1].text == "ab" and outs[-1].finish_reason == "length"
    assert any(o.finish_reason == "stop" for o in outs)


def test_outputs_match_their_format_and_leave_other_requests_unchanged(model):
    """Regex, GBNF and Lark outputs match in full and end with "stop" (no EOS in them); in
    one batch with unconstrained requests, every request gets the tokens it gets alone."""
    rng = np.random.default_rng(0)
    plain = [(rng.integers(3, 250, size=int(rng.integers(2, 12))).tolist(),
              SamplingParams(max_new_tokens=int(rng.integers(8, 20)), seed=i, temperature=1.0,
                             logprobs=True, top_p=[1.0, 0.9][i % 2]))
             for i in range(3)]
    regex = {"type": "regex", "pattern": REGEX}
    gbnf = {"type": "grammar", "grammar": YES_NO}
    lark = {"type": "grammar", "grammar": 'start: ("yes" | "no") "!"'}
    constrained = [("mail:", SamplingParams(max_new_tokens=40, response_format=f, seed=s,
                                            temperature=t))
                   for f, s, t in ((regex, 0, 0.0), (regex, 1, 1.0), (regex, 2, 1.5),
                                   (gbnf, 3, 1.0), (lark, 4, 0.0))]
    engine = jaxinfer.replicas.engine_for(model)
    calls = engine.stats().decode_calls
    alone = [jaxinfer.generate(model, p, sampling=sp)[0] for p, sp in plain + constrained]
    assert engine.stats().decode_calls > calls  # unconstrained requests decode several per call
    for (_, sp), out in zip(constrained, alone[len(plain):], strict=True):
        pattern = REGEX if sp.response_format.type == "regex" else "(yes|no)!"
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out
        assert EOS not in out.token_ids
    assert len({o.text for o in alone[len(plain): len(plain) + 3]}) > 1  # sampled addresses
    mixed = plain[:2] + constrained[:2] + plain[2:] + constrained[2:]
    outs = jaxinfer.generate(model, [p for p, _ in mixed], sampling=[sp for _, sp in mixed])
    together = {sp: out for (_, sp), out in zip(mixed, outs, strict=True)}
    for (_, sp), want in zip(plain + constrained, alone, strict=True):
        got = together[sp]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        if sp.logprobs:
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    engine.blocks.check_all_free()
