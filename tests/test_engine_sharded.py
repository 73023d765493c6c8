"""The continuous-batching engine on a mesh gives the single-device engine's tokens.

8 forced CPU devices in a subprocess (as in ``tests/test_sharding.py``): a tiny random GQA
model (8 query heads, 2 K/V heads, so model=4 and model=8 repeat K/V heads) serves 19
requests with staggered arrivals, chunked prefill, a pool small enough to preempt and five
prompts that share a 13-token prefix, on meshes (1, 8), (2, 4), (4, 2) and (2, 1), and a
model of 6 query and 3 K/V heads on (2, 3); every request's tokens must equal the
single-device engine's, every mesh must preempt and serve prompt tokens from its prefix
cache, and ``generate`` on every mesh must equal single-device ``generate``. Meshes
with data > 1 run one engine per replica (``DataParallelEngine``), each with its share of
the requests. n-gram speculation (its device loop) on the (1, 8) mesh gives the same tokens.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

MESHES = [(1, 8), (2, 4), (4, 2), (2, 1)]  # model-split, data x model, data only
MESHES_OF_3 = [(2, 3)]  # a model with 3 K/V heads (6 query heads, MLP of 192)
PAGE, SLOTS, BUDGET, MAX_SEQ = 4, 4, 12, 40
FAST_N = 6  # requests served with the fused layout on the (1, 8) mesh


@pytest.mark.slow
def test_engine_on_meshes_matches_single_device():
    from test_sharding import run_with_devices

    res = run_with_devices([__file__, "worker"])
    ref = res["ref_tokens"]
    assert res["ref_preemptions"] > 0  # the workload exercises preemption
    assert res["ref_cached_tokens"] > 0  # and prefix sharing
    assert set(res["meshes"]) == {f"{d}x{m}" for d, m in MESHES + MESHES_OF_3}
    for mesh, r in res["meshes"].items():
        want_tokens = res["ref_of_3"] if mesh in res["meshes_of_3"] else ref
        for i, (got, want) in enumerate(zip(r["tokens"], want_tokens, strict=True)):
            assert got == want, f"mesh {mesh}, request {i}: {got} != {want}"
        assert r["preemptions"] > 0, mesh
        assert r["cached_tokens"] > 0, mesh
        assert r["generate_equal"], f"generate on the {mesh} mesh differs"
        assert r["programs"] <= r["program_bound"], mesh  # one per step shape at most
        assert r["pool_shard"] == r["pool_shard_want"], mesh
        assert min(r["tokens_per_replica"]) > 0, mesh  # every replica took a share
        assert r["pool_devices"] == r["replica_devices"], mesh  # each pool on its replica
    assert res["engine_on_data_mesh_error"].startswith("the model's mesh has data=2")
    spec = res["speculative"]  # n-gram speculation on the (1, 8) mesh
    assert spec["tokens"] == ref and spec["verify_steps"] > 0, spec
    # load_model on a data-only mesh: every device holds the whole model in the requested
    # single-device layout; generate and score equal the single-device model's.
    dp = res["data_only_load"]
    assert dp["layout"] == "fast" and dp["replicas"] == 2, dp
    assert dp["tokens"] == dp["ref_tokens"] and dp["score_err"] < 1e-5, dp
    assert dp["cancelled"], dp  # a cancelled request leaves its replica idle
    # The "fast" layout on the (1, 8) mesh (per-layer weights fused per shard, per-layer
    # pool): the same tokens, each device holding only its slice of every fused weight.
    fast = res["fast_layout"]
    assert fast["tokens"] == ref[:FAST_N], fast
    assert fast["wqkv_shard"] == fast["wqkv_shard_want"] and fast["pool_per_layer"], fast
    # Its decode loop communicates as Megatron-style tensor parallelism must and no more: one
    # all-reduce after the attention and one after the MLP of each layer, one for the
    # embedding rows, one all-gather of the logits for sampling.
    assert fast["decode_collectives"], fast  # the engine ran decode loops
    for census in fast["decode_collectives"]:
        assert census == {"all-reduce": 2 * fast["num_layers"] + 1, "all-gather": 1}, census
    # Tensor-parallel decode loops compile with their own XLA options (each iteration one
    # CUDA graph with its NCCL all-reduces); data-only replicas (one device each) do not
    # (test_tensor_parallel_reads_the_model_axis checks the options they get).
    from jaxinfer import runner

    tp = {mesh: r["tensor_parallel"] for mesh, r in res["meshes"].items()}
    assert tp == {"1x8": [True], "2x4": [True, True], "4x2": [True] * 4,
                  "2x1": [False, False], "2x3": [True, True]}, tp
    assert fast["decode_options"] == [runner.TP_DEVICE_LOOP_GRAPHS] * len(
        fast["decode_options"]), fast["decode_options"]


TP_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxinfer import runner
from sharding import make_mesh
mesh = make_mesh(data=2, model=2)
def put(spec):
    return jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, spec))
one = jnp.ones((4, 4))
split, by_data, replicated = put(P(None, "model")), put(P("data")), put(P())
tp = runner.tensor_parallel
class Inp:
    tokens = np.zeros(2, np.int32)
class Wide:
    tokens = np.zeros(runner.UNSPLIT_K_ROWS, np.int32)
class Narrower:
    tokens = np.zeros(runner.UNSPLIT_K_ROWS - 1, np.int32)
options = runner.decode_steps.options
off = {"xla_gpu_experimental_force_split_k": 1}
wide = options({"w": split}, None, None, Wide())
# XLA takes the wide options (their names and values) on this backend too
jax.jit(lambda x: x @ x, compiler_options=wide).lower(one).compile()
print({
    "split": tp({"w": split}), "data_only": tp({"w": by_data}),
    "replicated": tp({"w": replicated}), "one_device": tp({"w": one}),
    "one_device_first": tp([{"a": one}, {"b": split}]),
    "tp_options": options({"w": split}, None, None, Inp()) == runner.TP_DEVICE_LOOP_GRAPHS,
    "data_options": options({"w": by_data}, None, None, Inp()) == runner.DEVICE_LOOP_GRAPHS,
    "one_options": options({"w": one}, None, None, Inp()) == runner.DEVICE_LOOP_GRAPHS,
    "tp_wide_options": wide == {**runner.TP_DEVICE_LOOP_GRAPHS, **off},
    "tp_narrower_options": (options({"w": split}, None, None, Narrower())
                            == runner.TP_DEVICE_LOOP_GRAPHS),
    "one_wide_options": (options({"w": one}, None, None, Wide())
                         == {**runner.DEVICE_LOOP_GRAPHS, **off}),
    "one_narrower_options": (options({"w": one}, None, None, Narrower())
                             == runner.DEVICE_LOOP_GRAPHS),
    "data_wide_options": (options({"w": by_data}, None, None, Wide())
                          == {**runner.DEVICE_LOOP_GRAPHS, **off})})
"""


