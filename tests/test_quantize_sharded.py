"""Quantized weights on a tensor-parallel mesh: each device quantizes its shard of a weight
(packed int4 values, scales and zeros split alongside), and the logits equal the
single-device quantized model's (fused "fast" layout: column- and row-split weights). An
act-order GPTQ folder (int4 as stored, rows in group order) splits the same way.

Two forced CPU devices in a subprocess (``tests/test_sharding.py`` explains why).
"""

from __future__ import annotations

import json
import sys

import pytest


def test_repeated_kv_heads_of_an_int4_weight_are_its_heads_repeated():
    # What a model split wider than its K/V heads does to a stored int4 wk / wv (AWQ / GPTQ).
    import numpy as np

    from jaxinfer.quantize import quantize_params
    from sharding.rules import expand_kv_heads
    from sharding.testing import tiny_config, tiny_params

    cfg = tiny_config(num_heads=8, num_kv_heads=2)
    layers = tiny_params(cfg)["layers"]
    params = quantize_params({"layers": {k: layers[k] for k in ("wk", "wv")}}, "int4")
    cfg4, rep = expand_kv_heads(cfg, params, 4)
    plain = {"layers": {k: params["layers"][k].dequantize() for k in ("wk", "wv")}}
    _, want = expand_kv_heads(cfg, plain, 4)
    assert cfg4.num_kv_heads == 8
    for k in ("wk", "wv"):
        assert rep["layers"][k].shape == (2, 64, 8 * 8)
        np.testing.assert_array_equal(rep["layers"][k].dequantize(), want["layers"][k])


@pytest.mark.slow
def test_int4_on_a_model_split_mesh_equals_one_device(tmp_path):
    import numpy as np
    import torch
    from test_hf_quantized import PROMPT, loaded_linears, torch_logits, write_packed_folder
    from test_sharding import run_with_devices

    from checkpoints.hf import load_hf_checkpoint

    # The act-order GPTQ model's logits: HF transformers' float32 model of its loaded weights.
    oracle = write_packed_folder(tmp_path / "g32", "gptq", 32, act_order=True)
    with torch.no_grad():
        for name, w in loaded_linears(load_hf_checkpoint(tmp_path / "g32")[1]).items():
            oracle.get_submodule(name).weight.copy_(torch.from_numpy(w))
    np.save(tmp_path / "want.npy", torch_logits(oracle, PROMPT))
    write_packed_folder(tmp_path / "g64", "gptq", 64)
    res = run_with_devices([__file__, "worker", str(tmp_path)], n=2)
    assert res["max_err"] < 1e-4, res
    # wo [in, out] is split on its input rows: each device holds half the packed bytes and
    # half the groups' scales.
    assert res["wo_q_shard"] == [16, 64] and res["wo_scale_shard"] == [1, 64]
    # Fused per shard: [in / 2 bytes, 1 of 2 shards, (64 + 16 + 16) / 2 columns].
    assert res["wqkv_q_shard"] == [32, 1, 48]
    assert "cannot split wo" in res["int8_error"]
    # fp8: w_down [128, 64] split on its rows has a scale row per device.
    assert res["fp8_max_err"] < 1e-4 and res["fp8_down_scale"] == [[2, 64], [1, 64]], res
    assert res["fp8_generate_equal"], res  # through the engine too
    # Act-order GPTQ: HF's logits; wo's 64 input rows, 32 a device, its row order replicated.
    assert res["gptq_max_err"] < 1e-4, res
    assert res["gptq_wo_q_shard"] == [16, 64] and res["gptq_wo_perm_shard"] == [64]
    assert "groups of 64 input rows, but split over model=2" in res["gptq_g64_error"]


def _worker(folders: str) -> None:
    import tempfile
    from pathlib import Path

    import jax
    import numpy as np

    import jaxinfer
    from jaxinfer.errors import InputError
    from sharding import make_mesh
    from sharding.testing import write_tiny_model

    path = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    prompt = [5, 9, 2, 77, 31, 8, 100]
    # The fused, per-layer layout: column-split fused weights and row-split wo / w_down.
    one = jaxinfer.load_model(path, dtype="float32", backend="reference", layout="fast",
                              quantize="int4")
    split = jaxinfer.load_model(path, dtype="float32", backend="reference", layout="fast",
                                quantize="int4", mesh=make_mesh(data=1, model=2))
    want = np.asarray(jaxinfer.compute_logits(one, prompt))
    got = np.asarray(jaxinfer.compute_logits(split, prompt))
    layer = split.params["layers"][0]
    out = {"max_err": float(np.abs(got - want).max()),
           "wo_q_shard": list(layer["wo"].q.addressable_shards[0].data.shape),
           "wo_scale_shard": list(layer["wo"].scale.addressable_shards[0].data.shape),
           "wqkv_q_shard": list(layer["wqkv"].q.addressable_shards[0].data.shape)}
    # fp8 on the same mesh: a row-split weight gets one scale per column and device; the
    # split model's logits equal one device running the same quantized weights.
    import dataclasses

    fp8 = jaxinfer.load_model(path, dtype="float32", backend="reference", layout="fast",
                              quantize="fp8", mesh=make_mesh(data=1, model=2))
    gathered = jax.tree.map(lambda a: jax.device_put(np.asarray(a), jax.devices()[0]),
                            fp8.params)
    fp8_one = dataclasses.replace(fp8, params=gathered, mesh=None)
    out["fp8_max_err"] = float(np.abs(np.asarray(jaxinfer.compute_logits(fp8, prompt))
                                      - np.asarray(jaxinfer.compute_logits(fp8_one, prompt))
                                      ).max())
    gen = [[c.token_ids for c in jaxinfer.generate(m, [prompt], max_new_tokens=6,
                                                    temperature=0.0)] for m in (fp8, fp8_one)]
    out["fp8_generate_equal"] = gen[0] == gen[1]
    down = fp8.params["layers"][0]["w_down"]
    out["fp8_down_scale"] = [list(down.scale.shape),
                             list(down.scale.addressable_shards[0].data.shape)]
    try:
        jaxinfer.load_model(path, dtype="float32", quantize="int8",
                            mesh=make_mesh(data=1, model=2))
        out["int8_error"] = ""
    except InputError as e:
        out["int8_error"] = str(e)
    from test_hf_quantized import PROMPT

    split = jaxinfer.load_model(Path(folders) / "g32", dtype="float32", backend="reference",
                                layout="fast", mesh=make_mesh(data=1, model=2))
    want = np.load(Path(folders) / "want.npy")
    out["gptq_max_err"] = float(np.abs(np.asarray(jaxinfer.compute_logits(split, PROMPT))
                                       - want).max())
    wo = split.params["layers"][0]["wo"]
    out["gptq_wo_q_shard"] = list(wo.q.addressable_shards[0].data.shape)
    out["gptq_wo_perm_shard"] = list(wo.perm.addressable_shards[0].data.shape)
    try:
        jaxinfer.load_model(Path(folders) / "g64", mesh=make_mesh(data=1, model=2))
        out["gptq_g64_error"] = ""
    except InputError as e:
        out["gptq_g64_error"] = str(e)
    assert jax.device_count() == 2
    print(json.dumps(out))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])
