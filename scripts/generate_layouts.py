"""End-to-end ``generate`` decode speed per execution layout ("stacked" vs "fast").

Usage: ``python scripts/generate_layouts.py --preset llama-3.1-8b --out result.json``

Random bf16 weights of a preset's shapes (``jaxinfer.model.init_params``), a ``Model`` built
directly (no tokenizer: prompts are token ids), batch 1, greedy, no stop tokens so every run
decodes exactly ``--new-tokens``. The stacked layout runs first; its params are then converted
in place (``prepare_params(donate=True)``) to the fast layout, so both runs use the same
weights and the device never holds two copies. Per layout: the first (compiling) call's wall
time, then ``--repeats`` warm calls; TPOT is ``Completion.time_per_output_token`` (the whole
decode runs in one on-device loop, so it is decode time / (tokens - 1)). A record for notes:
it prints and writes JSON and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.generate import Model
from jaxinfer.model import init_params, prepare_params
from jaxinfer.presets import preset_config


def _run(model: Model, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """Timings of one compiling call and ``repeats`` warm calls of ``generate``."""
    t0 = time.perf_counter()
    (first,) = jaxinfer.generate(model, [prompt], max_new_tokens=new_tokens, stop_token_ids=[])
    first_s = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        (c,) = jaxinfer.generate(model, [prompt], max_new_tokens=new_tokens, stop_token_ids=[])
        warm.append({"wall_s": time.perf_counter() - t0, "ttft_s": c.time_to_first_token,
                     "tpot_s": c.time_per_output_token, "tokens": len(c.token_ids)})
    tpot = statistics.median(w["tpot_s"] for w in warm)
    return {"first_call_s": first_s, "tpot_ms_median": 1e3 * tpot,
            "decode_tok_per_s": 1.0 / tpot, "warm": warm, "token_ids": first.token_ids}


def main() -> None:
    """Measure stacked then fast for one preset; print a summary and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cfg = preset_config(args.preset)
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    init_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    result: dict[str, Any] = {
        "preset": args.preset, "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__, "batch": 1, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "backend": args.backend, "init_params_s": init_s}
    model = Model(config=cfg, params=params, tokenizer=None, dtype=jnp.bfloat16,
                  backend=args.backend, max_batch=1)
    result["stacked"] = _run(model, prompt, args.new_tokens, args.repeats)
    t0 = time.perf_counter()
    model.params = jax.block_until_ready(
        prepare_params(params, fuse=True, unstack=True, donate=True))
    del params
    result["prepare_s"] = time.perf_counter() - t0
    assert model.layout == "fast"
    result["fast"] = _run(model, prompt, args.new_tokens, args.repeats)
    a, b = result["stacked"].pop("token_ids"), result["fast"].pop("token_ids")
    result["same_greedy_tokens"] = a == b
    result["first_divergence"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                       if x != y), None)
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    for layout in ("stacked", "fast"):
        r = result[layout]
        print(f"{args.preset} {layout}: TPOT {r['tpot_ms_median']:.3f} ms = "
              f"{r['decode_tok_per_s']:.0f} tok/s, first call {r['first_call_s']:.1f} s",
              flush=True)
    print(f"same greedy tokens: {result['same_greedy_tokens']} (first divergence "
          f"{result['first_divergence']}), prepare {result['prepare_s']:.2f} s, peak "
          f"{result['peak_bytes_in_use']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