def test_tensor_parallel_reads_the_model_axis():
    """``runner.tensor_parallel`` on 4 forced CPU devices: a weight split over ``model`` is
    tensor-parallel; one split over ``data`` only, replicated, or on one device is not, and
    a one-device model listed first does not hide a split one after it. ``decode_steps``
    picks ``TP_DEVICE_LOOP_GRAPHS`` for the first and ``DEVICE_LOOP_GRAPHS`` for the rest;
    from ``UNSPLIT_K_ROWS`` rows either loop also turns XLA's split-K off (``UNSPLIT_K``:
    ``tp_decode_options``, ``decode_options``), and XLA compiles with those options."""
    import ast
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", TP_CHECK], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert got == {"split": True, "data_only": False, "replicated": False,
                   "one_device": False, "one_device_first": True, "tp_options": True,
                   "data_options": True, "one_options": True, "tp_wide_options": True,
                   "tp_narrower_options": True, "one_wide_options": True,
                   "one_narrower_options": True, "data_wide_options": True}, got


def _workload(n: int = 14) -> list[tuple[list[int], int, int]]:
    """``(prompt, max_new_tokens, arrival step)``: ``n`` random prompts, then five that
    share a 13-token prefix (three full pages), arriving from step 1 to 18."""
    rng = np.random.default_rng(3)
    work = [(rng.integers(3, 250, size=int(rng.integers(1, 25))).tolist(),
             int(rng.integers(4, 13)), int(rng.integers(0, 12))) for _ in range(n)]
    prefix = rng.integers(3, 250, size=13).tolist()
    return work + [(prefix + rng.integers(3, 250, size=k).tolist(), 5, arrival)
                   for k, arrival in ((3, 1), (2, 13), (4, 15), (1, 17), (3, 18))]


