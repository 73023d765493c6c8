"""Partition rules (Megatron-style tensor parallelism + data parallelism) for jaxinfer pytrees.

Weights (``x @ W`` orientation, layers stacked on axis 0, see ``jaxinfer.model``)::

    wq, wk, wv, w_gate, w_up   [L, hidden, out]   out (heads*hd / intermediate) on "model"
    wo, w_down                 [L, in, hidden]    in  (heads*hd / intermediate) on "model"
    attn_norm, mlp_norm        [L, hidden]        replicated
    final_norm                 [hidden]           replicated
    embed                      [vocab, hidden]    vocab on "model"
    lm_head                    [hidden, vocab]    vocab on "model"

Column-parallel Q/K/V and gate/up followed by row-parallel O and down means each block needs
exactly one all-reduce of ``[B, T, hidden]`` (after O and after down) and no communication
inside attention: every shard owns whole heads and their slice of the KV cache.

Embeddings and LM head are split on vocab: the LM head is the largest single matrix (vocab x
hidden, 1 GiB in bf16 for Llama-3-70B) and a vocab split makes its matmul purely local, leaving
only the ``[B, vocab]`` logits to gather for sampling; a hidden split would instead all-reduce
full-vocab float32 partial logits. Tied models use one array for both, so the embedding follows
the head (the lookup becomes a masked local gather plus one all-reduce of ``[B, T, hidden]``).
When vocab does not divide the model size the split falls back to hidden, then to replication.

The engine's page pool (``engine_pool_spec``): kv heads on "model". When a model has fewer
K/V heads than the model axis, the K/V projection columns are repeated so each shard holds the
whole K/V head its query heads read (``expand_kv_heads``); the model's config then reports the
repeated head count and the pool grows accordingly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from jaxinfer.quantize import QuantizedWeight
from sharding.mesh import MODEL, mesh_sizes

log = logging.getLogger("jaxinfer.sharding")

Params = dict[str, Any]


def valid_model_sizes(config: LlamaConfig) -> list[int]:
    """Tensor-parallel sizes this model can be split over.

    A size ``m`` works when it divides the query heads and the MLP width, and either divides
    the K/V heads or is a multiple of them (then K/V heads are repeated, see
    ``expand_kv_heads``).
    """
    h, kv, f = config.num_heads, config.num_kv_heads, config.intermediate_size
    return [m for m in range(1, h + 1)
            if h % m == 0 and f % m == 0 and (kv % m == 0 or m % kv == 0)]


def kv_repeat_factor(config: LlamaConfig, model_size: int) -> int:
    """How many times each K/V head is repeated for a ``model_size``-way split (1 = none).

    Raises ``InputError`` listing the sizes that work when ``model_size`` is not one of them.
    """
    if model_size not in valid_model_sizes(config):
        raise InputError(
            f"model={model_size} cannot split this model (num_attention_heads="
            f"{config.num_heads}, num_key_value_heads={config.num_kv_heads}, intermediate_size="
            f"{config.intermediate_size}); model sizes that work: "
            f"{', '.join(map(str, valid_model_sizes(config)))}")
    kv = config.num_kv_heads
    return 1 if kv % model_size == 0 else model_size // kv


def expand_kv_heads(config: LlamaConfig, params: Params, repeat: int
                    ) -> tuple[LlamaConfig, Params]:
    """Repeat every K/V head ``repeat`` times in ``wk``/``wv`` (numpy or jax leaves).

    Head ``j`` of the result is original head ``j // repeat``, so query head ``i`` still reads
    the K/V of original head ``i // q_per_kv``: the computation is unchanged, but with
    ``kv_heads * repeat`` heads each shard of the model axis owns whole heads.

    Returns ``(config with num_kv_heads * repeat, params)``; ``wk``/``wv`` go from
    ``[L, hidden, kv*hd]`` to ``[L, hidden, kv*repeat*hd]``.
    """
    if repeat == 1:
        return config, params
    kv, hd = config.num_kv_heads, config.head_dim

    def rep_array(w: Any) -> Any:
        xp = jnp if isinstance(w, jax.Array) else np
        n, d, _ = w.shape
        return xp.repeat(w.reshape(n, d, kv, hd), repeat, axis=2).reshape(n, d, kv * repeat * hd)

    def rep(w: Any) -> Any:
        if isinstance(w, QuantizedWeight):  # values, scales, zeros: columns on the last axis
            return dataclasses.replace(w, q=rep_array(w.q), scale=rep_array(w.scale),
                                       zero=None if w.zero is None else rep_array(w.zero))
        return rep_array(w)

    layers = dict(params["layers"], wk=rep(params["layers"]["wk"]),
                  wv=rep(params["layers"]["wv"]))
    return (dataclasses.replace(config, num_kv_heads=kv * repeat),
            dict(params, layers=layers))


def _vocab_specs(config: LlamaConfig, model_size: int) -> tuple[P, P]:
    """(embed spec, lm_head spec): vocab split if it divides, else hidden, else replicated."""
    if config.vocab_size % model_size == 0:
        return P(MODEL, None), P(None, MODEL)
    if config.hidden_size % model_size == 0:
        log.warning("vocab_size=%d does not divide model=%d; embeddings and LM head are split "
                    "on hidden instead", config.vocab_size, model_size)
        return P(None, MODEL), P(MODEL, None)
    log.warning("neither vocab_size=%d nor hidden_size=%d divide model=%d; embeddings and LM "
                "head are replicated", config.vocab_size, config.hidden_size, model_size)
    return P(), P()


def param_specs(config: LlamaConfig, model_size: int) -> dict[str, Any]:
    """``PartitionSpec`` for every parameter of ``config`` (its head counts as given).

    ``config`` must already have K/V heads divisible by ``model_size`` (after
    ``expand_kv_heads``); see the module docstring for the layout.
    """
    col = P(None, None, MODEL)  # [L, hidden, out]: output columns split
    row = P(None, MODEL, None)  # [L, in, hidden]: input rows split
    embed, head = _vocab_specs(config, model_size)
    specs: dict[str, Any] = {
        "embed": embed,
        "layers": {"attn_norm": P(), "mlp_norm": P(), "wq": col, "wk": col, "wv": col,
                   "wo": row, "w_gate": col, "w_up": col, "w_down": row},
        "final_norm": P(),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = head
    return specs


def param_shardings(config: LlamaConfig, mesh: Mesh) -> dict[str, Any]:
    """``NamedSharding`` pytree for the params of ``config`` on ``mesh`` (replicated on data)."""
    _, model_size = mesh_sizes(mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, model_size),
                        is_leaf=lambda x: isinstance(x, P))


def stored_shardings(config: LlamaConfig, mesh: Mesh) -> dict[str, Any]:
    """Shardings to restore a checkpoint of ``config`` (stored, unexpanded K/V heads) into.

    Identical to ``param_shardings`` except that ``wk``/``wv`` are replicated when their heads
    will be repeated: they then have fewer heads than shards (and are small).
    """
    _, model_size = mesh_sizes(mesh)
    shardings = param_shardings(config, mesh)
    if kv_repeat_factor(config, model_size) > 1:
        rep = NamedSharding(mesh, P())
        shardings["layers"] = dict(shardings["layers"], wk=rep, wv=rep)
    return shardings


def shard_params(config: LlamaConfig, params: Params, mesh: Mesh, dtype: Any
                 ) -> tuple[LlamaConfig, Params]:
    """Cast ``params`` to ``dtype``, repeat K/V heads if needed, and place them on ``mesh``.

    Host (numpy) leaves are cast and sliced in host memory and each device receives only its
    own shard, so the whole model never sits on one device. ``jax.Array`` leaves (e.g. restored
    with ``stored_shardings``) are converted by a jitted reshard. A quantized weight
    (``QuantizedWeight``, e.g. an AWQ / GPTQ checkpoint's) keeps its dtypes: its values,
    scales and zeros are split like the weight (their axes are its axes, the input axis
    counted in bytes or groups) and a row order (``perm``) is replicated.

    Returns ``(config, params)``; the config differs from the input only in ``num_kv_heads``
    when K/V heads were repeated.

    Raises ``InputError`` before placing anything when a quantized weight split on its input
    rows would not give every device whole groups.
    """
    _, model_size = mesh_sizes(mesh)
    repeat = kv_repeat_factor(config, model_size)
    if repeat > 1:
        log.warning("num_key_value_heads=%d < model=%d: repeating each K/V head %d times so "
                    "every shard holds whole heads (KV cache grows %dx)",
                    config.num_kv_heads, model_size, repeat, repeat)
    dt = jnp.dtype(dtype)
    host = jax.tree.map(lambda a: a if isinstance(a, jax.Array | QuantizedWeight)
                        else np.asarray(a).astype(dt), params,
                        is_leaf=lambda a: isinstance(a, QuantizedWeight))
    new_config, host = expand_kv_heads(config, host, repeat)
    shardings = param_shardings(new_config, mesh)
    # ``host`` has the shardings' structure down to each weight (a QuantizedWeight included).
    jax.tree_util.tree_map_with_path(
        lambda path, sharding, a: _check_whole_groups(jax.tree_util.keystr(path), a, sharding,
                                                      model_size), shardings, host)

    def place(sharding: NamedSharding, a: Any) -> Any:
        if isinstance(a, QuantizedWeight):
            whole = NamedSharding(mesh, P())
            return dataclasses.replace(
                a, q=jax.device_put(a.q, sharding), scale=jax.device_put(a.scale, sharding),
                zero=None if a.zero is None else jax.device_put(a.zero, sharding),
                perm=None if a.perm is None else jax.device_put(a.perm, whole))
        if isinstance(a, jax.Array):
            return jax.jit(lambda x: x.astype(dt), out_shardings=sharding)(a)
        return jax.device_put(a, sharding)

    return new_config, jax.tree.map(place, shardings, host)


def _check_whole_groups(name: str, w: Any, sharding: NamedSharding, model_size: int) -> None:
    """``InputError`` when ``w`` is a ``QuantizedWeight`` whose input rows, split as
    ``sharding`` says, do not give each device whole groups (its scales split by group)."""
    if not isinstance(w, QuantizedWeight):
        return
    spec = tuple(sharding.spec) + (None,) * (w.q.ndim - len(sharding.spec))
    rows = w.shape[w.in_axis]
    if spec[w.in_axis] == MODEL and (rows // model_size) % w.group:
        raise InputError(f"{name} is quantized in groups of {w.group} input rows, but split over "
                         f"model={model_size} devices each gets {rows // model_size} rows, not "
                         "whole groups; use fewer model devices")


def engine_pool_spec(stacked: bool) -> P:
    """Spec of a buffer of the engine's page pool: one layer's ``[kv_heads, num_pages,
    page_size, D]``, or with ``stacked`` all layers' ``[L, kv_heads, ...]``.

    Heads on model, replicated over data: on one host a data>1 mesh is served by one engine
    (and pool) per replica (``jaxinfer.DataParallelEngine``), each on a ``(1, model)`` mesh;
    across hosts every process runs one engine in step, its replicas repeating the work.
    Trailing axes are left implicit (whole), so the spec also fits a quantized pool's
    scales (``jaxinfer.paged_cache.QuantizedPages``: the same axes without head_dim).
    """
    return P(None, MODEL) if stacked else P(MODEL)


def engine_pool_sharding(mesh: Mesh, config: LlamaConfig, stacked: bool) -> NamedSharding:
    """``NamedSharding`` of the engine's pool on ``mesh`` (``engine_pool_spec``).

    Raises ``InputError`` naming the mesh when the K/V heads do not divide the model size
    (they do after ``shard_params``).
    """
    data, model = mesh_sizes(mesh)
    if config.num_kv_heads % model:
        raise InputError(f"the engine cannot shard {config.num_kv_heads} K/V heads over the "
                         f"data={data} x model={model} mesh; load the model with "
                         "load_model(mesh=...) so K/V heads are repeated to fit")
    return NamedSharding(mesh, engine_pool_spec(stacked))
