"""Functional Llama: parameters are a plain pytree, the forward pass a pure function.

Params layout (weights in ``x @ W`` orientation, layers stacked on a leading axis so the layer
loop is one ``lax.scan`` and compile time does not grow with depth)::

    embed       [vocab, hidden]
    layers/attn_norm [L, hidden]          layers/mlp_norm [L, hidden]
    layers/wq   [L, hidden, heads*hd]     layers/wo     [L, heads*hd, hidden]
    layers/wk   [L, hidden, kv_heads*hd]  layers/wv     [L, hidden, kv_heads*hd]
    layers/w_gate, layers/w_up [L, hidden, inter]     layers/w_down [L, inter, hidden]
    final_norm  [hidden]
    lm_head     [hidden, vocab]           (absent when embeddings are tied; on one GPU, int4 /
                                          int8 columns padded to a multiple of 512 at load:
                                          one_device_layout)

Q/K weights use HF's non-interleaved ("rotate half") RoPE convention.

This stored layout is what checkpoints and the sharding rules use. ``prepare_params`` derives
execution layouts from it (fused matmuls, per-layer buffers; ``LAYOUTS`` names the choices
``load_model(layout=...)`` offers); ``forward_ragged`` (the engine's forward pass) runs any
of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxinfer.config import LlamaConfig
from jaxinfer.paged_cache import QuantizedPages
from jaxinfer.params import Params, init_params, param_shapes  # noqa: F401 (re-exported)
from jaxinfer.quantize import QuantizedWeight, fuse_quantized, input_axis_last
from sharding.attention import gather_vocab, mesh_write_and_attend, model_split


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, deterministic: bool = False
             ) -> jax.Array:
    """RMSNorm with float32 statistics, result in ``x.dtype`` (HF Llama's order of casts);
    ``deterministic``: the mean square through the batch-invariant ``row_sum`` kernel."""
    x32 = x.astype(jnp.float32)
    if deterministic:
        sq = (x32 * x32).reshape(-1, x.shape[-1])
        total = pallas_kernels.row_sum(sq, interpret=pallas_kernels.interpret_here())
        mean_sq = (total / x.shape[-1]).reshape(*x.shape[:-1], 1)
    else:
        mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(mean_sq + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse RoPE frequencies ``[head_dim // 2]`` float32, with llama3 scaling if configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv = inv.astype(np.float32)
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` by ``positions [B, T]`` (non-interleaved halves)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gemv_kernels(backend: str) -> bool:
    """Whether decode rows run the int8 / int4 Pallas kernels (``_dense_quantized``): on a
    GPU, or on CPU with ``backend="pallas"`` (the Pallas interpreter: tests). Not on a
    tensor-parallel mesh, where GSPMD cannot split them, nor on a TPU."""
    platform = jax.default_backend()
    return not model_split() and (platform == "gpu"
                                  or (platform == "cpu" and backend == "pallas"))


def _dense(x: jax.Array, w: jax.Array | QuantizedWeight, deterministic: bool = False,
           kernels: bool = False) -> jax.Array:
    """``x [..., in] @ w [in, out]``; ``deterministic``: the batch-invariant Pallas matmul
    (a row's result does not depend on the other rows), else XLA's GEMM. A
    ``QuantizedWeight`` goes through ``_dense_quantized`` (``kernels``: ``gemv_kernels``)."""
    if isinstance(w, QuantizedWeight):
        return _dense_quantized(x, w, x.dtype, kernels)
    if deterministic:
        interpret = pallas_kernels.interpret_here()
        out = pallas_kernels.matmul(x.reshape(-1, x.shape[-1]), w, interpret=interpret)
        return out.reshape(*x.shape[:-1], w.shape[-1])
    return jnp.einsum("...d,df->...f", x, w.astype(x.dtype))


def _kernel_weight(w: Any, kind: str, groups: tuple[int, ...], stacked: bool) -> bool:
    """Whether ``w`` is a ``kind`` weight with one of ``groups`` and, per layer
    (``stacked``: after the layer axis), one input axis and either one output axis or a fused
    ``[in, 1, out]`` one: what the few-row kernels take."""
    return (isinstance(w, QuantizedWeight) and w.kind == kind and w.group in groups
            and w.q.ndim - w.out_axes == 1 + stacked
            and (w.out_axes == 1 or w.q.shape[-2] == 1))


def int4_kernel_weight(w: Any, stacked: bool = False) -> bool:
    """Whether ``w`` is an int4 weight that ``pallas_kernels.int4_matmul`` multiplies on a GPU
    (one device): groups of 32, 64 or 128 rows, shaped as ``_kernel_weight`` says."""
    return _kernel_weight(w, "int4", (32, 64, 128), stacked)


def int8_kernel_weight(w: Any, stacked: bool = False) -> bool:
    """Whether ``w`` is an int8 weight that ``pallas_kernels.int8_matmul`` multiplies on a GPU
    (one device): one scale per 64 rows, shaped as ``_kernel_weight`` says."""
    return _kernel_weight(w, "int8", (64,), stacked)


def _gemv_kernel(w: QuantizedWeight, rows: int, kernels: bool) -> str | None:
    """Which Pallas kernel multiplies ``rows`` decode rows by ``w``: ``"int8"``, ``"int4"``,
    or None (XLA). ``kernels``: ``gemv_kernels``."""
    if not kernels or w.q.ndim != 2:
        return None
    if int8_kernel_weight(w) and rows <= pallas_kernels.GEMV_ROWS:
        return "int8"
    if int4_kernel_weight(w) and rows <= pallas_kernels.INT4_GEMV_ROWS:
        return "int4"
    return None


def _dense_quantized(x: jax.Array | pallas_kernels.ScaledPairs, w: QuantizedWeight,
                     out_dtype: Any, kernels: bool, partials: bool = False) -> jax.Array:
    """``x [..., in]`` times a quantized ``w [in, out]``, in ``out_dtype``; ``kernels``:
    decode rows may run the Pallas kernels (``gemv_kernels``). ``x`` may be ``ScaledPairs``
    ``[rows, in]`` (``_add_norm``; the result is then ``[rows, out]``). ``partials``: the
    float32 split-K partials ``[splits, rows, out]`` (``[1, rows, out]`` off the kernels)."""
    paired = isinstance(x, pallas_kernels.ScaledPairs)
    rows = math.prod(x.shape[:-1])
    if paired and (w.perm is not None or _gemv_kernel(w, rows, kernels) is None):
        x, paired = x.values().astype(out_dtype), False  # the activations they stand for
    if w.perm is not None:  # rows stored in another order (act-order GPTQ): match them
        x = jnp.take(x, w.perm, axis=-1)
        w = dataclasses.replace(w, perm=None)
    kernel = _gemv_kernel(w, rows, kernels)
    if kernel is not None:
        # Decode rows: the int8 / int4 kernels read the packed bytes only (XLA's GEMM would
        # read a bf16 copy it writes first).
        xs = x if paired else x.reshape(-1, x.shape[-1])  # [rows, in]
        kw = {"out_dtype": out_dtype, "interpret": pallas_kernels.interpret_here(),
              "partials": partials}
        out = (pallas_kernels.int8_matmul(xs, w.q, w.scale, **kw) if kernel == "int8" else
               pallas_kernels.int4_matmul(xs, w.q, w.scale, w.zero, **kw))
        return out if partials or paired else out.reshape(*x.shape[:-1], out.shape[-1])
    if partials:  # a caller that sums partials itself: the product as one
        out = _dense_quantized(x, w, out_dtype, kernels)
        return out.reshape(1, -1, out.shape[-1]).astype(jnp.float32)
    if w.kind == "fp8":
        return _dense_fp8(x, w, out_dtype)
    # Many rows (prefill): dequantize, then XLA's GEMM. The barrier makes the weight wait for
    # this layer's input, so XLA dequantizes one layer at a time rather than every layer up
    # front (which ran an 8B model out of memory).
    x, q = jax.lax.optimization_barrier((x, w.q))
    return jnp.einsum("...d,df->...f", x, dataclasses.replace(w, q=q).dequantize(x.dtype),
                      preferred_element_type=out_dtype)


def _dense_fp8(x: jax.Array, w: QuantizedWeight, out_dtype: Any) -> jax.Array:
    """``x [..., in]`` times an fp8 ``w`` (``[in, out]``, or fused ``[in, shards, out /
    shards]``): the e4m3 values converted to ``x.dtype`` inside the matmul, float32
    accumulation, the column scales applied to the result (per group of rows when the rows
    are split over a mesh), in ``out_dtype``.

    On a GPU XLA fuses the convert into its Triton GEMM, so only the fp8 bytes are read, at
    every row count (H100, bench/NOTES.md r54, per 8B layer: 154 us at 1 row and 174 us at 64
    against bf16's 208 / 211; 567 us at 512 rows against 375). An fp8 x fp8 GEMM (activations
    scaled into e4m3) ran 5-8x slower there: cuBLASLt's fp8 GEMM wants the weight with its
    input axis contiguous, and XLA transposed the ``[in, out]`` weight on every call. The
    barrier keeps the convert inside its layer (a loop-invariant convert would be hoisted
    where XLA does not fuse it, leaving a wide copy of every layer's weight).
    """
    x, q = jax.lax.optimization_barrier((x, w.q))
    if w.in_last:  # q [out, in]: one device, ``fp8_input_last``
        return _dense_fp8_input_last(x, q, w.scale[0], out_dtype, w.fp8_activations)
    groups = w.scale.shape[0]  # scale [G, *out]: 1, or one group per device's rows
    cols = "f" if q.ndim == 2 else "sf"
    if groups == 1:
        out = jnp.einsum(f"...d,d{cols}->...{cols}", x, q.astype(x.dtype),
                         preferred_element_type=jnp.float32)
        return (out * w.scale[0]).astype(out_dtype)
    # Rows split over a mesh: each device multiplies its rows and scales its partial product.
    xg = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    qg = q.reshape(groups, q.shape[0] // groups, *q.shape[1:])
    out = jnp.einsum(f"...gd,gd{cols}->...g{cols}", xg, qg.astype(x.dtype),
                     preferred_element_type=jnp.float32)
    return jnp.sum(out * w.scale, axis=-1 - len(cols)).astype(out_dtype)


def _dense_fp8_input_last(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype: Any,
                          fp8_activations: bool) -> jax.Array:
    """``x [..., in]`` times an fp8 weight stored ``q [out, in]`` with column scales ``scale
    [out]``. With ``fp8_activations`` each row of ``x`` is scaled into e4m3 (its absolute
    maximum to 448) and the product runs on fp8 tensor cores (cuBLASLt reads both operands
    with their contracted axis contiguous, so nothing is transposed); the row and column
    scales are applied to the float32 result. Rounding the activations to 3 mantissa bits
    costs accuracy: the default model's perplexity stays within 3% of bf16
    (tests/test_quantize.py). Without, the weight is converted inside the matmul."""
    if not fp8_activations:
        out = jnp.einsum("...d,fd->...f", x, q.astype(x.dtype),
                         preferred_element_type=jnp.float32)
        return (out * scale).astype(out_dtype)
    x32 = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12) / 448.0
    x8 = (x32 / x_scale).astype(jnp.float8_e4m3fn)
    out = jnp.einsum("...d,fd->...f", x8, q, preferred_element_type=jnp.float32)
    return (out * x_scale * scale).astype(out_dtype)


def _dense_fused(x: jax.Array | pallas_kernels.ScaledPairs, w: jax.Array | QuantizedWeight,
                 deterministic: bool = False, kernels: bool = False) -> jax.Array:
    """``x [..., in]`` times a fused weight ``[in, shards, out/shards]`` (``fuse_columns``):
    ``[..., shards, out/shards]``, each shard's columns apart (local to that shard on a mesh).
    ``x`` may be ``ScaledPairs`` ``[T, in]`` for a weight ``_reads_pairs``: then
    ``[1, T, 1, out]``."""
    if isinstance(x, pallas_kernels.ScaledPairs):
        return _dense_quantized(x, w.first_shard(), x.dtype, kernels)[None, :, None, :]
    if isinstance(w, QuantizedWeight) and (w.in_last or w.q.shape[-2] == 1):
        return _dense(x, w if w.in_last else w.first_shard(),
                      kernels=kernels)[..., None, :]
    if isinstance(w, QuantizedWeight):  # split over a mesh: dequantize a layer at a time
        if w.perm is not None:  # stored rows in another order: gather x, not the weight
            x = jnp.take(x, w.perm, axis=-1)
        if w.kind == "fp8":  # no dequantized copy: the convert is fused into the GEMM
            return _dense_fp8(x, dataclasses.replace(w, perm=None), x.dtype)
        x, q = jax.lax.optimization_barrier((x, w.q))
        w = dataclasses.replace(w, q=q, perm=None).dequantize(x.dtype)
    if w.shape[-2] == 1:  # one device: the plain matmul of the unfused layout (same GEMM)
        return _dense(x, w[:, 0], deterministic, kernels)[..., None, :]
    return jnp.einsum("...d,dsf->...sf", x, w.astype(x.dtype))


def _qkv(x: jax.Array | pallas_kernels.ScaledPairs, lp: Params, c: LlamaConfig,
         positions: jax.Array, deterministic: bool = False, kernels: bool = False
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q, K, V ``[B, T, heads, D]``, Q and K rotated to ``positions [B, T]``, from one fused
    matmul if the layout has ``wqkv`` (``x``: ``[B, T, hidden]``, or ``ScaledPairs`` of ``[T,
    hidden]`` with B = 1). Where ``x`` is ``ScaledPairs`` (the junctions' decode rows) the
    kernel's split partials go to one ``sum_rope`` kernel, which sums them and rotates."""
    b, t = (1, x.pairs.shape[0]) if isinstance(x, pallas_kernels.ScaledPairs) else x.shape[:2]
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inv_freq = rope_inv_freq(c)
    if isinstance(x, pallas_kernels.ScaledPairs) and c.head_dim & (c.head_dim - 1) == 0:
        # (ScaledPairs come only for a kernel weight, _add_norm; sum_rope's half-head blocks
        # need a power of two, else the fused path below takes the pairs)
        freqs = positions[0].astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)  # [T, D/2]
        parts = _dense_quantized(x, lp["wqkv"].first_shard(), x.dtype, kernels, partials=True)
        qkv = pallas_kernels.sum_rope(
            parts, jnp.cos(freqs), jnp.sin(freqs), head_dim=c.head_dim,
            rotated_heads=c.num_heads + c.num_kv_heads, dtype=x.dtype,
            interpret=pallas_kernels.interpret_here())  # [T, (nq + 2 nkv)]
        # Sliced by heads, not by columns: the paged kernel packs q|k|v back along the heads
        # axis, and XLA folds that concatenate of adjacent head slices away (of column
        # slices it kept a copy kernel per layer, r255 / r257).
        heads = qkv.reshape(t, -1, c.head_dim)  # [T, hq + 2 hkv, D]
        hq, hkv = c.num_heads, c.num_kv_heads
        return heads[None, :, :hq], heads[None, :, hq:hq + hkv], heads[None, :, hq + hkv:]
    if "wqkv" in lp:
        qkv = _dense_fused(x, lp["wqkv"], deterministic, kernels)  # [B, T, shards, ...]
        if isinstance(lp["wqkv"], QuantizedWeight):
            # The few-row int4 / int8 kernels leave K-split partials that XLA sums; fused
            # into the RoPE concatenate, each output added its 32-64 partials in one thread
            # (H200 r228, 70B: 6.7 us). The barrier makes the sum a reduction of its own:
            # 70B int4 batch 1 72.4 against 71.3 tok/s, 8B 395.8 against 391.5 (r234-r235).
            qkv = jax.lax.optimization_barrier(qkv)
        nq, nkv = nq // qkv.shape[-2], nkv // qkv.shape[-2]
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q, k, v = (_dense(x, lp["wq"], deterministic, kernels),
                   _dense(x, lp["wk"], deterministic, kernels),
                   _dense(x, lp["wv"], deterministic, kernels))
    return (apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, inv_freq),
            apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, inv_freq),
            v.reshape(b, t, c.num_kv_heads, c.head_dim))


