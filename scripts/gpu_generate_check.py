"""Run ``generate`` on an accelerator with both attention backends and record what it did.

Usage: ``python scripts/gpu_generate_check.py --model PATH_OR_NAME --out results.json``

For each backend: chat answers (greedy, bf16) with their timings, and the float32 logits of
one prompt compared between backends. A record for notes, not a test: it prints and writes
JSON, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import jaxinfer

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for sleeping better.",
]


def main() -> None:
    """Generate with each backend, compare them, print a summary and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=jaxinfer.DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the generate runs")
    parser.add_argument("--out", default="gpu_generate_check.json")
    args = parser.parse_args()

    record: dict[str, object] = {
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "dtype": args.dtype,
        "matmul_precision": str(jax.config.jax_default_matmul_precision), "runs": {},
    }
    tokens: dict[str, list[list[int]]] = {}
    for backend in ("reference", "pallas"):
        model = jaxinfer.load_model(args.model, backend=backend, dtype=args.dtype)
        t0 = time.perf_counter()
        outs = jaxinfer.generate(model, PROMPTS, chat=True, max_new_tokens=args.max_new_tokens)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = jaxinfer.generate(model, PROMPTS, chat=True, max_new_tokens=args.max_new_tokens)
        warm = time.perf_counter() - t0
        generated = sum(len(o.token_ids) for o in outs)
        tokens[backend] = [o.token_ids for o in outs]
        record["runs"][backend] = {
            "cold_s": cold, "warm_s": warm, "tokens": generated,
            "batch_tok_per_s": generated / warm,
            "ttft_s": [o.time_to_first_token for o in outs],
            "tpot_ms": [1e3 * o.time_per_output_token for o in outs],
            "texts": [o.text for o in outs],
        }
        print(f"== {backend}: cold {cold:.2f}s warm {warm:.3f}s {generated / warm:.0f} tok/s")
        for p, o in zip(PROMPTS, outs, strict=True):
            print(f"  Q: {p}\n  A: {o.text!r} ({o.finish_reason}, "
                  f"TPOT {1e3 * o.time_per_output_token:.2f} ms)")
    record["same_tokens"] = tokens["reference"] == tokens["pallas"]
    ids = jaxinfer.load_model(args.model).tokenizer.encode(PROMPTS[1] * 8)
    logits = {b: jaxinfer.compute_logits(jaxinfer.load_model(args.model, dtype="float32",
                                                             backend=b), ids)
              for b in ("reference", "pallas")}
    diff = float(np.abs(logits["reference"] - logits["pallas"]).max())
    record["float32_logits_max_abs_diff"] = diff
    print(f"same greedy tokens across backends ({args.dtype}): {record['same_tokens']}; "
          f"float32 logits max |diff| over {len(ids)} tokens: {diff:.2e}")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
