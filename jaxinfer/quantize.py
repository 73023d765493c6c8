"""Weight-only int8 quantization: symmetric, one scale per output column and group of
``GROUP`` input rows.

A quantized weight is a ``QuantizedWeight`` pytree (``q`` int8 in the weight's own shape,
``scale`` float32 ``[..., in / group, *out]``), so every execution layout (stacked under the
layer scan, per layer, fused QKV / gate|up) holds it like any other array. ``model._dense``
multiplies decode rows with ``pallas_kernels.int8_matmul`` on a GPU, which reads only the int8
values and scales (about half the bytes of bf16); larger steps, and other backends, multiply
by the weight dequantized in the activations' dtype (XLA does not fuse that into its GEMM).
Groups, rather than one scale per column: the default model's perplexity rises 3.0% with
per-column scales and stays within 1% with groups (tests/test_quantize.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.errors import InputError

QUANTIZATIONS = ("int8",)
"""Values ``load_model(quantize=...)`` accepts (None keeps the checkpoint's dtype)."""

GROUP = 64
"""Input rows sharing one scale (a divisor of every input size: hidden and intermediate)."""

# Matmul weights by name, and how many trailing axes are output axes (fused weights are
# [in, shards, out / shards]). Embeddings, norms and a tied output head stay unquantized.
_OUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 1, "w_gate": 1, "w_up": 1, "w_down": 1,
             "wqkv": 2, "w_gate_up": 2, "lm_head": 1}


@struct.dataclass
class QuantizedWeight:
    """An int8 weight ``q [..., in, *out]`` and its float32 ``scale [..., in / group, *out]``:
    ``w ~= q * scale`` per group of ``group`` input rows (``...`` is the layer axis of a
    stacked layout; ``out_axes`` counts the output axes: 2 for a fused ``[in, shards, out /
    shards]`` weight)."""

    q: jax.Array
    scale: jax.Array
    out_axes: int = struct.field(pytree_node=False, default=1)
    group: int = struct.field(pytree_node=False, default=GROUP)

    @property
    def in_axis(self) -> int:
        """The axis of ``q`` that a matmul contracts."""
        return self.q.ndim - self.out_axes - 1

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The weight ``q * scale``, computed and returned in ``dtype``."""
        a = self.in_axis
        shape = self.q.shape
        grouped = self.q.reshape(*shape[:a], shape[a] // self.group, self.group, *shape[a + 1:])
        w = grouped.astype(dtype) * jnp.expand_dims(self.scale, a + 1).astype(dtype)
        return w.reshape(shape)

    def first_shard(self) -> QuantizedWeight:
        """A fused ``[in, 1, out]`` weight as the plain ``[in, out]`` one (one device)."""
        return QuantizedWeight(q=self.q[:, 0], scale=self.scale[:, 0], out_axes=1,
                               group=self.group)


def _quantize_one(w: jax.Array, out_axes: int, group: int) -> QuantizedWeight:
    a = w.ndim - out_axes - 1
    shape = w.shape
    g = group if shape[a] % group == 0 else shape[a]  # one group when the rows do not split
    grouped = w.astype(jnp.float32).reshape(*shape[:a], shape[a] // g, g, *shape[a + 1:])
    amax = jnp.max(jnp.abs(grouped), axis=a + 1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(grouped / jnp.expand_dims(scale, a + 1)), -127, 127)
    return QuantizedWeight(q=q.astype(jnp.int8).reshape(shape), scale=scale, out_axes=out_axes,
                           group=g)


_quantize_jit = jax.jit(_quantize_one, static_argnames=("out_axes", "group"))


def check_method(method: str) -> None:
    """``InputError`` unless ``method`` is one of ``QUANTIZATIONS``."""
    if method not in QUANTIZATIONS:
        raise InputError(f"quantize={method!r} must be one of {', '.join(QUANTIZATIONS)} or "
                         "None")


def is_quantized(params: Any) -> bool:
    """Whether any weight of ``params`` is a ``QuantizedWeight``."""
    return any(isinstance(w, QuantizedWeight) for w in jax.tree.leaves(
        params, is_leaf=lambda w: isinstance(w, QuantizedWeight)))


def quantize_params(params: dict[str, Any], method: str, donate: bool = False
                    ) -> dict[str, Any]:
    """``params`` (any execution layout) with every matmul weight quantized by ``method``.

    ``donate`` deletes each original device array once its quantized copy exists, so the
    device holds at most one bf16 weight beside the quantized model.
    """
    check_method(method)

    def convert(tree: Any) -> Any:
        if isinstance(tree, list | tuple):
            return type(tree)(convert(t) for t in tree)
        if not isinstance(tree, dict):
            return tree
        out = {}
        for name, w in tree.items():
            if name in _OUT_AXES and isinstance(w, jax.Array | jnp.ndarray):
                out[name] = _quantize_jit(w, out_axes=_OUT_AXES[name], group=GROUP)
                if donate and isinstance(w, jax.Array):
                    w.delete()
            else:
                out[name] = convert(w)
        return out

    return convert(params)


def param_bytes(params: Any) -> int:
    """Bytes the parameters take on their devices (per copy; quantized weights count their
    int8 values and scales)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))
