"""Import a llama-architecture GGUF file (llama.cpp format) into the jaxinfer params pytree.

Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized to float32 with the ``gguf``
package, or, with ``load_gguf(native=True)``, Q8_0 / Q4_0 / Q4_1 matmul weights are kept as
their blocks in ``jaxinfer.quantize`` formats (``native_weight``): Q8_0 as int8 with a scale
per 32 input rows, Q4_0 / Q4_1 as int4 with group 32 (their nibble order is ours; Q4_0's
``d * (q - 8)`` is ``d * q + (-8 d)``); Q4_K is re-quantized to int4 (group 32), other
quantized types (Q5_*, Q6_K) to int8. llama.cpp's converter permutes the rows of Q and K
projections so that RoPE can rotate adjacent pairs (interleaved convention); we undo that so
the weights use HF's rotate_half layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.params import param_shapes, transpose_copy
from jaxinfer.quantize import QuantizedWeight, quantize_weight

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")
"""GGUF tensor types ``load_gguf(native=True)`` keeps quantized (matmul weights only)."""

# GGUF per-block tensor name -> (our key, whether it is a weight matrix to transpose).
_BLOCK_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("attn_norm", False),
    "attn_q": ("wq", True),
    "attn_k": ("wk", True),
    "attn_v": ("wv", True),
    "attn_output": ("wo", True),
    "ffn_norm": ("mlp_norm", False),
    "ffn_gate": ("w_gate", True),
    "ffn_up": ("w_up", True),
    "ffn_down": ("w_down", True),
}

# Llama 3.x GGUFs store llama3 rope scaling only as the per-frequency factor tensor
# ``rope_freqs.weight``; we recover the HF parameters by matching it against these candidates.
_LLAMA3_CANDIDATES = [
    {"low_freq_factor": lo, "high_freq_factor": hi, "original_max_position_embeddings": orig}
    for orig in (8192, 4096, 2048, 16384, 32768) for lo in (1.0, 2.0) for hi in (4.0, 2.0, 8.0)
]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` on a torch-orientation ``[n_head*head_dim, in]`` matrix.

    llama.cpp reshapes rows as ``(n_head, 2, head_dim/2)`` and swaps the last two axes so each
    rotated pair is adjacent; reading rows as ``(n_head, head_dim/2, 2)`` and swapping back
    restores the half-split order HF's rotate_half expects.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_scaling(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF ``rope_scaling`` (llama3) from GGUF's ``rope_freqs`` factor tensor."""
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if np.allclose(freqs, 1.0):
        return {}
    # Stored as float32: round off the representation error so the config reads e.g. 8.0.
    factor = round(float(freqs.max()), 4)
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    for cand in _LLAMA3_CANDIDATES:
        orig = cand["original_max_position_embeddings"]
        lo, hi = cand["low_freq_factor"], cand["high_freq_factor"]
        low_wl, high_wl = orig / lo, orig / hi
        smooth = (orig / wavelen - lo) / (hi - lo)
        # llama.cpp stores the divisor applied to each frequency: 1, factor, or the blend.
        expect = np.where(wavelen < high_wl, 1.0,
                          np.where(wavelen > low_wl, factor,
                                   1.0 / ((1 - smooth) / factor + smooth)))
        if expect.shape == freqs.shape and np.allclose(expect, freqs, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, **cand}
    raise CheckpointError("GGUF rope_freqs.weight does not match any llama3 rope scaling this "
                          "loader recognizes; convert the model from its HF checkpoint instead")


