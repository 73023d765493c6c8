"""Benchmark harness: decode and prefill timings next to the roofline of the same machine.

What one run measures, in order:

1. The two ceilings, on this device, now: a streaming read (a sum over a large bf16 array),
   a device copy (read + write counted) and a large bf16 matmul. Achieved bandwidth of
   decode is reported against the higher of read/copy, MFU against the matmul rate.
2. For every implementation (``--impl``, e.g. ``reference`` or ``pallas+fused``) and model:
   * decode: for each (batch, context) the engine's device function on a page pool
     (``runner.decode_steps``, the pool per layer or stacked as the engine makes it for that
     implementation) of random K/V: B active rows whose block tables point at distinct
     pages holding ``context`` positions each, then ``--decode-steps`` steps inside one
     call (the on-device loop: no host dispatch per token). ms/step = call time / steps,
     median of ``--repeats`` calls after a warm-up call. MBU counts the weights plus the
     live K/V (``roofline.decode_step_bytes``).
   * prefill: TTFT of one ``runner.mixed_step`` over one prompt per prompt length (random
     token ids, pages in a random pool), and MFU = ``roofline.prefill_flops`` / time /
     measured matmul rate.
   * compile: wall time of each program's first call minus its median run time.
   * the decode program's compiled HLO: launches per step (kernels in the loop bodies
     times their trip counts) and the largest buffers written inside the layer loop (a
     cache- or weight-sized copy shows up there).
3. JSON to ``--out`` (default ``bench/results/<device>/bench_<model>_<time>.json``) and a
   short table on stdout.

Weights are random bf16 of the exact shapes (``model.init_params``), never zeros; inputs
are random too. Run on a GPU with ``PYTHONPATH=. python3 scripts/bench.py ...``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import roofline, runner
from jaxinfer.config import LlamaConfig
from jaxinfer.model import (
    Params,
    init_params,
    one_device_layout,
    pool_is_stacked,
    prepare_params,
)
from jaxinfer.paged_cache import PagePool
from jaxinfer.presets import resolve_config
from jaxinfer.quantize import quantize_params
from jaxinfer.requests import Model
from jaxinfer.runner import DecodeInputs, MixedInputs
from jaxinfer.sampling import SamplingArrays, SamplingParams

_OPTIONS = ("fused", "unrolled")


# Measured ceilings per device kind (bf16 matmul FLOP/s, device-memory read bytes/s): H100
# from bench/NOTES.md (matmul ~634 TFLOP/s, read ~3.0 TB/s), H200 from the device notes.
MEASURED_CEILINGS: dict[str, tuple[float, float]] = {
    "h100": (634e12, 3.0e12),
    "h200": (790e12, 4.3e12),
}


def ceilings(device_kind: str, matmul_tflops: float | None, read_tbps: float | None
             ) -> tuple[float, float, str]:
    """``(matmul FLOP/s, read bytes/s, where they come from)`` for the floor.

    Command-line values win; otherwise the measured numbers of this device kind, or the
    H100's on a device without any (CPU), which the returned note says.
    """
    kind = device_kind.lower()
    known = next((k for k in MEASURED_CEILINGS if k in kind), None)
    flops, bandwidth = MEASURED_CEILINGS[known or "h100"]
    note = f"measured on {known}" if known else f"no measured ceilings for {device_kind!r}: H100's"
    if matmul_tflops is not None or read_tbps is not None:
        note += " (overridden on the command line)"
    return (flops if matmul_tflops is None else matmul_tflops * 1e12,
            bandwidth if read_tbps is None else read_tbps * 1e12, note)


def kv_bytes_per_position(cfg: LlamaConfig, dtype_bytes: int,
                          kv_cache_dtype: str | None = None) -> int:
    """K/V bytes of one position over all layers: ``dtype_bytes`` per element, or a
    quantized pool's one-byte values plus scales (``PagePool.bytes_per_page``)."""
    if kv_cache_dtype is None:
        return roofline.kv_bytes_per_seq(cfg, 1, dtype_bytes)
    return PagePool.bytes_per_page(cfg, 1, kv_cache_dtype=kv_cache_dtype)


