"""Decode tok/s vs tensor-parallel size for 8B/70B-shaped Llama, next to the per-GPU roofline.

    PYTHONPATH=. python scripts/tp_scaling.py --cases 8b:1,8b:2,8b:4,70b:4,70b:2 \
        --json $OUT/tp_scaling.json                                      # 4 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \
        python scripts/tp_scaling.py --cases tiny:1,tiny:2,tiny:4 --new 8 --prompt-len 16

Random bf16 weights are made directly in shards (``sharding.random_init.random_params``) on a
``make_mesh(data=1, model=tp)`` mesh, then put in ``--layout`` (default ``fast``: per-layer
weights, QKV and gate|up fused per shard) as ``load_model`` does. ``tp=1`` runs on one device
without a mesh; a case ``8b:1m`` keeps the one-device mesh (it should match no mesh).
Decode is timed inside the on-device loop: ``generate`` with ``stop_token_ids=[]`` runs the
whole decode of ``--new`` tokens in the engine's multi-step ``runner.decode_steps`` calls; TPOT is
``Completion.time_per_output_token`` of a warm call (best of ``--repeats``, after a compile
call). Per case the per-GPU memory roofline is ``jaxinfer.roofline.decode_step_bytes / tp``
(weights + live K/V at the mean decode context) over the datasheet bandwidth of ``--device``
(default: this machine's GPU) and over the read bandwidth measured per GPU in the same
process. With ``--profile``, one more warm call per case and batch runs under
``jax.profiler.trace`` and the record gets device 0's timeline per decode step
(``benchmark.timeline_split``: busy, idle, the collective kernels' count and time and the idle
before them; the call's prefill is in it), its top 30 kernels and the kernels with the most
idle time just before them. Cases run in the given order
and the JSON is rewritten after each item; a case is skipped when ``--budget-s`` would be exceeded.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(REPO))

import jaxinfer  # noqa: E402
from jaxinfer import roofline  # noqa: E402
from jaxinfer.benchmark import (  # noqa: E402
    device_events,
    device_name,
    idle_before,
    kernel_gaps,
    timeline_split,
    top_kernels,
    trace_events,
)
from jaxinfer.generate import Model  # noqa: E402
from jaxinfer.model import apply_layout  # noqa: E402
from jaxinfer.presets import preset_config  # noqa: E402
from sharding import make_mesh  # noqa: E402
from sharding.random_init import random_params  # noqa: E402
from sharding.testing import tiny_config  # noqa: E402

MODELS = {"8b": "llama-3.1-8b", "70b": "llama-3.1-70b", "1b": "llama-3.2-1b"}
# Rough seconds a case needs (init + 2 compiles + warm calls) on H200s, for the budget guard.
EST_S = {"tiny": 5, "1b": 25, "8b": 35, "70b": 80}

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="tiny:1,tiny:2,tiny:4",
                help="comma list of model:tp (model: tiny, 1b, 8b, 70b)")
ap.add_argument("--batches", default="1,64")
ap.add_argument("--backend", default="auto")
ap.add_argument("--layout", default="fast", choices=["stacked", "fast"])
ap.add_argument("--new", type=int, default=128)
ap.add_argument("--prompt-len", type=int, default=128)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--device", default="auto",
                help="jaxinfer.roofline device preset (auto: this machine's GPU, h100 on a CPU)")
ap.add_argument("--read-gib", type=float, default=2.0, help="per-GPU bytes of the read test")
ap.add_argument("--budget-s", type=float, default=440)
ap.add_argument("--json", default=None)
ap.add_argument("--profile", action="store_true",
                help="trace one more call per case and batch: device 0's time per step")
args = ap.parse_args()
T0 = time.perf_counter()
devs = jax.devices()
rec: dict = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 device=f"{len(devs)} x {devs[0].device_kind}", jax=jax.__version__,
                 command="python " + " ".join(sys.argv), new_tokens=args.new,
                 prompt_len=args.prompt_len, layout=args.layout, items=[])


def save(**item):
    """Record one result (seconds since the start added), print it, rewrite the JSON."""
    item["t"] = round(time.perf_counter() - T0, 1)
    rec["items"].append(item)
    print(json.dumps(item), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)


def profile_call(gen: Callable[[], Any], steps: int) -> dict[str, Any]:
    """Device 0's kernel timeline of one traced ``gen()`` call, in us per decode step
    (``timeline_split``), its top 30 kernels, the 12 kernel names with the most idle
    time just before them (``idle_before``) and the 25 host events with the most summed
    time (``top_host``, the runtime's events without Python's frames: nested events each
    count their children, so this says where the host waits or works between launches);
    ``{"kernels": 0}`` where the trace holds no kernel (a CPU run)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            gen()
        events = [e for e in device_events(Path(tmp), f"/device:GPU:{devs[0].id}")
                  if not e[0].startswith("Memcpy")]
        host = [e for e in trace_events(Path(tmp), "/host:", streams_only=False)
                if not e[0].startswith("$")]  # runtime events, not Python frames
    if not events:
        return {"kernels": 0}
    split = timeline_split(events, steps)  # ns, and a count of collectives
    times = {f"{k}_us": round(v / 1e3, 2) for k, v in split.items() if k != "collectives"}

    def per_step(top: list[tuple[str, list[float]]]) -> list[dict[str, Any]]:
        # (name, durations in ns) -> name, occurrences per decode step, mean duration
        return [{"name": n[:100], "per_step": len(d) / steps,
                 "mean_us": round(sum(d) / len(d) / 1e3, 2)} for n, d in top]

    return {"kernels": len(events) / steps, "collectives": split["collectives"], **times,
            "top_kernels": per_step(top_kernels(events, 30)),
            "idle_before": [{"name": n[:100], "per_step": c / steps,
                             "idle_us_per_step": round(g / steps / 1e3, 2)}
                            for n, g, c in idle_before(kernel_gaps(events), 12)],
            "top_host": per_step(top_kernels(host, 25))}


