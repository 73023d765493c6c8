"""Host-side checkpoint loading: ``load_hf_checkpoint`` on a random bf16 HF folder of a
preset's shapes (or a 4-bit AWQ / GPTQ export of them), against the floor of one host copy
of the file.

The folder (``config.json`` and one ``model.safetensors``, written here without torch) holds
random values; the page cache is warmed by one untimed load, so the figure is the
loader's own work (reading the mapped file, the [out, in] -> [in, out] transposes, stacking
the layers), not the disk. Floor: the file's bytes through one host copy at the rate
``np.copyto`` reaches on 1 GiB (``--copy-mib``) here. Each load is checked: one transposed
weight and the final norm must equal the file's. Prints one JSON record and, with
``--json``, writes it.

Usage:
    python scripts/bench_load.py --preset llama-3.2-1b --json bench/results/cpu/load/F.json
    python scripts/bench_load.py --preset llama-3.1-8b --layers 4   # 8B shapes, 4 layers
    python scripts/bench_load.py --preset llama-3.1-8b --layers 4 --packed awq
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from checkpoints.hf import hf_tensor_names, hf_tensor_shape, load_hf_checkpoint
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from jaxinfer.presets import resolve_config

PACKED_GROUP = 128
"""Input rows per scale in the ``--packed`` folders."""

_QUANTIZATION = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": PACKED_GROUP, "version": "gemm",
            "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": PACKED_GROUP,
             "desc_act": False, "checkpoint_format": "gptq"},
}


FLOAT_CODES = {"bfloat16": "BF16", "float16": "F16"}
"""``--dtype`` -> the safetensors code of the folder's float tensors."""


