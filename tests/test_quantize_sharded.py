"""Quantized weights on a tensor-parallel mesh: each device quantizes its shard of a weight
(packed int4 values, scales and zeros split alongside), and the logits equal the
single-device quantized model's, in the stacked and the fused ("fast") layout.

Two forced CPU devices in a subprocess (``tests/test_sharding.py`` explains why).
"""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.slow
def test_int4_on_a_model_split_mesh_equals_one_device():
    from test_sharding import run_with_devices

    res = run_with_devices([__file__, "worker"], n=2)
    for layout in ("stacked", "fast"):
        r = res[layout]
        assert r["max_err"] < 1e-4, (layout, r)
    # Stacked wo [L, in, out] is split on its input rows: each device holds half the packed
    # bytes and half the groups' scales.
    assert res["stacked"]["wo_q_shard"] == [2, 16, 64]
    assert res["stacked"]["wo_scale_shard"] == [2, 1, 64]
    # Fused per shard: [in / 2 bytes, 1 of 2 shards, (64 + 16 + 16) / 2 columns].
    assert res["fast"]["wqkv_q_shard"] == [32, 1, 48]
    assert "cannot split wo" in res["int8_error"]


def _worker() -> None:
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
    out: dict = {}
    for layout in ("stacked", "fast"):
        one = jaxinfer.load_model(path, dtype="float32", backend="reference", layout=layout,
                                  quantize="int4")
        split = jaxinfer.load_model(path, dtype="float32", backend="reference", layout=layout,
                                    quantize="int4", mesh=make_mesh(data=1, model=2))
        want = np.asarray(jaxinfer.compute_logits(one, prompt))
        got = np.asarray(jaxinfer.compute_logits(split, prompt))
        r = {"max_err": float(np.abs(got - want).max())}
        if layout == "stacked":
            wo = split.params["layers"]["wo"]
            r["wo_q_shard"] = list(wo.q.addressable_shards[0].data.shape)
            r["wo_scale_shard"] = list(wo.scale.addressable_shards[0].data.shape)
        else:
            wqkv = split.params["layers"][0]["wqkv"]
            r["wqkv_q_shard"] = list(wqkv.q.addressable_shards[0].data.shape)
        out[layout] = r
    try:
        jaxinfer.load_model(path, dtype="float32", quantize="int8",
                            mesh=make_mesh(data=1, model=2))
        out["int8_error"] = ""
    except InputError as e:
        out["int8_error"] = str(e)
    assert jax.device_count() == 2
    print(json.dumps(out))


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
