"""Time the int4 (``--int8``: int8) GEMV kernels on a GPU: the bandwidth each kernel and tiling
reaches on the weight shapes of a model's layer (``--shapes``: 1B, 8B by default, 70B) at batch
1 (one and two rows: an all-int4 model decodes a lone request in a one-row call, two requests
in a two-row one).

Usage: ``PYTHONPATH=. python scripts/bench_int4.py --json bench/results/<device>/int4.json``

Floor: a batch-1 int4 matmul must read its packed weight (half a byte per weight) and its
float16 scales and zeros once; at the measured read bandwidth (3.0 TB/s on an H100) that is
the fastest it can run. Each tiling (``pallas_kernels.int4_matmul.Int4Tiles``) is checked
against ``int4_matmul_reference`` first, then timed as the median of ``--repeats`` runs of a
program that calls the kernel ``--calls`` times, unrolled, cycling through weight copies
larger than the L2 cache, as the device time of its kernels (profiler trace; random inputs,
warmed up; ``time_call``). By default it
compares the candidates below on every shape, group sizes 32, 64 and 128 and each of
``--rows``. ``--sweep`` times the float16-pair kernel's tiles instead (column block, rows
per load and warps at 16 bytes per thread per load; with 4 warps also the weight loads'
evict-first hint) at one row and g128 on every shape. ``--sweep-wide`` times the wide tile
(``WordTiles.wide_tile``) at each of ``--programs``, beside the default.
``--probe`` times two stripped kernels that read the packed weight exactly as ``word_gemv``
does: one only xors the words (the read rate Pallas/Triton reaches with that access
pattern), one also makes every nibble a float (the cost of the unpacking). Their results
are not products, so they get no error check.
The candidates: the default (float16 pairs at groups of 128+, ``word_gemv``'s float32 kernel
below), the float32 kernel at every group size (``half2_min_group=0``) and the dot kernel.

``--int8`` times ``int8_matmul`` instead, on the same shapes and ``--rows`` (``q [K, N]`` int8,
float32 scales per 64 rows; floor: those bytes at ``--read-tbps``): ``word_gemv``'s float16
pairs (``Int8Tiles(word_rows=WORD_ROWS)``; one row by default) against its tensor-core kernel
(``Int8Tiles(word_rows=0)``) and, above 16 rows, that kernel with 32- and 16-row dots
(``Int8Tiles.dot_rows``), checked against ``int8_matmul_reference``; the JSON is rewritten
after each candidate. A record for bench/NOTES.md, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.benchmark import call_kernels, layer_gemms, top_kernels
from jaxinfer.presets import preset_config
from pallas_kernels import largest_divisor
from pallas_kernels.int4_matmul import Int4Tiles, int4_matmul, int4_matmul_reference
from pallas_kernels.matmul import Int8Tiles, int8_matmul, int8_matmul_reference
from pallas_kernels.word_gemv import WORD_ROWS, field_as_float


def layer_shapes(preset: str) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of a preset's layer weights in the fast layout (fused QKV and
    gate/up), whole (one device): ``layer_gemms``' one-GEMM entries."""
    gemms = layer_gemms(preset_config(preset))
    return [(name, gemms[name][0], gemms[name][1][0]) for name in ("qkv", "o", "gate_up", "down")]


SHAPES = {size: layer_shapes(f"llama-3.{minor}-{size}")
          for size, minor in (("1b", 2), ("8b", 1), ("70b", 1))}
SHAPES_8B = SHAPES["8b"]
# The default tiling with the float32 word kernel at every group size (no float16 pairs).
FLOAT32_WORDS = Int4Tiles(word=dataclasses.replace(Int4Tiles().word, half2_min_group=0))


