"""Two processes on this machine form one (data=2, model=4) mesh through ``jax.distributed``.

Each process forces 4 CPU devices and owns one data replica; the coordinator listens on
localhost. Both run the same program (SPMD) and must get the single-device tokens and logits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Hi", [{"role": "user", "content": "What is 2+2?"}]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_single_device(tmp_path):
    from sharding.testing import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model")
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(i), str(port),
                               str(model_dir)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, f"worker failed:\n{out[-2000:]}\n{err[-5000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        assert r["devices"] == [8, 4], r["devices"]
        assert r["tokens"] == r["ref_tokens"], r
        assert r["logits_max_err"] < 1e-4, r
    assert results[0]["tokens"] == results[1]["tokens"]
    # Each process owns one data replica: half the batch rows, a quarter of wq's columns.
    assert results[0]["local_wq_shards"] == [[2, 64, 16]] * 4


def _worker(process_id: int, port: int, model_dir: str) -> None:
    from sharding.multihost import initialize

    initialize(f"127.0.0.1:{port}", 2, process_id)
    import jax

    import jaxinfer
    from sharding import make_mesh

    mesh = make_mesh(data=2, model=4)
    model = jaxinfer.load_model(model_dir, dtype="float32", backend="reference", mesh=mesh)
    kw = dict(max_new_tokens=8, temperature=0.0)
    tokens = [c.token_ids for c in jaxinfer.generate(model, PROMPTS, **kw)]
    probe = model.tokenizer.encode("multi-host logits probe")
    logits = jaxinfer.compute_logits(model, probe)
    # Reference: the same model on this process's first local device only (restore's default
    # device is jax.devices()[0], which belongs to process 0).
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    single = jaxinfer.load_model(model_dir, dtype="float32", backend="reference",
                                 shardings=local)
    ref_tokens = [c.token_ids for c in jaxinfer.generate(single, PROMPTS, **kw)]
    ref_logits = jaxinfer.compute_logits(single, probe)
    wq = model.params["layers"]["wq"]
    print(json.dumps({
        "devices": [jax.device_count(), jax.local_device_count()],
        "tokens": tokens, "ref_tokens": ref_tokens,
        "logits_max_err": float(np.abs(logits - ref_logits).max()),
        "local_wq_shards": [list(s.data.shape) for s in wq.addressable_shards],
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
