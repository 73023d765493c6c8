"""The one attention entry point of the model: ragged paged attention over the engine's page
pool, backends ``"reference"`` (plain jnp) and ``"pallas"`` (the kernels in
``pallas_kernels``), plus the choice between them (``resolve_backend``).

q ``[tokens, q_heads, head_dim]`` packs prefill chunks and decode tokens of many sequences
and attends to one layer's page pool ``[kv_heads, num_pages, page_size, head_dim]`` through
``block_tables``; ``lengths`` are the keys per sequence including its new tokens, ``cu_q_lens``
the cumulative query counts. ``write_and_attend`` also stores the step's new K/V into the
pool first (the model's entry point).
"""

from __future__ import annotations

from typing import Any, Literal

import jax

import pallas_kernels
from jaxinfer.errors import InputError
from jaxinfer.paged_cache import QuantizedPages
from pallas_kernels import SUPPORTED_HEAD_DIMS

Backend = Literal["reference", "pallas", "auto"]


def check_backend(backend: Any) -> None:
    """Raise ``InputError`` unless ``backend`` names an attention backend (``Backend``);
    needs no config, so callers check before any I/O."""
    if backend not in ("reference", "pallas", "auto"):
        raise InputError(f"unknown attention backend {backend!r}; use 'reference', 'pallas' "
                         "or 'auto'")


def resolve_backend(backend: Backend, head_dim: int, deterministic: bool = False,
                    tensor_parallel: bool = False) -> Literal["reference", "pallas"]:
    """Map ``"auto"`` to the best backend for the default JAX platform and head size.

    ``"auto"`` picks the Pallas kernels on GPU when they support ``head_dim``; an explicit
    ``"pallas"`` with an unsupported head size is an error rather than a silent fallback.
    ``deterministic`` (batch-invariant kernels) always takes Pallas; ``check_deterministic``
    says where it cannot run (``tensor_parallel``: the model is split over devices).
    """
    if deterministic:
        backend = check_deterministic(backend, tensor_parallel)
    check_backend(backend)
    if backend == "auto":
        use = jax.default_backend() == "gpu" and head_dim in SUPPORTED_HEAD_DIMS
        return "pallas" if use else "reference"
    if backend == "pallas" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"the pallas attention backend supports head_dim {SUPPORTED_HEAD_DIMS}, "
                         f"not {head_dim}; use backend='reference'")
    return backend


def check_deterministic(backend: str, tensor_parallel: bool = False) -> str:
    """The attention backend deterministic mode runs (Pallas), or ``InputError`` saying why
    it cannot run here."""
    if backend == "reference":
        raise InputError("deterministic=True runs the Pallas kernels; use backend='auto' or "
                         "'pallas'")
    if tensor_parallel:
        raise InputError("deterministic=True runs on one device per replica; use a mesh with "
                         "model=1 (data parallel) or no mesh")
    if jax.default_backend() == "tpu":
        raise InputError("deterministic=True has no TPU kernels yet; run it on a GPU")
    return "pallas"


def attention(
    q: jax.Array,
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    lengths: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    *,
    backend: Literal["reference", "pallas"] = "reference",
    max_q_len: int | None = None,
    deterministic: bool = False,
) -> jax.Array:
    """Ragged paged attention with GQA, causal against the cache, float32 softmax.

    Args:
      q: ``[T, H, D]`` packed query tokens of many sequences (prefill chunks and decode
        tokens); sequence s owns rows ``[cu_q_lens[s], cu_q_lens[s + 1])``.
      k_pages, v_pages: one layer's page pool ``[KVH, num_pages, page_size, D]``;
        ``H % KVH == 0``. ``QuantizedPages`` (an int8 / fp8 pool): every backend
        dequantizes as it reads (the kernels inside their dot products, the reference the
        gathered pages only).
      lengths: ``[S]`` int32 keys per sequence including its new tokens.
      block_tables: ``[S, pages_per_seq]`` int32 physical page of each logical page.
      cu_q_lens: ``[S + 1]`` int32 cumulative query counts.
      backend: ``"reference"`` (plain jnp) or ``"pallas"`` (``pallas_kernels``; off-GPU the
        kernel runs in the Pallas interpreter: slow, but exact, which tests use).
      max_q_len: static bound on any sequence's query count (default ``T``), passed to the
        Pallas kernel, which sizes its query blocks by it; 1 with one row per sequence (a
        decode-only step) runs the split-K paged decode kernel. The reference ignores it.
      deterministic: a token's output must not depend on the step around it (Pallas only):
        the ragged kernel for every step, with the same query block whatever
        ``max_q_len`` is. (The split-K kernel splits keys by the batch size, and a smaller
        query block changes the tensor-core tile a decode token is computed in.)

    Returns:
      ``[T, H, D]`` like ``q``.
    """
    scales = {}
    if isinstance(k_pages, QuantizedPages):
        scales = {"k_scales": k_pages.scales, "v_scales": v_pages.scales}
        k_pages, v_pages = k_pages.values, v_pages.values
    if deterministic:
        if backend != "pallas":
            raise ValueError("deterministic attention needs the pallas backend")
        # max_q_len only caps the query block here; 16 keeps the kernel's default block.
        return pallas_kernels.ragged_attention(q, k_pages, v_pages, block_tables, lengths,
                                               cu_q_lens, max_q_len=max(max_q_len or 1, 16),
                                               interpret=pallas_kernels.interpret_here(),
                                               **scales)
    if backend == "pallas" and max_q_len == 1 and q.shape[0] == block_tables.shape[0]:
        # Decode-only step, row s = sequence s: the split-K paged kernel (Flash-Decoding)
        # keeps the GPU busy with few sequences, where the ragged kernel has one program per
        # (sequence, kv head). Inactive rows (length 0) give zeros.
        return pallas_kernels.paged_attention(q, k_pages, v_pages, block_tables, lengths,
                                              interpret=pallas_kernels.interpret_here(),
                                              **scales)
    if backend == "pallas":
        return pallas_kernels.ragged_attention(q, k_pages, v_pages, block_tables, lengths,
                                               cu_q_lens, max_q_len=max_q_len,
                                               interpret=pallas_kernels.interpret_here(),
                                               **scales)
    # Any head_dim here (the kernels' restriction does not apply to the reference).
    return pallas_kernels.ragged_attention_reference(q, k_pages, v_pages, block_tables,
                                                     lengths, cu_q_lens, **scales)