def _gated_mlp(x: jax.Array | pallas_kernels.ScaledPairs, lp: Params,
               deterministic: bool = False, kernels: bool = False
               ) -> jax.Array | pallas_kernels.ScaledPairs:
    """``silu(x @ w_gate) * (x @ w_up)``, one fused matmul if the layout has ``w_gate_up``
    (``x`` as for ``_qkv``). Where ``w_down``'s kernel reads ``ScaledPairs`` and the fused
    product comes from a kernel, gate|up's split partials go to one ``silu_mul_pairs`` kernel
    and the result is its ``ScaledPairs`` ``[T, intermediate]``."""
    t = math.prod(x.shape[:-1])
    w = lp.get("w_gate_up")
    if (_reads_pairs(lp.get("w_down"), t, kernels, norm=False) and isinstance(w, QuantizedWeight)
            and not w.in_last and w.q.shape[-2] == 1
            and _gemv_kernel(w.first_shard(), t, kernels) is not None):
        dtype = x.dtype
        xs = x if isinstance(x, pallas_kernels.ScaledPairs) else x.reshape(t, x.shape[-1])
        gu = _dense_quantized(xs, w.first_shard(), dtype, kernels, partials=True)
        return pallas_kernels.silu_mul_pairs(gu, group=_group(lp["w_down"]), dtype=dtype,
                                             interpret=pallas_kernels.interpret_here())
    if "w_gate_up" in lp:
        gu = _dense_fused(x, lp["w_gate_up"], deterministic, kernels)  # [B, T, shards, ...]
        f = gu.shape[-1] // 2
        act = jax.nn.silu(gu[..., :f]) * gu[..., f:]
        return act.reshape(*act.shape[:-2], -1)  # shard-major columns: w_down's row order
    return (jax.nn.silu(_dense(x, lp["w_gate"], deterministic, kernels))
            * _dense(x, lp["w_up"], deterministic, kernels))


