"""Execution layouts (``load_model(layout=...)``): the fast layout (fused matmuls, per-layer
weight buffers, unrolled layer loop) must give what the stored stacked layout gives, through
every entry point (``generate``, ``stream_tokens``, ``compute_logits``, the engine), with both
attention backends (Pallas runs in interpret mode on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from jaxinfer.generate import Model
from jaxinfer.model import (
    apply_layout,
    fuse_columns,
    init_params,
    param_shapes,
    params_layout,
    prepare_params,
    resolve_layout,
)

# head_dim 64: the Pallas kernels' smallest supported head size.
CFG = jaxinfer.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=160,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                           max_position_embeddings=256)
PROMPTS = [[5, 17, 99, 3, 42], [7] * 11, [120, 1, 64]]


def _models(backend: str) -> tuple[Model, Model]:
    """(stacked, fast) float32 models of the same random weights."""
    params = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    stacked = Model(config=CFG, params=params, tokenizer=None, dtype=jnp.float32,
                    backend=backend, max_batch=4)
    fast = Model(config=CFG, params=apply_layout(params, "fast"), tokenizer=None,
                 dtype=jnp.float32, backend=backend, max_batch=4)
    assert (stacked.layout, fast.layout) == ("stacked", "fast")
    return stacked, fast


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_fast_layout_equals_stacked(backend):
    stacked, fast = _models(backend)
    want = jaxinfer.generate(stacked, PROMPTS, max_new_tokens=8, ignore_eos=True)
    got = jaxinfer.generate(fast, PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(len(c.token_ids) == 8 for c in got)
    np.testing.assert_allclose(jaxinfer.compute_logits(fast, PROMPTS[0]),
                               jaxinfer.compute_logits(stacked, PROMPTS[0]),
                               rtol=1e-5, atol=1e-5)
    streamed = [t for piece in jaxinfer.stream_tokens(fast, PROMPTS[1], chunk_steps=4,
                                                      max_new_tokens=8, ignore_eos=True)
                for t in piece]
    assert streamed == want[1].token_ids


def test_engine_runs_the_fast_layout():
    stacked, fast = _models("reference")
    outs = []
    for model in (stacked, fast):
        engine = Engine(model, num_pages=32, page_size=4, max_tokens_per_step=16,
                        max_seq_len=32, verbose=False)
        ids = [engine.submit(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS]
        engine.run_until_done()
        outs.append([engine.result(i).token_ids for i in ids])
    assert outs[1] == outs[0]
    # More prompts than max_batch: generate() hands them to the engine.
    many = [[i + 3, 2 * i + 1] for i in range(6)]
    want = jaxinfer.generate(stacked, many, max_new_tokens=6, ignore_eos=True)
    got = jaxinfer.generate(fast, many, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_load_model_layouts(tmp_path):
    pytest.importorskip("transformers")
    from tests.conftest import make_hf_model

    make_hf_model("gqa").save_pretrained(tmp_path)
    models = {layout: jaxinfer.load_model(tmp_path, dtype="float32", backend="reference",
                                          layout=layout)
              for layout in ("auto", "stacked", "fast")}
    assert models["auto"].layout == "stacked"  # CPU: the scan layout, compile time flat
    assert models["fast"].layout == "fast"
    layers = models["fast"].params["layers"]
    assert len(layers) == models["fast"].config.num_layers
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(models["fast"].params))
    ids = [1, 5, 9, 33, 2, 7]
    np.testing.assert_allclose(jaxinfer.compute_logits(models["fast"], ids),
                               jaxinfer.compute_logits(models["stacked"], ids),
                               rtol=1e-5, atol=1e-5)
    want = jaxinfer.generate(models["stacked"], ids, max_new_tokens=8)[0].token_ids
    assert jaxinfer.generate(models["fast"], ids, max_new_tokens=8)[0].token_ids == want


def test_bad_layout_is_one_line_input_error(tmp_path):
    with pytest.raises(InputError) as e:
        jaxinfer.load_model(tmp_path, layout="unrolled")
    assert "\n" not in str(e.value) and "stacked" in str(e.value)
    with pytest.raises(InputError):
        resolve_layout("Fast")
    assert resolve_layout("auto") == "stacked"  # this CPU; "fast" on GPUs


def test_fuse_columns_keeps_each_shards_heads_together():
    """Shard s of a fused weight holds shard s's columns of every part, in part order."""
    wq, wk = np.arange(24).reshape(2, 12), 100 + np.arange(8).reshape(2, 4)
    fused = fuse_columns([wq, wk], shards=2)  # [in=2, shards=2, 6 + 2]
    assert fused.shape == (2, 2, 8)
    np.testing.assert_array_equal(fused[:, 1, :6], wq[:, 6:])
    np.testing.assert_array_equal(fused[:, 1, 6:], wk[:, 2:])
    np.testing.assert_array_equal(fuse_columns([wq, wk])[:, 0], np.concatenate([wq, wk], 1))


def test_donating_prepare_frees_the_stored_arrays_and_keeps_values():
    params = init_params(CFG, jax.random.PRNGKey(1), jnp.float32)
    host = jax.tree.map(np.asarray, params)
    fast = prepare_params(params, fuse=True, unstack=True, donate=True)
    assert all(a.is_deleted() for a in jax.tree.leaves(params["layers"]))
    assert params_layout(fast) == "fast"
    nq = CFG.num_heads * CFG.head_dim
    for i, lp in enumerate(fast["layers"]):
        np.testing.assert_array_equal(lp["wqkv"][:, 0, :nq], host["layers"]["wq"][i])
        np.testing.assert_array_equal(lp["w_gate_up"][:, 0, CFG.intermediate_size:],
                                      host["layers"]["w_up"][i])
        np.testing.assert_array_equal(lp["w_down"], host["layers"]["w_down"][i])
    # Host (numpy) params are sliced and placed layer by layer with `place`.
    placed = prepare_params(host, fuse=True, unstack=True,
                            place=lambda a: jnp.asarray(a, jnp.bfloat16))
    assert all(isinstance(a, jax.Array) and a.dtype == jnp.bfloat16
               for a in jax.tree.leaves(placed))
    shapes = param_shapes(CFG)["layers"]
    assert placed["layers"][0]["wqkv"].shape == (
        CFG.hidden_size, 1, shapes["wq"][2] + 2 * shapes["wk"][2])
