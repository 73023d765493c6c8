"""Load an HF Llama checkpoint folder (``config.json`` + safetensors) into the params pytree.

The params pytree (the contract with ``jaxinfer.model``) is a nested dict of arrays, weights in
``x @ W`` orientation (HF's torch ``Linear.weight`` transposed), all layers stacked on axis 0::

    {"embed": [vocab, hidden],
     "layers": {"attn_norm": [L, hidden], "wq": [L, hidden, heads*head_dim],
                "wk": [L, hidden, kv_heads*head_dim], "wv": [L, hidden, kv_heads*head_dim],
                "wo": [L, heads*head_dim, hidden], "mlp_norm": [L, hidden],
                "w_gate": [L, hidden, inter], "w_up": [L, hidden, inter],
                "w_down": [L, inter, hidden]},
     "final_norm": [hidden],
     "lm_head": [hidden, vocab]}   # absent when config.tie_word_embeddings

An AWQ or GPTQ 4-bit folder (``quantization_config`` in config.json) loads its quantized
linear layers as int4 ``QuantizedWeight`` without a float copy (``checkpoints.hf_quantized``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from checkpoints.hf_quantized import (
    PackedFormat,
    check_fused_orders,
    packed_format,
    packed_layers,
)
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.params import param_shapes, transpose_copy

# HF per-layer tensor name suffix -> (our key, whether the torch weight is transposed).
_LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}

# safetensors dtype code -> numpy dtype name (little-endian, as the format stores them); the
# names numpy lacks come from ml_dtypes (a JAX dependency).
_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
           "F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
           "I64": "<i8", "U8": "u1", "BOOL": "?"}


def _numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of safetensors dtype ``code``; CheckpointError for one jaxinfer
    does not read."""
    if code not in _DTYPES:
        raise CheckpointError(f"safetensors dtype {code!r} is not one jaxinfer reads "
                              f"({', '.join(_DTYPES)}); convert the checkpoint")
    return _parse_dtype(_DTYPES[code])


def hf_tensor_names(config: LlamaConfig) -> list[str]:
    """The names of the tensors an HF float checkpoint of ``config`` holds, in file order."""
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{suffix}" for i in range(config.num_layers)
              for suffix in _LAYER_TENSORS]
    names.append("model.norm.weight")
    return names if config.tie_word_embeddings else [*names, "lm_head.weight"]


def hf_tensor_shape(name: str, config: LlamaConfig) -> tuple[int, ...]:
    """Shape the HF (torch orientation) tensor ``name`` must have under ``config``."""
    shapes = param_shapes(config)
    if name == "model.embed_tokens.weight":
        return shapes["embed"]
    if name == "model.norm.weight":
        return shapes["final_norm"]
    if name == "lm_head.weight":
        return (config.vocab_size, config.hidden_size)
    suffix = name.split(".", 3)[3]
    key, transposed = _LAYER_TENSORS[suffix]
    shape = shapes["layers"][key][1:]
    return tuple(reversed(shape)) if transposed else shape


def _parse_dtype(dtype: Any) -> np.dtype | None:
    """``None``, a numpy dtype, a jnp dtype or a name such as ``"bfloat16"`` -> numpy dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        import ml_dtypes  # imported here: only needed for names numpy does not know

        if hasattr(ml_dtypes, dtype):
            return np.dtype(getattr(ml_dtypes, dtype))
    try:
        return np.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"unknown dtype {dtype!r}; use e.g. 'float32' or "
                              "'bfloat16'") from None


class _SafetensorsFile:
    """One ``.safetensors`` file: validated header, tensors read as numpy arrays.

    The header is parsed here, so that a truncated file is reported by name before any tensor
    read, and every tensor is read straight from the mapped bytes (bfloat16 and fp8, which the
    safetensors package's numpy backend refuses, through ml_dtypes).
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError("file shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file size {size}")
                header = json.loads(fh.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing; re-download the "
                                  "checkpoint") from None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not a valid safetensors file ({e}); re-download "
                                  "it") from None
        try:
            header.pop("__metadata__", None)
            end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path} has a malformed header ({type(e).__name__}: {e}); "
                                  "re-download it") from None
        self.data_start = 8 + n
        self.header: dict[str, dict[str, Any]] = header
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path} is truncated ({size} bytes, its header needs {self.data_start + end}); "
                "re-download it"
            )

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape as the header gives it."""
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """``(dtype, shape, start, stop)`` of tensor ``name`` from the header (byte offsets
        from the data's start); CheckpointError for a malformed entry."""
        info = self.header[name]
        try:
            shape = tuple(int(s) for s in info["shape"])
            start, stop = (int(o) for o in info["data_offsets"])
            code = info["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {name!r} has a malformed header entry in {self.path} "
                                  f"({type(e).__name__}: {e}); re-download the file") from None
        return _numpy_dtype(code), shape, start, stop

    def read(self, name: str, copy: bool = True) -> np.ndarray:
        """Tensor ``name`` from the file's memory map: a copy, or with ``copy=False`` a
        read-only view, for a caller that copies it anyway (one pass instead of two)."""
        dtype, shape, start, stop = self._entry(name)
        if stop - start != dtype.itemsize * math.prod(shape):
            raise CheckpointError(f"tensor {name!r} in {self.path} holds {stop - start} bytes, "
                                  f"not the {dtype.itemsize * math.prod(shape)} its dtype and "
                                  "shape need; the file is corrupt, re-download it")
        if stop == start:  # numpy cannot map zero bytes
            return np.zeros(shape, dtype)
        try:
            raw = np.memmap(self.path, dtype=np.uint8, mode="r",
                            offset=self.data_start + start, shape=(stop - start,))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.path} ({e}); re-"
                                  "download the checkpoint") from None
        view = raw.view(dtype).reshape(shape)
        return np.array(view) if copy else view


