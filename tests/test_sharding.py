"""Tensor/data parallel sharding: rules, errors, and sharded generate == one device.

The mesh tests need 8 devices, which XLA only creates on CPU when
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before JAX starts; the rest of
the suite runs with one device in this process, so they run in a subprocess (this file's
``__main__`` worker) and report back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

MESHES = [(1, 8), (2, 4), (2, 1)]  # model-split, data x model, data only
REPO = Path(__file__).resolve().parents[1]


def run_with_devices(args: list[str], n: int = 8, timeout: int = 600) -> dict:
    """Run ``python <args>`` with ``n`` forced CPU devices; return its last stdout line as JSON."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ in-process (one device)

def test_valid_model_sizes_and_error():
    from jaxinfer.errors import InputError
    from sharding.rules import kv_repeat_factor, valid_model_sizes
    from sharding.testing import tiny_config

    cfg = tiny_config(num_heads=8, num_kv_heads=2)
    assert valid_model_sizes(cfg) == [1, 2, 4, 8]
    assert [kv_repeat_factor(cfg, m) for m in (1, 2, 4, 8)] == [1, 1, 2, 4]
    odd = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72, head_dim=8,
                      intermediate_size=144)
    with pytest.raises(InputError, match=r"model=4 cannot split .*num_attention_heads=9.*"
                                         r"sizes that work: 1, 3, 9$"):
        kv_repeat_factor(odd, 4)


def test_make_mesh_errors():
    from jaxinfer.errors import InputError
    from sharding import make_mesh

    with pytest.raises(InputError, match="needs 64 devices but only"):
        make_mesh(data=8, model=8)
    with pytest.raises(InputError, match="positive integer"):
        make_mesh(data=0)
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "model": 1}


def test_param_specs_cover_every_param():
    import jax

    from jaxinfer.model import param_shapes
    from sharding.rules import param_specs
    from sharding.testing import tiny_config

    for tied in (False, True):
        cfg = tiny_config(tie_word_embeddings=tied)
        shapes = param_shapes(cfg)
        specs = param_specs(cfg, 4)
        is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
        assert (jax.tree.structure(shapes, is_leaf=is_shape)
                == jax.tree.structure(specs, is_leaf=lambda x: isinstance(
                    x, jax.sharding.PartitionSpec)))
        assert specs["layers"]["wq"] == jax.sharding.PartitionSpec(None, None, "model")
        assert specs["layers"]["w_down"] == jax.sharding.PartitionSpec(None, "model", None)
        assert specs["embed"] == jax.sharding.PartitionSpec("model", None)


def test_expanded_kv_heads_compute_the_same_logits():
    """Repeating K/V heads (what kv_heads < model needs) leaves the function unchanged."""
    import jax.numpy as jnp

    from jaxinfer.generate import Model, compute_logits
    from sharding.rules import expand_kv_heads
    from sharding.testing import tiny_config, tiny_params

    cfg = tiny_config(num_heads=8, num_kv_heads=2)
    params = tiny_params(cfg)
    cfg4, params4 = expand_kv_heads(cfg, params, 4)
    assert cfg4.num_kv_heads == 8 and params4["layers"]["wk"].shape == (2, 64, 64)
    ids = [5, 9, 200, 17, 3, 3, 80]
    a = compute_logits(Model(cfg, params, None, jnp.float32, backend="reference"), ids)
    b = compute_logits(Model(cfg4, params4, None, jnp.float32, backend="reference"), ids)
    np.testing.assert_allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------ 8 devices (subprocess)

