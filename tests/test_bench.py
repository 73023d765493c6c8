"""The benchmark harness end to end on CPU (structure, never timings), and the fast paths it
measures: execution layouts of the params and the layer-indexed decode kernel."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import attention as attn_mod
from jaxinfer import benchmark, steps
from jaxinfer.cli import main
from jaxinfer.config import LlamaConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.model import forward, init_params, prepare_params

TINY = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture()
def tiny_config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY.to_hf_dict()))
    return path


def test_bench_runs_end_to_end(tiny_config_path, tmp_path, capsys):
    out = tmp_path / "res.json"
    hlo_dir = tmp_path / "hlo"
    main(["bench", "--model", str(tiny_config_path), "--impl",
          "reference,reference+fused+unrolled", "--batch", "1", "--context", "8",
          "--prompt-lens", "16", "--decode-steps", "3", "--repeats", "2", "--ceiling-mb", "1",
          "--matmul-n", "64", "--out", str(out), "--hlo-dir", str(hlo_dir)])
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert set(res["ceilings"]) >= {"read_bw", "copy_bw", "matmul_flops"}
    assert [(r["impl"], r["batch"]) for r in res["decode"]] == [
        ("reference", 1), ("reference+fused+unrolled", 1)]
    for r in res["decode"]:
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mbu"]
        assert r["bytes_per_step"] > 0 and len(r["call_times_s"]) == 2
    first = res["decode"][0]
    assert first["hlo"]["loops"]  # the decode while loop and the layer scan were found
    assert len(list(hlo_dir.glob("*.hlo.txt"))) == 2
    assert [r["prompt_len"] for r in res["prefill"]] == [16, 16]
    assert all(r["ttft_ms"] > 0 and r["mfu"] > 0 for r in res["prefill"])
    table = capsys.readouterr().out
    assert "ms/step" in table and "TTFT ms" in table


def test_hlo_census_counts_loop_bodies():
    text = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_computation
  %g = bf16[1024,1024]{1,0} copy(f32[4]{0} %f)
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %f)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body, TRIP
  ROOT %o = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop, calls=%fused_computation
}
"""
    trip = 'backend_config={"known_trip_count":{"n":"16"}}'
    c = benchmark.hlo_census(text.replace("TRIP", trip))
    assert c["entry_launches"] == 1
    assert c["loops"]["body"] == {"trip_count": 16, "launches_per_iteration": 2,
                                  "ops": {"fusion": 1, "copy": 1}}
    assert c["largest_in_loops"][0] == {"bytes": 2 * 1024 * 1024, "what": "copy g"}


# (True, True) is the "fast" layout: tests/test_layouts.py covers it through every entry point.
@pytest.mark.parametrize("fuse,unstack", [(True, False), (False, True)])
def test_execution_layouts_match_stored_layout(fuse, unstack):
    params = init_params(TINY, jax.random.PRNGKey(0), jnp.float32)
    prepared = prepare_params(params, fuse=fuse, unstack=unstack)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, TINY.vocab_size)
    for p in (params, prepared):
        cache = KVCache.create(TINY, 2, 16, jnp.float32).replace(lengths=jnp.array([5, 3]))
        h, cache = forward(p, TINY, tokens, cache, mode="prefill", dtype=jnp.float32)
        cache = cache.replace(lengths=jnp.array([5, 3]))
        hd, _ = forward(p, TINY, tokens[:, :1], cache, mode="decode", dtype=jnp.float32)
        if p is params:
            want = (h, hd)
    np.testing.assert_allclose(h, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hd, want[1], rtol=1e-5, atol=1e-5)


def test_layer_indexed_decode_kernel_matches_reference():
    key = jax.random.split(jax.random.PRNGKey(3), 3)
    layers, b, kvh, s, d, h = 3, 2, 2, 40, 64, 8
    k_all = jax.random.normal(key[0], (layers, b, kvh, s, d), jnp.float32)
    v_all = jax.random.normal(key[1], (layers, b, kvh, s, d), jnp.float32)
    q = jax.random.normal(key[2], (b, h, d), jnp.float32)
    lengths = jnp.array([37, 5], jnp.int32)
    for layer in (0, 2):
        got = attn_mod.decode_attention_layer(q, k_all, v_all, jnp.int32(layer), lengths,
                                              block_k=16)
        want = attn_mod.attention(q, k_all[layer], v_all[layer], lengths, mode="decode")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_loop_same_tokens_with_layer_kernel_and_slices():
    params = init_params(TINY, jax.random.PRNGKey(0), jnp.float32)
    outs = []
    for flag in (True, False):
        attn_mod.DECODE_LAYER_KERNEL = flag
        jax.clear_caches()
        cache = benchmark.random_cache(TINY, 2, 24, 6, jax.random.PRNGKey(2))
        cache = cache.replace(k=cache.k.astype(jnp.float32), v=cache.v.astype(jnp.float32))
        state = benchmark.greedy_state(TINY, 2, 8, jax.random.PRNGKey(4))
        _, state = steps.decode_loop(params, cache, state, jnp.int32(4), config=TINY,
                                     backend="pallas", dtype=jnp.float32)
        outs.append(np.asarray(state.out_tokens))
    attn_mod.DECODE_LAYER_KERNEL = True
    jax.clear_caches()
    np.testing.assert_array_equal(outs[0], outs[1])