def _open_checkpoint(folder: Path) -> dict[str, _SafetensorsFile]:
    """Map every tensor name to the file holding it (single file or sharded index)."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); "
                                  "re-download it") from None
        files = {fname: _SafetensorsFile(folder / fname)
                 for fname in sorted(set(weight_map.values()))}
        where = {}
        for name, fname in weight_map.items():
            if name not in files[fname].header:
                raise CheckpointError(f"tensor {name!r} is listed in {index.name} but missing from "
                                      f"{fname}; re-download the checkpoint")
            where[name] = files[fname]
        return where
    if single.exists():
        f = _SafetensorsFile(single)
        return {name: f for name in f.header}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}; "
                              "pass an HF checkpoint folder with safetensors weights")
    where = {}
    for path in shards:
        f = _SafetensorsFile(path)
        where.update({name: f for name in f.header})
    return where


def _read(where: dict[str, _SafetensorsFile], name: str, expected: tuple[int, ...],
          copy: bool = True) -> np.ndarray:
    """Tensor ``name``, which the config requires with shape ``expected`` (``copy``: see
    ``_SafetensorsFile.read``)."""
    if name not in where:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} that the config requires; "
                              "the checkpoint is incomplete or not a Llama model")
    got = where[name].shape(name)
    if got != expected:
        raise CheckpointError(f"tensor {name!r} has shape {list(got)} but config.json implies "
                              f"{list(expected)}; the config does not match these weights")
    return where[name].read(name, copy)


def _packed(where: dict[str, _SafetensorsFile], names: list[str], config: LlamaConfig,
            fmt: PackedFormat | None) -> Any:
    """The linear weights ``names`` (one per layer, ``...weight``) of an AWQ/GPTQ folder
    stacked as one int4 ``QuantizedWeight``; None for a float folder or float weights."""
    if fmt is None:
        return None
    prefixes = [n.removesuffix(".weight") for n in names]
    return packed_layers(lambda name, shape: _read(where, name, shape),
                         lambda name: name in where, prefixes,
                         hf_tensor_shape(names[0], config), fmt)


def load_hf_checkpoint(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, dict[str, Any]]:
    """Load an HF Llama checkpoint folder.

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``.
      dtype: cast every tensor to this dtype (numpy/jnp dtype or name such as ``"bfloat16"``);
        ``None`` keeps the checkpoint's dtype.

    Returns:
      ``(config, params)``: params is the pytree described in this module's docstring, holding
      host numpy arrays (per-layer tensors stacked into ``[num_layers, ...]``); an AWQ/GPTQ
      folder's quantized linear weights are int4 ``QuantizedWeight`` of numpy arrays
      (``checkpoints.hf_quantized``), which ``dtype`` leaves as they are.

    Raises:
      CheckpointError: missing/corrupt/truncated files, missing tensors, or shape mismatches.
      ConfigError: unsupported config fields.
      InputError: a ``quantization_config`` jaxinfer does not run (before any tensor is read).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} has no config.json; pass an HF checkpoint folder")
    config = LlamaConfig.from_json_file(folder / "config.json")
    fmt = packed_format(folder)
    target = _parse_dtype(dtype)

    def buffer(shape: tuple[int, ...], stored: np.dtype) -> np.ndarray:
        # Every tensor is copied from the file's memory map into a buffer of the target
        # dtype: the copy casts, one pass per tensor, and peak host memory stays ~1x the
        # checkpoint (stacked layers are preallocated).
        return np.empty(shape, stored if target is None else target)

    def mapped(name: str) -> np.ndarray:  # a read-only view of the file, checked
        return _read(where, name, hf_tensor_shape(name, config), copy=False)

    def whole(name: str) -> np.ndarray:
        a = mapped(name)
        out = buffer(a.shape, a.dtype)
        out[...] = a
        return out

    where = _open_checkpoint(folder)
    params: dict[str, Any] = {"embed": whole("model.embed_tokens.weight"),
                              "final_norm": whole("model.norm.weight")}
    layers: dict[str, Any] = {}
    for suffix, (key, transposed) in _LAYER_TENSORS.items():
        names = [f"model.layers.{i}.{suffix}" for i in range(config.num_layers)]
        packed = _packed(where, names, config, fmt) if transposed else None
        if packed is not None:
            layers[key] = packed
            continue
        for i, name in enumerate(names):
            a = mapped(name)
            if key not in layers:
                layers[key] = buffer((config.num_layers, *(a.shape[::-1] if transposed
                                                            else a.shape)), a.dtype)
            if transposed:
                transpose_copy(a, layers[key][i])
            else:
                layers[key][i] = a
    if fmt is not None:
        check_fused_orders(layers)
    params["layers"] = layers
    if not config.tie_word_embeddings:
        head = _packed(where, ["lm_head.weight"], config, fmt)
        if head is None:
            a = mapped("lm_head.weight")
            head = transpose_copy(a, buffer(a.shape[::-1], a.dtype))
        else:
            head = jax.tree.map(lambda a: a[0], head)
        params["lm_head"] = head
    extra_layers = [n for n in where if n.startswith("model.layers.")
                    and int(n.split(".")[2]) >= config.num_layers]
    if extra_layers:
        raise CheckpointError(f"checkpoint has tensor {extra_layers[0]!r} beyond "
                              f"num_hidden_layers={config.num_layers}; the config does not match")
    return config, params


def iter_leaves(tree: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Yield ``("layers/wq", leaf)`` pairs of a nested-dict pytree, in sorted key order."""
    for key in sorted(tree):
        value = tree[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from iter_leaves(value, name + "/")
        else:
            yield name, value
