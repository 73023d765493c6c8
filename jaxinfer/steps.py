"""Pure, jitted prefill and decode steps, and the on-device decode loop.

The whole generation state is one pytree (``DecodeState``); ``decode_loop`` is a
``lax.while_loop`` whose condition is the stop rules, so no host round trip happens per token.
Streaming calls the same loop with a small ``num_steps`` and syncs once per chunk.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import LlamaConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.model import Params, forward, lm_head
from jaxinfer.sampling import SamplingArrays, sample

Backend = Literal["reference", "pallas"]


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries besides the cache. B = batch, N = max new tokens."""

    tokens: jax.Array  # Int['B']: last sampled token, the next step's input
    num_generated: jax.Array  # Int['B']: tokens produced so far (first one comes from prefill)
    done: jax.Array  # Bool['B']: hit a stop token or its max_new_tokens
    out_tokens: jax.Array  # Int['B N']: generated tokens, -1 where none yet
    out_logprobs: jax.Array  # Float['B N']: log-probability of each generated token
    seen: jax.Array  # Bool['B V']: tokens present in the sequence (repetition penalty)
    max_new_tokens: jax.Array  # Int['B']
    stop_ids: jax.Array  # Int['B K']: stop token ids, -1 padded
    sampling: SamplingArrays


@functools.partial(jax.jit, static_argnames=("config", "backend", "dtype", "all_logits"),
                   donate_argnums=(1,))
def prefill(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    config: LlamaConfig,
    backend: Backend = "reference",
    dtype: Any = jnp.bfloat16,
    all_logits: bool = False,
) -> tuple[KVCache, jax.Array]:
    """Process right-padded prompts ``tokens [B, T]`` of ``lengths [B]`` into an empty cache.

    Returns the cache (holding ``lengths`` positions per sequence) and float32 logits: those
    of each prompt's last token ``[B, vocab]``, or with ``all_logits`` of every position
    ``[B, T, vocab]`` (``compute_logits``; generation needs only the last row).
    """
    cache = cache.replace(lengths=lengths.astype(jnp.int32))
    h, cache = forward(params, config, tokens, cache, mode="prefill", backend=backend, dtype=dtype)
    if not all_logits:
        h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, hidden]
    return cache, lm_head(params, h)


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


@functools.partial(jax.jit, donate_argnums=(0,))
def start_state(
    prompt_seen: jax.Array,
    logits: jax.Array,
    sampling: SamplingArrays,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
    out_len: jax.Array,
) -> DecodeState:
    """Sample each sequence's first token from the prefill logits ``[B, V]``.

    ``prompt_seen [B, V]`` marks prompt tokens; ``out_len`` is a ``[N]`` array whose length
    sizes the output buffers.
    """
    b = logits.shape[0]
    n = out_len.shape[0]
    tokens, logprobs = sample(logits, sampling, prompt_seen, jnp.zeros((b,), jnp.int32))
    rows = jnp.arange(b)
    return DecodeState(
        tokens=tokens,
        num_generated=jnp.ones((b,), jnp.int32),
        done=_is_stop(tokens, stop_ids) | (max_new_tokens <= 1),
        out_tokens=jnp.full((b, n), -1, jnp.int32).at[:, 0].set(tokens),
        out_logprobs=jnp.zeros((b, n), jnp.float32).at[:, 0].set(logprobs),
        seen=prompt_seen.at[rows, tokens].set(True),
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        sampling=sampling,
    )


def decode_step_impl(
    params: Params,
    cache: KVCache,
    state: DecodeState,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
) -> tuple[KVCache, DecodeState]:
    """One token for every unfinished sequence; finished ones are left untouched."""
    h, cache = forward(params, config, state.tokens[:, None], cache, mode="decode",
                       backend=backend, dtype=dtype)
    logits = lm_head(params, h[:, 0])  # [B, V] float32
    tokens, logprobs = sample(logits, state.sampling, state.seen, state.num_generated)
    active = ~state.done
    rows = jnp.arange(tokens.shape[0])
    slot = jnp.where(active, state.num_generated, state.out_tokens.shape[1])  # OOB -> dropped
    num_generated = state.num_generated + active
    done = state.done | (active & (_is_stop(tokens, state.stop_ids)
                                   | (num_generated >= state.max_new_tokens)))
    # The input token's K/V were written at position lengths; only active sequences advance.
    cache = cache.replace(lengths=cache.lengths + active)
    state = state.replace(
        tokens=jnp.where(active, tokens, state.tokens),
        num_generated=num_generated,
        done=done,
        out_tokens=state.out_tokens.at[rows, slot].set(tokens, mode="drop"),
        out_logprobs=state.out_logprobs.at[rows, slot].set(logprobs, mode="drop"),
        seen=state.seen.at[rows, tokens].set(state.seen[rows, tokens] | active),
    )
    return cache, state


decode_step = jax.jit(decode_step_impl, static_argnames=("config", "backend", "dtype"),
                      donate_argnums=(1,))
decode_step.__doc__ = "Jitted ``decode_step_impl``: ``(params, cache, state) -> (cache, state)``."


@functools.partial(jax.jit, static_argnames=("config", "backend", "dtype"), donate_argnums=(1, 2))
def decode_loop(
    params: Params,
    cache: KVCache,
    state: DecodeState,
    num_steps: jax.Array,
    *,
    config: LlamaConfig,
    backend: Backend = "reference",
    dtype: Any = jnp.bfloat16,
) -> tuple[KVCache, DecodeState]:
    """Run decode steps on the device until every sequence is done or ``num_steps`` ran.

    The cache is never overrun: callers size it for prompt + ``max_new_tokens``, and a
    sequence whose next position would not fit is treated as done.
    """

    def keep_going(carry: tuple[KVCache, DecodeState, jax.Array]) -> jax.Array:
        cache, state, step = carry
        cache_full = cache.lengths >= cache.max_len
        all_done = jnp.all(state.done | cache_full)
        return (step < num_steps) & ~all_done

    def body(carry: tuple[KVCache, DecodeState, jax.Array]):
        cache, state, step = carry
        state = state.replace(done=state.done | (cache.lengths >= cache.max_len))
        cache, state = decode_step_impl(params, cache, state, config=config, backend=backend,
                                        dtype=dtype)
        return cache, state, step + 1

    cache, state, _ = jax.lax.while_loop(keep_going, body, (cache, state, jnp.int32(0)))
    return cache, state