def _group(w: QuantizedWeight) -> int:
    """Rows per scale group of an int4 / int8 weight (fused or not)."""
    return (2 if w.kind == "int4" else 1) * w.q.shape[0] // w.scale.shape[0]


def _reads_pairs(w: Any, rows: int, kernels: bool, norm: bool = True) -> bool:
    """Whether the kernel multiplying ``rows`` rows by the (fused, one-device) weight ``w``
    reads ``ScaledPairs`` (``norm``: RMSNorm'd, from ``add_norm_pairs``; else from
    ``silu_mul_pairs``) as they are, so that a junction kernel makes them."""
    if not isinstance(w, QuantizedWeight) or w.perm is not None or w.in_last:
        return False
    if w.out_axes == 2 and w.q.ndim == 3 and w.q.shape[-2] == 1:
        w = w.first_shard()
    kernel = _gemv_kernel(w, rows, kernels)
    if kernel == "int8":
        return pallas_kernels.int8_reads_pairs(rows, w.q, w.scale, norm=norm)
    return kernel == "int4" and pallas_kernels.int4_reads_pairs(rows, w.q, w.scale, w.zero,
                                                                norm=norm)


def _add_norm(h: jax.Array, partials: jax.Array | None, norm: jax.Array, next_w: Any,
              eps: float, kernels: bool, deterministic: bool
              ) -> tuple[jax.Array, jax.Array | pallas_kernels.ScaledPairs]:
    """``h [1, T, hidden]`` plus a matmul's float32 split-K ``partials [S, T, hidden]`` (or
    None: nothing to add), and the RMSNorm of the sum as ``next_w``'s matmul takes it: one
    ``add_norm_pairs`` kernel making ``ScaledPairs`` where ``_reads_pairs(next_w)``, else
    XLA's sum and ``rms_norm``. Returns ``(h, x)``."""
    if _reads_pairs(next_w, h.shape[1], kernels):
        h2, x = pallas_kernels.add_norm_pairs(partials, h[0], norm, group=_group(next_w), eps=eps,
                                              interpret=pallas_kernels.interpret_here())
        return h2[None], x
    if partials is not None:
        h = h + jnp.sum(partials, axis=0).astype(h.dtype)[None]
    return h, rms_norm(h, norm, eps, deterministic)


