"""Profile the engine's steps on a serving workload: where device time goes, kernel by kernel.

Usage: ``PYTHONPATH=. python scripts/profile_engine.py --model llama-3.2-1b --requests 512
--trace-steps 12 --out profile_engine.json`` (``--score`` profiles scoring requests instead)

Random bf16 weights in the execution layout ``load_model`` would pick, ``Engine(model)`` with
its defaults (``--max-batch`` and ``--token-budget`` shrink it, and so the step programs its
warm-up compiles: a 70B model's ~20 take ~6 minutes), a log-uniform workload (prompts 32-1,024
tokens, outputs 16-512, all at once, as ``scripts/bench_engine.py``). After ``--skip-steps``
untraced steps it traces ``--trace-steps`` engine steps with ``jax.profiler.trace``, reads the
trace back with ``jax.profiler.ProfileData`` and prints: the wall time of each traced step and
its kind (mixed step with its token bucket, or decode call with its rows and iterations), the
summed kernel time, and the kernels that take the most time. A record for bench/NOTES.md, not a
test.

``--batch1 N`` profiles single-request decode instead: one 128-token prompt, its N new
tokens traced after the prompt step, every kernel reported per generated token (count and
microseconds), with the kernel-time and first-to-last-kernel span per token (bench/NOTES.md
r37), and the idle device time just before each kernel name within an engine step
(``benchmark.idle_before``: where the span's gaps sit, the host's time between steps left
out; r111-r112 found a change that removed kernels but added idle time).
``--quantize int4-g128`` (any of ``jaxinfer.quantize.QUANTIZATIONS``) profiles random
weights quantized at those shapes (one device). ``--tp N`` shards the model over N local
devices (``make_mesh(data=1, model=N)``, weights made in shards); kernels are then counted
on the first device, where the collectives show up beside the GEMMs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.benchmark import (
    device_events,
    idle_before,
    kernel_gaps,
    quantized_copy,
    top_kernels,
    trace_events,
)
from jaxinfer.model import apply_layout, init_params, one_device_layout
from jaxinfer.presets import preset_config
from jaxinfer.quantize import QUANTIZATIONS, random_quantized_params
from jaxinfer.requests import Model
from sharding import make_mesh
from sharding.random_init import random_params


def profile_batch1(engine: jaxinfer.Engine, model: Model, new_tokens: int, out: str,
                   spec: jaxinfer.Speculative | None = None, timeline: str | None = None
                   ) -> None:
    """Trace one request's decode calls (with ``spec``: its speculation loop calls); print
    and record its kernels per generated token (on the first device of a mesh: each device
    runs the same kernels on its shard), and the host's wall time per engine step. With
    ``timeline``, also write the traced steps' kernels in order there (``write_timeline``)."""
    prompt = [(100 + i) % model.config.vocab_size for i in range(128)]
    engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True, speculative=spec)
    engine.run_until_done()  # the decode call lengths settle on measured times
    engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True, speculative=spec)
    engine.step()  # the prompt
    tokens, step_ms = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            while engine.has_unfinished():
                t0 = time.perf_counter()
                with jax.profiler.TraceAnnotation(f"{STEP_MARK}{len(step_ms)}"):
                    tokens += sum(len(new) for _, new, _ in engine.step())
                step_ms.append(1e3 * (time.perf_counter() - t0))
        events = device_events(Path(tmp), "/device:GPU:0" if model.mesh is not None else
                               "/device:")
        per_step = step_kernels(host_marks(Path(tmp)), events)
        if timeline and events:
            write_timeline(Path(timeline), per_step, host_lines(Path(tmp)))
    if not events:
        raise SystemExit("profile_engine: the trace holds no accelerator kernels (a CPU run?)")
    kernel_ms = sum(d for _, _, d in events) / 1e6 / tokens
    span_ms = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / 1e6 / tokens
    top = top_kernels(events, 40)
    # Gaps inside each engine step: the host's round trip between steps is not a launch gap.
    idle = idle_before([g for _, ks in per_step for g in kernel_gaps(ks)], 12)
    record = {
        "model": model.name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "tp": 1 if model.mesh is None else model.mesh.size,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "tokens": tokens,
        "kernel_ms_per_token": kernel_ms, "span_ms_per_token": span_ms,
        "kernels_per_token": len(events) / tokens, "speculative": repr(spec),
        "steps": len(step_ms), "step_wall_ms_median": float(np.median(step_ms)),
        "step_kernel_ms_mean": sum(d for _, _, d in events) / 1e6 / len(step_ms),
        "top_kernels": [{"name": n[:100], "per_token": len(ds) / tokens,
                         "us_per_token": sum(ds) / 1e3 / tokens,
                         "mean_us": sum(ds) / len(ds) / 1e3} for n, ds in top],
        "idle_before": [{"name": n[:100], "per_token": c / tokens,
                         "idle_us_per_token": g / 1e3 / tokens} for n, g, c in idle],
    }
    print(f"{tokens} tokens: {kernel_ms:.3f} ms of kernels per token, first-to-last span "
          f"{span_ms:.3f} ms, {record['kernels_per_token']:.1f} kernels per token; "
          f"{len(step_ms)} engine steps: wall {record['step_wall_ms_median']:.2f} ms median, "
          f"kernels {record['step_kernel_ms_mean']:.2f} ms mean")
    for k in record["top_kernels"]:
        print(f"{k['us_per_token']:9.1f} us/token {k['per_token']:6.1f}/token "
              f"{k['mean_us']:8.2f} us  {k['name']}")
    print("idle device time just before a kernel, within engine steps (under the profiler):")
    for k in record["idle_before"]:
        print(f"{k['idle_us_per_token']:9.1f} us/token before {k['per_token']:6.1f}/token  "
              f"{k['name']}")
    Path(out).write_text(json.dumps(record, indent=1))


