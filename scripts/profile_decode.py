"""Profile decode steps: where the time of one step goes, kernel by kernel.

Usage: ``PYTHONPATH=. python scripts/profile_decode.py --model llama-3.1-8b --batch 1
--context 1024 --steps 32 --out profile.json``

Runs ``--steps`` decode steps inside one ``runner.decode_steps`` call, the engine's decode
program (random bf16 weights in the fast layout, a per-layer page pool of random K/V with
``--context`` positions per row, greedy; ``jaxinfer.benchmark.decode_case``) under
``jax.profiler.trace``, reads the trace back with
``jax.profiler.ProfileData`` and reports, per step: wall time, summed device kernel time, the
gap between them (launch and scheduling overhead), the number of kernels, and the kernels
that take the most time. A record for bench/NOTES.md, not a test.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.benchmark import decode_case, run_decode, top_kernels
from jaxinfer.model import init_params, prepare_params
from jaxinfer.presets import resolve_config


def _device_events(trace_dir: Path) -> tuple[list[tuple[str, float, float]], list[str]]:
    """Kernel events (name, start_ns, duration_ns) on the accelerator planes of the trace,
    and the "plane / line" names seen (so a trace with an unexpected layout can be read)."""
    (path,) = trace_dir.rglob("*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(path))
    events, seen = [], []
    for plane in data.planes:
        for line in plane.lines:
            seen.append(f"{plane.name} / {line.name}")
            # Kernel timelines ("Stream #..."); skip the derived XLA op/module summary lines.
            if plane.name.startswith("/device:") and "stream" in line.name.lower():
                events.extend((e.name, e.start_ns, e.duration_ns) for e in line.events)
    return events, seen


def main() -> None:
    """Trace decode steps and summarise device time against wall time."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--backend", default="pallas")
    parser.add_argument("--out", default="profile_decode.json")
    args = parser.parse_args()

    config = resolve_config(args.model)
    params = prepare_params(init_params(config, jax.random.PRNGKey(0), jnp.bfloat16),
                            fuse=True, unstack=True)
    case = decode_case(config, params, args.backend, args.batch, args.context, args.steps,
                       jax.random.PRNGKey(1))
    jax.block_until_ready((case.pool, case.inputs))

    def run() -> float:
        # Each call restarts at --context (the pool is donated and handed back).
        t0 = time.perf_counter()
        run_decode(params, config, args.backend, case)
        return time.perf_counter() - t0

    run()  # compile
    untraced = min(run() for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            traced = run()
        events, lines_seen = _device_events(Path(tmp))

    total_ns = sum(d for _, _, d in events)
    top = top_kernels(events, 15)
    span_ns = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) if events else 0
    per_step = {
        "wall_ms_untraced": 1e3 * untraced / args.steps,
        "wall_ms_traced": 1e3 * traced / args.steps,
        "device_span_ms": span_ns / 1e6 / args.steps,
        "kernel_busy_ms": total_ns / 1e6 / args.steps,
        "kernels": len(events) / args.steps,
    }
    per_step["idle_ms"] = per_step["device_span_ms"] - per_step["kernel_busy_ms"]
    record = {
        "model": args.model, "batch": args.batch, "context": args.context,
        "steps": args.steps, "backend": args.backend, "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "per_step": per_step, "trace_lines": lines_seen[:60],
        "top_kernels": [{"name": n[:120], "count_per_step": len(ds) / args.steps,
                         "ms_per_step": sum(ds) / 1e6 / args.steps,
                         "mean_us": sum(ds) / len(ds) / 1e3} for n, ds in top],
    }
    print(json.dumps(per_step, indent=1))
    for k in record["top_kernels"]:
        print(f"{k['ms_per_step']:8.3f} ms/step {k['count_per_step']:6.1f}x "
              f"{k['mean_us']:8.1f} us  {k['name']}")
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
