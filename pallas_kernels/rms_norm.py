"""Residual add and RMSNorm in one kernel, for decode steps.

In a decode step every op of a layer other than the matmuls and attention moves a few
kilobytes, so its cost is the launch: XLA runs ``h + attn @ wo`` and the RMSNorm that follows
as three kernels (the add, the mean square, the scaling), ~1.3 us each plus the gap between
launches (8B batch-1 census, bench/NOTES.md r37). This kernel does all three per row: one
program per row holds the whole ``[1, D]`` row, so the sum of squares needs no second pass.

Same casts as ``jaxinfer.model.rms_norm`` (HF Llama's): the sum in ``x.dtype``, statistics in
float32, the normalised row cast back to ``x.dtype`` before the weight multiplies it.

GPU only (Pallas Triton; the Triton interpreter on CPU for tests). ``D`` must be a power of
two (a Triton block); callers fall back to XLA otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check, check_dtype, gpu_params

NORM_ROWS = 64
"""Rows (tokens of a step) up to which ``jaxinfer.model`` runs this kernel: past a decode
batch the three XLA kernels are no longer launch-bound."""


def add_rms_norm_reference(x: jax.Array, residual: jax.Array | None, weight: jax.Array,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """``h = x + residual`` (``x`` when ``residual`` is None) and ``weight * h / rms(h)``,
    both ``[M, D]`` in ``x.dtype``."""
    h = x if residual is None else x + residual
    h32 = h.astype(jnp.float32)
    normed = h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return h, weight.astype(x.dtype) * normed.astype(x.dtype)


def _add_rms_norm_kernel(*refs, eps: float, add: bool) -> None:
    """One row: refs are x, (residual,) weight ``[1, D]``, then h (when adding) and normed."""
    if add:
        x_ref, r_ref, w_ref, h_ref, n_ref = refs
        h = x_ref[...] + r_ref[...]  # [1, D] in x.dtype, as the XLA add rounds it
        h_ref[...] = h
    else:
        x_ref, w_ref, n_ref = refs
        h = x_ref[...]
    h32 = h.astype(jnp.float32)
    mean_sq = jnp.sum(h32 * h32, axis=1, keepdims=True) / h32.shape[1]  # [1, 1]
    normed = (h32 * lax.rsqrt(mean_sq + eps)).astype(h.dtype)
    n_ref[...] = w_ref[...].astype(h.dtype) * normed


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm_jit(x, residual, weight, *, eps, interpret):
    m, d = x.shape
    row = pl.BlockSpec((1, d), lambda i: (i, 0))
    add = residual is not None
    operands = [x, residual, weight[None, :]] if add else [x, weight[None, :]]
    specs = [row, row] if add else [row]
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    outs = pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, eps=eps, add=add),
        grid=(m,),
        in_specs=[*specs, pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=[row, row] if add else [row],
        out_shape=[out, out] if add else [out],
        compiler_params=gpu_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxinfer_add_rms_norm",
    )(*operands)
    return (outs[0], outs[1]) if add else (x, outs[0])


def add_rms_norm(x: jax.Array, residual: jax.Array | None, weight: jax.Array, eps: float, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(h, weight * h / rms(h))`` for ``h = x + residual`` (``x`` when ``residual`` is
    None), from ``x``, ``residual [M, D]`` and ``weight [D]``, ``D`` a power of two; both
    results ``[M, D]`` in ``x.dtype``. ``interpret``: the Pallas interpreter (CPU tests)."""
    check(x.ndim == 2 and weight.shape == (x.shape[1],),
          f"add_rms_norm takes x [M, D] and weight [D], got {x.shape} and {weight.shape}")
    check(residual is None or residual.shape == x.shape,
          f"residual {None if residual is None else residual.shape} must match x {x.shape}")
    d = x.shape[1]
    check(d & (d - 1) == 0, f"add_rms_norm needs D a power of two (a Triton block), got {d}")
    check_dtype("x", x)
    return _add_rms_norm_jit(x, residual, weight, eps=float(eps), interpret=interpret)