def write_kv(pages: jax.Array | QuantizedPages, layer: int | jax.Array | None, new: jax.Array,
             write_pages: jax.Array, write_offsets: jax.Array) -> jax.Array | QuantizedPages:
    """Scatter ``new [T, KVH, D]`` into one layer's pages, in place.

    ``pages`` is that layer's ``[KVH, P, page_size, D]`` buffer (``layer`` None) or the
    stacked ``[L, KVH, P, page_size, D]`` pool with ``layer`` its index. Padding tokens name
    page ``P`` and are dropped. ``QuantizedPages``: ``new`` is quantized per token and head
    (``pallas_kernels.quantize_kv``), values and scales scattered to the same slots.
    """
    if isinstance(pages, QuantizedPages):
        values, scales = pallas_kernels.quantize_kv(new, pages.values.dtype)  # [T,KVH,D], [T,KVH]
        return QuantizedPages(
            values=write_kv(pages.values, layer, values, write_pages, write_offsets),
            scales=write_kv(pages.scales, layer, scales, write_pages, write_offsets))
    if layer is None:
        return pallas_kernels.store_new_tokens(pages, new, write_pages, write_offsets)
    # (layer, :, page[T], offset[T]): the scalar splits the advanced indices, so T comes first.
    return pages.at[layer, :, write_pages, write_offsets].set(new.astype(pages.dtype),
                                                              mode="drop")


def _decode_write(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: Any, v_pages: Any,
                  batch: dict[str, jax.Array], out_pairs: bool) -> tuple[Any, Any, Any]:
    """A decode-only step on the Pallas backend: ``pallas_kernels.paged_attention_write``
    stores each row's K/V and attends in one kernel (quantized pools: the new K/V quantized
    first, as ``write_kv`` does); ``out_pairs`` as there."""
    kw: dict[str, Any] = {"interpret": pallas_kernels.interpret_here(), "out_pairs": out_pairs}
    if isinstance(k_pages, QuantizedPages):
        dtype = k_pages.values.dtype
        (k, k_scale), (v, v_scale) = (pallas_kernels.quantize_kv(x, dtype) for x in (k, v))
        kw.update(k_scales=k_pages.scales, v_scales=v_pages.scales, k_new_scales=k_scale,
                  v_new_scales=v_scale)
        k_vals, v_vals = k_pages.values, v_pages.values
    else:
        k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
        k_vals, v_vals = k_pages, v_pages
    out, k_vals, v_vals, *scales = pallas_kernels.paged_attention_write(
        q, k, v, k_vals, v_vals, batch["block_tables"], batch["kv_lens"], batch["write_pages"],
        batch["write_offsets"], **kw)
    if scales:
        return (out, QuantizedPages(values=k_vals, scales=scales[0]),
                QuantizedPages(values=v_vals, scales=scales[1]))
    return out, k_vals, v_vals


def write_and_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    layer: int | jax.Array | None,
    batch: dict[str, jax.Array],
    *,
    backend: Literal["reference", "pallas"] = "reference",
    max_q_len: int | None = None,
    deterministic: bool = False,
    out_pairs: bool = False,
) -> tuple[Any, Any, Any]:
    """Store a step's new K/V into the pool, then attend: the model's one attention call.

    ``q [T, H, D]``, ``k``/``v [T, KVH, D]`` (after RoPE); the pool and ``layer`` as in
    ``write_kv``; ``batch`` holds the packed step's ``write_pages``, ``write_offsets [T]``,
    ``kv_lens [S]``, ``block_tables [S, P]`` and ``cu_q_lens [S + 1]``. Other arguments as
    ``attention``. A decode-only step (one token per sequence, ``max_q_len`` 1) on the Pallas
    backend with a per-layer pool runs one kernel that stores and attends (at batch 1 the
    two scatters before the attention were two of ~15 kernels per layer); every other step
    scatters with ``write_kv``, then calls ``attention``. Returns ``(out [T, H, D], k_pages,
    v_pages)``; with ``out_pairs``, that one-kernel decode step returns ``out`` as
    ``pallas_kernels.ScaledPairs`` ``[T, H * D]`` (``paged_attention_write``), for an o
    matmul that reads them.
    """
    decode = max_q_len == 1 and q.shape[0] == batch["block_tables"].shape[0]
    if backend == "pallas" and decode and layer is None and not deterministic:
        return _decode_write(q, k, v, k_pages, v_pages, batch, out_pairs)
    k_pages = write_kv(k_pages, layer, k, batch["write_pages"], batch["write_offsets"])
    v_pages = write_kv(v_pages, layer, v, batch["write_pages"], batch["write_offsets"])
    k_l = k_pages if layer is None else k_pages[layer]
    v_l = v_pages if layer is None else v_pages[layer]
    out = attention(q, k_l, v_l, batch["kv_lens"], batch["block_tables"], batch["cu_q_lens"],
                    backend=backend, max_q_len=max_q_len, deterministic=deterministic)
    return out, k_pages, v_pages