def gguf_config_dict(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """Build the HF ``config.json`` dict a llama GGUF's metadata describes."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF general.architecture is {arch!r}; jaxinfer imports only "
                              "'llama' GGUF files")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise CheckpointError(f"GGUF metadata lacks 'llama.{key}'; the file is incomplete")
        return meta[f"llama.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length")
                   or meta.get("llama.rope.dimension_count") or hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(need("vocab_size"))
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if "llama.rope.dimension_count" in meta and int(meta["llama.rope.dimension_count"]) != head_dim:
        raise ConfigError(f"GGUF llama.rope.dimension_count={meta['llama.rope.dimension_count']} "
                          f"differs from head_dim={head_dim}; partial RoPE is not supported")
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        # Passed through so LlamaConfig rejects types it cannot compute (e.g. linear, yarn).
        cfg["rope_scaling"] = {"type": scaling_type,
                               "factor": float(meta.get("llama.rope.scaling.factor", 1.0))}
    elif rope_freqs is not None:
        scaling = _llama3_scaling(rope_freqs, theta, head_dim)
        if scaling:
            cfg["rope_scaling"] = scaling
    if "tokenizer.ggml.bos_token_id" in meta:
        cfg["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if k in meta]
    if eos:
        cfg["eos_token_id"] = list(dict.fromkeys(eos))
    return cfg


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
               10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _GGUFFile:
    """A GGUF file parsed directly with ``struct`` over a read-only memory map.

    ``gguf.GGUFReader`` builds a numpy view per string, which takes seconds for a 49k-token
    vocabulary; this parser reads the same format (v2/v3, little-endian) in milliseconds and
    leaves tensor bytes mapped until they are dequantized (with ``gguf.quants``).
    """

    def __init__(self, path: Path):
        import struct

        self.path = path
        self.buf = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else b""
        # memoryview slices are cheap; slicing the memmap itself builds a numpy view per string.
        self.mv = memoryview(self.buf)
        self.size = len(self.buf)
        self.pos = 0
        self._struct = struct
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("missing GGUF magic bytes")
        self.pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self.pos // align) * align
        # name -> (quant type, numpy shape [out, in] order, absolute offset, byte count)
        self.tensors: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
        import gguf

        for name, dims, qtype, offset in infos:
            qt = gguf.GGMLQuantizationType(qtype)
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            self.tensors[name] = (qt, tuple(reversed(dims)), data_start + offset, nbytes)

    def _take(self, n: int) -> int:
        if self.pos + n > self.size:
            raise EOFError(f"header ends after {self.size} bytes")
        start = self.pos
        self.pos += n
        return start

    def _scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype]
        start = self._take(self._struct.calcsize(fmt))
        return self._struct.unpack_from(fmt, self.mv, start)[0]

    def _string(self) -> str:
        n = self._scalar(10)
        start = self._take(n)
        return str(self.mv[start:start + n], "utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[item])
                start = self._take(dt.itemsize * count)
                return np.frombuffer(self.buf, dtype=dt, count=count, offset=start).tolist()
            return [self._value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._scalar(vtype)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 array in torch ``[out, in]`` orientation."""
        import gguf
        from gguf.quants import dequantize

        qt, shape, offset, nbytes = self.tensors[name]
        try:
            raw = np.asarray(self.buf[offset:offset + nbytes])
            if qt == gguf.GGMLQuantizationType.F32:
                return raw.view(np.float32).reshape(shape).copy()
            if qt == gguf.GGMLQuantizationType.F16:
                return raw.view(np.float16).reshape(shape).astype(np.float32)
            rows = raw.reshape(*shape[:-1], -1)  # dequantize works on rows of packed blocks
            return dequantize(rows, qt).astype(np.float32, copy=False).reshape(shape)
        except Exception as e:  # noqa: BLE001 - unsupported quant types or corrupt data
            raise CheckpointError(f"cannot decode GGUF tensor {name!r} of type {qt.name} "
                                  f"({type(e).__name__}: {e})") from None


def native_weight(raw: np.ndarray, qtype: str, shape: tuple[int, int], n_head: int = 0
                  ) -> QuantizedWeight:
    """A GGUF tensor's Q8_0 / Q4_0 / Q4_1 blocks as a ``QuantizedWeight`` in ``x @ W``
    orientation (numpy arrays), without dequantizing.

    Args:
      raw: the tensor's bytes (uint8), ``shape[0]`` rows of ``shape[1] / 32`` blocks.
      qtype: one of ``NATIVE_TYPES``.
      shape: ``(out, in)``, GGUF's (torch) orientation.
      n_head: > 0 undoes llama.cpp's Q/K row permutation for that many heads.
    """
    out, n_in = shape
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    blocks = raw.reshape(out, n_in // 32, block_bytes)  # [out, in / 32, block]
    if n_head:
        blocks = _unpermute(blocks, n_head)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].T  # [in / 32, out]
    if qtype == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, n_in)
        return QuantizedWeight(q=np.ascontiguousarray(q.T), scale=d.astype(np.float32),
                               group=32, kind="int8")
    nibbles = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]  # [out, in / 32, 16]
    q = np.ascontiguousarray(nibbles.reshape(out, n_in // 2).T)  # byte j: rows j, j + 16
    if qtype == "Q4_1":
        zero = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].T
    else:  # d * (v - 8) = d * v + (-8 d), exact in float16 (a power-of-two scaling)
        zero = (-8 * d.astype(np.float32)).astype(np.float16)
    return QuantizedWeight(q=q, scale=np.ascontiguousarray(d), zero=np.ascontiguousarray(zero),
                           group=32, kind="int4")


def _open_gguf(path: Path) -> _GGUFFile:
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        f = _GGUFFile(path)
    except ModuleNotFoundError as e:  # the file may be fine: say what is missing
        raise CheckpointError(f"reading {path} needs the {e.name!r} package; install it "
                              f"(pip install {e.name})") from None
    except Exception as e:  # noqa: BLE001 - malformed headers raise many types
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                              "it is truncated or corrupt, re-download it") from None
    for name, (_, _, offset, nbytes) in f.tensors.items():
        # A truncated file can still parse its header; its last tensors then lie past the end.
        if offset + nbytes > f.size:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} extends past the end "
                                  f"of the file ({f.size} bytes); re-download it")
    return f


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file's header as Python values (no tensor data is read).

    Use with ``jaxinfer.tokenizer.Tokenizer.from_gguf_metadata`` to get only the tokenizer.
    """
    return dict(_open_gguf(Path(path)).metadata)


def load_gguf(path: str | Path, native: bool = False
              ) -> tuple[LlamaConfig, dict[str, Any], dict[str, Any]]:
    """Import a llama-architecture GGUF file.

    Args:
      path: the ``.gguf`` file.
      native: keep quantized matmul weights quantized (``QuantizedWeight``): Q8_0 / Q4_0 /
        Q4_1 blocks as they are (``native_weight``), K-quants and other types re-quantized
        layer by layer (``_native_method`` says how per weight kind); the embedding, norms
        and weights stored as floats are dequantized as without it.

    Returns:
      ``(config, params, metadata)``: params is the jaxinfer params pytree of float32 numpy
      arrays (or, with ``native``, ``QuantizedWeight`` of numpy arrays; see
      ``checkpoints.hf``), with Q/K in HF rotate_half layout; metadata is every GGUF
      key/value (tokenizer vocabulary, merges, chat template, ...) as Python values, suitable for
      ``jaxinfer.tokenizer.Tokenizer.from_gguf_metadata``.

    Raises:
      CheckpointError: not a llama GGUF, truncated/corrupt file, missing or misshapen tensors.
    """
    path = Path(path)
    f = _open_gguf(path)
    meta = f.metadata
    tensors = f.tensors
    freqs = f.tensor("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    config = LlamaConfig.from_hf_dict(gguf_config_dict(meta, set(tensors), freqs))
    shapes = param_shapes(config)

    def get(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"GGUF file {path.name} is missing tensor {name!r}")
        a = f.tensor(name)
        got = a.shape[::-1] if transpose else a.shape
        if got != shape:
            raise CheckpointError(f"GGUF tensor {name!r} has shape {list(got)} (x@W "
                                  f"orientation) but the metadata implies {list(shape)}")
        return transpose_copy(a) if transpose else a

    params: dict[str, Any] = {
        "embed": get("token_embd.weight", shapes["embed"], False),
        "final_norm": get("output_norm.weight", shapes["final_norm"], False),
    }
    layers: dict[str, Any] = {}
    for gname, (key, transpose) in _BLOCK_TENSORS.items():
        names = [f"blk.{i}.{gname}.weight" for i in range(config.num_layers)]
        for name in names:
            if name not in tensors:
                raise CheckpointError(f"GGUF file {path.name} is missing tensor {name!r}")
        shape = shapes["layers"][key][1:]
        n_head = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(key, 0)
        method = _native_method({tensors[n][0].name for n in names}) if native else None
        if method is not None:
            per_layer = [_native_checked(f, n, key, tuple(reversed(shape)), n_head, method)
                         for n in names]
            layers[key] = jax.tree.map(lambda *a: np.stack(a), *per_layer)
            continue
        stacked = np.empty(shapes["layers"][key], dtype=np.float32)
        for i, name in enumerate(names):
            a = _shape_checked(name, f.tensor(name),
                               tuple(reversed(shape)) if transpose else shape)
            if n_head:
                a = _unpermute(a, n_head)
            if transpose:
                transpose_copy(a, stacked[i])
            else:
                stacked[i] = a
        layers[key] = stacked
    params["layers"] = layers
    if not config.tie_word_embeddings:
        name = "output.weight"
        if name not in tensors:
            raise CheckpointError(f"GGUF file {path.name} is missing tensor {name!r}")
        method = _native_method({tensors[name][0].name}) if native else None
        if method is not None:
            params["lm_head"] = _native_checked(f, name, "lm_head",
                                                tuple(reversed(shapes["lm_head"])), 0, method)
        else:
            params["lm_head"] = get(name, shapes["lm_head"], True)
    return config, params, meta


_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def _native_method(types: set[str]) -> str | None:
    """How ``load_gguf(native=True)`` keeps a weight kind stored in these GGUF types (one
    kind stacks all layers, so they must agree): ``"native"`` for Q8_0 or Q4_0/Q4_1 blocks
    as they are; ``"int4"`` (group 32) when Q4_K joins Q4_0/Q4_1 (its 32-value sub-blocks
    share one affine 16-level grid, which group-32 min/max quantization finds again);
    ``"int8"`` for other quantized types (Q5, Q6_K, mixes: 8 bits keep their precision);
    None (dequantized to float) when a layer is stored as floats."""
    if types <= {"Q8_0"} or types <= {"Q4_0", "Q4_1"}:
        return "native"
    if types <= {"Q4_0", "Q4_1", "Q4_K"}:
        return "int4"
    return None if types & _FLOAT_TYPES else "int8"


def _native_checked(f: _GGUFFile, name: str, key: str, shape: tuple[int, int], n_head: int,
                    method: str) -> QuantizedWeight:
    """Tensor ``name`` as our quantized weight ``key``: its blocks as they are
    (``native_weight``) when its type allows, else dequantized and re-quantized by
    ``method`` (``requantized_weight``)."""
    qt, got, offset, nbytes = f.tensors[name]
    if got != shape:
        raise CheckpointError(f"GGUF tensor {name!r} has shape {list(got)} ([out, in]) but "
                              f"the metadata implies {list(shape)}")
    if qt.name in NATIVE_TYPES and method in ("native", "int4"):  # int4: Q4_0 / Q4_1 here
        return native_weight(np.asarray(f.buf[offset:offset + nbytes]), qt.name, shape, n_head)
    return requantized_weight(f.tensor(name), key, method, n_head)


def requantized_weight(w: np.ndarray, key: str, method: str, n_head: int = 0
                       ) -> QuantizedWeight:
    """A dequantized GGUF matmul weight ``w [out, in]`` (float32, torch orientation)
    quantized by ``method`` into weight ``key`` (``"wq"``, ...), in ``x @ W`` orientation,
    numpy arrays: one layer at a time on the default device, so a K-quant model is never
    held in float32 there."""
    if n_head:
        w = _unpermute(w, n_head)
    return jax.device_get(quantize_weight(transpose_copy(w), key, method))


def _shape_checked(name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if a.shape != shape:
        raise CheckpointError(f"GGUF tensor {name!r} has shape {list(a.shape)} ([out, in]) "
                              f"but the metadata implies {list(shape)}")
    return a
