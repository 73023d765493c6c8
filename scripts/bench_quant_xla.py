"""Time quantized-weight matmuls written for XLA against jaxinfer's Pallas kernels, on a chain
of 8B-shaped layers, at decode and prefill row counts.

Usage: ``PYTHONPATH=. python scripts/bench_quant_xla.py --json bench/results/<device>/q.json``

Question it answers: does XLA fuse the dequantization of an int8 / int4 / fp8 weight into
its GEMM (reading only the quantized bytes), for which formulations, and how close to the
read floor does that run next to ``pallas_kernels.int8_matmul`` / ``int4_matmul``?

Each variant multiplies through ``--layers`` layers of distinct random weights (so nothing is
cached between layers, and XLA cannot hoist a dequantization out of a loop): per layer the
fused QKV, the output projection, the fused gate/up and the down projection of
Llama-3.1-8B, with ``x [M, 4096]`` flowing through them as in a layer (SiLU gate, residual).
The floor per layer is the larger of its weight bytes over ``--read-tbps`` and its FLOPs
over ``--matmul-tflops``. Each program is compiled, warmed up and timed as the median of
``--repeats`` runs; the count of each GEMM kind in the optimised HLO says what XLA made of
it (``triton_gemm``: a fused Triton GEMM, ``cublas``: a library call, whose operand had to be
written out first). A record for bench/NOTES.md, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_matmul, int8_matmul
from pallas_kernels.int4_matmul import Int4Tiles
from pallas_kernels.matmul import Int8Tiles
from pallas_kernels.word_gemv import WORD_ROWS, WordTiles, word_gemv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int4 import SHAPES_8B  # noqa: E402 - the sibling script, importable once its folder is on the path

HIDDEN = 4096

Weight = dict[str, jax.Array]
Make = Callable[[jax.Array, int, int], Weight]  # (key, K, N) -> the weight's arrays
Apply = Callable[[jax.Array, Weight], jax.Array]  # (x [M, K] bf16, weight) -> [M, N] bf16


def _normal(key: jax.Array, k: int, n: int) -> jax.Array:
    return jax.random.normal(key, (k, n), jnp.float32) * k ** -0.5


def make_bf16(key, k, n):
    """The bf16 baseline: a random ``[K, N]`` weight."""
    return dict(w=_normal(key, k, n).astype(jnp.bfloat16))


def make_int8(group: int) -> Make:
    """int8 ``[K, N]``, float32 scale ``[K / G, N]`` (G 0: one scale per column)."""
    def make(key, k, n):
        group_ = group or k
        w = _normal(key, k, n).reshape(k // group_, group_, n)
        s = jnp.max(jnp.abs(w), axis=1) / 127  # [K / group, N]
        q = jnp.round(w / s[:, None]).astype(jnp.int8).reshape(k, n)
        return dict(q=q, s=s)
    return make


def make_uint4(group: int) -> Make:
    """jaxinfer's int4 format: uint8 ``[K / 2, N]``, float16 scale and zero ``[K / G, N]``."""
    def make(key, k, n):
        kq, ks = jax.random.split(key)
        q = jax.random.randint(kq, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
        s = (jax.random.uniform(ks, (k // group, n)) * 0.02 / k ** 0.5).astype(jnp.float16)
        return dict(q=q, s=s, z=(-7.5 * s).astype(jnp.float16))
    return make


def make_s4(group: int) -> Make:
    """XLA's int4 type (signed, packed by XLA), float16 scale and zero ``[K / G, N]``."""
    def make(key, k, n):
        group_ = group or k
        kq, ks = jax.random.split(key)
        q = jax.random.randint(kq, (k, n), -8, 8, jnp.int32).astype(jnp.int4)
        s = (jax.random.uniform(ks, (k // group_, n)) * 0.02 / k ** 0.5).astype(jnp.float16)
        return dict(q=q, s=s, z=(0.5 * s).astype(jnp.float16))
    return make


def make_fp8(key, k, n):
    """e4m3 ``[K, N]`` with a float32 scale per output column (its largest value at 448)."""
    w = _normal(key, k, n)
    s = jnp.max(jnp.abs(w), axis=0) / 448  # [N]
    return dict(q=(w / s).astype(jnp.float8_e4m3fn), s=s)


def _grouped_dequant(q, s, z=None):
    """``[K, N]`` bf16 from a ``[K, N]`` integer weight and ``[K / G, N]`` scales (zeros)."""
    k, n = q.shape
    g = k // s.shape[0]
    w = q.reshape(k // g, g, n).astype(jnp.bfloat16) * s[:, None].astype(jnp.bfloat16)
    if z is not None:
        w = w + z[:, None].astype(jnp.bfloat16)
    return w.reshape(k, n)


def _grouped_batched(x, q, s, z=None):
    """Per-group partial products (a batched GEMM over groups), scaled, then summed."""
    k, n = q.shape
    groups = s.shape[0]
    xg = x.reshape(x.shape[0], groups, k // groups)  # [M, G', g]
    p = jnp.einsum("mgk,gkn->mgn", xg, q.reshape(groups, k // groups, n).astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)  # [M, G', N]
    out = jnp.einsum("mgn,gn->mn", p, s.astype(jnp.float32))
    if z is not None:
        out = out + jnp.einsum("mg,gn->mn", jnp.sum(xg.astype(jnp.float32), -1),
                               z.astype(jnp.float32))
    return out.astype(jnp.bfloat16)


def apply_u4_xla(x, w):
    """The packed int4 weight (two rows per byte, group scales and zeros) dequantized to
    bf16 by jnp, then ``x @ w``: whatever XLA fuses of it."""
    groups, n = w["s"].shape
    half = w["q"].shape[0] // groups
    v = w["q"].reshape(groups, half, n)
    v = jnp.concatenate([v & 15, v >> 4], axis=1)  # [G', g, N]
    wd = (v.astype(jnp.bfloat16) * w["s"][:, None].astype(jnp.bfloat16)
          + w["z"][:, None].astype(jnp.bfloat16))
    return x @ wd.reshape(2 * w["q"].shape[0], n)


def apply_fp8_act(x, w, w_in_axis: int = 0):
    """An fp8 x fp8 GEMM: each row of ``x`` scaled into e4m3, the weight's input axis
    ``w_in_axis`` contracted, row and column scales applied to the float32 result."""
    x32 = x.astype(jnp.float32)
    xs = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12) / 448
    out = jax.lax.dot_general((x32 / xs).astype(jnp.float8_e4m3fn), w["q"],
                              (((1,), (w_in_axis,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return (out * xs * w["s"]).astype(jnp.bfloat16)


def make_fp8_nk(key, k, n):
    """fp8 stored ``[N, K]`` (input axis contiguous: the operand layout of cuBLASLt's fp8
    GEMM)."""
    w = make_fp8(key, k, n)
    return dict(q=w["q"].T.copy(), s=w["s"])


VARIANTS: dict[str, tuple[Make, Apply, int]] = {
    # name: (make, apply, largest M it runs; 0: any)
    "bf16": (make_bf16, lambda x, w: x @ w["w"], 0),
    "int8_g64_kernel": (make_int8(64), lambda x, w: int8_matmul(x, w["q"], w["s"]), 64),
    "int8_g64_tensorcore": (make_int8(64), lambda x, w: int8_matmul(
        x, w["q"], w["s"], tiles=Int8Tiles(word_rows=0)), 64),
    "int8_g64_word": (make_int8(64), lambda x, w: word_gemv(  # the float32 word kernel (r64)
        x, w["q"], w["s"], None, bits=8, offset=-128, flip=0x80, interpret=False,
        tiles=WordTiles(int8_half2=False), out_dtype=x.dtype), WORD_ROWS),
    "int8_g64_xla_dequant": (make_int8(64), lambda x, w: x @ _grouped_dequant(w["q"], w["s"]), 0),
    "int8_g64_xla_batched": (make_int8(64), lambda x, w: _grouped_batched(x, w["q"], w["s"]), 0),
    "int8_channel_xla": (make_int8(0), lambda x, w: (
        (x @ w["q"].astype(jnp.bfloat16)).astype(jnp.float32) * w["s"][0]).astype(jnp.bfloat16),
        0),
    "int4_g128_kernel": (make_uint4(128), lambda x, w: int4_matmul(x, w["q"], w["s"], w["z"]),
                         64),
    "int4_g32_kernel": (make_uint4(32), lambda x, w: int4_matmul(x, w["q"], w["s"], w["z"]), 64),
    "int4_g128_tensorcore": (make_uint4(128), lambda x, w: int4_matmul(
        x, w["q"], w["s"], w["z"], tiles=Int4Tiles(word_rows=0)), 64),
    "int4_g128_xla_u8": (make_uint4(128), apply_u4_xla, 0),
    "s4_g128_xla_dequant": (make_s4(128), lambda x, w: x @ _grouped_dequant(w["q"], w["s"],
                                                                             w["z"]), 0),
    "s4_g32_xla_dequant": (make_s4(32), lambda x, w: x @ _grouped_dequant(w["q"], w["s"],
                                                                           w["z"]), 0),
    "s4_g128_xla_batched": (make_s4(128), lambda x, w: _grouped_batched(x, w["q"], w["s"],
                                                                         w["z"]), 0),
    "s4_g32_xla_batched": (make_s4(32), lambda x, w: _grouped_batched(x, w["q"], w["s"],
                                                                       w["z"]), 0),
    "s4_channel_xla": (make_s4(0), lambda x, w: (
        (x @ w["q"].astype(jnp.bfloat16)).astype(jnp.float32) * w["s"][0]).astype(jnp.bfloat16),
        0),
    "fp8_act": (make_fp8, apply_fp8_act, 0),
    "fp8_act_nk": (make_fp8_nk, lambda x, w: apply_fp8_act(x, w, w_in_axis=1), 0),
    "fp8_weight_only_nk": (make_fp8_nk, lambda x, w: (  # in_last, a program under 128 rows
        jnp.einsum("md,nd->mn", x, w["q"].astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32) * w["s"]).astype(jnp.bfloat16), 0),
    "fp8_weight_only": (make_fp8, lambda x, w: (
        (x @ w["q"].astype(jnp.bfloat16)).astype(jnp.float32) * w["s"]).astype(jnp.bfloat16),
        0),
}


def build(make: Make, layers: int, seed: int = 0) -> list[dict[str, Weight]]:
    """``layers`` layers of distinct weights, made on the device."""
    key = jax.random.key(seed)
    out = []
    for i in range(layers):
        keys = jax.random.split(jax.random.fold_in(key, i), len(SHAPES_8B))
        out.append({nm: make(kk, k, n) for kk, (nm, k, n) in zip(keys, SHAPES_8B, strict=True)})
    return out


def chain(apply: Apply) -> Callable:
    """``x [M, 4096]`` through every layer: QKV (first 4096 columns on), O, gate/up, down."""
    def run(x, weights):
        for w in weights:
            h = apply(x, w["qkv"])[:, :HIDDEN]
            h = apply(h, w["o"])
            gu = apply(h, w["gate_up"])
            a, b = jnp.split(gu, 2, axis=-1)
            h = apply(jax.nn.silu(a) * b, w["down"])
            x = x + h
            x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1,
                                           keepdims=True) + 1e-6).astype(x.dtype)
        return x
    return jax.jit(run)


def weight_bytes(weights: list[dict[str, Weight]]) -> int:
    """Bytes of every array of every weight (int4: half a byte per value)."""
    total = 0
    for layer in weights:
        for w in layer.values():
            for a in w.values():
                bits = 4 if a.dtype == jnp.int4 else a.dtype.itemsize * 8
                total += a.size * bits // 8
    return total


def gemm_kinds(hlo: str) -> dict[str, int]:
    """How many GEMMs of each kind the optimised HLO holds."""
    return {kind: hlo.count(pattern) for kind, pattern in (
        ("triton_gemm", '"kind":"__triton_gemm"'), ("cublas", 'custom_call_target="__cublas$gemm"'),
        ("cublaslt", 'custom_call_target="__cublas$lt$matmul'),
        ("pallas", 'custom_call_target="__gpu$xla.gpu.triton"'),
        ("any_dot", " dot("))}


def measure(name: str, m: int, args: argparse.Namespace) -> dict:
    """One variant at ``m`` rows: compile, check kinds, time."""
    make, apply, _ = VARIANTS[name]
    weights = build(make, args.layers)
    jax.block_until_ready(weights)
    x = jax.random.normal(jax.random.key(1), (m, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    f = chain(apply)
    t0 = time.perf_counter()
    compiled = f.lower(x, weights).compile(compiler_options=args.compiler_options or None)
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    kinds = gemm_kinds(hlo)
    y = compiled(x, weights)
    y.block_until_ready()
    finite = bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        compiled(x, weights).block_until_ready()
        times.append(time.perf_counter() - t0)
    s = float(np.median(times)) / args.layers
    nbytes = weight_bytes(weights) / args.layers
    flops = 2 * m * sum(k * n for _, k, n in SHAPES_8B)
    floor = max(nbytes / (args.read_tbps * 1e12), flops / (args.matmul_tflops * 1e12))
    row = dict(variant=name, rows=m, layer_us=s * 1e6, floor_us=floor * 1e6,
               fraction_of_floor=floor / s, weight_mb_per_layer=nbytes / 1e6,
               compile_s=compile_s, gemm_kinds=kinds, finite=finite,
               compiler_options=args.compiler_options)
    print(f"{name:22s} M={m:<4d} {s * 1e6:8.1f} us/layer  floor {floor * 1e6:7.1f} us "
          f"({row['fraction_of_floor']:6.1%})  compile {compile_s:5.1f} s  {kinds}"
          f"{'' if finite else '  NON-FINITE'}", flush=True)
    if args.hlo_dir:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.hlo_dir) / f"{name}_m{m}.hlo.txt").write_text(hlo)
    del weights
    return row


def compiler_option(text: str) -> tuple[str, bool | int | str]:
    """``NAME=VALUE`` as ``(NAME, VALUE)``, the value a bool (true / false), an int or the
    text itself; one line for the user otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"bench_quant_xla: --compiler-option {text!r} is not NAME=VALUE, "
                         "e.g. xla_gpu_enable_triton_gemm=false")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def main() -> None:
    """Measure each variant at each row count; print; write JSON as it goes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--read-tbps", type=float, default=3.0, help="measured read bandwidth")
    ap.add_argument("--matmul-tflops", type=float, default=634.0, help="measured bf16 rate")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", default="1,64,512", help="row counts (tokens per step)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hlo-dir", default=None, help="write each optimised HLO here")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA option for every program compiled here (repeatable), e.g. "
                         "xla_gpu_enable_triton_gemm=false")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.compiler_options = dict(compiler_option(o) for o in args.compiler_option)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench_quant_xla: unknown variants {unknown}; known: {list(VARIANTS)}")
    rows = []
    stats = jax.devices()[0].memory_stats() or {}
    before = stats.get("bytes_in_use", 0)
    probe = jnp.zeros((4096, 28672), jnp.int4) + jnp.int4(1)
    probe.block_until_ready()
    after = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
    print(f"an int4 [4096, 28672] array holds {after - before} bytes on the device "
          f"({probe.size // 2} packed)", flush=True)
    del probe
    record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  int4_probe_bytes=after - before, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  read_tbps=args.read_tbps, matmul_tflops=args.matmul_tflops,
                  layers=args.layers, compiler_options=args.compiler_options, rows=rows)
    for m in (int(v) for v in args.rows.split(",")):
        for name in names:
            if VARIANTS[name][2] and m > VARIANTS[name][2]:
                continue
            try:
                rows.append(measure(name, m, args))
            except Exception as e:  # noqa: BLE001 - a variant XLA cannot run is a finding
                print(f"{name:22s} M={m:<4d} FAILED: {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                rows.append(dict(variant=name, rows=m, error=f"{type(e).__name__}: {e}"[:2000]))
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
