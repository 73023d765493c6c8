"""Time a model layer's GEMMs through XLA on a GPU, at the row counts the engine runs.

Which kernel XLA picks for each (rows, shape) and how close it runs to its floor: the larger
of the FLOPs at the measured matmul rate and the weight bytes at the measured read rate.
A decode iteration of 256 sequences is 256 rows, a mixed step up to 4,096; a row count near
the crossover (about 200 rows on an H100 for bf16) is where a poor tile choice costs most.
Variants of the gate|up GEMM: fused (one ``[hidden, 2 * intermediate]`` weight, the fast
layout's) and as two GEMMs.

Times are device kernel time from a profiler trace (``jaxinfer.benchmark.call_kernels``),
each call on its own activations and its own weight copy.

Usage: PYTHONPATH=. python scripts/bench_gemm.py --model llama-3.1-8b --rows 64,256,4096
    --json bench/results/h100/gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.benchmark import call_kernels, layer_gemms, top_kernels
from jaxinfer.presets import PRESETS, resolve_config

COLD_BYTES = 1 << 40
"""Weight bytes a timing program cycles through: more than any call count needs, so every
call gets its own weight copy. With a copy shared by several calls, XLA merged their GEMMs
into one of more rows (r82: at 1-256 rows, up to 8x the weight's floor)."""


def gemm_call(outs: int) -> Callable[..., list[jax.Array]]:
    """``x [M, in]`` times each of ``outs`` weights ``[in, out]``: bf16 in, bf16 out."""
    def call(x: jax.Array, *ws: jax.Array) -> list[jax.Array]:
        return [x @ w for w in ws[:outs]]
    return call


def measure(name: str, rows: int, k: int, ns: list[int], *, tflops: float, tbps: float,
            calls: int, repeats: int) -> dict:
    """One GEMM (or GEMM pair) at ``rows`` rows: kernel time, rates, fraction of floor."""
    key = jax.random.key(rows * 7919 + k)
    x = jax.random.normal(key, (rows, k), jnp.bfloat16)
    ws = tuple(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02
               for i, n in enumerate(ns))
    events = call_kernels(gemm_call(len(ns)), (x, *ws), calls, repeats, cold_bytes=COLD_BYTES)
    if not events:
        raise SystemExit("bench_gemm: the profiler recorded no device kernels")
    s = sum(d for _, _, d in events) / 1e9 / (repeats * calls)
    flops = 2 * rows * k * sum(ns)
    nbytes = 2 * k * sum(ns)
    floor = max(flops / (tflops * 1e12), nbytes / (tbps * 1e12))
    kernels = [(nm, len(ds) // (repeats * calls), sum(ds) / len(ds) / 1e3)
               for nm, ds in top_kernels(events, 3)]
    row = dict(shape=name, rows=rows, k=k, n=ns, us=s * 1e6, tflops=flops / s / 1e12,
               tbps=nbytes / s / 1e12, floor_us=floor * 1e6, fraction_of_floor=floor / s,
               kernels=kernels)
    names = "; ".join(f"{nm[:48]} x{c} {us:.1f}us" for nm, c, us in kernels)
    print(f"{name:8s} m{rows:<5d} {s * 1e6:9.1f} us  {row['tflops']:6.1f} TFLOP/s  "
          f"{row['tbps']:5.2f} TB/s  {row['fraction_of_floor']:6.1%} of floor  {names}",
          flush=True)
    return row


def main() -> None:
    """Measure every GEMM of the preset's layer at each row count; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="llama-3.1-8b")
    ap.add_argument("--rows", default="64,128,256,512,4096", help="comma list of row counts")
    ap.add_argument("--shapes", default=None, help="comma list (default: all of the layer's)")
    ap.add_argument("--matmul-tflops", type=float, default=634.0, help="measured bf16 rate")
    ap.add_argument("--read-tbps", type=float, default=3.0, help="measured read bandwidth")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config = resolve_config(args.model)
    gemms = layer_gemms(config)
    names = args.shapes.split(",") if args.shapes else list(gemms)
    unknown = sorted(set(names) - set(gemms))
    if unknown:
        sys.exit(f"bench_gemm: unknown shape(s) {unknown}; choose from {sorted(gemms)}")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        sys.exit(f"bench_gemm: --rows must be a comma list of integers, got {args.rows!r}")
    print(f"{args.model} on {jax.devices()[0].device_kind}: floor = max(FLOPs at "
          f"{args.matmul_tflops} TFLOP/s, weight bytes at {args.read_tbps} TB/s)", flush=True)
    results = [measure(nm, m, gemms[nm][0], gemms[nm][1], tflops=args.matmul_tflops,
                       tbps=args.read_tbps, calls=args.calls, repeats=args.repeats)
               for m in rows for nm in names]
    if args.json:
        record = dict(command=" ".join(sys.argv), device=jax.devices()[0].device_kind,
                      jax=jax.__version__, model=args.model, results=results)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