LAYOUTS = ("auto", "stacked", "fast")
"""Execution layouts ``load_model(layout=...)`` accepts.

* ``"stacked"``: the stored layout (``param_shapes``): layers stacked on a leading axis and run
  by one ``lax.scan``, so compile time does not grow with depth.
* ``"fast"``: ``prepare_params(fuse=True, unstack=True)``: fused QKV and gate|up matmuls and
  one weight buffer per layer, run by an unrolled layer loop. On a mesh the weights are
  first split by the rules of ``sharding.rules`` and fused per shard (``fuse_columns``).
  On a GPU, XLA copies each layer's weights out of a stacked buffer before every matmul inside the
  scan; the fast layout reads each weight once (H100, bench/NOTES.md: 8B decode 61 -> 172 tok/s,
  1B 325 -> 643). Its compile time grows with depth (H100, 8B: ~10 s for ``generate``'s prefill
  and decode programs, vs ~7 s stacked; bench/NOTES.md run 3).
* ``"auto"``: ``"fast"`` on GPUs, ``"stacked"`` elsewhere (CPU, TPU).
"""


def resolve_layout(layout: str) -> Literal["stacked", "fast"]:
    """``"stacked"`` or ``"fast"`` for ``layout`` (one of ``LAYOUTS``) on this backend.

    ``"auto"`` is ``"fast"`` on GPUs (one device or a mesh) and ``"stacked"`` elsewhere.
    Raises ``InputError`` for an unknown name.
    """
    from jaxinfer.errors import InputError  # local: errors is a leaf module, kept import-light

    if layout not in LAYOUTS:
        raise InputError(f"layout {layout!r} is not known; use one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        return "fast" if jax.default_backend() == "gpu" else "stacked"
    return layout


def params_layout(params: Params) -> str:
    """Which execution layout ``params`` are in: ``"stacked"``, ``"fast"``, or ``"custom"``
    for the other ``prepare_params`` combinations (fused only, or unstacked only)."""
    layers = params["layers"]
    unstacked = isinstance(layers, list | tuple)
    fused = "wqkv" in (layers[0] if unstacked else layers)
    if unstacked == fused:
        return "fast" if fused else "stacked"
    return "custom"


_FUSED = (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up")))


@jax.jit
def _take_layer(stacked: jax.Array | QuantizedWeight, i: jax.Array) -> Any:
    # The index is traced, so one program per weight shape serves every layer.
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)


def fuse_columns(parts: Sequence[Any], shards: int = 1) -> Any:
    """Fuse weights ``[..., in, out_i]`` into one ``[..., in, shards, sum(out_i) / shards]``.

    Shard ``s`` of the result holds the ``s``-th column slice of every part side by side,
    so with the shard axis split over a mesh's ``model`` devices each device multiplies by
    exactly the Q/K/V heads (or gate/up columns) the tensor-parallel rules give it, and the
    fused output splits into its parts without communication. ``shards=1`` on one device.
    Works on numpy and jax arrays alike, and on ``QuantizedWeight`` parts (each of their
    arrays fused the same way).
    """
    if isinstance(parts[0], QuantizedWeight):
        return fuse_quantized(list(parts), functools.partial(fuse_columns, shards=shards))
    xp = jnp if isinstance(parts[0], jax.Array) else np
    split = [p.reshape(*p.shape[:-1], shards, p.shape[-1] // shards) for p in parts]
    return xp.concatenate(split, axis=-1)


_fuse_on_device = jax.jit(fuse_columns, static_argnames="shards")


def _delete(a: Any, keep: Any = None) -> None:
    """Free a weight's device buffers now, except those ``keep`` (its placed copy) shares
    (numpy arrays are left to the garbage collector)."""
    kept = {id(leaf) for leaf in jax.tree.leaves(keep)}
    for leaf in jax.tree.leaves(a):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted() and id(leaf) not in kept:
            leaf.delete()


def prepare_params(
    params: Params,
    *,
    fuse: bool = False,
    unstack: bool = False,
    place: Any = None,
    donate: bool = False,
    shards: int = 1,
) -> Params:
    """An execution layout of ``params`` for ``forward_ragged``, built once outside the jitted
    steps.

    The stored layout (``param_shapes``) stays the contract for checkpoints and sharding;
    this derives from it, and ``forward_ragged`` accepts either.

    Args:
      fuse: concatenate ``wq|wk|wv`` into ``wqkv`` and ``w_gate|w_up`` into ``w_gate_up``
        along the output axis (``fuse_columns``: ``[in, shards, out / shards]``), so each
        layer runs two fewer matmuls (fewer launches; larger matmuls keep more of the GPU
        busy at batch 1).
      unstack: split the stacked ``[L, ...]`` layer arrays into a list of per-layer dicts, so
        ``forward_ragged`` unrolls the layer loop and no weight is sliced out of a stacked
        buffer.
      place: optional ``weight -> weight`` applied to every array or ``QuantizedWeight`` of
        the result (e.g. cast and put on the device). With host (numpy) params, each layer's
        slice is placed as it is made, so the device never holds the stacked copy.
      donate: delete each input ``jax.Array`` as soon as its data has been copied out. Peak
        device memory is then the result plus one stacked weight kind (its largest, e.g.
        ``w_down``: a quarter of the 8B model's layer weights) instead of two whole models.
        Only for params the caller owns: the input pytree is unusable afterwards.
      shards: the mesh's ``model`` size for params split by ``sharding.rules`` (1 on one
        device): fused weights get one slice per shard, and every result keeps its input's
        split (per-layer slices of a column-split stack stay column-split).

    Without ``donate`` the input arrays are not modified; with either option the result holds
    new buffers.
    """
    place = place or (lambda a: a)
    out = {k: place(v) for k, v in params.items() if k != "layers"}
    if donate:
        for k, v in params.items():
            if k != "layers":
                _delete(v, keep=out[k])
    layers = dict(params["layers"])
    if not unstack:
        if fuse:
            for name, parts in _FUSED:
                pieces = [layers.pop(p) for p in parts]
                layers[name] = fuse_columns(pieces, shards)
                if donate:
                    for piece in pieces:
                        _delete(piece)
        placed = {k: place(v) for k, v in layers.items()}
        if donate:
            for k, v in layers.items():
                _delete(v, keep=placed[k])
        out["layers"] = placed
        return out

    # One weight kind at a time, so that with ``donate`` at most one stacked kind is
    # duplicated on the device at any moment (a stacked buffer cannot be freed in parts).
    n = next(iter(layers.values())).shape[0]
    per_layer: list[Params] = [{} for _ in range(n)]
    for key in list(layers):
        stacked = layers.pop(key)
        on_device = isinstance(jax.tree.leaves(stacked)[0], jax.Array)
        for i in range(n):
            piece = (_take_layer(stacked, jnp.int32(i)) if on_device
                     else jax.tree.map(lambda a, i=i: a[i], stacked))
            per_layer[i][key] = place(piece)
        if donate:
            _delete(stacked)
    if fuse:
        for lp in per_layer:
            for name, parts in _FUSED:
                pieces = [lp.pop(p) for p in parts]
                lp[name] = (_fuse_on_device(pieces, shards=shards)
                            if isinstance(jax.tree.leaves(pieces)[0], jax.Array)
                            else fuse_columns(pieces, shards))
                for piece in pieces:  # per-layer slices made above: always ours to free
                    _delete(piece)
    out["layers"] = per_layer
    return out


def apply_layout(params: Params, layout: str, *, mesh: Any = None, place: Any = None,
                 donate: bool = False) -> Params:
    """``params`` (stored layout) in the execution layout ``layout`` resolves to.

    ``layout`` is one of ``LAYOUTS`` (see there); ``place`` and ``donate`` as in
    ``prepare_params``. ``"stacked"`` only places the leaves.
    """
    fast = resolve_layout(layout) == "fast"
    shards = 1 if mesh is None else int(mesh.shape["model"])
    return prepare_params(params, fuse=fast, unstack=fast, place=place, donate=donate,
                          shards=shards)


def fp8_input_last(params: Params) -> Params:
    """Per-layer ``params`` with each layer's fp8 weights and an fp8 LM head laid out ``q
    [out, in]`` (``quantize.input_axis_last``), the one-device layout in which prefill
    matmuls run fp8 x fp8 (``runner.FP8_ACTIVATION_ROWS``). Other weights stay as they are.
    Consumes ``params`` (its layers' ``[in, out]`` fp8 buffers are freed); raises
    ``ValueError`` for a stacked layout.

    ``load_model`` applies it on one GPU with fp8 tensor cores (``fp8_tensor_cores``). A
    program whose matmuls then run fp8 x fp8 must leave its GEMMs to cuBLAS
    (``runner.gemm_options``): XLA's autotuning of its own fp8 GEMMs at thousands of rows did
    not finish in minutes (H100, bench/NOTES.md r88-r89, r106)."""
    if not isinstance(params["layers"], list | tuple):
        raise ValueError("fp8_input_last lays out per-layer weights on one device: "
                         "prepare_params(unstack=True) first")
    layers = []
    for lp in params["layers"]:
        new = dict(lp)
        for name, w in lp.items():
            if isinstance(w, QuantizedWeight) and w.kind == "fp8" and not w.in_last:
                new[name] = input_axis_last(w)
                _delete(w, keep=new[name])
        layers.append(new)
    out = {**params, "layers": layers}
    head = params.get("lm_head")
    if isinstance(head, QuantizedWeight) and head.kind == "fp8" and not head.in_last:
        # In a program that leaves its GEMMs to cuBLAS, an [in, out] fp8 head would be
        # converted to a bf16 copy on every call (H100 r119: 0.62 ms, then a 0.45 ms GEMM).
        # Not deleted: prepare_params passes the head through, so another layout of the same
        # params may hold it; the caller's reference is its last.
        out["lm_head"] = input_axis_last(head)
    return out


def _first_layer_weights(params: Params) -> list[QuantizedWeight] | None:
    """The quantized weights of a per-layer layout's first layer, or None for a stacked
    layout (or no ``"layers"``). The fp8 layout is all layers or none, so they speak for all."""
    layers = params.get("layers")
    if not isinstance(layers, list | tuple):
        return None
    return [w for w in layers[0].values() if isinstance(w, QuantizedWeight)]


def fp8_gemms(params: Params) -> bool:
    """Whether ``params`` hold ``fp8_input_last`` weights, which can run fp8 x fp8
    (``with_fp8_activations``)."""
    return any(w.in_last for w in _first_layer_weights(params) or ())


def with_fp8_activations(params: Params, on: bool) -> Params:
    """``params`` with every ``in_last`` fp8 weight's matmuls set to run fp8 x fp8 (``on``)
    or weight-only (``QuantizedWeight.fp8_activations``); other weights as they are. A
    static choice: a program traced with one runs every such matmul that way."""
    def mark(w: Any) -> Any:
        if isinstance(w, QuantizedWeight) and w.in_last and w.fp8_activations != on:
            return dataclasses.replace(w, fp8_activations=on)
        return w

    first = _first_layer_weights(params)
    if first is not None and all(w.fp8_activations == on for w in first if w.in_last):
        return params  # set already (all layers alike): no host time spent rebuilding
    return jax.tree.map(mark, params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


def fp8_tensor_cores(device: Any) -> bool:
    """Whether ``device`` multiplies fp8 x fp8 on its tensor cores: an NVIDIA GPU of compute
    capability 8.9 (Ada) or above, Hopper included."""
    capability = str(getattr(device, "compute_capability", "") or "")
    if device.platform != "gpu" or not re.fullmatch(r"\d+\.\d+", capability):
        return False  # not NVIDIA (a ROCm device names its architecture, e.g. gfx942)
    major, minor = (int(v) for v in capability.split("."))
    return (major, minor) >= (8, 9)


def pad_columns(w: QuantizedWeight, multiple: int) -> QuantizedWeight:
    """A one-device ``[in, out]`` quantized weight with its output columns padded to a
    multiple of ``multiple`` by zero codes, scales and zeros (the padded columns' products
    are 0); ``w`` itself where they divide already."""
    if w.in_last or w.out_axes != 1 or w.q.ndim != 2:
        raise ValueError(f"pad_columns takes one device's [in, out] weight, got q {w.q.shape}"
                         f" with {w.out_axes} output axes" + (", input last" if w.in_last else ""))
    extra = -w.q.shape[-1] % multiple

    def pad(a: jax.Array | None) -> jax.Array | None:  # [rows, out] -> [rows, out + extra]
        return None if a is None else jnp.pad(a, ((0, 0), (0, extra)))

    return w if extra == 0 else dataclasses.replace(w, q=pad(w.q), scale=pad(w.scale),
                                                    zero=pad(w.zero))


def one_device_layout(params: Params, device: Any) -> Params:
    """``params`` for one ``device``, as ``load_model`` leaves them last on one device:
    - with per-layer fp8 weights and fp8 tensor cores (``fp8_tensor_cores``),
      ``fp8_input_last(params)``, so their prefill matmuls run fp8 x fp8;
    - on a GPU, an int4 / int8 LM head whose columns ``pallas_kernels.WIDE_BLOCK_N`` does
      not divide (Llama 3's 128,256 and 512) padded to a multiple of it (``pad_columns``;
      ``lm_head`` slices the logits back to the vocabulary) where a one-row call then runs
      the wide tile, as the layers' weights do: unpadded, it runs the narrow one (8B int4:
      89.6 us a token against a 61 us floor, bench/NOTES.md r250).
    Else ``params`` as they are."""
    fp8 = any(w.kind == "fp8" for w in _first_layer_weights(params) or ())
    if fp8 and fp8_tensor_cores(device):
        params = fp8_input_last(params)
    head = params.get("lm_head")
    if (device.platform == "gpu" and (int4_kernel_weight(head) or int8_kernel_weight(head))
            and head.out_axes == 1):
        pad = functools.partial(pad_columns, multiple=pallas_kernels.WIDE_BLOCK_N)
        # A weight reads pairs only on the wide tile (and never with a row order, ``perm``;
        # shapes decide: no bytes moved here)
        if head.q.shape[-1] % pallas_kernels.WIDE_BLOCK_N and _reads_pairs(
                jax.eval_shape(pad, head), 1, kernels=True, norm=False):
            # Not deleted: as in fp8_input_last, the caller's reference is the head's last
            params = {**params, "lm_head": pad(head)}
    return params


def one_row_decode_weights(params: Params, platform: str) -> bool:
    """Whether every matmul weight (each layer's and the LM head) is int4 or int8 that
    ``pallas_kernels.int4_matmul`` / ``int8_matmul`` multiplies on ``platform`` (a GPU only;
    ``int4_kernel_weight``, ``int8_kernel_weight``), so a decode step's matmuls all run a
    few-row kernel that computes every row it is given: the engine then decodes a lone
    request in a one-row call (a padding row cost int4 15% more per 8B layer, and int8's
    one-row kernel is 6% faster than its two-row one; H100 r85, r91) instead of the two rows
    that keep XLA's bf16 GEMM (``runner.row_buckets``). A tied head (the embedding table) is
    not quantized."""
    if platform != "gpu":
        return False
    layers = params["layers"]
    stacked = not isinstance(layers, list | tuple)

    def few_row(w: Any, stacked: bool = False) -> bool:
        return int4_kernel_weight(w, stacked) or int8_kernel_weight(w, stacked)

    return few_row(params.get("lm_head")) and all(
        few_row(w, stacked) for lp in ([layers] if stacked else layers)
        for name, w in lp.items() if not name.endswith("_norm"))


def lm_head(params: Params, h: jax.Array, deterministic: bool = False) -> jax.Array:
    """Logits ``[..., vocab]`` float32 from final hidden states ``[..., hidden]``
    (``deterministic``: the batch-invariant matmul, see ``_dense``)."""
    if deterministic:
        tied = "lm_head" not in params
        w = params["embed"] if tied else params["lm_head"]
        logits = pallas_kernels.matmul(h.reshape(-1, h.shape[-1]), w, transpose_w=tied,
                                       out_dtype=jnp.float32,
                                       interpret=pallas_kernels.interpret_here())
        logits = logits.reshape(*h.shape[:-1], logits.shape[-1])
    elif isinstance(params.get("lm_head"), QuantizedWeight):
        # The head takes no backend: the kernels where the default ("auto") runs them
        logits = _dense_quantized(h, params["lm_head"], jnp.float32, gemv_kernels("auto"))
    elif "lm_head" in params:
        w = params["lm_head"]
        logits = jnp.einsum("...d,dv->...v", h, w.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...d,vd->...v", h, params["embed"].astype(h.dtype),
                            preferred_element_type=jnp.float32)
    vocab = params["embed"].shape[0]
    if logits.shape[-1] != vocab:  # a head padded at load (one_device_layout)
        logits = logits[..., :vocab]
    if deterministic:  # one device per replica (check_deterministic): rows are whole
        return logits
    return gather_vocab(logits)  # on a mesh the head is vocab-split; sampling wants whole rows


def pool_is_stacked(params: Params, backend: str) -> bool:
    """Whether the page pool for ``params`` is stacked over layers (run by a layer scan).

    Only for stacked weights on the reference backend: a Pallas kernel given one layer of a
    stacked pool gets a copy of that layer's whole pool (gigabytes) on every call.
    """
    return backend == "reference" and not isinstance(params["layers"], list | tuple)


def layer_params(layers: Params | list[Params], i: int) -> Params:
    """Layer ``i``'s weights from either layout (a list entry, or a static slice of stacks)."""
    if isinstance(layers, list | tuple):
        return layers[i]
    return {name: jax.tree.map(lambda a: a[i], w) for name, w in layers.items()}


def decoder_layer(
    lp: Params,
    config: LlamaConfig,
    h: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    layer: int | jax.Array | None,
    batch: dict[str, Any],
    *,
    max_q_len: int | None,
    backend: Literal["reference", "pallas"],
    deterministic: bool = False,
    pending: jax.Array | None = None,
    defer: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """The one layer body: ``h [1, T, hidden]`` -> ``h``, K/V written to pages, attended.

    A pure function of the layer's weights ``lp`` and its inputs. ``k_pages``/``v_pages``
    and ``layer`` as in ``attention.write_kv``; ``batch`` holds the packed step's ``write_pages``,
    ``write_offsets`` ``[T]``, ``block_tables [S, P]``, ``kv_lens [S]``, ``cu_q_lens
    [S + 1]``. ``deterministic``: batch-invariant matmuls and attention (``load_model``).

    Decode rows whose next matmul's kernel reads ``ScaledPairs`` (``_reads_pairs``) join it
    to the one before through one ``pallas_kernels.junction`` kernel that reads the first
    matmul's split-K partials: the residual add and RMSNorm (``_add_norm``, twice), the QKV
    sum with RoPE (``_qkv``) and ``silu(gate) * up`` (``_gated_mlp``). Across layers the MLP's
    partials wait for the next layer: with ``defer`` they are returned as ``pending`` (``[S,
    T, hidden]`` float32, not yet in ``h``), and ``pending`` is the previous layer's.
    Returns ``(h, pending or None, k_pages, v_pages)``.
    """
    c = config
    t = h.shape[1]
    kernels = gemv_kernels(backend)
    h, x = _add_norm(h, pending, lp["attn_norm"], lp.get("wqkv"), c.rms_norm_eps, kernels,
                     deterministic)
    q, k, v = _qkv(x, lp, c, positions, deterministic, kernels)
    if isinstance(k_pages, QuantizedPages) and pallas_kernels.rotates_keys(k_pages.values.dtype):
        # int8 keys are stored Hadamard-rotated, queries rotated alike: q . k is unchanged and
        # the keys' outlier channels no longer set every channel's step (kv_quant).
        q, k = pallas_kernels.hadamard_rotate(q), pallas_kernels.hadamard_rotate(k)
    # Stored, then attended: a chunk's queries see its own keys through the pages. Per model
    # shard under a mesh (shard_map); plain ``write_and_attend`` on one device.
    # The o GEMV reading scaled pairs takes them from the attention's combine kernel, one
    # scale per head: o's groups must be a head or a part of one (int8's 64 rows).
    out_pairs = (_reads_pairs(lp["wo"], t, kernels, norm=False)
                 and c.head_dim % _group(lp["wo"]) == 0)
    attn, k_pages, v_pages = mesh_write_and_attend(
        q[0], k[0], v[0], k_pages, v_pages, layer, batch, backend=backend, max_q_len=max_q_len,
        deterministic=deterministic, out_pairs=out_pairs)
    if not isinstance(attn, pallas_kernels.ScaledPairs):
        attn = attn.reshape(1, t, c.num_heads * c.head_dim)
    if _reads_pairs(lp.get("w_gate_up"), t, kernels):
        h, x = _add_norm(h, _dense_partials(attn, lp["wo"], kernels, deterministic), lp["mlp_norm"],
                         lp["w_gate_up"], c.rms_norm_eps, kernels, deterministic)
    else:
        h = h + _dense(attn, lp["wo"], deterministic, kernels)
        x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps, deterministic)
    mlp = _gated_mlp(x, lp, deterministic, kernels)
    if defer and _reads_pairs(lp.get("wqkv"), t, kernels):  # the next layer's alike
        return h, _dense_partials(mlp, lp["w_down"], kernels, deterministic), k_pages, v_pages
    return h + _dense(mlp, lp["w_down"], deterministic, kernels), None, k_pages, v_pages


def _dense_partials(x: jax.Array, w: Any, kernels: bool, deterministic: bool) -> jax.Array:
    """``x [1, T, in] @ w`` as float32 split-K partials ``[S, T, out]`` for ``_add_norm``
    (``[1, T, out]`` where no kernel splits K)."""
    if isinstance(w, QuantizedWeight):
        return _dense_quantized(x, w, x.dtype, kernels, partials=True)
    return _dense(x, w, deterministic, kernels).astype(jnp.float32)


def forward_ragged(
    params: Params,
    config: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array | QuantizedPages | Sequence[jax.Array | QuantizedPages],
    v_pages: jax.Array | QuantizedPages | Sequence[jax.Array | QuantizedPages],
    write_pages: jax.Array,
    write_offsets: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int | None = None,
    backend: Literal["reference", "pallas"] = "reference",
    dtype: Any = jnp.bfloat16,
    deterministic: bool = False,
) -> tuple[jax.Array, Any, Any]:
    """Decoder over a packed mix of prefill chunks and decode tokens, K/V in a page pool.

    The engine's one forward pass: sequence s owns tokens ``[cu_q_lens[s], cu_q_lens[s+1])``.
    The pool's layout picks the loop (``pool_is_stacked`` says which one a model gets): a
    tuple of per-layer ``[KVH, num_pages, page_size, D]`` buffers runs an unrolled loop, so
    every kernel reads its layer's pages in place (stacked weights are then sliced per layer);
    a stacked ``[L, KVH, num_pages, page_size, D]`` pool runs one ``lax.scan`` over stacked
    weights, so compile time stays flat in depth.

    Args:
      tokens, positions: ``[T]`` int32, each token's id and absolute position in its sequence.
      k_pages, v_pages: the pool (see above); a quantized pool (``kv_cache_dtype``) has
        ``QuantizedPages`` for arrays: K/V are quantized as they are written and dequantized
        by the attention as it reads them.
      write_pages, write_offsets: ``[T]`` int32, where each token's K/V go; padding tokens
        use page ``num_pages`` (out of range, so the write is dropped).
      block_tables: ``[S, pages_per_seq]`` int32; kv_lens ``[S]`` keys per sequence
        including this step's tokens; cu_q_lens ``[S + 1]`` cumulative token counts.
      max_q_len: static bound on any sequence's token count this step (the attention kernel
        skips query blocks past it); None means ``T``.
      deterministic: batch-invariant matmuls and attention: a token's hidden states do not
        depend on the other tokens of the step, its position in it, or the step's shape.

    Returns:
      ``(hidden [T, hidden] after the final norm, k_pages, v_pages)``.
    """
    c = config
    h = params["embed"].astype(dtype)[tokens][None]  # [1, T, hidden]: apply_rope wants a batch
    pos = positions[None]
    batch = {"write_pages": write_pages, "write_offsets": write_offsets,
             "block_tables": block_tables, "kv_lens": kv_lens, "cu_q_lens": cu_q_lens}
    kw = {"max_q_len": max_q_len, "backend": backend, "deterministic": deterministic}
    layers = params["layers"]
    if isinstance(k_pages, list | tuple):
        k_out, v_out = list(k_pages), list(v_pages)
        pending = None  # the previous layer's MLP partials, added by this layer's first norm
        for i in range(c.num_layers):
            h, pending, k_out[i], v_out[i] = decoder_layer(
                layer_params(layers, i), c, h, pos, k_out[i], v_out[i], None, batch, **kw,
                pending=pending, defer=i + 1 < c.num_layers)
        k_pages, v_pages = tuple(k_out), tuple(v_out)
    else:
        def body(carry, xs):
            h, k_all, v_all = carry
            lp, i = xs
            h, _, k_all, v_all = decoder_layer(lp, c, h, pos, k_all, v_all, i, batch, **kw)
            return (h, k_all, v_all), None

        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (h, k_pages, v_pages), _ = jax.lax.scan(body, (h, k_pages, v_pages),
                                                (layers, layer_ids))
    return (rms_norm(h[0], params["final_norm"], c.rms_norm_eps, deterministic), k_pages,
            v_pages)
