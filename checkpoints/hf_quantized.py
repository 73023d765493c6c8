"""HF AWQ and GPTQ 4-bit checkpoint folders as ``jaxinfer.quantize`` int4 weights, kept packed.

``config.json``'s ``quantization_config`` (written by AutoAWQ, AutoGPTQ, GPTQModel and HF
transformers) says which format a folder holds; each quantized linear layer ``<prefix>``
(e.g. ``model.layers.0.self_attn.q_proj``) then stores, with ``g`` its ``group_size``:

* AWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``): ``qweight`` int32
  ``[in, out / 8]`` and ``qzeros`` int32 ``[in / g, out / 8]``, eight 4-bit values per int32
  along the output axis, nibble ``i`` (bits ``4i .. 4i + 3``) holding column
  ``_AWQ_ORDER[i]`` of its eight; ``scales`` float16 ``[in / g, out]``.
* GPTQ (``quant_method: "gptq"``): ``qweight`` int32 ``[in / 8, out]``, packed along the
  input axis (nibble ``j`` of row ``r``: input row ``8r + j``); ``qzeros`` int32
  ``[in / g, out / 8]``, packed along the output axis in order; ``scales`` float16
  ``[in / g, out]``; ``g_idx`` int32 ``[in]``, each input row's group. ``checkpoint_format``
  ``"gptq"`` (v1, AutoGPTQ's and the default) stores ``z - 1`` (the reference kernels add the
  1 back to the stored nibble, so a zero of 16 occurs), ``"gptq_v2"`` (GPTQModel) ``z``.

Both mean ``w[i, o] = s[group(i), o] * (q[i, o] - z[group(i), o])``. Our int4 weight is
``scale * v + zero`` per group of ``g`` contiguous input rows, so the mapping keeps the 4-bit
values ``v = q`` and the scales ``s`` as they are (repacked two per byte, ``pack_int4``) and
sets ``zero = -s * z`` in float16: every weight is its format's ``s * (q - z)`` within half a
float16 ulp of ``s * z`` (``z <= 16``: at most ``s / 128``, under 1% of a quantization
step), no float weight is made, and the bytes are the checkpoint's (plus a float16 zero per
group instead of a 4-bit one).

Act-order GPTQ (``desc_act``: ``g_idx`` not ``i // g``) scatters each group over the input
rows. Sorting the rows by group makes the groups contiguous; the weight keeps that row order
(``QuantizedWeight.perm``) and the matmul gathers its input columns to match (``x[..., perm]``,
``jaxinfer.model``), which is exact. Q/K/V (and gate/up) of one layer, which GPTQ orders
alike from their shared input, must agree, since the fast layout fuses them.

``InputError`` here, before any tensor is read: other methods, bits other than 4, group sizes
other than 32/64/128 (``-1`` included), AWQ versions other than GEMM, GPTQ formats other than
v1/v2 or words other than int32 (GPTQModel's ``pack_dtype``). Modules left unquantized
(``modules_to_not_convert``, a float lm_head) load as floats; a quantized lm_head as int4.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.errors import CheckpointError, InputError
from jaxinfer.params import host_threads
from jaxinfer.quantize import QuantizedWeight, pack_int4

GROUPS = (32, 64, 128)
"""``group_size`` values whose checkpoints load as int4 (the int4 kernel's groups)."""

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i holds column _AWQ_ORDER[i] of 8
_AWQ_COLUMNS = np.argsort(_AWQ_ORDER)  # column c of 8 is in nibble _AWQ_COLUMNS[c]


@dataclasses.dataclass(frozen=True)
class PackedFormat:
    """How a folder's linear layers are packed: ``method`` ``"awq"`` or ``"gptq"``, input
    rows per ``group``, and ``zero_offset`` added to each stored zero (1 for GPTQ v1)."""

    method: str
    group: int
    zero_offset: int = 0


def packed_format(folder: str | Path) -> PackedFormat | None:
    """The packing ``folder/config.json``'s ``quantization_config`` describes, or None for a
    float checkpoint (no ``quantization_config``).

    Raises ``InputError`` (one line: what is wrong, what to use) for a quantization jaxinfer
    does not run; ``CheckpointError`` for an unreadable config.json.
    """
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read model config {path}: {e}") from None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise InputError(f"{path}: quant_method={method!r} is not supported; jaxinfer loads AWQ "
                         "(GEMM) and GPTQ 4-bit folders, or load the float model with "
                         "quantize='int4'")
    name = method.upper()
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise InputError(f"{path}: {name} bits={bits} is not supported; jaxinfer runs 4-bit "
                         "AWQ/GPTQ (use a 4-bit checkpoint, or the float model with "
                         "quantize='int8')")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUPS:
        raise InputError(f"{path}: {name} group_size={group} is not supported; jaxinfer's int4 "
                         "runs groups of 32, 64 or 128 input rows (use a checkpoint quantized "
                         "with one of those)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise InputError(f"{path}: AWQ version={version!r} packs weights for its own "
                             "kernels; jaxinfer loads version 'gemm' (AutoAWQ's default), use "
                             "a GEMM export")
        if qc.get("zero_point", True) is not True:
            raise InputError(f"{path}: AWQ zero_point={qc['zero_point']!r} is not supported; "
                             "jaxinfer loads AWQ GEMM with zero points (AutoAWQ's default)")
        return PackedFormat("awq", group)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise InputError(f"{path}: GPTQ checkpoint_format={fmt!r} packs weights for its own "
                         "kernels; jaxinfer loads 'gptq' (v1) and 'gptq_v2' folders")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise InputError(f"{path}: GPTQ pack_dtype={qc['pack_dtype']!r} is not supported; "
                         "jaxinfer reads values packed in int32 words (the default)")
    return PackedFormat("gptq", group, zero_offset=1 if fmt == "gptq" else 0)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 ``[..., n]`` -> its eight 4-bit values uint8 ``[..., n, 8]``, low nibble first.
    Byte-wise (the words' four little-endian bytes, each split in two): 5x faster than
    shifting each word eight times in uint32 (an 8B gate projection: 36 against 181 ms)."""
    b = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8)
    b = b.reshape(*words.shape, 4)
    out = np.empty((*words.shape, 4, 2), np.uint8)
    np.bitwise_and(b, 15, out=out[..., 0])
    np.right_shift(b, 4, out=out[..., 1])
    return out.reshape(*words.shape, 8)


def _row_order(g_idx: np.ndarray, group: int, name: str) -> np.ndarray | None:
    """The input rows sorted by group (int32 ``[in]``), or None when ``g_idx`` already is
    ``i // group``; ``CheckpointError`` unless every group has exactly ``group`` rows."""
    natural = np.arange(g_idx.size) // group
    if np.array_equal(g_idx, natural):
        return None
    order = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[order], natural):
        raise CheckpointError(f"{name} does not put exactly {group} input rows in each group; "
                              "the checkpoint is corrupt or not a GPTQ export")
    return order.astype(np.int32)


