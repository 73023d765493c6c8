"""Import a llama-architecture GGUF file (llama.cpp format) into the jaxinfer params pytree.

Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized to float32 with the ``gguf``
package. llama.cpp's converter permutes the rows of Q and K projections so that RoPE can rotate
adjacent pairs (interleaved convention); we undo that so the weights use HF's rotate_half layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.hf import expected_shapes
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import CheckpointError, ConfigError

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


def _field_value(field: Any) -> Any:
    """Python value of a ``gguf.ReaderField`` (str, int, float, bool, or list of those)."""
    if hasattr(field, "contents"):
        return field.contents()
    # Older gguf releases: decode from the raw parts.
    import gguf

    def scalar(part: np.ndarray, vtype: Any) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part.tolist()[0]
        return bool(value) if vtype == gguf.GGUFValueType.BOOL else value

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value metadata of an open ``gguf.GGUFReader`` as plain Python values."""
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


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


def _open_reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises many types on malformed input
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                              "it is truncated or corrupt, re-download it") from None
    size = path.stat().st_size
    for t in reader.tensors:
        # A truncated file can still parse its header; its last tensors then lie past the end.
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path} is truncated: tensor {t.name!r} extends past the end "
                                  f"of the file ({size} bytes); re-download it")
    return reader


def _tensor(t: Any) -> np.ndarray:
    """Dequantized float32 numpy array in torch ``[out, in]`` orientation."""
    import gguf
    from gguf.quants import dequantize

    try:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            a = np.asarray(t.data, dtype=np.float32)
        else:
            a = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost-first; numpy order is the reverse.
        return a.reshape(tuple(int(d) for d in reversed(t.shape)))
    except Exception as e:  # noqa: BLE001 - unsupported quant types or corrupt data
        raise CheckpointError(f"cannot decode GGUF tensor {t.name!r} of type "
                              f"{t.tensor_type.name} ({type(e).__name__}: {e})") from None


def load_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, Any], dict[str, Any]]:
    """Import a llama-architecture GGUF file.

    Args:
      path: the ``.gguf`` file.

    Returns:
      ``(config, params, metadata)``: params is the jaxinfer params pytree of float32 numpy
      arrays (see ``checkpoints.hf``), with Q/K in HF rotate_half layout; metadata is every GGUF
      key/value (tokenizer vocabulary, merges, chat template, ...) as Python values, suitable for
      ``jaxinfer.tokenizer.Tokenizer.from_gguf_metadata``.

    Raises:
      CheckpointError: not a llama GGUF, truncated/corrupt file, missing or misshapen tensors.
    """
    path = Path(path)
    reader = _open_reader(path)
    try:
        meta = read_gguf_metadata(reader)
    except Exception as e:  # noqa: BLE001 - malformed strings/arrays
        raise CheckpointError(f"cannot decode the metadata of {path} ({e}); the file is "
                              "corrupt, re-download it") from None
    tensors = {t.name: t for t in reader.tensors}
    freqs = _tensor(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    config = LlamaConfig.from_hf_dict(gguf_config_dict(meta, set(tensors), freqs))
    shapes = expected_shapes(config)

    def get(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"GGUF file {path.name} is missing tensor {name!r}")
        a = _tensor(tensors[name])
        if transpose:
            a = a.T
        if a.shape != shape:
            raise CheckpointError(f"GGUF tensor {name!r} has shape {list(a.shape)} (x@W "
                                  f"orientation) but the metadata implies {list(shape)}")
        return a

    params: dict[str, Any] = {
        "embed": get("token_embd.weight", shapes["embed"], False),
        "final_norm": get("output_norm.weight", shapes["final_norm"], False),
    }
    layers: dict[str, np.ndarray] = {
        key: np.empty(shape, dtype=np.float32) for key, shape in shapes["layers"].items()
    }
    for i in range(config.num_layers):
        for gname, (key, transpose) in _BLOCK_TENSORS.items():
            name = f"blk.{i}.{gname}.weight"
            if name not in tensors:
                raise CheckpointError(f"GGUF file {path.name} is missing tensor {name!r}")
            shape = shapes["layers"][key][1:]
            a = _shape_checked(name, _tensor(tensors[name]),
                               tuple(reversed(shape)) if transpose else shape)
            if key == "wq":
                a = _unpermute(a, config.num_heads)
            elif key == "wk":
                a = _unpermute(a, config.num_kv_heads)
            layers[key][i] = a.T if transpose else a
    params["layers"] = layers
    if not config.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("output.weight", shapes["lm_head"], True))
    return config, params, meta


def _shape_checked(name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if a.shape != shape:
        raise CheckpointError(f"GGUF tensor {name!r} has shape {list(a.shape)} ([out, in]) "
                              f"but the metadata implies {list(shape)}")
    return a