def workload_floor(cfg: LlamaConfig, prompt_lens: Sequence[int], output_lens: Sequence[int],
                   num_slots: int, matmul_flops_per_s: float, read_bytes_per_s: float,
                   dtype_bytes: int, kv_cache_dtype: str | None = None, devices: int = 1,
                   weight_bytes_per_step: int | None = None) -> dict[str, Any]:
    """The device time no engine can beat on a workload of prompts of ``prompt_lens`` tokens
    producing ``output_lens`` tokens each, and the output tok/s it allows.

    * Prefill: every prompt's ``roofline.prefill_flops`` (layer matmuls, causal attention,
      the LM head on its last token) at the matmul rate.
    * Decode: each request's first token comes out of its prefill, the other
      ``output_len - 1`` from decode steps. The engine decodes all running sequences in one
      step, which reads the weights once, so we assume ``decode_tokens / batch_eff`` steps
      with ``batch_eff = min(slots, requests)`` (every slot always busy: an offline-best
      assumption, optimistic for Poisson arrivals and for the tail of a run) at
      ``roofline.weight_bytes_per_step`` each, plus every decode token's K/V read: its
      context (prompt + tokens before it) x K/V bytes per position
      (``kv_bytes_per_position``: quantized with ``kv_cache_dtype``). All at the read
      bandwidth.
    * ``devices`` accelerators (tensor and data parallel; ``num_slots`` per data replica)
      split both the FLOPs and the bytes evenly: the times are divided by ``devices``.
    * ``weight_bytes_per_step``: what a step reads of quantized weights
      (``quantize.decode_weight_bytes``); None: ``roofline.weight_bytes_per_step`` of
      ``dtype_bytes`` weights.

    The two times add up (the engine interleaves the phases but never overlaps their
    floors on one device).
    """
    prefill_flops = sum(roofline.prefill_flops(cfg, 1, p) for p in prompt_lens)
    decode_tokens = sum(o - 1 for o in output_lens)
    batch_eff = max(1, min(num_slots, len(prompt_lens)))
    decode_steps = decode_tokens / batch_eff
    if weight_bytes_per_step is None:
        weight_bytes_per_step = roofline.weight_bytes_per_step(cfg, dtype_bytes)
    weight_bytes = decode_steps * weight_bytes_per_step
    # Decode token i (1..o-1) of a prompt of p tokens attends to p + i positions.
    kv_positions = sum((o - 1) * p + o * (o - 1) // 2
                       for p, o in zip(prompt_lens, output_lens, strict=True))
    kv_bytes = kv_positions * kv_bytes_per_position(cfg, dtype_bytes, kv_cache_dtype)
    prefill_s = prefill_flops / matmul_flops_per_s / devices
    decode_s = (weight_bytes + kv_bytes) / read_bytes_per_s / devices
    floor_s = prefill_s + decode_s
    output_tokens = sum(output_lens)
    return dict(
        prefill_flops=prefill_flops, prefill_s=prefill_s, decode_tokens=decode_tokens,
        batch_eff=batch_eff, decode_steps=decode_steps, decode_weight_bytes=weight_bytes,
        decode_kv_bytes=kv_bytes, decode_s=decode_s, floor_s=floor_s, devices=devices,
        output_tokens=output_tokens,
        floor_output_tok_per_s=output_tokens / floor_s if floor_s else None,
        matmul_flops_per_s=matmul_flops_per_s, read_bytes_per_s=read_bytes_per_s,
        assumption="decode steps = sum(output_len - 1) / min(slots, requests); weights read "
                   "once per step; each decode token reads its context's K/V; work split "
                   "evenly over the devices")