def _serve(engine, work, speculative=None) -> list[list[int]]:
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(work) or engine.has_unfinished():
        for i, (prompt, max_new, arrival) in enumerate(work):
            if arrival == step:
                ids[i] = engine.submit(prompt, max_new_tokens=max_new, temperature=0.0,
                                       speculative=speculative)
        engine.step()
        step += 1
    return [engine.result(ids[i]).token_ids for i in range(len(work))]


def _worker() -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import runner
    from jaxinfer.engine import Engine
    from jaxinfer.errors import InputError
    from jaxinfer.generate import Model
    from jaxinfer.model import prepare_params
    from jaxinfer.replicas import DataParallelEngine
    from sharding import make_mesh, shard_params
    from sharding.testing import tiny_config, tiny_params

    assert jax.device_count() == 8, jax.devices()
    cfg = tiny_config(num_heads=8, num_kv_heads=2)
    host = tiny_params(cfg)
    work = _workload()
    # Small pool (14 pages of 4 = 56 tokens) for 4 slots of up to 36 tokens: preemptions.
    kw = dict(num_pages=14, page_size=PAGE, max_tokens_per_step=BUDGET, max_seq_len=MAX_SEQ,
              verbose=False)
    def single(cfg: jaxinfer.LlamaConfig, host: dict) -> tuple[Model, Engine, list]:
        base = Model(cfg, jax.tree.map(jnp.asarray, host), None, jnp.float32,
                     backend="reference", max_batch=SLOTS)
        engine = Engine(base, **kw)
        return base, engine, _serve(engine, work)

    base, engine, ref = single(cfg, host)
    gen_prompts = [p for p, _, _ in work[:9]]
    ref_gen = [c.token_ids for c in jaxinfer.generate(base, gen_prompts, max_new_tokens=6)]
    out: dict = {"ref_tokens": ref, "ref_preemptions": engine.stats().num_preemptions,
                 "ref_cached_tokens": engine.stats().cached_tokens, "meshes": {}}
    cfg3 = tiny_config(num_heads=6, num_kv_heads=3, head_dim=8, intermediate_size=192)
    host3 = tiny_params(cfg3)
    base3, _, out["ref_of_3"] = single(cfg3, host3)
    ref_gen3 = [c.token_ids for c in jaxinfer.generate(base3, gen_prompts, max_new_tokens=6)]
    out["meshes_of_3"] = [f"{d}x{m}" for d, m in MESHES_OF_3]
    models = {}
    for data, model, cfg_, host_, gen_want in (
            [(d, m, cfg, host, ref_gen) for d, m in MESHES]
            + [(d, m, cfg3, host3, ref_gen3) for d, m in MESHES_OF_3]):
        mesh = make_mesh(data=data, model=model)
        mcfg, params = shard_params(cfg_, host_, mesh, jnp.float32)
        m = Model(mcfg, params, None, jnp.float32, backend="reference", max_batch=SLOTS,
                  mesh=mesh)
        models[(data, model)] = m
        engine = DataParallelEngine(m, **kw) if data > 1 else Engine(m, **kw)
        replicas = engine.replicas if data > 1 else [engine]
        pool_devices = [sorted(d.id for d in jax.tree.leaves(e.pool)[0].devices())
                        for e in replicas]  # where each pool was made
        toks = _serve(engine, work)
        stats = engine.stats()
        # generate's engine (a larger token budget) on the same mesh
        gen = [c.token_ids for c in jaxinfer.generate(m, gen_prompts, max_new_tokens=6)]
        if (data, model) == (2, 4):
            try:
                Engine(m, **kw)
                out["engine_on_data_mesh_error"] = ""
            except InputError as e:
                out["engine_on_data_mesh_error"] = str(e)
        first = replicas[0]
        out["meshes"][f"{data}x{model}"] = {
            "tokens": toks, "preemptions": stats.num_preemptions,
            "cached_tokens": stats.cached_tokens, "programs": stats.num_programs,
            "generate_equal": gen == gen_want,
            "program_bound": len(first.token_buckets) + len(first.row_buckets),
            "pool_shard": list(first.pool.k.addressable_shards[0].data.shape),
            "pool_shard_want": [cfg_.num_layers, mcfg.num_kv_heads // model, 14, PAGE,
                                cfg_.head_dim],
            "tokens_per_replica": [e.stats().generated_tokens for e in replicas],
            "pool_devices": pool_devices,
            "replica_devices": [sorted(d.id for d in row) for row in mesh.devices.tolist()],
            # what each replica's own model reads as
            "tensor_parallel": [runner.tensor_parallel(e.model.params) for e in replicas],
        }
    m = models[(1, 8)]
    # n-gram speculation's device loop on the model-split mesh: the plain tokens.
    engine = Engine(m, **kw)
    out["speculative"] = {
        "tokens": _serve(engine, work, jaxinfer.Speculative(num_tokens=3, adaptive=False)),
        "verify_steps": engine.stats().verify_steps}
    fast = dataclasses.replace(m, params=prepare_params(m.params, fuse=True, unstack=True,
                                                        shards=8))
    engine = Engine(fast, **kw)
    wqkv = fast.params["layers"][0]["wqkv"]
    with _compiled_texts(jaxinfer.engine, "decode_steps") as decode_programs:
        fast_tokens = _serve(engine, work[:FAST_N])
    out["fast_layout"] = {
        "tokens": fast_tokens,
        "decode_collectives": [_collectives(t) for _, t in decode_programs],
        "decode_options": [o for o, _ in decode_programs],
        "num_layers": cfg.num_layers,
        "wqkv_shard": list(wqkv.addressable_shards[0].data.shape),
        "wqkv_shard_want": [cfg.hidden_size, 1, wqkv.shape[2]],
        "pool_per_layer": isinstance(engine.pool.k, tuple),
    }
    out["data_only_load"] = _data_only_load(gen_prompts)
    print(json.dumps(out))


