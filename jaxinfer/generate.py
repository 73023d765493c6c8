"""The user-facing calls: ``generate``, ``stream``, ``score``, ``score_rolling`` and
``compute_logits``.

Each validates its input into ``requests.Request`` objects on the host and runs them through
the model's one engine (``replicas.engine_for``): the same scheduler, forward pass,
sampling and stop rules serve one prompt or thousands.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import resolve_backend
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError, RequestError
from jaxinfer.model import Params, forward_ragged, lm_head, pool_is_stacked
from jaxinfer.paged_cache import PagePool
from jaxinfer.replicas import engine_for
from jaxinfer.requests import (
    Completion,
    Model,
    Prompt,
    ScorePair,
    ScoreResult,
    encode,
    find_stop,
    make_requests,
    make_score_requests,
)
from jaxinfer.runner import step_program
from jaxinfer.sampling import SamplingParams, is_int
from sharding.placement import on_mesh, put_replicated, to_host

_LOGITS_BUCKET = 16  # compute_logits pads its sequence to a power of two >= this


def generate(
    model: Model,
    prompts: Prompt | Sequence[Prompt],
    *,
    chat: bool = False,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    **sampling_kwargs: Any,
) -> list[Completion]:
    """Generate completions for one prompt or many.

    Args:
      model: from ``jaxinfer.load_model``.
      prompts: a string, a list of token ids, a chat (list of ``{"role", "content"}`` dicts,
        rendered with the model's chat template), or a list of any of these.
      chat: wrap string prompts in the model's chat template as a user turn.
      sampling: one ``SamplingParams`` for all prompts or one per prompt; alternatively pass
        its fields as keywords (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``stop_token_ids``,
        ``logprobs``).

    All prompts go to the model's engine at once (continuous batching over a paged KV
    cache); each result equals the same request run alone.

    Returns:
      One ``Completion`` per prompt, in order. A request that failed while it ran (its
      output handling raised, or the device ran out of memory in its step) has
      ``finish_reason == "error"`` and says why in ``error``; the others are unaffected.
    """
    requests = make_requests(model, prompts, chat, sampling, sampling_kwargs)
    return run_requests(engine_for(model), requests)


def run_requests(engine: Any, requests: Sequence[Any]) -> list[Any]:
    """Run validated requests through ``engine`` and return their results in order; if
    anything interrupts the run (``Ctrl-C``, an error), they are cancelled first, so the
    engine holds nothing of them and serves the next call."""
    ids = [engine.add_request(r) for r in requests]
    try:
        return engine.run(ids)
    except BaseException:
        for i in ids:
            engine.cancel(i)
            engine.forget(i)
        raise


def stream_tokens(
    model: Model,
    prompt: Prompt,
    *,
    chat: bool = False,
    chunk_steps: int = 8,
    **sampling_kwargs: Any,
) -> Iterator[list[int]]:
    """Yield lists of new token ids for one prompt as the device produces them.

    ``chunk_steps`` caps the tokens decoded per device round trip while this stream runs.
    Raises ``RequestError`` at the end if the request failed while it ran.
    """
    if chunk_steps < 1:
        raise InputError(f"chunk_steps={chunk_steps} must be >= 1")
    requests = make_requests(model, prompt, chat, None, sampling_kwargs)
    if len(requests) != 1:
        raise InputError(f"stream takes one prompt, got {len(requests)}; use generate() for "
                         "several")
    engine = engine_for(model)
    rid = engine.add_request(requests[0])
    done = False
    result = None
    try:
        while not done:
            for i, new, finished in engine.step(max_decode_steps=chunk_steps):
                if i == rid:
                    done = finished
                    if new:
                        yield new
    finally:  # also when the consumer stops early (the generator is closed) or is interrupted
        if done:
            result = engine.result(rid)  # hand the result over, then let the engine forget it
        else:
            engine.cancel(rid)
        engine.forget(rid)
    if result is not None and result.error is not None:
        raise RequestError(result.error)


def stream(
    model: Model,
    prompt: Prompt,
    *,
    chat: bool = False,
    chunk_steps: int = 8,
    **sampling_kwargs: Any,
) -> Iterator[str]:
    """Yield text pieces of one completion as they are decoded.

    ``prompt`` is a string, token ids, or a whole chat (list of ``{"role", "content"}``
    dicts) for multi-turn use: append each reply as an assistant message and call again.
    Pieces are only emitted once they are final text (a multi-byte character split over
    several tokens arrives whole), and stop strings are never emitted.
    """
    if model.tokenizer is None:
        raise InputError("stream() needs a tokenizer; use stream_tokens() for token ids")
    text = TextStream(model, SamplingParams.from_kwargs(**sampling_kwargs).stop)
    pieces = stream_tokens(model, prompt, chat=chat, chunk_steps=chunk_steps, **sampling_kwargs)
    try:
        for new in itertools.chain(pieces, [None]):  # None: the end, nothing more held back
            piece = text.add(new)
            if piece:
                yield piece
    finally:  # closed early: the request is cancelled now, not when garbage collected
        pieces.close()


class TextStream:
    """The final text of one generation, in pieces, as its tokens arrive (``stream`` and the
    server's streamed responses).

    Tokens are detokenized incrementally (``Tokenizer.incremental_decoder``: a short window
    per token, so a long output costs linear time); ``add`` returns the text that became
    final: an incomplete character and anything that could start a stop string are held
    back until more tokens (or the end, ``add(None)``) decide them; a stop string and what
    follows it are never returned. The pieces add up to the request's ``Completion.text``.
    """

    def __init__(self, model: Model, stops: Sequence[str]) -> None:
        if model.tokenizer is None:
            raise InputError("streaming text needs a tokenizer; stream token ids instead")
        self._decoder = model.tokenizer.incremental_decoder()
        self._stops = tuple(stops)
        self._hold = max((len(s) - 1 for s in self._stops), default=0)
        self._decoded = ""  # text the decoder made final
        self._stopped = False  # a stop string was found: nothing more is returned
        self.text = ""  # returned so far

    def add(self, new: Sequence[int] | None) -> str:
        """Take newly generated token ids (``None`` at the end); return the new final text."""
        if self._stopped:
            return ""
        self._decoded += (self._decoder.add_many(new) if new is not None
                          else self._decoder.flush())
        text = self._decoded
        # A stop string ending in the new text starts at most len(stop) - 1 characters
        # before it, inside the held-back tail.
        cut = find_stop(text[len(self.text):], self._stops)
        if cut >= 0:
            text, self._stopped = text[: len(self.text) + cut], True
        elif new is not None:
            text = text[: max(len(self.text), len(text) - self._hold)]
        piece = text[len(self.text):]
        self.text = text
        return piece


def score(model: Model, requests: ScorePair | Sequence[ScorePair]) -> list[ScoreResult]:
    """Log-likelihood of continuations given contexts, batched through the engine.

    Args:
      requests: ``(context, continuation)`` pairs (or one pair); each side a string or token
        ids. A string context is encoded with BOS, a string continuation without.

    Returns one ``ScoreResult`` per pair, in order: ``token_logprobs``, ``logprob`` (their
    sum), ``greedy`` (every continuation token is the argmax) and ``cached_tokens`` (context
    tokens served by the prefix cache: continuations sharing a context compute it once).
    """
    return run_requests(engine_for(model), make_score_requests(model, requests))


def score_rolling(model: Model, text: str | Sequence[int], *, max_length: int | None = None,
                  stride: int | None = None) -> ScoreResult:
    """Log-likelihood of a whole text, longer than the context if need be (perplexity).

    The text is cut into windows of ``max_length`` tokens (default: the model's context)
    that advance by ``stride`` tokens (default ``max_length // 2``); each window scores only
    its new tokens with the rest as context, and all windows run as one batch. The first
    token has no context and is not scored. ``exp(-logprob / len(token_logprobs))`` is the
    perplexity.
    """
    context = model.config.max_position_embeddings
    for name, value in (("max_length", max_length), ("stride", stride)):
        if value is not None and not is_int(value):
            raise InputError(f"{name}={value!r} must be a whole number of tokens or None")
    max_length = context if max_length is None else int(max_length)
    if not 1 < max_length <= context:
        raise InputError(f"max_length={max_length} must be in [2, {context}]")
    stride = max(1, max_length // 2) if stride is None else int(stride)
    if not 1 <= stride < max_length:
        raise InputError(f"stride={stride} must be in [1, max_length={max_length})")
    ids = encode(model, text)
    if len(ids) < 2:
        raise InputError("score_rolling needs at least 2 tokens; nothing to score")
    pairs, scored = [], 1
    while scored < len(ids):
        end = min(len(ids), max_length if scored == 1 else scored + stride)
        begin = max(0, end - max_length)
        pairs.append((ids[begin:scored], ids[scored:end]))
        scored = end
    parts = score(model, pairs)
    lps = [x for p in parts for x in p.token_logprobs]
    return ScoreResult(token_logprobs=lps, logprob=float(np.sum(lps, dtype=np.float64)),
                       greedy=all(p.greedy for p in parts), context_token_ids=ids[:1],
                       continuation_token_ids=ids[1:],
                       cached_tokens=sum(p.cached_tokens for p in parts))


@step_program(lambda tokens, length, **_: tokens.shape[0],
              static_argnames=("config", "backend", "dtype", "page_size", "deterministic",
                               "kv_cache_dtype"))
def _sequence_logits(params: Params, tokens: jax.Array, length: jax.Array, *,
                     config: LlamaConfig, backend: str, dtype: Any, page_size: int,
                     deterministic: bool, kv_cache_dtype: str | None) -> jax.Array:
    """Float32 logits ``[T, V]`` of one sequence ``tokens [T]`` (``length`` real tokens),
    through the engine's forward pass over a private pool of ``T / page_size`` pages (stored
    as the model's engine stores K/V: ``kv_cache_dtype``)."""
    t = tokens.shape[0]
    pages = t // page_size
    pool = PagePool.create(config, pages, page_size, dtype,
                           stacked=pool_is_stacked(params, backend),
                           kv_cache_dtype=kv_cache_dtype)
    pos = jnp.arange(t, dtype=jnp.int32)
    h, _, _ = forward_ragged(params, config, tokens, pos, pool.k, pool.v,
                             jnp.where(pos < length, pos // page_size, pages), pos % page_size,
                             jnp.arange(pages, dtype=jnp.int32)[None], length[None],
                             jnp.stack([0, length]).astype(jnp.int32), backend=backend,
                             dtype=dtype, deterministic=deterministic)
    return lm_head(params, h, deterministic)


def compute_logits(model: Model, token_ids: Sequence[int]) -> np.ndarray:
    """Float32 logits ``[len(token_ids), vocab]`` of one sequence (the engine's forward pass,
    K/V stored as ``model.kv_cache_dtype`` says)."""
    if isinstance(token_ids, str):
        raise InputError("compute_logits takes token ids; encode text with model.tokenizer")
    ids = encode(model, token_ids)
    cfg = model.config
    if len(ids) > cfg.max_position_embeddings:
        raise InputError(f"{len(ids)} tokens exceed the model's context of "
                         f"{cfg.max_position_embeddings}; shorten the input")
    length = max(_LOGITS_BUCKET, 1 << (len(ids) - 1).bit_length())
    tokens = np.zeros(length, np.int32)
    tokens[: len(ids)] = ids
    with on_mesh(model.mesh):
        logits = _sequence_logits(model.params, *put_replicated(model.mesh, (
            tokens, np.int32(len(ids)))), config=cfg,
            backend=resolve_backend(model.backend, cfg.head_dim, model.deterministic),
            dtype=model.dtype,
            page_size=_LOGITS_BUCKET, deterministic=model.deterministic,
            kv_cache_dtype=model.kv_cache_dtype)
    return to_host(logits)[: len(ids)].astype(np.float32)