@functools.cache
def operands(m: int, k: int, n: int, group: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random ``x [M, K]`` bf16, ``q [K / 2, N]`` uint8, ``scale``/``zero [K / G, N]`` fp16."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(0, 256, size=(k // 2, n), dtype=np.uint8))
    scale = jnp.asarray(rng.random((k // group, n)) * 0.02, jnp.float16)
    zero = jnp.asarray(-rng.random((k // group, n)) * 0.15, jnp.float16)
    return x, q, scale, zero


@functools.cache
def operands8(m: int, k: int, n: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random ``x [M, K]`` bf16, ``q [K, N]`` int8, ``scale [K / 64, N]`` float32 (the
    ``jaxinfer.quantize`` int8 format)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, size=(k, n), dtype=np.int8))
    scale = jnp.asarray(rng.random((k // 64, n)) * 0.01, jnp.float32)
    return x, q, scale


def weight_bytes(*weight: jax.Array) -> int:
    """Bytes a batch-1 matmul must read: the packed weight, its scales (and zeros)."""
    return sum(w.nbytes for w in weight)


Call = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A kernel to time: ``call(x, q, scale, zero)`` on the ``[K / 2, N]`` operands, or with
    ``int8`` ``call(x, q, scale)`` on ``operands8``."""

    label: str
    call: Call
    probe: bool = False  # a stripped kernel (``--probe``): timed, not checked
    int8: bool = False


def for_tiles(tiles: Int4Tiles | Int8Tiles) -> Candidate:
    """``int4_matmul`` (or, for ``Int8Tiles``, ``int8_matmul``) with ``tiles``."""
    if isinstance(tiles, Int8Tiles):
        return Candidate(str(tiles), functools.partial(int8_matmul, tiles=tiles), int8=True)
    return Candidate(str(tiles), functools.partial(int4_matmul, tiles=tiles))


def _probe_kernel(x_ref, q_ref, o_ref, *, sub: int, unroll: int, steps: int, unpack: bool) -> None:
    """Read this program's ``[R / splits, block_n / 4]`` words in ``[sub, words]`` loads,
    ``unroll`` loads per loop step; xor them (or sum every nibble as a float)."""
    split = pl.program_id(1)
    words = q_ref.shape[1]

    def body(step, acc):
        for j in range(unroll):
            w = q_ref[pl.ds(((split * steps + step) * unroll + j) * sub, sub), :]
            if unpack:
                for f in range(8):
                    acc = acc + field_as_float(w, 19 - 4 * f, 4)
            else:
                acc = acc ^ w
        return acc

    dtype = jnp.float32 if unpack else jnp.uint32
    acc = lax.fori_loop(0, steps, body, jnp.zeros((sub, words), dtype))
    # x joins the result so that the timing loop cannot hoist the call out of itself.
    o_ref[...] = (jnp.sum(acc.astype(jnp.float32), axis=0)
                  + x_ref[0, 0].astype(jnp.float32))[None, :]


def stream_probe(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array, *,
                 unpack: bool, block_n: int = 128, sub: int = 16, step_rows: int = 64,
                 target_programs: int = 512) -> jax.Array:
    """``word_gemv``'s grid and loads over ``q [R, N]`` (uint8) without its arithmetic:
    ``[splits, N]`` float32 of no meaning, for timing only."""
    del scale, zero
    r, n = q.shape
    col_blocks = -(-n // block_n)
    unroll = step_rows // sub
    total = r // step_rows
    splits = largest_divisor(total, target_programs // col_blocks)
    words = lax.bitcast_convert_type(q.reshape(r, n // 4, 4), jnp.uint32)
    return pl.pallas_call(
        functools.partial(_probe_kernel, sub=sub, unroll=unroll, steps=total // splits,
                          unpack=unpack),
        grid=(col_blocks, splits),
        in_specs=[pl.BlockSpec(x.shape, lambda j, t: (0, 0)),
                  pl.BlockSpec((r, block_n // 4), lambda j, t: (0, j))],
        out_specs=pl.BlockSpec((None, 1, block_n // 4), lambda j, t: (t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, 1, n // 4), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        name="bench_stream_probe",
    )(x, words)[:, 0]


COLD_BYTES = 256 << 20
"""Weight bytes a timing program cycles through (over 5x the H100's 50 MB L2), so no call
reads its weight from the cache a previous call filled."""


def time_call(call: Call, ops: tuple[jax.Array, ...], calls: int, repeats: int) -> float:
    """Seconds of device kernels per call (``call_kernels``, summed).

    Kernel time, not wall time: the wall time of such a short program is mostly its
    dispatch, which added ~17 us to every call (r71, r73: an 8.4 MB weight "took" 26 us;
    r74's trace: its kernel ran 8.9 us)."""
    events = call_kernels(call, ops, calls, repeats, cold_bytes=COLD_BYTES)
    if not events:
        raise SystemExit("bench_int4: the profiler recorded no device kernels")
    return sum(d for _, _, d in events) / 1e9 / (repeats * calls)


def trace_call(cand: Candidate, ops: tuple[jax.Array, ...], calls: int) -> None:
    """Print the device kernels of one traced run of ``time_call``'s program (count, mean
    microseconds): what a call's time is made of."""
    events = call_kernels(cand.call, ops, calls, 1, cold_bytes=COLD_BYTES)
    print(f"trace {cand.label}: {len(events)} kernels")
    for name, ds in top_kernels(events, 12):
        print(f"  {len(ds):5d} x {sum(ds) / len(ds) / 1e3:8.2f} us  {name[:90]}")


def measure(name: str, m: int, k: int, n: int, group: int, cand: Candidate, read_tbps: float,
            calls: int, repeats: int) -> dict:
    """One row count, shape and kernel: time, bandwidth, fraction of the floor, and the
    largest difference from the float32-dequantized reference."""
    ops = operands8(m, k, n) if cand.int8 else operands(m, k, n, group)
    reference = int8_matmul_reference if cand.int8 else int4_matmul_reference
    want = reference(*ops, out_dtype=jnp.float32)
    err = (float("nan") if cand.probe else
           float(jnp.max(jnp.abs(cand.call(*ops).astype(jnp.float32) - want))))
    s = time_call(cand.call, ops, calls, repeats)
    nbytes = weight_bytes(*ops[1:])
    floor_s = nbytes / (read_tbps * 1e12)
    row = dict(shape=name, rows=m, k=k, n=n, group=group, kernel=cand.label, us=s * 1e6,
               tbps=nbytes / s / 1e12, fraction_of_floor=floor_s / s, floor_us=floor_s * 1e6,
               max_abs_error=err)
    print(f"{name:8s} m{m} g{group:<4d} {cand.label}  {s * 1e6:8.1f} us  {row['tbps']:5.2f} "
          f"TB/s  {row['fraction_of_floor']:6.1%} of floor  err {err:.3g}", flush=True)
    return row


def run_once(shapes: list[tuple[str, int, int]]) -> None:
    """Each default kernel on each of ``shapes`` at one row, twice (the second call is the one
    to read in a profile: the first compiles), with no profiler of JAX's own attached:
    ``ncu`` and ``jax.profiler`` both need CUPTI."""
    cands = [for_tiles(Int4Tiles()), for_tiles(FLOAT32_WORDS),
             dataclasses.replace(for_tiles(Int8Tiles()), label="int8 default")]
    for name, k, n in shapes:
        for cand in cands:
            ops = operands8(1, k, n) if cand.int8 else operands(1, k, n, 128)
            for _ in range(2):
                jax.block_until_ready(cand.call(*ops))
        x = operands(1, k, n, 128)[0]
        w = jnp.asarray(np.random.default_rng(1).normal(size=(k, n)), jnp.bfloat16)
        for _ in range(2):
            jax.block_until_ready(jnp.dot(x, w))
        print(f"ran {name}", flush=True)


def main() -> None:
    """Measure the candidates (and the sweep); print each layer's time; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--read-tbps", type=float, default=3.0, help="measured read bandwidth")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2", help="row counts to time")
    sweeps = ap.add_mutually_exclusive_group()  # each fills the same ranked list
    sweeps.add_argument("--sweep", action="store_true",
                        help="time the float16-pair kernel's tiles at one row, g128 (slow)")
    sweeps.add_argument("--sweep-pairs", action="store_true",
                        help="time the float16-pair kernel's tilings, loads a step ahead or "
                             "not and each of --programs (int4 g128 at each of --rows; with "
                             "--int8 the int8 g64 kernel at one row instead) (slow)")
    sweeps.add_argument("--sweep-wide", action="store_true",
                        help="time the wide tile at each of --programs as its program "
                             "target (int4 g128 at each of --rows; with --int8 the int8 g64 "
                             "kernel at one row at 256 x 8 and 512 x 8) beside the default")
    ap.add_argument("--programs", default="512,1024,2048",
                    help="--sweep-pairs, --sweep-wide: the program targets to time")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="8b",
                    help="whose layer shapes to time (the layer's fraction of its floor)")
    ap.add_argument("--probe", action="store_true",
                    help="also time the stripped read / unpack kernels (one row)")
    ap.add_argument("--only-probe", action="store_true",
                    help="time the probes only, not the kernels")
    ap.add_argument("--trace", action="store_true",
                    help="profile one timed program per kernel on the o shape (g128, one "
                         "row) and print its device kernels: what a call's time is made of")
    ap.add_argument("--int8", action="store_true",
                    help="time int8_matmul instead (g64): the float16-pair few-row kernel "
                         "against the tensor-core one")
    ap.add_argument("--once", action="store_true",
                    help="only run each default kernel (int4 g128, int8 g64, bf16 through "
                         "XLA) twice per shape at one row, untimed: a program for Nsight "
                         "Compute (ncu) to profile; other modes are ignored")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        programs = [int(p) for p in args.programs.split(",")]
        row_counts = [int(m) for m in args.rows.split(",")]
    except ValueError:
        ap.error(f"--programs {args.programs!r} and --rows {args.rows!r} must be "
                 "comma-separated whole numbers, e.g. 512,1024")
    if min(programs + row_counts) < 1:
        ap.error("--programs and --rows must be positive")
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("bench_int4: the kernel under test runs on a GPU; none is visible")

    def write(candidates: list[dict], sweep: list[dict]) -> None:
        if not args.json:
            return
        record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                      date=time.strftime("%Y-%m-%d %H:%M:%S"), read_tbps=args.read_tbps,
                      command="python " + " ".join(sys.argv), candidates=candidates,
                      sweep=sweep)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}", flush=True)

    def layer(cand: Candidate, m: int, groups=(32, 64, 128)) -> dict:
        rows = [measure(nm, m, k, n, g, cand, args.read_tbps, args.calls, args.repeats)
                for g in groups for nm, k, n in SHAPES[args.shapes]]
        floor = {g: sum(r["floor_us"] for r in rows if r["group"] == g) for g in groups}
        us = {g: sum(r["us"] for r in rows if r["group"] == g) for g in groups}
        print(f"layer, {m} row(s): " + ", ".join(
            f"g{g} {us[g]:.1f} us ({floor[g] / us[g]:.1%} of floor)" for g in groups)
            + f"  {cand.label}", flush=True)
        return dict(kernel=cand.label, shapes=args.shapes, rows_per_call=m, rows=rows,
                    layer_us=us, floor_us=floor)

    if args.once:
        run_once(SHAPES[args.shapes])
        return
    if args.int8 and not (args.sweep_pairs or args.sweep_wide):  # one row count at a
        # time, each kernel and dot_rows, the JSON rewritten after each
        candidates = []
        for m in row_counts:
            for label, tiles in (
                    ("int8 float16 pairs", Int8Tiles(word_rows=WORD_ROWS)),
                    ("int8 tensor-core (word_rows=0)", Int8Tiles(word_rows=0)),
                    ("int8 tensor-core, 32-row dots", Int8Tiles(word_rows=0, dot_rows=32)),
                    ("int8 tensor-core, 16-row dots", Int8Tiles(word_rows=0, dot_rows=16))):
                if m <= 16 and tiles.dot_rows < 64:
                    continue  # a 16-row tile is one 16-row dot already
                cand = dataclasses.replace(for_tiles(tiles), label=label)
                candidates.append(layer(cand, m, groups=(64,)))
                write(candidates, [])
        return
    if args.trace:
        for cand in (for_tiles(Int4Tiles()),
                     Candidate("probe(read)", functools.partial(stream_probe, unpack=False),
                               probe=True)):
            trace_call(cand, operands(1, 4096, 4096, 128), args.calls)
    candidates = [] if args.only_probe or args.sweep_pairs or args.sweep or args.sweep_wide else [
        layer(c, m) for m in row_counts
        for c in (for_tiles(Int4Tiles()),
                  for_tiles(FLOAT32_WORDS),
                  for_tiles(Int4Tiles(word_rows=0)))]
    if args.probe or args.only_probe:
        for unpack, block_n, step_rows in itertools.product((False, True), (128, 256),
                                                            (64, 256)):
            label = f"probe({'unpack' if unpack else 'read'}, block_n={block_n}, " \
                    f"step_rows={step_rows})"
            call = functools.partial(stream_probe, unpack=unpack, block_n=block_n,
                                     step_rows=step_rows)
            candidates.append(layer(Candidate(label, call, probe=True), 1, groups=(128,)))
    sweep = []
    if args.sweep_pairs:  # every shape, the JSON rewritten after each tiling; int4 at each
        # of --rows, or with --int8 int8 at one row (its pair kernel's only row count,
        # Int8Tiles.word_rows); each around its shipped tiling, so the default is a candidate
        if not args.int8:
            for m, ahead, target in itertools.product(row_counts, (False, True), programs):
                word = dataclasses.replace(Int4Tiles().word, prefetch=ahead,
                                           half2_programs=target)
                sweep.append(layer(for_tiles(Int4Tiles(word=word)), m, groups=(128,)))
                write(candidates, sweep)
        for ahead, target in itertools.product((False, True) if args.int8 else (), programs):
            word = dataclasses.replace(Int8Tiles().word, prefetch=ahead,
                                       target_programs=target)
            sweep.append(layer(for_tiles(Int8Tiles(word=word)), 1, groups=(64,)))
            write(candidates, sweep)
    if args.sweep_wide:  # the wide tile (r224-r235): its program target; the time includes
        # the XLA sum of the partials (alone here: in a model XLA may fuse it into the
        # consumer, so an engine A/B decides)
        # (the default first; a variant equal to it is not timed again)
        if args.int8:
            sweep.append(layer(for_tiles(Int8Tiles()), 1, groups=(64,)))
            write(candidates, sweep)
            for tile, target in itertools.product(((256, 8), (512, 8)), programs):
                word = dataclasses.replace(Int8Tiles().word, wide_tile=tile,
                                           wide_programs=target)
                if word != Int8Tiles().word:
                    sweep.append(layer(for_tiles(Int8Tiles(word=word)), 1, groups=(64,)))
                    write(candidates, sweep)
        else:
            for m in row_counts:
                sweep.append(layer(for_tiles(Int4Tiles()), m, groups=(128,)))
                write(candidates, sweep)
                for target in programs:
                    word = dataclasses.replace(Int4Tiles().word, wide_programs=target)
                    if word != Int4Tiles().word:
                        sweep.append(layer(for_tiles(Int4Tiles(word=word)), m, groups=(128,)))
                        write(candidates, sweep)
    if args.sweep:  # the float16-pair kernel's tile at one row, g128, around the default
        for block_n, sub_rows, warps, evict in itertools.product(
                (64, 128, 256, 512), (4, 8, 16, 32, 64), (2, 4, 8), (False, True)):
            if sub_rows * block_n // 4 // (32 * warps) != 4 or (evict and warps != 4):
                continue  # 16 bytes per thread per load (r122: 32 always slower)
            # Fewer rows per load leave each thread more of a group's rows (fewer scale and
            # zero epilogues per weight), and more float16 products per sum: 128 / sub_rows.
            word = dataclasses.replace(Int4Tiles().word, block_n=block_n, sub_rows=sub_rows,
                                       num_warps=warps, evict_first=evict,
                                       half2_products=max(8, 128 // sub_rows))
            sweep.append(layer(for_tiles(Int4Tiles(word=word)), 1, groups=(128,)))
            write(candidates, sweep)
    for c in sorted(sweep, key=lambda c: (c["kernel"][:4], c["rows_per_call"],
                                          sum(c["layer_us"].values()))):  # the ranking
        print(f"{sum(c['layer_us'].values()):8.1f} us per layer, {c['rows_per_call']} "
              f"row(s)  {c['kernel']}")
    write(candidates, sweep)


if __name__ == "__main__":
    main()