@contextlib.contextmanager
def _compiled_texts(module: Any, name: str) -> Iterator[list[tuple[dict | None, str]]]:
    """While open, every call of ``module.name`` (a ``runner.StepProgram``) also compiles the
    program it runs and appends its XLA options and optimized HLO text to the yielded list."""
    program = getattr(module, name)
    texts: list[tuple[dict | None, str]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        texts.append((program.options(*args, **kwargs),
                      program.lower(*args, **kwargs).compile().as_text()))
        return program(*args, **kwargs)

    setattr(module, name, recording)
    try:
        yield texts
    finally:
        setattr(module, name, program)


def _collectives(hlo_text: str) -> dict[str, int]:
    """How many instructions of each collective kind an optimized HLO text holds."""
    kinds = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|"
                       r"collective-permute)(?:-start)?\(", hlo_text)
    return dict(collections.Counter(kinds))


def _data_only_load(prompts: list[list[int]]) -> dict:
    import tempfile

    import jaxinfer
    from sharding import make_mesh
    from sharding.testing import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(tmp)
        kw = dict(dtype="float32", backend="reference", layout="fast")
        single = jaxinfer.load_model(path, **kw)
        dp = jaxinfer.load_model(path, mesh=make_mesh(data=2), **kw)
        gen = dict(max_new_tokens=6, temperature=0.0)
        pairs = [(p, p[:3]) for p in prompts if len(p) > 3]
        want = [r.token_logprobs for r in jaxinfer.score(single, pairs)]
        got = [r.token_logprobs for r in jaxinfer.score(dp, pairs)]
        engine = dp.engine
        rid = engine.submit(prompts[0], max_new_tokens=4)
        cancelled = engine.cancel(rid) and not engine.has_unfinished()
        return {
            "cancelled": cancelled,
            "layout": dp.layout, "replicas": len(dp.engine.replicas),
            "tokens": [c.token_ids for c in jaxinfer.generate(dp, prompts, **gen)],
            "ref_tokens": [c.token_ids for c in jaxinfer.generate(single, prompts, **gen)],
            "score_err": max(abs(a - b) for x, y in zip(got, want, strict=True)
                             for a, b in zip(x, y, strict=True)),
        }


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