def packed_weight(read: Callable[[str, tuple[int, ...]], np.ndarray],
                  has: Callable[[str], bool], prefix: str, shape: tuple[int, int],
                  fmt: PackedFormat) -> QuantizedWeight:
    """The linear layer ``prefix`` as an int4 ``QuantizedWeight`` ``[in, out]`` (``x @ W``
    orientation, numpy arrays), from its packed tensors.

    Args:
      read: ``read(name, shape)``: the tensor ``name``, which must exist with that shape
        (``CheckpointError`` otherwise).
      has: whether the checkpoint holds a tensor.
      prefix: the layer's tensor name without ``.qweight`` etc.
      shape: ``(out, in)``, the torch orientation of the weight it stands for.
      fmt: the folder's ``packed_format``.
    """
    out, n_in = shape
    g = fmt.group
    if n_in % g or out % 8:
        raise CheckpointError(f"{prefix} has {n_in} input rows and {out} outputs, not whole "
                              f"groups of {g} rows and 8-column words; the config does not "
                              "match these weights")
    perm = None
    if fmt.method == "awq":
        v = _nibbles(read(f"{prefix}.qweight", (n_in, out // 8)))[..., _AWQ_COLUMNS]
    else:
        v = _nibbles(read(f"{prefix}.qweight", (n_in // 8, out))).transpose(0, 2, 1)
        if has(f"{prefix}.g_idx"):
            perm = _row_order(read(f"{prefix}.g_idx", (n_in,)).astype(np.int64), g,
                              f"{prefix}.g_idx")
    v = v.reshape(n_in, out)  # [in, out] values 0..15
    if perm is not None:
        v = v[perm]
    zeros = _nibbles(read(f"{prefix}.qzeros", (n_in // g, out // 8)))
    if fmt.method == "awq":
        zeros = zeros[..., _AWQ_COLUMNS]
    z = zeros.reshape(n_in // g, out).astype(np.float32) + fmt.zero_offset  # [in / g, out]
    s = read(f"{prefix}.scales", (n_in // g, out))
    scale = s.astype(np.float16)
    if not np.array_equal(scale.astype(np.float32), s.astype(np.float32)):
        raise CheckpointError(f"{prefix}.scales ({s.dtype}) are not all float16 values; the "
                              "checkpoint is not an AWQ/GPTQ export jaxinfer reads")
    if has(f"{prefix}.bias") and np.any(read(f"{prefix}.bias", (out,))):
        raise CheckpointError(f"{prefix}.bias is not zero; jaxinfer's Llama has no bias terms")
    zero = (-scale.astype(np.float32) * z).astype(np.float16)
    return QuantizedWeight(q=pack_int4(v, g, axis=0), scale=scale, zero=zero, perm=perm,
                           group=g, kind="int4")


def packed_layers(read: Callable[[str, tuple[int, ...]], np.ndarray],
                  has: Callable[[str], bool], prefixes: Sequence[str], shape: tuple[int, int],
                  fmt: PackedFormat) -> QuantizedWeight | None:
    """One weight kind of every layer (``prefixes``, layer order) stacked into a
    ``QuantizedWeight`` ``[L, ...]`` (``packed_weight``), or None when every layer stores it
    as a float ``.weight`` (left unquantized by its exporter); ``CheckpointError`` for a mix.
    A row order (act-order GPTQ) in any layer gives every layer one (the identity where
    its rows are in order), so the layers stack."""
    packed = [has(f"{p}.qweight") for p in prefixes]
    if not any(packed):
        return None
    if not all(packed):
        raise CheckpointError(f"{prefixes[packed.index(False)]} is stored unquantized but "
                              f"{prefixes[packed.index(True)]} is quantized; jaxinfer stacks "
                              "one kind per weight across layers")
    # One layer per thread (numpy releases the GIL): 8 layers of an 8B AWQ / GPTQ export
    # loaded 1.3x / 1.5x faster on the 2-core CI machine (bench/NOTES.md r190).
    with ThreadPoolExecutor(host_threads(len(prefixes))) as pool:
        weights = list(pool.map(lambda p: packed_weight(read, has, p, shape, fmt), prefixes))
    if any(w.perm is not None for w in weights):
        identity = np.arange(shape[1], dtype=np.int32)
        weights = [w if w.perm is not None else dataclasses.replace(w, perm=identity)
                   for w in weights]
    first = weights[0]

    def stack(field: str) -> Any:
        parts = [getattr(w, field) for w in weights]
        return None if parts[0] is None else np.stack(parts)

    return QuantizedWeight(q=stack("q"), scale=stack("scale"), zero=stack("zero"),
                           perm=stack("perm"), group=first.group, kind=first.kind)


FUSED_INPUTS = (("wq", "wk", "wv"), ("w_gate", "w_up"))
"""Weights that read one input and that ``jaxinfer.model``'s fast layout fuses."""


def check_fused_orders(layers: dict[str, Any]) -> None:
    """``CheckpointError`` unless the weights of each ``FUSED_INPUTS`` group are all
    quantized or all float, and share their row order (``perm``), which a fused weight
    keeps one of."""
    for names in FUSED_INPUTS:
        if len({isinstance(layers[n], QuantizedWeight) for n in names}) > 1:
            raise CheckpointError(f"of {', '.join(names)} some are quantized and some not; "
                                  "jaxinfer fuses them, so they must be stored alike")
        orders = [getattr(layers[n], "perm", None) for n in names]
        if any(o is not None for o in orders) and not all(
                o is not None and np.array_equal(o, orders[0]) for o in orders):
            raise CheckpointError(f"act-order GPTQ weights {', '.join(names)} order their "
                                  "input rows differently (g_idx); jaxinfer needs one order "
                                  "for weights that share an input")
