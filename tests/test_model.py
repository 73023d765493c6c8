"""The model through the engine (``compute_logits``, ``generate``) against HF transformers on
tiny random configs, and properties of the engine's compiled decode program."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxinfer
import pallas_kernels
from jaxinfer import benchmark, runner
from jaxinfer.model import init_params, prepare_params


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
    (out,) = jaxinfer.generate(model, [prompt], max_new_tokens=20, ignore_eos=True)
    assert out.token_ids == _hf_greedy(torch_model, prompt, 20)  # HF runs without eos too
    assert out.finish_reason == "length"


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


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "while", "bitcast", "conditional",
                "call", "scatter", "dynamic-update-slice"}


def pool_sized_writes(hlo: str, layer_elems: int) -> list[str]:
    """Instructions of compiled HLO text that produce a buffer of at least one layer's pool,
    other than in-place updates (a scatter, or a fusion whose root is one): such a buffer is
    a copy of (a layer of) the KV pool."""
    roots, comp = {}, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith((" ", "\t")):
            comp = m.group(1)
        elif comp and line.strip().startswith("ROOT") and (ins := _INSTR.match(line)):
            roots[comp] = ins.group(3)
    bad = []
    for line in hlo.splitlines():
        ins = _INSTR.match(line)
        if not ins:
            continue
        _, dims, op = ins.groups()
        if math.prod(int(d) for d in dims.split(",") if d) < layer_elems or op in _BOOKKEEPING:
            continue
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        if op == "fusion" and callee and roots.get(callee.group(1)) in _BOOKKEEPING:
            continue
        bad.append(line.strip()[:200])
    return bad


def _decode_hlo(params, cfg, backend: str = "reference"):
    case = benchmark.decode_case(cfg, params, backend, 3, 20, 4, jax.random.PRNGKey(1),
                                 page_size=8, dtype=jnp.float32)
    # More pages than the rows map, so attention's page gathers are smaller than the pool.
    case.pool = benchmark.random_pool(cfg, 64, 8, stacked=case.pool.stacked,
                                      key=jax.random.PRNGKey(2), dtype=jnp.float32)
    hlo = runner.decode_steps.lower(params, case.pool, case.counts, case.inputs, config=cfg,
                                    backend=backend, dtype=jnp.float32,
                                    max_steps=4, chunk=4, stochastic=False).compile().as_text()
    return case, hlo


def test_decode_steps_hlo_does_not_copy_the_pool():
    """The engine's decode program updates a per-layer pool in place: no copy, transpose or
    fusion writes a buffer the size of a layer's pool (the core performance property)."""
    cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    base = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    fast = prepare_params(base, fuse=True, unstack=True)
    layer_elems = cfg.num_kv_heads * 64 * 8 * cfg.head_dim
    case, hlo = _decode_hlo(fast, cfg)
    assert not case.pool.stacked
    assert pool_sized_writes(hlo, layer_elems) == []
    # The check sees copies: slicing a layer out of a stacked pool (what a custom call such
    # as a Pallas kernel would be given) shows up as one.
    case, hlo = _decode_hlo(base, cfg)
    assert case.pool.stacked
    assert pool_sized_writes(hlo, layer_elems)


def test_decode_steps_donate_the_pool():
    cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    params = prepare_params(init_params(cfg, jax.random.PRNGKey(0), jnp.float32), fuse=True,
                            unstack=True)
    case = benchmark.decode_case(cfg, params, "reference", 2, 5, 3, jax.random.PRNGKey(1),
                                 page_size=8, dtype=jnp.float32)
    old = [*case.pool.k, *case.pool.v, case.counts]
    benchmark.run_decode(params, cfg, "reference", case, jnp.float32)
    assert all(a.is_deleted() for a in old)


def test_compile_time_does_not_grow_with_depth():
    def lowered_ops(layers: int) -> int:
        cfg = jaxinfer.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8)
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)  # stacked: layer scan
        tables = np.arange(2, dtype=np.int32)[None]
        inp = benchmark.prefill_inputs([np.ones(16, np.int32)], tables, 8)
        pool = benchmark.random_pool(cfg, 2, 8, stacked=True, key=jax.random.PRNGKey(1),
                                     dtype=jnp.float32)
        text = runner.mixed_step.lower(params, pool, jnp.zeros((1, 64), jnp.int32), inp, config=cfg,
                                       backend="reference", dtype=jnp.float32, max_q_len=16,
                                       score=False, stochastic=False).as_text()
        return len(text.splitlines())

    assert lowered_ops(2) == lowered_ops(12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=""), "prompt is empty"),
        (dict(prompts=[[]]), "prompt is empty"),
        (dict(prompts=[[5, 999]]), "in the vocabulary"),
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


def test_pallas_backend_gives_the_same_tokens(monkeypatch):
    """The Pallas kernels (interpreted) give the reference's tokens and logits, in the stacked
    and the fast layout. Both run per-layer pools on this backend, so decode steps take the
    kernel that stores the new K/V itself (``paged_attention_write``)."""
    cfg = jaxinfer.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=160,
                               num_layers=2, num_heads=4, num_kv_heads=1, head_dim=64,
                               max_position_embeddings=256)
    weights = init_params(cfg, jax.random.PRNGKey(4), jnp.float32)
    model = jaxinfer.Model(cfg, weights, None, dtype=jnp.float32, backend="reference")
    prompts = [[3, 14, 15, 92, 65, 35], list(range(3, 40)), [7]]
    params = [jaxinfer.SamplingParams(max_new_tokens=n) for n in (5, 3, 6)]
    ref = jaxinfer.generate(model, prompts, sampling=params)
    fast = prepare_params(weights, fuse=True, unstack=True)
    traced = []  # layers traced with the storing decode kernel, per model
    kernel = pallas_kernels.paged_attention_write
    monkeypatch.setattr(pallas_kernels, "paged_attention_write",
                        lambda *a, **k: traced.append(1) or kernel(*a, **k))
    for pallas in (dataclasses.replace(model, backend="pallas"),
                   dataclasses.replace(model, backend="pallas", params=fast)):
        traced.clear()
        got = jaxinfer.generate(pallas, prompts, sampling=params)
        assert traced
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        np.testing.assert_allclose(jaxinfer.compute_logits(pallas, prompts[1]),
                                   jaxinfer.compute_logits(model, prompts[1]), atol=1e-4)