TIMELINE_GAP_NS = 20_000
"""Gaps from this long (20 us) on get the host's events around them in a timeline file."""


def host_lines(trace_dir: Path) -> list[tuple[str, str, float, float]]:
    """Every host event ``(thread line, name, start_ns, duration_ns)`` of a trace."""
    (path,) = trace_dir.rglob("*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(path))
    return [(line.name, e.name, e.start_ns, e.duration_ns) for plane in data.planes
            if plane.name.startswith("/host:") for line in plane.lines for e in line.events]


def write_timeline(path: Path, steps: list[tuple[tuple[str, float, float],
                                                  list[tuple[str, float, float]]]],
                   host: list[tuple[str, str, float, float]]) -> None:
    """Write each step's kernels in start order, a line each: start (us from the step's
    mark), idle gap before it, duration, name. After each gap of ``TIMELINE_GAP_NS`` or more,
    up to 6 host events that cover at least half of it, innermost (shortest) first: what the
    host was doing meanwhile. The census's idle totals do not say whether a gap recurs every
    iteration or once a call; this does."""
    starts = np.array([h[2] for h in host], np.float64)
    ends = starts + np.array([h[3] for h in host], np.float64)
    lines = []
    for (mark, m0, mdur), ks in steps:
        lines.append(f"== {mark}: {mdur / 1e3:.1f} us, {len(ks)} kernels")
        busy_end = None
        for name, start, dur in ks:
            gap = 0.0 if busy_end is None else max(0.0, start - busy_end)
            lines.append(f"{(start - m0) / 1e3:10.1f} {gap / 1e3:8.1f} {dur / 1e3:8.1f}  "
                         f"{name[:90]}")
            if gap >= TIMELINE_GAP_NS:
                cover = np.minimum(ends, start) - np.maximum(starts, busy_end)
                near = sorted(np.flatnonzero(cover >= gap / 2), key=lambda i: host[i][3])[:6]
                lines.extend(f"{'':30}host {host[i][3] / 1e3:9.1f} us  [{host[i][0][:24]}] "
                             f"{host[i][1][:70]}" for i in near)
            busy_end = start + dur if busy_end is None else max(busy_end, start + dur)
    path.write_text("\n".join(lines) + "\n")


STEP_MARK = "jaxinfer_engine_step_"
"""Name prefix of the host trace annotation around each traced ``engine.step()``."""


def host_marks(trace_dir: Path) -> list[tuple[str, float, float]]:
    """The ``STEP_MARK`` annotations ``(name, start_ns, duration_ns)`` of a trace's host
    planes."""
    return [e for e in trace_events(trace_dir, "/host:", streams_only=False)
            if e[0].startswith(STEP_MARK)]


def step_kernels(marks: list[tuple[str, float, float]],
                 kernels: list[tuple[str, float, float]]
                 ) -> list[tuple[tuple[str, float, float], list[tuple[str, float, float]]]]:
    """Each host mark ``(name, start_ns, duration_ns)``, by start time, with its kernels in
    start order: a kernel belongs to the step whose mark it starts in (kernels share the
    host's clock in a ``jax.profiler`` trace)."""
    return [(m, sorted((k for k in kernels if m[1] <= k[1] < m[1] + m[2]), key=lambda k: k[1]))
            for m in sorted(marks, key=lambda m: m[1])]


def step_timelines(per_step: list[tuple[tuple[str, float, float],
                                         list[tuple[str, float, float]]]]) -> list[dict]:
    """Where a step's wall time goes on the device, one dict per host mark (by start time).

    ``per_step`` is ``step_kernels``' output: each host annotation ``(name, start_ns,
    duration_ns)`` around a step with the device events that start in it. Per step: kernel
    count and summed time; ``lead`` from the step's start to its first kernel (planning,
    input transfers, dispatch); ``span`` from first kernel start to last kernel end; ``idle``
    the time inside the span with no kernel running (launch gaps); ``tail`` from the last
    kernel to the step's end (results to the host, output processing); the largest gap and
    the kernel after it. Milliseconds."""
    out = []
    for (_, m0, mdur), ks in per_step:
        if not ks:
            out.append(dict(kernels=0, kernel_ms=0.0, lead_ms=mdur / 1e6, span_ms=0.0,
                            idle_ms=0.0, tail_ms=0.0, max_gap_ms=0.0, max_gap_before=""))
            continue
        gaps = kernel_gaps(ks)
        before, gap = max(gaps, key=lambda g: g[1])
        busy_end = max(s + d for _, s, d in ks)
        out.append(dict(kernels=len(ks), kernel_ms=sum(k[2] for k in ks) / 1e6,
                        lead_ms=(ks[0][1] - m0) / 1e6, span_ms=(busy_end - ks[0][1]) / 1e6,
                        idle_ms=sum(g for _, g in gaps) / 1e6,
                        tail_ms=max(0.0, m0 + mdur - busy_end) / 1e6,
                        max_gap_ms=gap / 1e6, max_gap_before=before[:60]))
    return out


def kernel_rows(top: list[tuple[str, list[float]]], tokens: int | None = None) -> list[dict]:
    """``top_kernels``' output as records: name, count, summed ms and mean us, and with
    ``tokens`` the us per token."""
    return [{"name": name[:100], "count": len(ds), "ms": sum(ds) / 1e6,
             "mean_us": sum(ds) / len(ds) / 1e3,
             **({} if tokens is None else {"us_per_token": sum(ds) / 1e3 / tokens})}
            for name, ds in top]


def kernels_by_kind(steps: list[dict], kernels: list[tuple[tuple[str, float, float],
                                                            list[tuple[str, float, float]]]],
                    n: int = 15) -> dict[str, list[dict]]:
    """The ``n`` kernels with the most time in each kind of step (``"decode"``, ``"mixed"``),
    ``steps`` the step records (``kind``, ``computed_tokens``) and ``kernels`` their kernels
    (``step_kernels``, same order): count, summed ms, mean us and us per token computed in
    steps of that kind. The overall list mixes prefill GEMMs with decode ones; a decode
    iteration's cost per token is what batch decoding is judged by."""
    out = {}
    for kind in sorted({s["kind"] for s in steps}):
        chosen = [ks for s, (_, ks) in zip(steps, kernels, strict=True) if s["kind"] == kind]
        tokens = max(1, sum(s["computed_tokens"] for s in steps if s["kind"] == kind))
        out[kind] = kernel_rows(top_kernels([k for ks in chosen for k in ks], n), tokens)
    return out


def main() -> None:
    """Run the workload, trace some steps, print and record the kernel summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="a jaxinfer.presets name")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--skip-steps", type=int, default=20)
    ap.add_argument("--trace-steps", type=int, default=12)
    ap.add_argument("--score", action="store_true", help="scoring requests (8-token tails)")
    ap.add_argument("--batch1", type=int, default=0, metavar="N",
                    help="profile one request's N decode tokens instead of the workload")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a mesh)")
    ap.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                    help="random weights quantized so (one device)")
    ap.add_argument("--draft", default=None, metavar="PRESET",
                    help="with --batch1: speculate with a draft model of this preset's shapes "
                         "(random weights; 'self' = the target; a quantization method such "
                         "as int4-g128 = the target's weights quantized so), every step (not "
                         "adaptive)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="engine slots (fewer: fewer step programs to compile)")
    ap.add_argument("--token-budget", type=int, default=None,
                    help="the engine's max_tokens_per_step (smaller: fewer step programs)")
    ap.add_argument("--out", default="profile_engine.json")
    ap.add_argument("--timeline", default=None, metavar="PATH",
                    help="with --batch1: also write every traced kernel in order, with the "
                         "idle gap before it and the host's events during long gaps")
    args = ap.parse_args()
    if not 1 <= args.tp <= jax.local_device_count():
        ap.error(f"--tp {args.tp}: this machine has {jax.local_device_count()} devices")
    if args.quantize is not None and args.tp > 1:
        ap.error("--quantize profiles one device: leave --tp at 1")
    if args.draft is not None and not args.batch1:
        ap.error("--draft profiles single-request decode: pass --batch1 N too")
    if any(n is not None and n < 1 for n in (args.max_batch, args.token_budget)):
        ap.error("--max-batch and --token-budget must be positive")

    # An 8k context, as bench_engine's presets: block tables are as wide as the context.
    cfg = dataclasses.replace(preset_config(args.model), max_position_embeddings=8192)
    mesh = make_mesh(data=1, model=args.tp) if args.tp > 1 else None
    if args.quantize is not None:  # quantized a layer at a time: no bf16 copy of the model
        params = random_quantized_params(cfg, args.quantize, jax.random.PRNGKey(0))
    elif mesh is None:
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    else:  # made in shards; the config may repeat K/V heads to fill the model axis
        cfg, params = random_params(cfg, mesh, jnp.bfloat16)
    params = apply_layout(params, "auto", mesh=mesh, donate=True)
    if mesh is None:  # as load_model does
        params = one_device_layout(params, jax.devices()[0])
    model = Model(cfg, params, None, jnp.bfloat16, name=args.model, mesh=mesh)
    sizes = dict(max_batch=args.max_batch, max_tokens_per_step=args.token_budget)
    engine = jaxinfer.Engine(model, **{k: v for k, v in sizes.items() if v is not None})
    spec = None
    if args.draft is not None:
        draft = model
        if args.draft in QUANTIZATIONS:  # the target's quantized copy
            draft = quantized_copy(model, args.draft)
        elif args.draft != "self":
            dcfg = preset_config(args.draft)
            dparams = init_params(dcfg, jax.random.PRNGKey(1), jnp.bfloat16)
            draft = Model(dcfg, apply_layout(dparams, "auto", donate=True), None,
                          jnp.bfloat16, name=args.draft)
        spec = jaxinfer.Speculative(method="draft", draft=draft, adaptive=False)
    engine.warmup(generate=not args.score, score=args.score, speculative=spec)
    if args.batch1:
        profile_batch1(engine, model, args.batch1, args.out, spec, args.timeline)
        return
    rng = np.random.default_rng(0)
    lens = np.exp(rng.uniform(np.log(32), np.log(1025), args.requests)).astype(int)
    outs = np.exp(rng.uniform(np.log(16), np.log(513), args.requests)).astype(int)
    eos = set(cfg.eos_token_ids)
    vocab = np.array([t for t in range(3, 30000) if t not in eos])
    if args.score:
        pairs = [(rng.choice(vocab, int(n)).tolist(), rng.choice(vocab, 8).tolist())
                 for n in lens]
        from jaxinfer.requests import make_score_requests

        for r in make_score_requests(model, pairs):
            engine.add_request(r)
    else:
        for n, o in zip(lens, outs, strict=True):
            engine.submit(rng.choice(vocab, int(n)).tolist(), max_new_tokens=int(o),
                          ignore_eos=True)
    for _ in range(args.skip_steps):
        engine.step()
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for i in range(args.trace_steps):
                before = engine.stats()
                t0 = time.perf_counter()
                with jax.profiler.TraceAnnotation(f"{STEP_MARK}{i}"):
                    engine.step()
                s = engine.stats()
                kind = ("decode" if s.decode_calls > before.decode_calls else "mixed")
                steps.append({"kind": kind, "wall_ms": 1e3 * (time.perf_counter() - t0),
                              "device_ms": 1e3 * (s.device_seconds - before.device_seconds),
                              "padded_tokens": s.padded_tokens - before.padded_tokens,
                              "computed_tokens": s.computed_tokens - before.computed_tokens})
        events = device_events(Path(tmp))
        marks = host_marks(Path(tmp))
    per_step = step_kernels(marks, events)
    for s, t in zip(steps, step_timelines(per_step), strict=True):
        s.update(t)
    total_ms = sum(d for _, _, d in events) / 1e6
    by_kind = kernels_by_kind(steps, per_step)
    record = {
        "model": args.model, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "score": args.score,
        "slots": engine.max_batch, "token_buckets": engine.token_buckets,
        "steps": steps, "kernel_ms_total": total_ms,
        "top_kernels": kernel_rows(top_kernels(events, 25)),
        "top_kernels_by_kind": by_kind,
    }
    for s in steps:
        print(f"{s['kind']:6s} wall {s['wall_ms']:8.2f} ms  device {s['device_ms']:8.2f} ms  "
              f"tokens {s['computed_tokens']}/{s['padded_tokens']}  | kernels {s['kernels']} "
              f"{s['kernel_ms']:.2f} ms, lead {s['lead_ms']:.2f}, span {s['span_ms']:.2f}, "
              f"idle in span {s['idle_ms']:.2f}, tail {s['tail_ms']:.2f}; largest gap "
              f"{s['max_gap_ms']:.2f} ms before {s['max_gap_before']}")
    print(f"kernel time {total_ms:.1f} ms over {len(steps)} steps "
          f"(wall {sum(s['wall_ms'] for s in steps):.1f} ms)")
    for k in record["top_kernels"]:
        print(f"{k['ms']:9.2f} ms {k['count']:6d}x {k['mean_us']:9.1f} us  {k['name']}")
    for kind, top_kind in by_kind.items():
        print(f"{kind} steps, per computed token:")
        for k in top_kind:
            print(f"{k['us_per_token']:9.3f} us/token {k['count']:6d}x {k['mean_us']:9.1f} us"
                  f"  {k['name']}")
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