def config_of(name: str) -> jaxinfer.LlamaConfig:
    """The config a ``--cases`` model name stands for (``tiny``: a small GQA test config)."""
    if name == "tiny":
        return tiny_config(num_heads=8, num_kv_heads=2)
    return preset_config(MODELS[name])


def read_bandwidth() -> dict:
    """Streaming-read bytes/s of every device at once: a float32 sum and a GEMV per shard."""
    n = len(devs)
    cols = 8192
    rows = max(1, int(args.read_gib * 2**30) // (2 * cols))
    mesh = Mesh(np.array(devs), ("d",))
    sh = NamedSharding(mesh, P("d", None, None))
    x = jax.jit(lambda k: jax.random.normal(k, (n, rows, cols), jnp.bfloat16),
                out_shardings=sh)(jax.random.PRNGKey(0))
    v = jax.device_put(jnp.ones((cols,), jnp.bfloat16), NamedSharding(mesh, P()))
    total = jax.jit(lambda a: jnp.sum(a, axis=(1, 2), dtype=jnp.float32))
    gemv = jax.jit(lambda a, b: a @ b)
    out = {}
    for name, fn in (("sum", lambda: total(x)), ("gemv", lambda: gemv(x, v))):
        jax.block_until_ready(fn())
        times = []
        for _ in range(5):
            t = time.perf_counter()
            r = None
            for _ in range(10):
                r = fn()
            jax.block_until_ready(r)
            times.append((time.perf_counter() - t) / 10)
        out[f"{name}_read_bw_per_gpu"] = rows * cols * 2 / statistics.median(times)
    out["read_bw_per_gpu"] = max(out["sum_read_bw_per_gpu"], out["gemv_read_bw_per_gpu"])
    out["bytes_per_gpu"] = rows * cols * 2
    return out


rng = np.random.default_rng(0)
preset = args.device
if preset == "auto":  # a GPU without a preset, or a CPU run of tiny cases: the H100's
    preset = device_name()
    preset = preset if preset in roofline.DEVICES else "h100"
spec = roofline.device_spec(preset)
rec["roofline_device"] = spec.name
try:
    bw = read_bandwidth()
    save(what="read bandwidth", **bw)
    measured_bw = bw["read_bw_per_gpu"]
except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    save(what="failed", case="read bandwidth", error=repr(e)[:500])
    measured_bw = None
gc.collect()

batches = [int(b) for b in args.batches.split(",")]
for case in args.cases.split(","):
    name, tp_s = case.split(":")
    keep_mesh = tp_s.endswith("m")
    tp = int(tp_s.rstrip("m"))
    cfg0 = config_of(name)
    pbytes = roofline.param_bytes(cfg0)
    left = args.budget_s - (time.perf_counter() - T0)
    if left < EST_S.get(name, 60) * (1.5 if tp == 1 else 1):
        save(what="skipped: budget", model=name, tp=tp, seconds_left=round(left, 1))
        continue
    if tp > len(devs):
        save(what="skipped: devices", model=name, tp=tp, devices=len(devs))
        continue
    model = params = gen = None
    for backend in dict.fromkeys([args.backend, "reference"]):
        try:
            t = time.perf_counter()
            mesh = make_mesh(data=1, model=tp)
            cfg, params = random_params(cfg0, mesh, jnp.bfloat16)
            params = apply_layout(params, args.layout, mesh=mesh, donate=True)
            jax.block_until_ready(params)
            init_s = time.perf_counter() - t
            per_dev = {str(d.id): 0 for d in mesh.devices.flat}
            for leaf in jax.tree.leaves(params):
                for s in leaf.addressable_shards:
                    per_dev[str(s.device.id)] += s.data.nbytes
            save(what="init", model=name, tp=tp, init_s=round(init_s, 2),
                 param_bytes_total=pbytes, param_bytes_per_gpu=per_dev,
                 kv_heads=cfg.num_kv_heads)
            # No EOS: every row decodes exactly --new tokens (random weights can emit one).
            model = Model(dataclasses.replace(cfg, eos_token_ids=()), params, None,
                          jnp.bfloat16, backend=backend,
                          mesh=None if tp == 1 and not keep_mesh else mesh)
            for batch in batches:
                prompts = [rng.integers(3, min(cfg.vocab_size, 30000), args.prompt_len).tolist()
                           for _ in range(batch)]

                def gen(model=model, prompts=prompts):
                    return jaxinfer.generate(model, prompts, max_new_tokens=args.new,
                                             stop_token_ids=[])

                t = time.perf_counter()
                gen()
                compile_s = time.perf_counter() - t
                best = None
                for _ in range(args.repeats):
                    outs = gen()
                    tpot = float(np.mean([o.time_per_output_token for o in outs]))
                    ttft = float(np.mean([o.time_to_first_token for o in outs]))
                    if best is None or tpot < best[0]:
                        best = (tpot, ttft, min(len(o.token_ids) for o in outs))
                tpot, ttft, ntok = best
                ctx = args.prompt_len + args.new // 2  # mean context during decode
                step_bytes = roofline.decode_step_bytes(cfg0, batch, ctx) / tp
                roof_dt = batch / (step_bytes / spec.bandwidth)
                roof_meas = batch / (step_bytes / measured_bw) if measured_bw else None
                tps = batch / tpot
                save(what="decode", model=name, preset=MODELS.get(name, name), tp=tp,
                     mesh=keep_mesh or tp > 1, batch=batch, backend=backend, tokens_per_row=ntok,
                     tpot_ms=round(tpot * 1e3, 3), decode_tok_per_s=round(tps, 1),
                     ttft_ms=round(ttft * 1e3, 1), first_call_s=round(compile_s, 1),
                     step_bytes_per_gpu=int(step_bytes), mean_context=ctx,
                     roofline_tok_per_s_datasheet=round(roof_dt, 1),
                     roofline_tok_per_s_measured_bw=None if roof_meas is None
                     else round(roof_meas, 1),
                     frac_of_datasheet_roofline=round(tps / roof_dt, 3),
                     achieved_bw_per_gpu=step_bytes / tpot)
                if args.profile:
                    save(what="profile", model=name, tp=tp, batch=batch,
                         **profile_call(gen, args.new))
            break
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            save(what="failed", model=name, tp=tp, backend=backend, error=repr(e)[:800])
            if "RESOURCE_EXHAUSTED" in repr(e) or "out of memory" in repr(e).lower():
                break
        finally:
            # ``gen`` holds the model as a default argument: drop it too, or the last case's
            # params stay on the GPUs (run 1's 70B tp=1 attempt ran out of memory that way).
            model = params = gen = None
            gc.collect()
print("done", round(time.perf_counter() - T0, 1), flush=True)