def trace_events(trace_dir: Path, plane_name: str, *, streams_only: bool
                 ) -> list[tuple[str, float, float]]:
    """Events ``(name, start_ns, duration_ns)`` of the trace planes whose name starts with
    ``plane_name`` (``streams_only``: on their stream lines only, where a device's kernels
    run), read back from a ``jax.profiler.trace`` directory; host and device events share
    one clock."""
    (path,) = trace_dir.rglob("*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(path))
    return [(e.name, e.start_ns, e.duration_ns) for plane in data.planes
            if plane.name.startswith(plane_name) for line in plane.lines
            if not streams_only or "stream" in line.name.lower() for e in line.events]


def device_events(trace_dir: Path, plane_name: str = "/device:") -> list[tuple[str, float,
                                                                             float]]:
    """Kernel events ``(name, start_ns, duration_ns)`` on the stream lines of the trace
    planes whose name starts with ``plane_name`` (default: every accelerator)
    (profile_engine.py, bench_int4.py, bench_gemm.py)."""
    return trace_events(trace_dir, plane_name, streams_only=True)


def top_kernels(events: list[tuple[str, float, float]], n: int
                ) -> list[tuple[str, list[float]]]:
    """The ``n`` kernel names with the most summed time, each with its durations (ns)."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, _, d in events:
        by_name[name].append(d)
    return sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:n]


def kernel_gaps(events: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """Idle device time before each kernel: ``(name, gap)`` in start order, ``gap`` from the
    end of everything that started before it to its start (0 where it overlaps them); the
    first kernel's gap is 0. Same time unit as ``events`` ``(name, start, duration)``."""
    out: list[tuple[str, float]] = []
    busy_end: float | None = None
    for name, start, dur in sorted(events, key=lambda e: e[1]):
        out.append((name, 0.0 if busy_end is None else max(0.0, start - busy_end)))
        busy_end = start + dur if busy_end is None else max(busy_end, start + dur)
    return out


def idle_before(gaps: list[tuple[str, float]], n: int) -> list[tuple[str, float, int]]:
    """The ``n`` kernel names with the most idle device time just before them, from
    ``kernel_gaps`` (of one timeline, or of several steps' put together): ``(name, summed
    gap, kernels of that name)``, most idle first (where a timeline's launch gaps sit)."""
    total: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for name, gap in gaps:
        total[name] += gap
        counts[name] += 1
    return sorted(((k, total[k], counts[k]) for k in total), key=lambda t: -t[1])[:n]


COLLECTIVE_KERNEL = re.compile(
    r"nccl|(?<![a-z])(?:all[-_]?(?:reduce|gather|to[-_]?all)|reduce[-_]?scatter)", re.IGNORECASE)
"""Names of collective kernels in a device trace (NCCL's ``ncclDevKernel_AllReduce_...``,
XLA's own ``all-reduce`` kernels)."""


def timeline_split(events: list[tuple[str, float, float]], per: int) -> dict[str, float]:
    """Where one device's traced time went, in ``events``' unit per one of ``per`` (e.g.
    decode steps): ``span`` (first kernel start to last end), ``busy`` (kernels running,
    overlaps counted once), ``idle`` (span - busy), and for ``COLLECTIVE_KERNEL`` kernels
    their ``collectives`` count, ``collective_time`` (summed durations), ``collective_mean``
    (per kernel, not per ``per``) and ``idle_before_collectives`` (the idle just before each,
    ``kernel_gaps``): how a tensor-parallel step's all-reduces split into NCCL kernel time and
    the waits around it."""
    if not events:
        return {}
    gaps = kernel_gaps(events)
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    idle = sum(g for _, g in gaps)
    coll = [d for n, _, d in events if COLLECTIVE_KERNEL.search(n)]
    return {"span": span / per, "busy": (span - idle) / per, "idle": idle / per,
            "collectives": len(coll) / per, "collective_time": sum(coll) / per,
            "collective_mean": sum(coll) / len(coll) if coll else 0.0,
            "idle_before_collectives": sum(g for n, g in gaps
                                           if COLLECTIVE_KERNEL.search(n)) / per}


def layer_gemms(c: LlamaConfig) -> dict[str, tuple[int, list[int]]]:
    """Each GEMM of one layer in the fast layout, whole (one device): ``name -> (in, [out,
    ...])``; several outs are separate GEMMs on the same input (the gate|up split). The
    shapes ``scripts/bench_gemm.py`` and ``scripts/bench_int4.py`` time."""
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, f = c.hidden_size, c.intermediate_size
    return {
        "qkv": (h, [nq + 2 * nkv]),
        "o": (nq, [h]),
        "gate_up": (h, [2 * f]),
        "gate+up": (h, [f, f]),
        "down": (f, [h]),
        "head": (h, [c.vocab_size]),
    }


def call_kernels(call: Callable[..., Any], ops: tuple[jax.Array, ...], calls: int,
                 repeats: int, *, cold_bytes: int) -> list[tuple[str, float, float]]:
    """The device kernels (``traced_kernels``: ``Memcpy`` events left out) of ``repeats``
    traced runs of one program of ``calls`` calls ``call(x, *weights)``, after a warm-up run.

    ``ops`` is ``(x, *weights)``. The calls are unrolled, each on its own ``x`` (so none is
    folded away) and on one of enough weight copies to fill ``cold_bytes`` (more than the
    L2 cache: no call reads its weights from a cache the previous call filled). Kernel time,
    not wall time: a short program's wall time is mostly its dispatch (bench_int4.py,
    bench_gemm.py)."""
    x, *weight = ops
    copies = max(1, min(calls, -(-cold_bytes // sum(w.nbytes for w in weight))))
    weights = [weight] + [[jnp.array(w, copy=True) for w in weight] for _ in range(copies - 1)]
    xs = [x + jnp.asarray(i, x.dtype) for i in range(calls)]

    @jax.jit
    def run(xs, weights):  # every output returned whole: no kernel of the harness's own
        return [call(xi, *weights[i % copies]) for i, xi in enumerate(xs)]

    jax.block_until_ready(run(xs, weights))
    return traced_kernels(lambda: run(xs, weights), repeats)


def traced_kernels(program: Callable[[], Any], repeats: int) -> list[tuple[str, float, float]]:
    """The device kernels ``(name, start_ns, duration_ns)`` of ``repeats`` runs of
    ``program()`` under the profiler (``device_events``), the runtime's ``Memcpy`` events
    (copies between host and device or between buffers) left out.
    Compile and warm ``program`` first: the trace should hold only its steady state."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(repeats):
                jax.block_until_ready(program())
        events = device_events(Path(tmp))
    return [e for e in events if not e[0].startswith("Memcpy")]


def quantized_copy(model: Model, method: str) -> Model:
    """``model`` with its weights quantized by ``method`` (``jaxinfer.quantize``), as a draft
    for speculation: named after the method, and running the fast kernels even when
    ``model`` is deterministic (a draft's numerics decide which proposals are accepted,
    never the output). On one device its params get ``load_model``'s last layout step
    (``model.one_device_layout``), as a draft loaded with ``quantize=method`` would."""
    params = quantize_params(model.params, method)
    if model.mesh is None:
        params = one_device_layout(params, jax.devices()[0])
    return dataclasses.replace(model, name=f"{model.name}-{method}", deterministic=False,
                               params=params)


def log(msg: str) -> None:
    """Progress line on stderr (stdout keeps the table)."""
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation to time: an attention backend plus execution-layout options.

    Written ``backend[+option...]``: ``reference``, ``pallas``, ``pallas+fused``,
    ``pallas+fused+unrolled`` (see ``model.prepare_params``). The page pool's layout follows
    as in the engine (``model.pool_is_stacked``): per layer for ``pallas`` or unrolled
    weights, stacked for ``reference`` with stacked weights.
    """

    backend: str
    fused: bool = False
    unrolled: bool = False

    @classmethod
    def parse(cls, text: str) -> Impl:
        """Parse ``backend[+option...]``."""
        backend, *opts = text.split("+")
        if backend not in ("reference", "pallas"):
            raise ValueError(f"impl {text!r}: backend must be 'reference' or 'pallas'")
        bad = [o for o in opts if o not in _OPTIONS]
        if bad:
            raise ValueError(f"impl {text!r}: unknown option {bad[0]!r}; known: {_OPTIONS}")
        return cls(backend, fused="fused" in opts, unrolled="unrolled" in opts)

    @property
    def name(self) -> str:
        """The ``backend[+option...]`` spelling."""
        opts = [o for o in _OPTIONS if getattr(self, o)]
        return "+".join([self.backend, *opts])


# --------------------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _batched(fn: Callable[[], Any], calls: int = 10) -> Callable[[], None]:
    """``calls`` back-to-back launches, one sync: host dispatch stays out of the timing.

    A single ~1 ms ceiling kernel timed call by call carries ~0.1 ms of dispatch and sync
    (run 1/2 read 2.4-2.7 TB/s that way while decode itself moved 2.6 TB/s).
    """

    def run() -> None:
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)

    return run


def measure_ceilings(read_bytes: int, matmul_n: int, repeats: int) -> dict[str, float]:
    """Streaming read, device copy and bf16 matmul rates of the default device.

    Inputs are random (a matmul on zeros can run faster than on real data). ``read_bw`` is
    the better of a float32-accumulated sum and a GEMV over the same bytes (every byte read
    once, almost nothing written); XLA's sum alone stayed ~15% under what GEMVs reach.
    """
    n = read_bytes // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    copy = jax.jit(lambda a: a * 2)
    jax.block_until_ready((total(x), copy(x)))
    t_read = median_time(_batched(lambda: total(x)), repeats)[0] / 10
    t_copy = median_time(_batched(lambda: copy(x)), repeats)[0] / 10
    # A GEMV over the same bytes: the access pattern of decode's weight reads.
    cols = 8192 if n >= 8192 * 64 else 64
    mat = x[: (n // cols) * cols].reshape(n // cols, cols)
    vec = jax.random.normal(jax.random.PRNGKey(2), (cols,), jnp.bfloat16)
    gemv = jax.jit(lambda m, v: m @ v)
    gemv(mat, vec).block_until_ready()
    t_gemv = median_time(_batched(lambda: gemv(mat, vec)), repeats)[0] / 10
    gemv_bytes = mat.size * 2
    x = mat = None  # free the large arrays before the matmul inputs
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(kb, (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    t_mm = median_time(_batched(lambda: mm(a, b)), repeats)[0] / 10
    return {
        "read_bw": max(2 * n / t_read, gemv_bytes / t_gemv),
        "sum_read_bw": 2 * n / t_read,
        "gemv_read_bw": gemv_bytes / t_gemv,
        "copy_bw": 2 * 2 * n / t_copy,
        "matmul_flops": 2 * matmul_n**3 / t_mm,
        "read_bytes": 2 * n,
        "matmul_n": matmul_n,
    }


# --------------------------------------------------------------------------- HLO census

_LAUNCH_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
                "conditional", "call", "after-all", "partition-id", "replica-id",
                "opt-barrier", "add-dependency", "domain"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1,
                "u8": 1, "f64": 8, "s64": 8, "u64": 8}


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def hlo_census(hlo_text: str, top: int = 8) -> dict[str, Any]:
    """Count kernel launches per iteration of each loop in compiled HLO text.

    A launch is any instruction of a non-fused computation that is not pure bookkeeping
    (tuples, parameters, bitcasts, control flow). ``per_outer_iteration`` multiplies each
    nested loop body by its known trip count (the layer scan inside the decode loop), so it
    estimates kernels per decode step. ``largest`` lists the biggest buffers written by
    launches inside loops: a per-layer weight or cache copy is visible there.
    """
    comps: dict[str, list[tuple[str, str, int]]] = {}
    whiles: dict[str, list[tuple[str, int]]] = {}
    entry = ""
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith((" ", "\t")):  # headers start at column 0
            current = m.group(2)
            comps[current] = []
            whiles[current] = []
            if m.group(1):
                entry = current
            continue
        if current is None:
            continue
        ins = _INSTR.match(line)
        if not ins:
            continue
        name, shape, op = ins.groups()
        if op == "while":
            w = _WHILE.search(line)
            trip = _TRIP.search(line)
            if w:
                whiles[current].append((w.group(1), int(trip.group(1)) if trip else 1))
        if op in _LAUNCH_FREE:
            continue
        if "fused_computation" in current or current.startswith("fused"):
            continue
        comps[current].append((name, op, _shape_bytes(shape)))

    def launches(comp: str, depth: int = 0) -> int:
        if depth > 8 or comp not in comps:
            return 0
        return len(comps[comp]) + sum(t * launches(b, depth + 1) for b, t in whiles[comp])

    bodies = {b: t for ws in whiles.values() for b, t in ws}
    outer = [b for b, _ in whiles.get(entry, [])]
    loops = {b: {"trip_count": t, "launches_per_iteration": len(comps.get(b, [])),
                 "ops": _op_counts(comps.get(b, []))} for b, t in bodies.items()}
    big = sorted(((nbytes, f"{op} {name}") for b in bodies for name, op, nbytes in
                  comps.get(b, [])), reverse=True)[:top]
    return {
        "entry_launches": len(comps.get(entry, [])),
        "loops": loops,
        "launches_per_outer_iteration": {b: launches(b) for b in outer},
        "largest_in_loops": [{"bytes": n, "what": w} for n, w in big],
    }


def _op_counts(instrs: list[tuple[str, str, int]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, op, _ in instrs:
        counts[op] = counts.get(op, 0) + 1
    return counts


# --------------------------------------------------------------------------- model runs


def random_pool(config: LlamaConfig, num_pages: int, page_size: int, *, stacked: bool,
                key: jax.Array, dtype: Any = jnp.bfloat16) -> PagePool:
    """A page pool (the engine's layout: per layer or stacked) of random non-zero K/V."""
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    if stacked:
        shape = (config.num_layers, *shape)
    fill = jax.jit(lambda k: jax.random.normal(k, shape, dtype))
    keys = iter(jax.random.split(key, 2 * config.num_layers))
    if stacked:
        return PagePool(k=fill(next(keys)), v=fill(next(keys)))
    return PagePool(k=tuple(fill(next(keys)) for _ in range(config.num_layers)),
                    v=tuple(fill(next(keys)) for _ in range(config.num_layers)))


def page_tables(batch: int, pages_per_seq: int, key: jax.Array) -> np.ndarray:
    """Block tables ``[batch, pages_per_seq]``: distinct pages, shuffled over the pool."""
    perm = np.asarray(jax.random.permutation(key, batch * pages_per_seq))
    return perm.reshape(batch, pages_per_seq).astype(np.int32)


def greedy_sampling(batch: int) -> SamplingArrays:
    """Greedy sampling rows (temperature 0)."""
    return SamplingArrays.from_params([SamplingParams(seed=0)] * batch)


@dataclasses.dataclass
class DecodeCase:
    """One ``runner.decode_steps`` workload: B rows at ``context`` keys each, in a pool."""

    pool: PagePool
    counts: jax.Array  # [B, vocab] int32 (the engine's token-count table for the penalties)
    inputs: DecodeInputs
    max_steps: int
    page_size: int


def decode_case(config: LlamaConfig, params: Params, backend: str, batch: int, context: int,
                steps: int, key: jax.Array, *, page_size: int = 16,
                dtype: Any = jnp.bfloat16) -> DecodeCase:
    """B active rows whose first ``context`` positions hold random K/V in distinct pages.

    The pool is per layer or stacked as the engine would make it for ``params`` and
    ``backend`` (``model.pool_is_stacked``). Row b feeds a random token at position
    ``context`` and may decode ``steps`` tokens (no stop token, pages reserved for all).
    """
    pages_per_seq = math.ceil((context + steps + 1) / page_size)
    kp, kt, kx = jax.random.split(key, 3)
    pool = random_pool(config, batch * pages_per_seq, page_size,
                       stacked=pool_is_stacked(params, backend), key=kp, dtype=dtype)
    tables = page_tables(batch, pages_per_seq, kt)
    inputs = DecodeInputs(
        tokens=jax.random.randint(kx, (batch,), 0, config.vocab_size, jnp.int32),
        positions=jnp.full((batch,), context, jnp.int32),
        block_tables=jnp.asarray(tables),
        active=jnp.ones((batch,), bool),
        remaining=jnp.full((batch,), steps, jnp.int32),
        limit=jnp.full((batch,), pages_per_seq * page_size, jnp.int32),
        gen_index=jnp.ones((batch,), jnp.int32),
        stop_ids=jnp.full((batch, 1), -1, jnp.int32),
        num_steps=jnp.int32(steps),
        sampling=greedy_sampling(batch),
    )
    counts = jnp.asarray(runner.new_counts(batch, config.vocab_size))
    return DecodeCase(pool, counts, inputs, steps, page_size)


def _greedy_loop(max_steps: int) -> dict[str, Any]:
    """Static arguments of a greedy ``runner.decode_steps`` program of ``max_steps``."""
    return {"max_steps": max_steps, "chunk": math.gcd(max_steps, runner.DECODE_CHUNK),
            "stochastic": False}


def run_decode(params: Params, config: LlamaConfig, backend: str, case: DecodeCase,
               dtype: Any = jnp.bfloat16) -> jax.Array:
    """One ``runner.decode_steps`` call on ``case``; returns its tokens ``[steps, B]`` (ready).

    Every call starts from the same positions: the K/V the previous call wrote past
    ``context`` are overwritten, so each call does identical work. The pool and ``counts``
    are donated, so ``case`` takes the returned ones.
    """
    case.pool, case.counts, out = runner.decode_steps(
        params, case.pool, case.counts, case.inputs, config=config, backend=backend,
        dtype=dtype, **_greedy_loop(case.max_steps))
    return jax.block_until_ready(out["tokens"])


def prefill_inputs(prompts: Sequence[np.ndarray], tables: np.ndarray, page_size: int
                   ) -> MixedInputs:
    """``runner.mixed_step`` inputs reading whole prompts (one per row of ``tables``) at once,
    each sampling its first token greedily."""
    lens = np.array([len(p) for p in prompts], np.int32)
    tokens = np.concatenate(prompts).astype(np.int32)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    seq = np.repeat(np.arange(len(prompts)), lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return MixedInputs(
        tokens=jnp.asarray(tokens), positions=jnp.asarray(positions),
        write_pages=jnp.asarray(tables[seq, positions // page_size]),
        write_offsets=jnp.asarray(positions % page_size),
        targets=jnp.full(tokens.shape, -1, jnp.int32),
        block_tables=jnp.asarray(tables), kv_lens=jnp.asarray(lens), cu_q_lens=jnp.asarray(cu),
        last_index=jnp.asarray(cu[1:] - 1), gen_index=jnp.zeros(len(prompts), jnp.int32),
        samples=jnp.ones(len(prompts), bool), sampling=greedy_sampling(len(prompts)))


def bench_decode(params: Params, config: LlamaConfig, impl: Impl, batch: int, context: int,
                 steps_per_call: int, repeats: int, ceilings: dict[str, float],
                 census: bool) -> dict[str, Any]:
    """Time ``steps_per_call`` decode steps inside one ``runner.decode_steps`` call."""
    key = jax.random.PRNGKey(batch * 7919 + context)
    case = decode_case(config, params, impl.backend, batch, context, steps_per_call, key)
    row: dict[str, Any] = {"impl": impl.name, "batch": batch, "context": context,
                           "steps_per_call": steps_per_call,
                           "pool": "stacked" if case.pool.stacked else "per_layer"}
    compile_s = None
    if census:
        t0 = time.perf_counter()
        compiled = runner.decode_steps.lower(
            params, case.pool, case.counts, case.inputs, config=config, backend=impl.backend,
            dtype=jnp.bfloat16, **_greedy_loop(steps_per_call)).compile()
        compile_s = time.perf_counter() - t0
        row["hlo"] = hlo_census(compiled.as_text())
        row["_hlo_text"] = compiled.as_text()

    def call() -> None:
        run_decode(params, config, impl.backend, case)

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    med, times = median_time(call, repeats)
    step_s = med / steps_per_call
    nbytes = roofline.decode_step_bytes(config, batch, context)
    flops = roofline.decode_step_flops(config, batch, context)
    bw = max(ceilings["read_bw"], ceilings["copy_bw"])
    floor = max(nbytes / bw, flops / ceilings["matmul_flops"])
    row.update({
        "ms_per_step": step_s * 1e3,
        "tokens_per_s": batch / step_s,
        "bytes_per_step": nbytes,
        "flops_per_step": flops,
        "achieved_TBps": nbytes / step_s / 1e12,
        "mbu": nbytes / step_s / bw,
        "floor_ms": floor * 1e3,
        "compile_s": compile_s if compile_s is not None else max(first - med, 0.0),
        "call_times_s": times,
    })
    return row


def bench_prefill(params: Params, config: LlamaConfig, impl: Impl, prompt_len: int,
                  batch: int, repeats: int, ceilings: dict[str, float],
                  page_size: int = 16) -> dict[str, Any]:
    """Time one ``runner.mixed_step`` over ``batch`` random prompts of ``prompt_len`` tokens."""
    key = jax.random.PRNGKey(prompt_len)
    kp, kt, kx = jax.random.split(key, 3)
    pages_per_seq = math.ceil(prompt_len / page_size)
    num_pages = batch * pages_per_seq
    tables = page_tables(batch, pages_per_seq, kt)
    prompts = list(np.asarray(jax.random.randint(kx, (batch, prompt_len), 0,
                                                 config.vocab_size, jnp.int32)))
    inputs = prefill_inputs(prompts, tables, page_size)
    holder = {"pool": random_pool(config, num_pages, page_size, key=kp,
                                  stacked=pool_is_stacked(params, impl.backend)),
              "counts": jnp.asarray(runner.new_counts(batch, config.vocab_size))}

    def call() -> None:
        pool, counts, out = runner.mixed_step(
            params, holder["pool"], holder["counts"], inputs, config=config,
            backend=impl.backend, dtype=jnp.bfloat16, max_q_len=prompt_len, score=False,
            stochastic=False)
        jax.block_until_ready(out["tokens"])
        holder["pool"], holder["counts"] = pool, counts

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    med, times = median_time(call, repeats)
    flops = roofline.prefill_flops(config, batch, prompt_len)
    return {
        "impl": impl.name, "batch": batch, "prompt_len": prompt_len,
        "ttft_ms": med * 1e3,
        "flops": flops,
        "achieved_TFLOPs": flops / med / 1e12,
        "mfu": flops / med / ceilings["matmul_flops"],
        "floor_ms": 1e3 * max(flops / ceilings["matmul_flops"],
                              roofline.prefill_bytes(config, batch, prompt_len)
                              / max(ceilings["read_bw"], ceilings["copy_bw"])),
        "compile_s": max(first - med, 0.0),
        "call_times_s": times,
    }


def _model_tag(model: str) -> str:
    """A file-name-safe tag: the preset name, or the config file's folder name."""
    path = Path(model)
    if path.name == "config.json":
        return path.parent.name
    return path.stem if path.suffix == ".json" else path.name


def _fits(config: LlamaConfig, batch: int, context: int, budget: float | None) -> bool:
    if budget is None:
        return True
    need = roofline.param_bytes(config) + batch * roofline.kv_bytes_per_seq(config, context)
    return need <= budget


def device_name() -> str:
    """A short folder name for the default device: ``h100``, ``cpu``, ..."""
    d = jax.devices()[0]
    return device_folder(getattr(d, "device_kind", d.platform), d.platform)


def device_folder(kind: str, platform: str) -> str:
    """``bench/results``' folder for a device kind (``NVIDIA H100 80GB HBM3`` -> ``h100``),
    else ``platform``."""
    for known in ("h100", "h200", "a100", "a10", "v5e", "v5p", "v5 lite", "v4"):
        if known in kind.lower():
            return known.replace(" ", "")
    return platform


def record_path(json_arg: str | None, auto: Path) -> Path | None:
    """Where a benchmark script's ``--json`` record goes: None (no record), ``auto`` for
    ``--json auto`` (the script's ``bench/results/<device>/...`` path), else the path given."""
    if json_arg is None:
        return None
    return auto if json_arg == "auto" else Path(json_arg)


def write_record(path: Path | None, record: dict[str, Any]) -> None:
    """Write a benchmark record as indented JSON (creating its folder); None writes nothing."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


def run_bench(
    model: str,
    impls: Sequence[str],
    batches: Sequence[int],
    contexts: Sequence[int],
    prompt_lens: Sequence[int],
    *,
    decode_steps: int = 64,
    repeats: int = 5,
    ceiling_bytes: int = 2 << 30,
    matmul_n: int = 8192,
    census: bool = True,
    hlo_dir: Path | None = None,
    memory_budget: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the whole benchmark for one model; return the result dict (see module doc)."""
    config = resolve_config(model)
    parsed = [Impl.parse(i) for i in impls]
    result: dict[str, Any] = {
        "model": model, "device": str(jax.devices()[0]), "device_name": device_name(),
        "jax": jax.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": config.to_hf_dict(), "num_params": config.num_params(),
        "decode_steps_per_call": decode_steps, "repeats": repeats,
        "decode": [], "prefill": [], "errors": [],
    }
    log(f"[bench] ceilings on {result['device']}")
    ceilings = measure_ceilings(ceiling_bytes, matmul_n, repeats)
    result["ceilings"] = ceilings
    log(f"[bench] read {ceilings['read_bw'] / 1e12:.2f} TB/s, copy "
        f"{ceilings['copy_bw'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops'] / 1e12:.0f} "
        "TFLOP/s")
    t0 = time.perf_counter()
    base = init_params(config, jax.random.PRNGKey(seed), jnp.bfloat16)
    jax.block_until_ready(base)
    result["init_params_s"] = time.perf_counter() - t0
    for impl in parsed:
        try:
            params = prepare_params(base, fuse=impl.fused, unstack=impl.unrolled)
        except Exception as e:  # report and go on with the other implementations
            result["errors"].append({"impl": impl.name, "what": "prepare", "error": repr(e)})
            continue
        for b in batches:
            for s in contexts:
                if not _fits(config, b, s + decode_steps + 1, memory_budget):
                    log(f"[bench] skip decode {impl.name} B={b} ctx={s}: does not fit")
                    continue
                log(f"[bench] decode {impl.name} B={b} ctx={s}")
                try:
                    row = bench_decode(params, config, impl, b, s, decode_steps, repeats,
                                       ceilings, census and b == batches[0] and s == contexts[0])
                except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                    traceback.print_exc()
                    result["errors"].append({"impl": impl.name, "batch": b, "context": s,
                                             "error": repr(e)[:2000]})
                    continue
                hlo_text = row.pop("_hlo_text", None)
                if hlo_text is not None and hlo_dir is not None:
                    hlo_dir.mkdir(parents=True, exist_ok=True)
                    name = f"decode_{_model_tag(model)}_{impl.name}.hlo.txt"
                    (hlo_dir / name).write_text(hlo_text)
                log(f"[bench]   {row['ms_per_step']:.3f} ms/step, {row['tokens_per_s']:.0f} "
                    f"tok/s, MBU {row['mbu']:.0%}")
                result["decode"].append(row)
        for t in prompt_lens:
            if not _fits(config, 1, t, memory_budget):
                continue
            log(f"[bench] prefill {impl.name} T={t}")
            try:
                row = bench_prefill(params, config, impl, t, 1, repeats, ceilings)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                result["errors"].append({"impl": impl.name, "prompt_len": t,
                                         "error": repr(e)[:2000]})
                continue
            log(f"[bench]   TTFT {row['ttft_ms']:.1f} ms, MFU {row['mfu']:.0%}")
            result["prefill"].append(row)
        del params
        jax.clear_caches()  # each implementation compiles its own programs
    return result


def format_table(result: dict[str, Any]) -> str:
    """The short stdout table of one result dict."""
    c = result["ceilings"]
    lines = [
        f"{result['model']} on {result['device']} (jax {result['jax']}): read "
        f"{c['read_bw'] / 1e12:.2f} TB/s, copy {c['copy_bw'] / 1e12:.2f} TB/s, matmul "
        f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s",
        f"{'impl':<24} {'B':>4} {'ctx':>6} {'ms/step':>8} {'tok/s':>8} {'GB/step':>8} "
        f"{'TB/s':>6} {'MBU':>5} {'floor':>7} {'compile':>8}",
    ]
    for r in result["decode"]:
        lines.append(
            f"{r['impl']:<24} {r['batch']:>4} {r['context']:>6} {r['ms_per_step']:>8.3f} "
            f"{r['tokens_per_s']:>8.0f} {r['bytes_per_step'] / 1e9:>8.2f} "
            f"{r['achieved_TBps']:>6.2f} {r['mbu']:>5.0%} {r['floor_ms']:>7.3f} "
            f"{r['compile_s']:>7.1f}s")
    if result["prefill"]:
        lines.append(f"{'impl':<24} {'B':>4} {'prompt':>6} {'TTFT ms':>8} {'TFLOP/s':>8} "
                     f"{'MFU':>5} {'floor':>7} {'compile':>8}")
        for r in result["prefill"]:
            lines.append(
                f"{r['impl']:<24} {r['batch']:>4} {r['prompt_len']:>6} {r['ttft_ms']:>8.2f} "
                f"{r['achieved_TFLOPs']:>8.1f} {r['mfu']:>5.0%} {r['floor_ms']:>7.2f} "
                f"{r['compile_s']:>7.1f}s")
    for e in result["errors"]:
        lines.append(f"ERROR {e}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The harness's flags (shared by ``scripts/bench.py`` and ``jaxinfer bench``)."""
    p.add_argument("--model", default="llama-3.2-1b",
                   help="preset name(s), comma-separated, or a config.json path")
    p.add_argument("--impl", default="pallas",
                   help="comma-separated backend[+fused][+unrolled], e.g. reference,pallas")
    p.add_argument("--batch", type=_int_list, default=[1])
    p.add_argument("--context", type=_int_list, default=[1024])
    p.add_argument("--prompt-lens", type=_int_list, default=[128, 2048, 8192])
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ceiling-mb", type=int, default=2048, help="read/copy ceiling array size")
    p.add_argument("--matmul-n", type=int, default=8192, help="matmul ceiling size n^3")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="skip cases whose weights + cache exceed this many GB")
    p.add_argument("--no-census", action="store_true", help="skip the compiled-HLO census")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/)")
    p.add_argument("--hlo-dir", default=None, help="write the decode programs' HLO here")


def run_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``run_bench`` for every model in ``args.model``; write JSON, print tables."""
    results = []
    for model in [m for m in args.model.split(",") if m]:
        res = run_bench(
            model, [i for i in args.impl.split(",") if i], args.batch, args.context,
            args.prompt_lens, decode_steps=args.decode_steps, repeats=args.repeats,
            ceiling_bytes=args.ceiling_mb << 20, matmul_n=args.matmul_n,
            census=not args.no_census, hlo_dir=Path(args.hlo_dir) if args.hlo_dir else None,
            memory_budget=None if args.memory_gb is None else args.memory_gb * 1e9)
        out = Path(args.out) if args.out else Path("bench/results") / res["device_name"] / (
            f"bench_{_model_tag(model)}_{time.strftime('%Y%m%d_%H%M%S')}.json")
        if len(args.model.split(",")) > 1 and args.out:
            out = out.with_name(f"{out.stem}_{_model_tag(model)}{out.suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=_json_default))
        print(format_table(res), flush=True)
        print(f"wrote {out}", flush=True)
        results.append(res)
    return results


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python scripts/bench.py``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bench_args(p)
    run_from_args(p.parse_args(argv))
    return 0
