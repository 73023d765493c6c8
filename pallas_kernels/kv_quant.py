"""The quantized K/V page format the paged and ragged attention kernels read.

Values are int8 or float8 e4m3 with one scale per token and K/V head: a page pool
``[kv_heads, num_pages, page_size, head_dim]`` of values goes with a scale pool
``[kv_heads, num_pages, page_size]`` of the same layout (``k = values * scale``), so a block
table addresses both and a page moves with its scales.

* int8: symmetric, ``scale = amax / 127`` over the token's head_dim values;
* fp8 (``jnp.float8_e4m3fn``): ``scale = amax / 448`` (e4m3's largest finite value), so the
  token's largest value lands on the format's top and the others keep 3 mantissa bits.

Scales are stored in bfloat16 (``SCALE_DTYPE``): 2 bytes per token and head, so a head_dim-64
pool still holds 1.94x the tokens of bfloat16 values (float32 scales: 1.88x). Values are
quantized against the bfloat16-rounded scale, so rounding the scale adds no error of its own
beyond clipping the largest value by at most a part in 2^9.

The kernels dequantize inside the dot products: a key's logits are ``q . k_values`` times
its scale (one multiply per logit, not per element), and a value's softmax weight is
multiplied by its scale before ``p @ v_values``.

int8 keys are stored rotated (``rotates_keys``): a few channels of a head's keys carry most of
their magnitude, so one scale per token quantizes the other channels coarsely. The caller
rotates queries and keys by the same orthonormal Hadamard matrix (``hadamard_rotate``) before
writing and attending; ``q . k`` is unchanged and the rotated key's magnitude is spread
evenly over its channels. The default model's perplexity (tests/test_kv_cache_quant.py, float32
weights): +1.03% with plain int8 keys, +0.34% rotated. float8 keeps its relative precision in
small channels and does better unrotated (+0.40%, rotated +2.06%), so fp8 keys are stored
as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
"""Names of the quantized K/V formats and their value dtypes."""

SCALE_DTYPE = jnp.dtype(jnp.bfloat16)
"""Dtype of the per-token, per-head scales."""

_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized_kv_dtype(dtype: jnp.dtype) -> bool:
    """Whether ``dtype`` is one of the quantized value dtypes (``KV_CACHE_DTYPES``)."""
    return jnp.dtype(dtype) in _QMAX


def rotates_keys(dtype: jnp.dtype) -> bool:
    """Whether keys of this value dtype are stored rotated by ``hadamard_rotate`` (int8)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.int8)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """``x [..., D] @ H`` with ``H`` the orthonormal ``D x D`` Sylvester Hadamard matrix
    (``D`` a power of two; ``H`` is symmetric and its own inverse), in ``x``'s dtype.

    A fast Walsh-Hadamard transform: log2(D) butterfly stages of adds in float32, so each
    output is the same fixed sum whatever the other rows (batch-invariant, no GEMM).
    """
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard_rotate needs a power-of-two last axis, got {d}")
    lead = x.shape[:-1]
    y = x.astype(jnp.float32)
    h = 1
    while h < d:  # pairs (i, i + h) within blocks of 2h: [a + b, a - b]
        y = y.reshape(*lead, d // (2 * h), 2, h)
        y = jnp.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / d ** 0.5)).astype(x.dtype)


def quantize_kv(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Quantize K or V rows ``x [..., head_dim]`` to ``(values [..., head_dim] dtype,
    scales [...] SCALE_DTYPE)`` with one scale per row (token and head).

    ``dtype`` is a value dtype of ``KV_CACHE_DTYPES``. An all-zero row gets scale 1.
    """
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(SCALE_DTYPE)
    # Against the stored (rounded) scale, clipped: the rounding may push amax past qmax.
    y = jnp.clip(x32 / scale.astype(jnp.float32)[..., None], -qmax, qmax)
    if dtype == jnp.dtype(jnp.int8):
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype: jnp.dtype = jnp.float32
                  ) -> jax.Array:
    """``values [..., head_dim] * scales [...]``, computed and returned in ``dtype``."""
    return values.astype(dtype) * scales.astype(dtype)[..., None]
