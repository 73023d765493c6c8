"""What one tensor-parallel all-reduce costs at batch-1 decode sizes, alone and between GEMVs.

Each case is one jitted program: ``--iters`` dependent steps in a ``lax.fori_loop``, one
iteration per round of weight copies, compiled with the XLA options of ``--graphs`` (by default
the engine's for a tensor-parallel decode loop: one CUDA graph per iteration, launched by
the host), on a ``("model",)`` mesh of ``--tp`` devices, activations ``x [rows, hidden]`` in
bf16:

- ``psum``: ``x <- psum(x) / tp``: all-reduces only;
- ``gemv``: ``x_shard [rows, hidden / tp] @ w_shard [hidden / tp, hidden]``, the row-parallel
  projection (attention output, MLP down) of the model's layers, without the reduction: each
  device keeps its partial sum and takes its next input slice from it;
- ``gemv+psum``: the same with the all-reduce, as the model runs it.

``gemv+psum - gemv`` is what an all-reduce adds where the model issues it (two per layer);
``psum`` is its cost with nothing around it. The weight shards cycle through enough copies
to exceed the L2 cache (at most ``MAX_COPIES``), so each GEMV reads its weight from memory;
its floor is those bytes at the device kind's measured read bandwidth
(``benchmark.ceilings``), printed beside it.
The all-reduce moves ``2 (tp - 1) / tp x rows x hidden x 2`` bytes per device, a few KB:
its cost is latency, not bandwidth. Before timing, every case is checked against a
single-device ``jnp`` reference.

    PYTHONPATH=. python scripts/bench_collectives.py --tp 4 --hidden 4096,8192 --json auto
        [--graphs engine|device-loop|xla]

A record for bench/NOTES.md, not a test (``tests/test_bench.py`` runs it on CPU devices).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(REPO))

from jaxinfer import runner  # noqa: E402
from jaxinfer.benchmark import (  # noqa: E402
    ceilings,
    device_folder,
    median_time,
    record_path,
    write_record,
)

VARIANTS = ("psum", "gemv", "gemv+psum")
MAX_COPIES = 64
"""Weight copies a program cycles through at most: the steps of one loop iteration, unrolled
(64 x a 1 MB shard at tp=8, hidden 2048, still exceeds a 50 MB L2 cache)."""
GRAPHS = {"engine": runner.TP_DEVICE_LOOP_GRAPHS, "device-loop": runner.DEVICE_LOOP_GRAPHS,
          "xla": None}
"""``--graphs``: the XLA options the programs compile with: the engine's for a
tensor-parallel decode loop (each iteration one CUDA graph with its NCCL all-reduces; the
default, so the steps run as the model's do), the one-device decode loop's (the whole loop
in one graph, which XLA's own all-reduce kernels break up), or XLA's defaults."""


def chain(variant: str, mesh: Mesh, iters: int, options: dict[str, Any] | None
          ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The jitted ``iters``-step program of ``variant`` (XLA ``options``): ``(x [rows,
    hidden] replicated, w [copies * tp, hidden / tp, hidden] split over "model" by its first
    axis) -> x`` (``gemv``: each device's, stacked ``[tp * rows, hidden]``). Step ``i``
    multiplies by copy ``i % copies``; a loop iteration runs one step per copy, each copy
    indexed statically (a dynamic index into the stacked copies made XLA copy the weight
    before each GEMV: r161's GEMVs ran at 15-24% of their floor)."""
    tp = mesh.shape["model"]
    # Without the reduction a step's output is a 1/tp share of the sum: scaled back, the
    # values stay O(1) over the loop (timing never runs on underflowed zeros).
    scale = tp ** 0.5 if variant == "gemv" else 1.0

    def per_device(x: jax.Array, w: jax.Array) -> jax.Array:
        # x [rows, hidden], the same on every device; w [copies, hidden / tp, hidden]
        part = x.shape[1] // tp
        copies = w.shape[0]
        me = jax.lax.axis_index("model")

        def step(c: int, x: jax.Array) -> jax.Array:
            if variant == "psum":
                return (jax.lax.psum(x, "model") / tp).astype(x.dtype)
            x_shard = jax.lax.dynamic_slice_in_dim(x, me * part, part, axis=1)
            y = jnp.dot(x_shard, w[c], preferred_element_type=jnp.float32)
            if variant == "gemv+psum":
                y = jax.lax.psum(y, "model")
            return (y * scale).astype(x.dtype)

        def round_of_copies(_: jax.Array, x: jax.Array) -> jax.Array:
            for c in range(copies):
                x = step(c, x)
            return x

        x = jax.lax.fori_loop(0, iters // copies, round_of_copies, x)
        for c in range(iters % copies):  # the steps past the last whole round
            x = step(c, x)
        return x

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("model")),
                           out_specs=P("model") if variant == "gemv" else P(),
                           check_vma=False)
    return jax.jit(mapped, compiler_options=options)


def reference(variant: str, x: np.ndarray, w: np.ndarray, tp: int, iters: int) -> np.ndarray:
    """``chain``'s result on one device in float32 (``w [copies * tp, hidden / tp, hidden]``,
    device d holding copies ``d * copies ... (d + 1) * copies - 1``)."""
    copies = w.shape[0] // tp
    part = x.shape[1] // tp
    if variant == "psum":
        return x
    scale = tp ** 0.5 if variant == "gemv" else 1.0
    xs = [x] * tp  # each device's current x
    for i in range(iters):
        ys = [xs[d][:, d * part:(d + 1) * part] @ w[d * copies + i % copies]
              for d in range(tp)]
        if variant == "gemv+psum":
            ys = [sum(ys)] * tp
        xs = [(y * scale).astype(jnp.bfloat16).astype(np.float32) for y in ys]
    return np.concatenate(xs) if variant == "gemv" else xs[0]


def run_case(mesh: Mesh, rows: int, hidden: int, iters: int, repeats: int,
             read_bytes_per_s: float, cold_bytes: int, options: dict[str, Any] | None
             ) -> list[dict[str, Any]]:
    """Every variant at one ``(rows, hidden)``: checked against ``reference``, then timed.
    The weight shards cycle through enough copies to fill ``cold_bytes`` per device (at
    most ``iters``)."""
    tp = mesh.shape["model"]
    shard_bytes = hidden // tp * hidden * 2
    copies = max(1, min(iters, MAX_COPIES, -(-cold_bytes // shard_bytes)))
    kx, kw = jax.random.split(jax.random.PRNGKey(rows * 100003 + hidden))
    x = jax.random.normal(kx, (rows, hidden), jnp.bfloat16)
    # N(0, 1/hidden): each GEMV plus its all-reduce keeps x's scale.
    w = (jax.random.normal(kw, (copies * tp, hidden // tp, hidden), jnp.float32)
         * hidden ** -0.5).astype(jnp.bfloat16)
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P("model")))
    out = []
    for variant in VARIANTS:
        check_iters = min(iters, copies + 1)  # a whole round of copies and one step more
        got = np.asarray(chain(variant, mesh, check_iters, options)(x, w), np.float32)
        want = reference(variant, np.asarray(x, np.float32), np.asarray(w, np.float32), tp,
                         check_iters)
        err = float(np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want)))))
        if err > 0.05:  # bf16 steps, float32 accumulation: a few ulps
            raise RuntimeError(f"{variant} at rows={rows} hidden={hidden}: relative error "
                               f"{err:.3g} against the reference")
        timed = chain(variant, mesh, iters, options)

        def call(fn: Callable[..., jax.Array] = timed) -> None:
            jax.block_until_ready(fn(x, w))

        call()  # compile and warm up
        step_s = median_time(call, repeats)[0] / iters
        item = {"variant": variant, "tp": tp, "rows": rows, "hidden": hidden, "iters": iters,
                "us_per_step": round(step_s * 1e6, 3), "check_rel_err": round(err, 5),
                "allreduce_bytes_per_device": (2 * (tp - 1) * rows * hidden * 2 // tp
                                               if "psum" in variant else 0)}
        if variant != "psum":
            floor = shard_bytes / read_bytes_per_s
            item.update(gemv_floor_us=round(floor * 1e6, 3),
                        floor_share=round(floor / step_s, 3))
        out.append(item)
    by = {i["variant"]: i["us_per_step"] for i in out}
    out.append({"variant": "added by the all-reduce", "tp": tp, "rows": rows, "hidden": hidden,
                "us_per_step": round(by["gemv+psum"] - by["gemv"], 3)})
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every case; print a line each and return the record (also written to --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=None, help="devices (default: all)")
    ap.add_argument("--hidden", default="4096,8192", help="hidden sizes (8B: 4096, 70B: 8192)")
    ap.add_argument("--rows", default="2", help="activation rows (batch 1 runs 2)")
    ap.add_argument("--iters", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graphs", choices=sorted(GRAPHS), default="engine",
                    help="XLA options of the programs (see GRAPHS)")
    ap.add_argument("--cold-mib", type=int, default=256,
                    help="weight MiB per device the GEMVs cycle through (above the L2 cache)")
    ap.add_argument("--json", default=None, help="record path, or 'auto'")
    args = ap.parse_args(argv)
    devices = jax.devices()
    tp = len(devices) if args.tp is None else args.tp
    hidden, rows = _ints(args.hidden), _ints(args.rows)
    if not 2 <= tp <= len(devices) or any(h % tp for h in hidden) or args.iters < 1:
        ap.error(f"need 2 <= --tp <= {len(devices)} devices, hidden sizes divisible by it "
                 "and --iters >= 1")
    mesh = Mesh(np.array(devices[:tp]), ("model",))
    kind = devices[0].device_kind
    _, read_bw, note = ceilings(kind, None, None)
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"{tp} x {kind}", "jax": jax.__version__, "command": " ".join(sys.argv),
        "read_bytes_per_s": read_bw, "ceilings": note, "graphs": args.graphs, "items": []}
    for h in hidden:
        for r in rows:
            for item in run_case(mesh, r, h, args.iters, args.repeats, read_bw,
                                 args.cold_mib << 20, GRAPHS[args.graphs]):
                record["items"].append(item)
                share = item.get("floor_share")
                print(f"tp={tp} rows={r} hidden={h} {item['variant']:24s} "
                      f"{item['us_per_step']:9.2f} us/step"
                      + ("" if share is None else f"  (GEMV floor {item['gemv_floor_us']} us: "
                         f"{100 * share:.0f}%)"), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    folder = device_folder(kind, devices[0].platform)
    write_record(record_path(args.json, REPO / "bench" / "results" / folder
                             / f"collectives_tp{tp}_{stamp}.json"), record)
    return record


if __name__ == "__main__":
    main()