@pytest.mark.slow
def test_meshes_match_single_device():
    res = run_with_devices([__file__, "worker"])
    for mesh, r in res["meshes"].items():
        assert r["tokens_equal"], f"mesh {mesh}: {r['tokens']} != {res['ref_tokens']}"
        assert r["logits_max_err"] < 1e-4, f"mesh {mesh}: logits differ by {r['logits_max_err']}"
        assert r["wq_shard"] == [2, 64, 64 // r["model"]], mesh
        # The engine's pool [L, KVH, pages, page_size, D]: K/V heads split on model.
        assert r["pool_shard"][1] == r["kv_per_shard"], mesh
        assert r["pool_shard"][2:] == r["pool_shape"][2:], mesh
        assert r["kv_heads"] == max(2, r["model"]), mesh
    # kv_heads=2 < model for (1, 8) and (2, 4): repeated, and said so in the log.
    assert "repeating each K/V head 4 times" in res["meshes"]["1x8"]["log"]
    assert "repeating each K/V head 2 times" in res["meshes"]["2x4"]["log"]
    assert res["meshes"]["2x1"]["log"] == ""
    for name in ("layer_pool", "stacked_pool"):
        assert res[f"{name}_attention_err"] < 1e-5, name
        assert res[f"{name}_pools_equal"], name


def _worker() -> None:
    import logging
    import tempfile

    import jax
    import jax.numpy as jnp

    import jaxinfer
    from sharding import make_mesh
    from sharding.attention import mesh_write_and_attend
    from sharding.testing import write_tiny_model

    assert jax.device_count() == 8, jax.devices()
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("jaxinfer.sharding").addHandler(Grab())
    path = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    prompts = ["The quick brown fox", [256, 7, 8, 9], "Hi",
               [{"role": "user", "content": "What is 2+2?"}], "A longer prompt about meshes."]
    kw = dict(max_new_tokens=10, temperature=0.0)
    base = jaxinfer.load_model(path, dtype="float32", backend="reference")
    ref = [c.token_ids for c in jaxinfer.generate(base, prompts, **kw)]
    probe = base.tokenizer.encode("sharded logits probe")
    ref_logits = jaxinfer.compute_logits(base, probe)
    out: dict = {"ref_tokens": ref, "meshes": {}}
    for data, model in MESHES:
        records.clear()
        m = jaxinfer.load_model(path, dtype="float32", backend="reference",
                                mesh=make_mesh(data=data, model=model))
        toks = [c.token_ids for c in jaxinfer.generate(m, prompts, **kw)]
        logits = jaxinfer.compute_logits(m, probe)
        first = m.engine.replicas[0] if data > 1 else m.engine  # one engine per replica
        pool_k = first.pool.k
        out["meshes"][f"{data}x{model}"] = {
            "data": data, "model": model, "tokens": toks, "tokens_equal": toks == ref,
            "logits_max_err": float(np.abs(logits - ref_logits).max()),
            "wq_shard": list(m.params["layers"]["wq"].addressable_shards[0].data.shape),
            "pool_shard": list(pool_k.addressable_shards[0].data.shape),
            "pool_shape": list(pool_k.shape),
            "kv_heads": first.model.config.num_kv_heads,
            "kv_per_shard": m.config.num_kv_heads // model,
            "log": "\n".join(records),
        }

    # shard_map wrapper of the K/V store and ragged attention (per model shard), checked
    # against one device, on a layer's pool and on a stacked pool.
    from jaxinfer.attention import write_and_attend

    mesh = make_mesh(data=2, model=4)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((7, 8, 16)), jnp.float32)  # 4 + 2 + 1 tokens
    k_new = jnp.asarray(rng.standard_normal((7, 4, 16)), jnp.float32)
    v_new = k_new * 0.5 - 1
    k = jnp.asarray(rng.standard_normal((4, 12, 4, 16)), jnp.float32)  # [KVH, pages, ps, D]
    v = k * 0.5 + 1
    tables = np.asarray([[0, 1, 2], [5, 3, 7], [11, 4, 8]], np.int32)
    positions = np.asarray([0, 1, 2, 3, 7, 8, 5])
    seq = np.asarray([0, 0, 0, 0, 1, 1, 2])
    batch = {"write_pages": jnp.asarray(tables[seq, positions // 4]),
             "write_offsets": jnp.asarray(positions % 4, jnp.int32),
             "kv_lens": jnp.asarray([4, 9, 6], jnp.int32), "block_tables": jnp.asarray(tables),
             "cu_q_lens": jnp.asarray([0, 4, 6, 7], jnp.int32)}
    for name, k_pool, v_pool, layer in (
            ("layer_pool", k, v, None),
            ("stacked_pool", jnp.stack([k * 2, k]), jnp.stack([v * 2, v]), jnp.int32(1))):
        want = write_and_attend(q, k_new, v_new, k_pool, v_pool, layer, batch)
        with jax.set_mesh(mesh):
            got = jax.jit(mesh_write_and_attend)(q, k_new, v_new, k_pool, v_pool, layer, batch)
        out[f"{name}_attention_err"] = float(jnp.abs(got[0] - want[0]).max())
        out[f"{name}_pools_equal"] = all(bool(jnp.array_equal(a, b))
                                         for a, b in zip(got[1:], want[1:], strict=True))
    print(json.dumps(out))


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