def folder_tensors(config: LlamaConfig, packed: str | None, code: str = "BF16"
                   ) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of each tensor of a random folder of ``config``:
    floats of ``code`` throughout, or with ``packed`` (``"awq"`` / ``"gptq"``) every layer's
    linear weight as that format's int32 ``qweight`` / ``qzeros`` and float16 ``scales``."""
    out = []
    for name in hf_tensor_names(config):
        shape = hf_tensor_shape(name, config)
        if packed is None or not name.startswith("model.layers.") or len(shape) != 2:
            out.append((name, code, shape))
            continue
        prefix, (rows, cols) = name.removesuffix(".weight"), shape  # torch [out, in]
        qweight = (cols, rows // 8) if packed == "awq" else (cols // 8, rows)
        out += [(f"{prefix}.qweight", "I32", qweight),
                (f"{prefix}.qzeros", "I32", (cols // PACKED_GROUP, rows // 8)),
                (f"{prefix}.scales", "F16", (cols // PACKED_GROUP, rows))]
    return out


def write_random_folder(folder: Path, config: LlamaConfig, packed: str | None = None,
                        code: str = "BF16", seed: int = 0) -> int:
    """Write ``config.json`` and a random ``model.safetensors`` (``folder_tensors``) into
    ``folder``; return the file's size in bytes. Float values (bf16 weights, float16 scales)
    are positive normal numbers (bit patterns 0x3C00-0x3F7F: [2^-7, 1) in bf16, [1, 2) in
    float16), never zeros, NaNs or infinities; packed words are random bits."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_dict()
    if packed is not None:
        hf["quantization_config"] = _QUANTIZATION[packed]
    (folder / "config.json").write_text(json.dumps(hf))
    tensors = folder_tensors(config, packed, code)
    header: dict[str, Any] = {}
    offset = 0
    for name, code, shape in tensors:
        nbytes = (4 if code == "I32" else 2) * int(np.prod(shape))
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, code, shape in tensors:
            n = int(np.prod(shape))
            if code == "I32":
                f.write(rng.integers(0, 1 << 32, n, dtype=np.uint32).astype("<u4").tobytes())
            else:
                f.write(rng.integers(0x3C00, 0x3F80, n, dtype=np.uint16).tobytes())
    return path.stat().st_size


def copy_rate(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Host copy bytes/s: the median of ``repeats`` ``np.copyto`` calls of ``nbytes``."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def check_loaded(folder: Path, params: dict[str, Any], packed: str | None,
                 dtype: Any) -> None:
    """Raise AssertionError unless the loaded layer-0 ``wq`` is the file's q_proj (its
    weight transposed; with ``packed``, its scales) and the final norm is the file's (floats
    of numpy ``dtype``)."""
    raw = np.memmap(folder / "model.safetensors", dtype=np.uint8, mode="r")
    header_len = struct.unpack("<Q", raw[:8].tobytes())[0]
    header = json.loads(raw[8:8 + header_len].tobytes())

    def stored(name: str, as_dtype: Any) -> np.ndarray:
        start, stop = header[name]["data_offsets"]
        return (raw[8 + header_len + start:8 + header_len + stop]
                .view(as_dtype).reshape(header[name]["shape"]))

    q = "model.layers.0.self_attn.q_proj"
    wq = params["layers"]["wq"]
    if packed is None:
        if not np.array_equal(wq[0], stored(f"{q}.weight", dtype).T):
            raise AssertionError("loaded wq[0] is not the file's q_proj transposed")
    elif not np.array_equal(wq.scale[0], stored(f"{q}.scales", np.float16)):
        raise AssertionError("loaded wq[0]'s scales are not the file's q_proj.scales")
    if not np.array_equal(params["final_norm"], stored("model.norm.weight", dtype)):
        raise AssertionError("loaded final_norm is not the file's")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b",
                    help="a model preset or a config.json path (shapes only)")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers")
    ap.add_argument("--packed", choices=sorted(_QUANTIZATION), default=None,
                    help="write the layers' linear weights as a 4-bit AWQ or GPTQ export "
                         f"(group {PACKED_GROUP}) instead of floats")
    ap.add_argument("--dtype", choices=sorted(FLOAT_CODES), default="bfloat16",
                    help="the folder's float tensors")
    ap.add_argument("--repeats", type=int, default=3, help="timed loads (median reported)")
    ap.add_argument("--dir", default=None,
                    help="a new or empty folder to write and keep (default: a temporary one)")
    ap.add_argument("--copy-mib", type=int, default=1024,
                    help="MiB the host copy test moves (the floor's rate)")
    ap.add_argument("--json", default=None, help="also write the record here")
    args = ap.parse_args(argv)
    try:
        config = resolve_config(args.preset)
    except InputError as e:
        sys.exit(f"bench_load: {e}")
    if args.layers is not None:
        if not 1 <= args.layers <= config.num_layers:
            sys.exit(f"bench_load: --layers must be 1-{config.num_layers} for {args.preset}")
        config = dataclasses.replace(config, num_layers=args.layers)
    if args.repeats < 1 or args.copy_mib < 1:
        sys.exit("bench_load: --repeats and --copy-mib must be at least 1")
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        sys.exit(f"bench_load: --dir {args.dir} is not empty; pass a new or empty folder")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir) if args.dir else Path(tmp) / "model"
        file_bytes = write_random_folder(folder, config, args.packed, FLOAT_CODES[args.dtype])
        dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float16
        rate = copy_rate(args.copy_mib << 20)
        params = load_hf_checkpoint(folder)[1]  # warms the page cache; checked, not timed
        check_loaded(folder, params, args.packed, dtype)
        del params
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            params = load_hf_checkpoint(folder)[1]
            times.append(time.perf_counter() - t)
            check_loaded(folder, params, args.packed, dtype)
            del params
    load_s = statistics.median(times)
    floor_s = file_bytes / rate
    record = {"what": "load_hf_checkpoint", "preset": args.preset, "layers": config.num_layers,
              "packed": args.packed, "dtype": args.dtype,
              "file_bytes": file_bytes, "copy_GBps": rate / 1e9, "load_s": load_s,
              "load_s_all": times, "floor_s": floor_s, "frac_of_floor": floor_s / load_s}
    print(json.dumps(record))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
