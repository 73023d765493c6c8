"""End to end on the default model (SmolLM2-135M-Instruct GGUF) against HF transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import jaxinfer

# Every test but the last loads or runs the 135M model: tens of seconds each on a CPU.
slow = pytest.mark.slow
CHATS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def ours_f32(default_gguf):
    return jaxinfer.load_model(default_gguf, dtype="float32", backend="reference")


@slow
def test_default_model_by_name_is_cached_and_bf16(default_gguf):
    model = jaxinfer.load_model("smollm2-135m-instruct")
    assert model.config.num_layers == 30 and model.config.num_kv_heads == 3
    assert model.config.tie_word_embeddings
    assert model.params["embed"].dtype == jax_bf16()
    (out,) = jaxinfer.generate(model, CHATS[0], chat=True, max_new_tokens=12)
    assert "Paris" in out.text


def jax_bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


@slow
def test_logits_match_transformers(ours_f32, hf_smollm2):
    tok, hf = hf_smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": CHATS[1]}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ours = jaxinfer.compute_logits(ours_f32, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-4 * np.abs(ref).max()


@slow
def test_score_matches_transformers(ours_f32, hf_smollm2):
    _, hf = hf_smollm2
    ctx = "The capital of France is"
    pairs = [(ctx, " Paris, a city on the Seine."), (ctx, " Berlin.")]  # one shared context
    results = jaxinfer.score(ours_f32, pairs)
    for r in results:
        ids = r.context_token_ids + r.continuation_token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1).numpy()
        rows = np.arange(len(r.context_token_ids) - 1, len(ids) - 1)
        want = logp[rows, r.continuation_token_ids]
        np.testing.assert_allclose(r.token_logprobs, want, atol=2e-4)
        assert r.logprob == pytest.approx(float(want.sum()), abs=1e-3)
        assert r.greedy == bool(np.all(logits.numpy()[rows].argmax(-1)
                                       == r.continuation_token_ids))


@slow
def test_greedy_chat_tokens_match_transformers(ours_f32, hf_smollm2):
    tok, hf = hf_smollm2
    outs = jaxinfer.generate(ours_f32, CHATS, chat=True, max_new_tokens=32)
    for prompt, out in zip(CHATS, outs, strict=True):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        if out.finish_reason == "stop":
            assert ref[: len(out.token_ids) + 1][:-1] == out.token_ids
            assert ref[len(out.token_ids)] in ours_f32.tokenizer.eos_ids
        else:
            assert ref == out.token_ids
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@slow
def test_stop_strings_and_streaming(ours_f32):
    (full,) = jaxinfer.generate(ours_f32, CHATS[1], chat=True, max_new_tokens=40)
    words = full.text.split()
    stop = words[len(words) // 2]
    (cut,) = jaxinfer.generate(ours_f32, CHATS[1], chat=True, max_new_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    pieces = list(jaxinfer.stream(ours_f32, CHATS[1], chat=True, max_new_tokens=40))
    assert len(pieces) > 1 and "".join(pieces) == full.text
    streamed_cut = "".join(jaxinfer.stream(ours_f32, CHATS[1], chat=True, max_new_tokens=40,
                                           stop=[stop]))
    assert streamed_cut == cut.text


@slow
def test_int4_copy_as_draft_gives_the_plain_greedy_tokens(ours_f32):
    """Speculation with the model's int4 copy as draft: real weights (stored as Q4_1, so the
    int4 copy is close: every proposal was accepted when written), and the output is plain
    greedy decoding's."""
    from jaxinfer.quantize import quantize_params

    draft = jaxinfer.Model(config=ours_f32.config, tokenizer=ours_f32.tokenizer,
                           params=quantize_params(ours_f32.params, "int4"), dtype=np.float32,
                           backend="reference")
    spec = jaxinfer.Speculative(method="draft", draft=draft, num_tokens=4, adaptive=False)
    # The model's own engine (programs other tests compiled), the draft attached to it.
    plain = jaxinfer.generate(ours_f32, CHATS, chat=True, max_new_tokens=16)
    drafted = jaxinfer.generate(ours_f32, CHATS, chat=True, max_new_tokens=16, speculative=spec)
    for p, d in zip(plain, drafted, strict=True):
        assert d.token_ids == p.token_ids and d.text == p.text
    assert sum(d.accepted_tokens for d in drafted) > 0.5 * sum(d.draft_tokens for d in drafted)


@slow
def test_structured_outputs_parse_and_validate(ours_f32):
    """JSON-schema, JSON-object and regex outputs (response_format) of the default model. A
    small engine: the reference attention reads every page a sequence may have per token."""
    import json
    import re

    import jsonschema

    from jaxinfer.engine import Engine

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"type": "string", "maxLength": 12}},
              "required": ["city", "country"], "additionalProperties": False}
    pattern = r"(Paris|Lyon|Nice), population [0-9]{4,8}"
    formats = [{"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
               {"type": "json_object"}, {"type": "regex", "pattern": pattern}]
    engine = Engine(ours_f32, max_batch=4, max_seq_len=96, max_tokens_per_step=64,
                    verbose=False)
    ids = [engine.submit(CHATS[0], chat=True, max_new_tokens=30, response_format=f)
           for f in formats]
    engine.run_until_done()
    outs = [engine.result(i) for i in ids]
    assert all(o.finish_reason == "stop" for o in outs), outs
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(pattern, outs[2].text)


@slow
def test_cli_generate_answers_a_chat_question():
    """The CLI loads the default model by name and answers; float32, which a CPU runs ~3x
    faster than the default bfloat16 (whose load and answer the in-process test covers)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", CHATS[0], "--chat",
         "--max-new-tokens", "12", "--dtype", "float32"], capture_output=True, text=True,
        env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_reports_bad_input_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", "hi", "--top-p", "2"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "top_p" in proc.stderr
