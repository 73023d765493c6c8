"""Property-based tests (hypothesis): any sampling options, prompts, chat messages and
batch_eval records either work or raise ``InputError`` (a bad batch_eval record becomes an
error record), and nothing hangs: each example has a deadline."""

from __future__ import annotations

import datetime
import json
import string
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.params import init_params
from jaxinfer.requests import CHAT_ROLES, Completion, make_requests
from jaxinfer.sampling import SamplingParams
from tests.test_batch_eval import _load_script

OPTIONS = sorted(f.name for f in __import__("dataclasses").fields(SamplingParams))
SETTINGS = dict(deadline=datetime.timedelta(seconds=30),
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# Values a user might pass anywhere: numbers at and past every range, NaN and infinities,
# bools (which are ints to Python), None, strings, containers.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63, 0.5, 1.0]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
ANYTHING = st.one_of(SCALARS, st.lists(SCALARS, max_size=3),
                     st.dictionaries(st.text(max_size=3), SCALARS, max_size=2))


def _one_of_outcomes(fn, *args, **kwargs) -> Any:
    """``fn(...)``; ``None`` if it raised ``InputError`` (any other exception fails)."""
    try:
        return fn(*args, **kwargs)
    except InputError as e:
        assert "\n" not in str(e).strip(), "an InputError is one line"
        return None


@settings(max_examples=300, **SETTINGS)
@given(st.dictionaries(st.sampled_from([*OPTIONS, "temprature", "n"]), ANYTHING, max_size=4))
def test_any_sampling_options_work_or_raise_input_error(options):
    sp = _one_of_outcomes(SamplingParams.from_kwargs, **options)
    if sp is not None:
        assert 1 <= sp.max_new_tokens < 2**31 and sp.temperature >= 0


@pytest.fixture(scope="module")
def model(default_gguf: Path) -> jaxinfer.Model:
    """A tiny random model with the default model's real tokenizer and chat template."""
    from checkpoints.gguf import read_gguf_metadata
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_gguf))
    cfg = jaxinfer.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                               num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                               max_position_embeddings=96, eos_token_ids=tok.eos_ids)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    return jaxinfer.Model(config=cfg, params=params, tokenizer=tok, dtype=jnp.float32,
                          backend="reference", max_batch=4)


MESSAGES = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from([*CHAT_ROLES, "robot", ""]),
                           "content": st.one_of(st.text(max_size=12), SCALARS)}),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), SCALARS, max_size=3),
    SCALARS), max_size=3)
ONE_PROMPT = st.one_of(
    st.text(string.printable + "é漢\u2028\U0001f600", max_size=30),
    st.lists(st.one_of(st.integers(-5, 50_000), st.booleans(), SCALARS), max_size=8),
    MESSAGES, SCALARS)
PROMPTS = st.one_of(ONE_PROMPT, st.lists(ONE_PROMPT, max_size=3))


@settings(max_examples=300, **SETTINGS)
@given(prompts=PROMPTS, chat=st.booleans())
def test_any_prompts_and_chats_validate_or_raise_input_error(model, prompts, chat):
    reqs = _one_of_outcomes(make_requests, model, prompts, chat, None, {"max_new_tokens": 4})
    if reqs is not None:
        vocab = model.config.vocab_size
        assert all(0 <= t < vocab for r in reqs for t in r.prompt_ids)


@settings(max_examples=25, **SETTINGS)
@given(prompts=PROMPTS, chat=st.booleans(),
       options=st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "min_p",
                                                "repetition_penalty", "presence_penalty",
                                                "frequency_penalty", "stop", "seed"]),
                               ANYTHING, max_size=3))
def test_generate_on_any_input_works_or_raises_input_error(model, prompts, chat, options):
    out = _one_of_outcomes(jaxinfer.generate, model, prompts, chat=chat, max_new_tokens=3,
                           **options)
    if out is not None:
        assert all(isinstance(c, Completion) and c.error is None and 1 <= len(c.token_ids) <= 3
                   or c.finish_reason == "stop" for c in out)


JSON = st.recursive(SCALARS.filter(lambda x: not (isinstance(x, float) and x != x)),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
RECORD = st.one_of(
    st.text(max_size=20),  # not JSON at all
    JSON.map(lambda v: json.dumps(v, allow_nan=True)),
    st.fixed_dictionaries({}, optional={"id": JSON, "prompt": JSON, "messages": JSON,
                                        "completion": JSON}).map(json.dumps),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=10)},
                          optional={"completion": st.text(max_size=5)}).map(json.dumps))


@settings(max_examples=200, **SETTINGS)
@given(lines=st.lists(RECORD, min_size=1, max_size=6), score=st.booleans())
def test_any_batch_eval_records_parse_to_records_or_error_records(tmp_path_factory, lines,
                                                                   score):
    be = _load_script()
    path = tmp_path_factory.mktemp("records") / "in.jsonl"
    lines = [x.replace("\n", "\\n").replace("\r", "\\r") for x in lines]
    path.write_text("\n".join(lines), encoding="utf-8")
    records = be.parse_records(path, score)
    expected = [n for n, x in enumerate(lines, start=1) if x.strip()]
    assert [r.line for r in records] == expected  # one record per non-blank line, in place
    for r in records:
        assert (r.error is None) == (r.prompt is not None)
        if r.error is not None:
            assert "\n" not in r.error
