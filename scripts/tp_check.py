"""Tensor parallel tp=2 vs tp=1 on random Llama weights: greedy tokens, float32 logits, tok/s.

    PYTHONPATH=. python scripts/tp_check.py --preset 1b --json out.json   # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. \
        python scripts/tp_check.py --preset tiny                            # CPU

float32: batch-4 greedy tokens and ``compute_logits`` of one prompt, tp=1 vs tp=2.
bfloat16: decode tok/s at batch 1 and 64 (second call of each shape; the first compiles) and
where tp=2's greedy tokens first differ from tp=1's. Params are ``init_params``'s stacked
layout (not the "fast" layout load_model picks on one GPU). A wall-clock guard skips what is
left after ``--budget-s`` seconds; the JSON is rewritten after every item.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.generate import Model, compute_logits
from jaxinfer.model import init_params
from sharding import make_mesh, shard_params

PRESETS = {
    "1b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                               rope_theta=500000.0, max_position_embeddings=8192,
                               tie_word_embeddings=True, eos_token_ids=(128001,)),
    "tiny": jaxinfer.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=512),
}

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
ap.add_argument("--backend", default="auto")
ap.add_argument("--new", type=int, default=128)
ap.add_argument("--prompt-len", type=int, default=128)
ap.add_argument("--budget-s", type=float, default=150)
ap.add_argument("--json", default=None)
args = ap.parse_args()
T0 = time.perf_counter()
cfg = PRESETS[args.preset]
rec: dict = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 device=f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
                 jax=jax.__version__, command="python " + " ".join(sys.argv), preset=args.preset,
                 items=[])


def save(**item):
    """Record one result (seconds since the start added), print it, rewrite the JSON."""
    item["t"] = round(time.perf_counter() - T0, 1)
    rec["items"].append(item)
    print(json.dumps(item), flush=True)
    if args.json:
        json.dump(rec, open(args.json, "w"), indent=1)


rng = np.random.default_rng(0)
prompts = [rng.integers(3, min(cfg.vocab_size, 30000), args.prompt_len).tolist() for _ in range(64)]
mesh = make_mesh(data=1, model=2)


def models(dtype, backend):
    """The preset's random model in ``dtype`` on one device and on the 2-way model mesh,
    by tensor-parallel size."""
    p = init_params(cfg, jax.random.PRNGKey(0), dtype)
    m1 = Model(cfg, p, None, dtype, backend=backend)
    cfg2, p2 = shard_params(cfg, p, mesh, dtype)
    m2 = Model(cfg2, p2, None, dtype, backend=backend, mesh=mesh)
    return {1: m1, 2: m2}


def gen(m, batch):
    """Greedy completions of the first ``batch`` prompts."""
    outs = jaxinfer.generate(m, prompts[:batch], max_new_tokens=args.new)
    return outs


def run(dtype, backend):
    """Compare tp=1 with tp=2 in ``dtype`` on ``backend``: in float32 the greedy tokens and
    the prompt's logits; otherwise decode speed and TTFT at batch 1 and 64 (within the time
    budget) and where the two sizes' greedy tokens first differ."""
    ms = models(dtype, backend)
    name = jnp.dtype(dtype).name
    if dtype == jnp.float32:
        toks = {tp: [o.token_ids for o in gen(m, 4)] for tp, m in ms.items()}
        lg = {tp: np.asarray(compute_logits(m, prompts[0]), np.float32) for tp, m in ms.items()}
        d = np.abs(lg[1] - lg[2])
        save(what="float32 tp1 vs tp2", backend=backend, batch=4, new_tokens=args.new,
             greedy_equal=toks[1] == toks[2],
             tokens_per_row=[len(t) for t in toks[1]],
             logits_max_abs_diff=float(d.max()), logits_max_abs=float(np.abs(lg[1]).max()),
             argmax_equal_frac=float((lg[1].argmax(-1) == lg[2].argmax(-1)).mean()))
        return
    res = {}
    for batch in (1, 64):
        for tp, m in ms.items():
            if time.perf_counter() - T0 > args.budget_s:
                save(what="skipped: budget", dtype=name, batch=batch, tp=tp)
                continue
            gen(m, batch)  # compile
            t = time.perf_counter()
            outs = gen(m, batch)
            wall = time.perf_counter() - t
            tpot = float(np.mean([o.time_per_output_token for o in outs]))
            res[(batch, tp)] = [o.token_ids for o in outs]
            n = sum(len(o.token_ids) for o in outs)
            save(what="decode", dtype=name, backend=backend, tp=tp, batch=batch,
                 new_tokens=args.new, prompt_len=args.prompt_len,
                 decode_tok_per_s=batch / tpot, tpot_ms=tpot * 1e3,
                 ttft_ms=float(np.mean([o.time_to_first_token for o in outs])) * 1e3,
                 wall_s=wall, output_tokens=n)
        if (batch, 1) in res and (batch, 2) in res:
            a, b = res[(batch, 1)], res[(batch, 2)]
            first = [next((i for i, (x, y) in enumerate(zip(r, s, strict=False)) if x != y),
                          None if len(r) == len(s) else min(len(r), len(s)))
                     for r, s in zip(a, b, strict=True)]
            save(what="bf16 greedy tp1 vs tp2", batch=batch,
                 rows_identical=sum(f is None for f in first),
                 rows=len(first), first_divergence=[f for f in first if f is not None][:16])


for dtype in (jnp.float32, jnp.bfloat16):
    for backend in dict.fromkeys([args.backend, "reference"]):
        try:
            run(dtype, backend)
            break
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            save(what="failed", dtype=jnp.dtype(dtype).name, backend=backend, error=repr(e)[:500])
