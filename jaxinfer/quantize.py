"""Weight-only quantization: int8, group-wise int4 (packed two per byte), fp8.

A quantized weight is a ``QuantizedWeight`` pytree, so every execution layout (stacked under
the layer scan, per layer, fused QKV / gate|up) holds it like any other array. Its ``kind``
says how ``q`` encodes the weight ``w [..., in, *out]`` (``...``: the layer axis of a stacked
layout):

* ``"int8"``: ``q`` int8 ``[..., in, *out]``, ``scale`` float32 ``[..., in / group, *out]``;
  ``w ~= q * scale``, symmetric, one scale per output column and ``group`` input rows.
* ``"int4"``: ``q`` uint8 ``[..., in / 2, *out]``, two 4-bit values per byte; ``scale`` and
  ``zero`` float16 ``[..., in / group, *out]``; ``w ~= scale * v + zero`` for ``v`` in
  0..15 (asymmetric: ``zero`` is the group's minimum). Within each group of ``group`` input
  rows, byte row ``j`` holds row ``j`` in its low nibble and row ``j + group / 2`` in its high
  nibble: GGUF's Q4_0 / Q4_1 block order, so those blocks load without unpacking
  (``checkpoints.gguf``), and a kernel multiplies the low and the high halves of a group by
  two contiguous halves of the activations, without interleaving.
* ``"fp8"``: ``q`` float8_e4m3fn ``[..., in, *out]``, ``scale`` float32 ``[..., 1, *out]``
  (one scale per output column: ``group`` is the whole input size; a weight whose input rows
  are split over a mesh has one scale per column and device, ``group`` = rows / devices).
  ``input_axis_last`` re-lays a single device's fp8 weight as ``q [out, in]`` (``in_last``),
  the operand layout of cuBLASLt's fp8 GEMM: an execution layout (``model.fp8_input_last``),
  never stored.

``perm`` (int32 ``[..., in]``, any kind; None for nearly every weight) says that the stored
input rows are the weight's rows in another order: stored row ``r`` is row ``perm[r]``, so
``x @ w`` is ``x[..., perm]`` times the stored weight. Act-order GPTQ checkpoints need it
(``checkpoints.hf_quantized``): their groups are scattered over the input rows, and sorting
the rows by group makes them the contiguous groups above.

``model._dense`` multiplies decode rows by an int8 or int4 weight with a Pallas kernel on a
GPU (``pallas_kernels.int8_matmul`` / ``int4_matmul``), which reads only the packed bytes
and scales; larger steps, and other backends, multiply by the weight dequantized in the
activations' dtype (XLA does not fuse that into its GEMM). Groups rather than one scale per
column: the default model's perplexity rises 3.0% with per-column int8 scales and stays within
1% with groups (tests/test_quantize.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from jaxinfer.params import param_shapes

# method -> (kind, input rows per group; 0: all of them)
_METHODS = {"int8": ("int8", 64), "int4": ("int4", 32), "int4-g64": ("int4", 64),
            "int4-g128": ("int4", 128), "fp8": ("fp8", 0)}
QUANTIZATIONS = tuple(_METHODS)
"""Values ``load_model(quantize=...)`` accepts besides ``"native"`` (None keeps the
checkpoint's dtype): ``"int4"`` groups 32 input rows (GGUF's Q4 block size; the default
model's perplexity on ``tests/test_quantize.py``'s 134-token text: +0.0% at 32, +50% at 64,
+106% at 128), ``"int4-g64"`` / ``"int4-g128"`` 64 / 128 (fewer scale bytes)."""

GROUP = _METHODS["int8"][1]
"""Input rows sharing one int8 scale (a divisor of every input size: hidden and intermediate)."""

# Matmul weights by name, and how many trailing axes are output axes (fused weights are
# [in, shards, out / shards]). Embeddings, norms and a tied output head stay unquantized.
_OUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 1, "w_gate": 1, "w_up": 1, "w_down": 1,
             "wqkv": 2, "w_gate_up": 2, "lm_head": 1}

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@struct.dataclass
class QuantizedWeight:
    """A quantized weight (see the module docstring for each ``kind``'s arrays).

    ``out_axes`` counts the output axes: 2 for a fused ``[in, shards, out / shards]`` weight.
    ``zero`` is None except for int4; ``perm`` is None unless the stored rows are permuted.
    ``in_last``: ``q`` holds the input axis last (``[out, in]``, fp8 only, ``input_axis_last``).
    ``fp8_activations`` (``in_last`` only): a matmul scales its activations into e4m3 and runs
    fp8 x fp8; else it converts the weight inside the matmul. Set for a whole program by
    ``runner.StepProgram`` (``model.with_fp8_activations``).
    """

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    out_axes: int = struct.field(pytree_node=False, default=1)
    group: int = struct.field(pytree_node=False, default=GROUP)
    kind: str = struct.field(pytree_node=False, default="int8")
    in_last: bool = struct.field(pytree_node=False, default=False)
    fp8_activations: bool = struct.field(pytree_node=False, default=False)

    @property
    def in_axis(self) -> int:
        """The axis of ``q`` that a matmul contracts."""
        return self.q.ndim - 1 if self.in_last else self.q.ndim - self.out_axes - 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, ``[..., in, *out]`` (int4 packs two input
        rows per byte)."""
        if self.in_last:
            return self._input_axis_back().shape
        shape = list(self.q.shape)
        if self.kind == "int4":
            shape[self.in_axis] *= 2
        return tuple(shape)

    def _input_axis_back(self) -> QuantizedWeight:
        """An ``in_last`` weight in the module's ``[..., in, *out]`` layout."""
        q = jnp.moveaxis(self.q, -1, -1 - self.out_axes)
        return dataclasses.replace(self, q=q, in_last=False, fp8_activations=False)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The weight, computed in float32 and returned in ``dtype`` (with ``perm``, its
        rows put back in the weight's order)."""
        if self.in_last:
            return self._input_axis_back().dequantize(dtype)
        if self.perm is not None:
            stored = dataclasses.replace(self, perm=None).dequantize(dtype)
            inverse = jnp.argsort(jnp.asarray(self.perm), axis=-1)  # [..., in]
            inverse = inverse.reshape(*inverse.shape, *(1,) * self.out_axes)
            return jnp.take_along_axis(stored, inverse, axis=self.in_axis)
        a = self.in_axis
        shape = self.q.shape
        if self.kind == "int4":
            half = self.group // 2
            grouped = self.q.reshape(*shape[:a], shape[a] // half, half, *shape[a + 1:])
            v = jnp.concatenate([grouped & 15, grouped >> 4], axis=a + 1)  # [.., in/G, G, *out]
            w = (v.astype(jnp.float32) * jnp.expand_dims(self.scale, a + 1).astype(jnp.float32)
                 + jnp.expand_dims(self.zero, a + 1).astype(jnp.float32))
            return w.reshape(self.shape).astype(dtype)
        grouped = self.q.reshape(*shape[:a], shape[a] // self.group, self.group, *shape[a + 1:])
        w = grouped.astype(jnp.float32) * jnp.expand_dims(self.scale, a + 1)
        return w.reshape(shape).astype(dtype)

    def first_shard(self) -> QuantizedWeight:
        """A fused ``[in, 1, out]`` weight as the plain ``[in, out]`` one (one device)."""
        return QuantizedWeight(q=self.q[:, 0], scale=self.scale[:, 0],
                               zero=None if self.zero is None else self.zero[:, 0],
                               perm=self.perm, out_axes=1, group=self.group, kind=self.kind)


def input_axis_last(w: QuantizedWeight) -> QuantizedWeight:
    """A one-device fp8 weight (``[in, out]``, or fused ``[in, 1, out]``) as ``q [out, in]``
    (``in_last``): the layout cuBLASLt's fp8 x fp8 GEMM reads, which prefill matmuls then
    use (``model._dense_fp8``; applied by ``model.fp8_input_last``). XLA transposes an
    ``[in, out]`` fp8 weight before every such GEMM (bench/NOTES.md r54: 5-8x slower); this
    transposes it once."""
    if w.kind != "fp8" or w.perm is not None or w.q.ndim - w.out_axes != 1:
        raise ValueError(f"input_axis_last takes one layer's fp8 weight without a row order, "
                         f"got kind {w.kind!r}, q {w.q.shape}")
    if w.out_axes == 2:
        if w.q.shape[1] != 1:
            raise ValueError(f"input_axis_last takes one device's weight, got q {w.q.shape}")
        w = w.first_shard()
    return dataclasses.replace(w, q=jnp.swapaxes(w.q, 0, 1), in_last=True)


def fuse_quantized(parts: list[QuantizedWeight], fuse: Any) -> QuantizedWeight:
    """Quantized weights fused along their output axis: ``fuse`` (``model.fuse_columns``
    with its shard count) applied to each array kind; the parts share kind and group, and
    their row order: the first part's ``perm`` serves them all (one input feeds them; loaders
    check that the parts of a fused weight agree, ``checkpoints.hf_quantized``)."""
    first = parts[0]
    if any((p.kind, p.group, p.out_axes, p.perm is None)
           != (first.kind, first.group, 1, first.perm is None) for p in parts):
        raise ValueError("fused weights need one kind, group and row order and plain [in, out] "
                         "parts")
    return QuantizedWeight(q=fuse([p.q for p in parts]), scale=fuse([p.scale for p in parts]),
                           zero=None if first.zero is None else fuse([p.zero for p in parts]),
                           perm=first.perm, out_axes=2, group=first.group, kind=first.kind)


def pack_int4(v: Any, group: int, axis: int) -> Any:
    """Values 0..15 ``[..., in, ...]`` (``in`` on ``axis``, a multiple of ``group``) packed
    into uint8 ``[..., in / 2, ...]`` in the module's nibble order (numpy or jax)."""
    xp = jnp if isinstance(v, jax.Array) else np
    shape = v.shape
    v = v.astype(xp.uint8).reshape(*shape[:axis], shape[axis] // group, 2, group // 2,
                                   *shape[axis + 1:])
    lo = xp.take(v, 0, axis=axis + 1)
    hi = xp.take(v, 1, axis=axis + 1)
    packed = lo | (hi << 4)  # [..., in / group, group / 2, ...]
    return packed.reshape(*shape[:axis], shape[axis] // 2, *shape[axis + 1:])


def _quantize_one(w: jax.Array, out_axes: int, kind: str, group: int) -> QuantizedWeight:
    a = w.ndim - out_axes - 1
    shape = w.shape
    # One group when the rows do not split (fp8 asks for that with group 0).
    g = group if group and shape[a] % group == 0 else shape[a]
    grouped = w.astype(jnp.float32).reshape(*shape[:a], shape[a] // g, g, *shape[a + 1:])
    if kind == "int4":
        lo, hi = jnp.min(grouped, axis=a + 1), jnp.max(grouped, axis=a + 1)
        # float16 scales (GGUF's), and the values quantized against the rounded ones, so a
        # weight is off by at most half a step; a scale that rounds to 0 (a constant group)
        # becomes 1, and every value is then the minimum.
        scale = ((hi - lo) / 15).astype(jnp.float16)
        scale = jnp.where(scale > 0, scale, jnp.float16(1))
        zero = lo.astype(jnp.float16)
        v = jnp.round((grouped - jnp.expand_dims(zero, a + 1).astype(jnp.float32))
                      / jnp.expand_dims(scale, a + 1).astype(jnp.float32))
        q = pack_int4(jnp.clip(v, 0, 15).reshape(shape), g, a)
        return QuantizedWeight(q=q, scale=scale, zero=zero, out_axes=out_axes, group=g,
                               kind="int4")
    amax = jnp.max(jnp.abs(grouped), axis=a + 1)
    top = 127.0 if kind == "int8" else _FP8_MAX
    scale = jnp.where(amax > 0, amax / top, 1.0)
    scaled = grouped / jnp.expand_dims(scale, a + 1)
    if kind == "int8":
        q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(q=q.reshape(shape), scale=scale, out_axes=out_axes, group=g, kind=kind)


_quantize_jit = jax.jit(_quantize_one, static_argnames=("out_axes", "kind", "group"))


def check_method(method: str, native: bool = False) -> None:
    """``InputError`` unless ``method`` is one of ``QUANTIZATIONS`` (or, where ``native``,
    ``"native"``: a loader's choice, ``load_model``)."""
    if method not in QUANTIZATIONS and not (native and method == "native"):
        names = ", ".join((*QUANTIZATIONS, "native") if native else QUANTIZATIONS)
        raise InputError(f"quantize={method!r} must be one of {names} or None")


def is_quantized(params: Any) -> bool:
    """Whether any weight of ``params`` is a ``QuantizedWeight``."""
    return any(isinstance(w, QuantizedWeight) for w in jax.tree.leaves(
        params, is_leaf=lambda w: isinstance(w, QuantizedWeight)))


def quantize_weight(w: jax.Array | np.ndarray, name: str, method: str) -> QuantizedWeight:
    """The matmul weight ``name`` (a key of a layout's params: ``"wq"``, ``"wqkv"``, ...)
    quantized by ``method`` (one of ``QUANTIZATIONS``), on the default device, or, for a
    weight split over a mesh, split the same way (packed values, scales and zeros alike:
    their axes are the weight's, the input axis counted in bytes or groups).

    Raises ``InputError`` when a split of the input axis does not give each device whole
    groups.
    """
    kind, group = _METHODS[method]
    out_axes = _OUT_AXES[name]
    w = jnp.asarray(w)
    a = w.ndim - out_axes - 1
    if kind == "int4" and w.shape[a] % 2:
        raise InputError(f"quantize={method!r} packs two input rows per byte, but {name} has "
                         f"{w.shape[a]}; use int8 or fp8")
    sharding = w.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return _quantize_jit(w, out_axes=out_axes, kind=kind, group=group)
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
    names = spec[a] if isinstance(spec[a], tuple) else (spec[a],)
    shards = math.prod(sharding.mesh.shape[n] for n in names if n is not None)
    if kind == "fp8":  # one scale per column and device's rows: each device scales its shard
        group = w.shape[a] // shards
    g = group if group and w.shape[a] % group == 0 else w.shape[a]
    if (w.shape[a] // shards) % g:
        raise InputError(f"quantize={method!r} cannot split {name}: its {w.shape[a]} input rows"
                         f" over {shards} devices are not whole groups of {g}; use fewer "
                         "model devices or a smaller group")
    quantize = functools.partial(_quantize_one, out_axes=out_axes, kind=kind, group=group)
    out_shardings = jax.tree.map(lambda _: sharding, jax.eval_shape(quantize, w))
    return jax.jit(quantize, out_shardings=out_shardings)(w)


def quantize_params(params: dict[str, Any], method: str, donate: bool = False
                    ) -> dict[str, Any]:
    """``params`` (any execution layout) with every matmul weight quantized by ``method``.

    ``donate`` deletes each original device array once its quantized copy exists, so the
    device holds at most one full-precision weight beside the quantized model. Weights that
    are quantized already are kept.
    """
    check_method(method)

    def convert(tree: Any) -> Any:
        if isinstance(tree, list | tuple):
            return type(tree)(convert(t) for t in tree)
        if not isinstance(tree, dict):
            return tree
        out = {}
        for name, w in tree.items():
            if name in _OUT_AXES and isinstance(w, jax.Array | np.ndarray):
                out[name] = quantize_weight(w, name, method)
                if donate and isinstance(w, jax.Array):
                    w.delete()
            else:
                out[name] = convert(w)
        return out

    return convert(params)


def random_quantized_params(config: LlamaConfig, method: str, key: jax.Array,
                            dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """Random params of ``config`` in the stored layout, matmul weights quantized by
    ``method``, made one layer of one weight at a time (benchmarks of models whose
    full-precision weights do not fit on the device: 70B bf16 is 141 GB).

    Each layer's weight is drawn like ``params.init_params`` (normal / sqrt(fan_in)) and
    quantized inside a loop that writes it into the stacked quantized arrays, so the device
    holds the quantized model plus one layer's float32 draw. Norms and embeddings are drawn
    in ``dtype``. The values differ from ``init_params``'s; they are for speed measurements.
    """
    check_method(method)
    kind, group = _METHODS[method]
    shapes = param_shapes(config)
    keys = iter(jax.random.split(key, len(shapes["layers"]) + 4))

    def norm(shape: tuple[int, ...]) -> jax.Array:
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    params: dict[str, Any] = {
        "embed": (jax.random.normal(next(keys), shapes["embed"], jnp.float32)
                  / math.sqrt(shapes["embed"][0])).astype(dtype),
        "final_norm": norm(shapes["final_norm"]),
        "layers": {name: norm(shape) if "norm" in name
                   else _draw_stacked(shape, next(keys), kind=kind, group=group)
                   for name, shape in shapes["layers"].items()}}
    if "lm_head" in shapes:
        params["lm_head"] = jax.tree.map(
            lambda a: a[0], _draw_stacked((1, *shapes["lm_head"]), next(keys), kind=kind,
                                          group=group))
    return params


@jax.jit(static_argnames=("shape", "kind", "group"))
def _draw_stacked(shape: tuple[int, ...], key: jax.Array, kind: str, group: int
                  ) -> QuantizedWeight:
    """A random ``[L, in, out]`` weight quantized layer by layer (one layer's draw live)."""
    def layer(i: jax.Array) -> QuantizedWeight:
        w = jax.random.normal(jax.random.fold_in(key, i), shape[1:], jnp.float32)
        return _quantize_one(w / math.sqrt(shape[-2]), 1, kind, group)

    out = jax.tree.map(lambda a: jnp.zeros((shape[0], *a.shape), a.dtype),
                       jax.eval_shape(layer, jnp.int32(0)))
    return jax.lax.fori_loop(0, shape[0], lambda i, acc: jax.tree.map(
        lambda s, x: s.at[i].set(x), acc, layer(i)), out)


def param_bytes(params: Any) -> int:
    """Bytes the parameters take on their devices (per copy; quantized weights count their
    stored values, packed int4 included, and their scales). Leaves may be arrays or
    ``jax.ShapeDtypeStruct`` (``jax.eval_shape``'s: a model's bytes without making it)."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize  # shapes suffice
                   for x in jax.tree.leaves(params)))


def decode_weight_bytes(params: Any, tie_word_embeddings: bool) -> int | None:
    """Bytes of weights one decode step reads where ``params`` hold quantized weights: all
    of them as stored (``param_bytes``), less the embedding table, of which a step reads its
    tokens' rows only (a tied table is the LM head too, read whole); None for unquantized
    weights, whose bytes ``roofline.weight_bytes_per_step`` counts from the config."""
    if not is_quantized(params):
        return None
    embed = 0 if tie_word_embeddings else param_bytes(params["embed"])
    return param_bytes(params) - embed
