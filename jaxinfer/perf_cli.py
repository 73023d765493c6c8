"""The ``jaxinfer plan`` and ``jaxinfer bench`` subcommands (kept apart from ``cli.py``).

``cli.py`` calls ``add_parsers`` on its subparser set; each parser carries its handler in
``args.perf_handler``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING, Any

from jaxinfer.errors import InputError

if TYPE_CHECKING:
    from jaxinfer.config import LlamaConfig
    from jaxinfer.roofline import Storage


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def add_parsers(sub: Any) -> None:
    """Register ``plan`` and ``bench`` on an ``argparse`` subparsers object."""
    p = sub.add_parser("plan", help="roofline plan: memory, latency, throughput per batch size")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="preset name (see jaxinfer.presets) or a config.json path")
    p.add_argument("--batch", type=_int_list, default=None,
                   help="batch sizes, e.g. 1,8,64 (default: powers of two past the memory limit)")
    p.add_argument("--context", type=int, default=4096, help="cached positions per sequence")
    p.add_argument("--device", default="h100", help="device preset or 'custom'")
    p.add_argument("--bandwidth", type=float, default=None, help="override, TB/s")
    p.add_argument("--flops", type=float, default=None, help="override, dense TFLOP/s")
    p.add_argument("--memory", type=float, default=None, help="override, GB")
    p.add_argument("--dtype-bytes", type=int, default=2,
                   help="bytes per weight/cache element where not quantized (default 2: bf16)")
    p.add_argument("--quantize", default=None,
                   help="plan with the matmul weights quantized as load_model(quantize=) "
                   "stores them: int8, int4, int4-g64, int4-g128 or fp8")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="plan with K/V stored as int8 or fp8 (load_model(kv_cache_dtype=))")
    p.set_defaults(perf_handler=run_plan)

    from jaxinfer.benchmark import add_bench_args

    b = sub.add_parser("bench", help="benchmark decode/prefill against the measured roofline")
    add_bench_args(b)
    b.set_defaults(perf_handler=run_bench)


def run_plan(args: argparse.Namespace) -> None:
    """Print the roofline plan for ``args``."""
    from jaxinfer import roofline
    from jaxinfer.presets import resolve_config

    for flag, value in (("--bandwidth", args.bandwidth), ("--flops", args.flops),
                        ("--memory", args.memory)):
        if value is not None and not 0 < value < math.inf:
            raise InputError(f"{flag} {value} must be a finite number > 0")
    if args.context < 1:
        raise InputError(f"--context {args.context} must be >= 1")
    if args.batch and min(args.batch) < 1:
        raise InputError(f"--batch {min(args.batch)} must be >= 1")
    config = resolve_config(args.model)
    device = roofline.device_spec(
        args.device,
        bandwidth=None if args.bandwidth is None else args.bandwidth * 1e12,
        flops=None if args.flops is None else args.flops * 1e12,
        memory=None if args.memory is None else args.memory * 1e9)
    if args.dtype_bytes not in roofline.DTYPE_NAMES:
        raise InputError(f"--dtype-bytes {args.dtype_bytes} must be 1, 2 or 4")
    storage = plan_storage(config, args.dtype_bytes, args.quantize, args.kv_cache_dtype)
    batches = args.batch or roofline.default_batches(
        roofline.max_batch(config, device, args.context, storage))
    rows = roofline.plan(config, device, batches, args.context, storage)
    print(roofline.format_plan(args.model, config, device, rows, storage))


def plan_storage(config: LlamaConfig, dtype_bytes: int, quantize: str | None,
                 kv_cache_dtype: str | None) -> Storage:
    """``roofline.Storage`` of ``config`` with weights and K/V of ``dtype_bytes`` per element,
    or, with ``quantize`` / ``kv_cache_dtype``, as ``load_model`` stores them: the quantized
    model's bytes from its shapes (``jax.eval_shape``; nothing is made), scales included,
    and a quantized page pool's bytes per position (not the few columns ``load_model`` pads
    an LM head with on a GPU: ``model.one_device_layout``). ``InputError`` for an unknown
    method, or a K/V dtype unknown or unfit for the model's head size."""
    import jax

    from jaxinfer import roofline
    from jaxinfer.benchmark import kv_bytes_per_position
    from jaxinfer.paged_cache import check_kv_cache_dtype
    from jaxinfer.quantize import (
        check_method,
        decode_weight_bytes,
        param_bytes,
        random_quantized_params,
    )

    storage = roofline.Storage.of(config, dtype_bytes)
    if quantize is None and kv_cache_dtype is None:
        return storage
    if quantize is not None:
        check_method(quantize)
    check_kv_cache_dtype(kv_cache_dtype, config.head_dim)
    if quantize is not None:
        shapes = jax.eval_shape(lambda: random_quantized_params(
            config, quantize, jax.random.PRNGKey(0), dtype=roofline.DTYPE_NAMES[dtype_bytes]))
        storage = dataclasses.replace(
            storage, params=param_bytes(shapes),
            step_weights=decode_weight_bytes(shapes, config.tie_word_embeddings))
    return dataclasses.replace(
        storage, kv_per_position=kv_bytes_per_position(config, dtype_bytes, kv_cache_dtype),
        label=f"{quantize or storage.label} weights, {kv_cache_dtype or storage.label} K/V")


def run_bench(args: argparse.Namespace) -> None:
    """Run the benchmark harness with ``args``."""
    from jaxinfer.benchmark import run_from_args

    run_from_args(args)
