"""Where a request becomes tokens: ``generate``, ``stream`` and ``compute_logits``.

A batch of prompts is right-padded to a bucketed length, prefilled into a fresh preallocated
cache, and decoded by the on-device loop in ``jaxinfer.steps``. Shapes (batch, prompt length,
cache length, output length) are rounded up to powers of two so that a long run of different
requests compiles a bounded number of programs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import resolve_backend
from jaxinfer.errors import InputError
from jaxinfer.model import params_layout
from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.steps import decode_loop, prefill, start_state
from sharding.placement import (
    new_cache,
    on_mesh,
    put_batch,
    put_batch_from_primary,
    put_replicated,
    round_batch,
    to_host,
)

Messages = Sequence[dict[str, Any]]  # a chat: [{"role": "user", "content": "..."}, ...]
Prompt = str | Sequence[int] | Messages
_MIN_PROMPT_BUCKET = 16
_MIN_CACHE_BUCKET = 64
_STOP_STRING_CHUNK = 16  # decode steps between host-side stop-string checks


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree, tokenizer and compute settings.

    ``params`` are in an execution layout (``jaxinfer.model.LAYOUTS``): the stored, stacked
    layout of ``model.param_shapes``, or one made by ``model.prepare_params`` (e.g. the
    ``"fast"`` layout that ``load_model`` picks on a single GPU). Every entry point
    (``generate``, ``stream``, ``compute_logits``, ``Engine``) runs either.
    """

    config: Any  # LlamaConfig
    params: dict[str, Any]
    tokenizer: Any  # jaxinfer.tokenizer.Tokenizer, or None for token-id-only use
    dtype: Any = jnp.bfloat16
    name: str = ""
    backend: Literal["reference", "pallas", "auto"] = "auto"
    max_batch: int = 64
    # jax.sharding.Mesh from sharding.make_mesh when the params are sharded (load_model(mesh=)):
    # caches and inputs are then created on it, batch split over "data". None = one device.
    mesh: Any = None

    @property
    def layout(self) -> str:
        """The execution layout of ``params``: ``"stacked"``, ``"fast"`` or ``"custom"``."""
        return params_layout(self.params)


@dataclasses.dataclass
class Completion:
    """The result of one request.

    ``token_ids`` are the generated tokens (without the stop token or the tokens of a stop
    string's tail); ``logprobs`` (when asked for) align with them. Times are in seconds.
    """

    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    prompt_token_ids: list[int]
    time_to_first_token: float
    time_per_output_token: float
    logprobs: list[float] | None = None


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: tuple[int, ...]


def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _is_messages(prompt: Any) -> bool:
    return (isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0
            and all(isinstance(m, dict) for m in prompt))


def encode_chat(model: Model, messages: Messages) -> list[int]:
    """Token ids of a whole conversation rendered with the model's chat template.

    The template ends with the assistant's generation prompt, so the ids are ready to be
    continued by ``generate``/``stream``; multi-turn chat appends each reply as an
    ``{"role": "assistant", ...}`` message and the next user turn, then re-encodes.
    """
    if model.tokenizer is None:
        raise InputError("this model has no tokenizer; chat messages need one")
    text = model.tokenizer.apply_chat_template(list(messages))
    return model.tokenizer.encode(text, add_bos=False)


def _encode(model: Model, prompt: Prompt, chat: bool) -> list[int]:
    if _is_messages(prompt):
        return encode_chat(model, prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("prompt is empty; pass a non-empty string or token ids")
        if model.tokenizer is None:
            raise InputError("this model has no tokenizer; pass prompts as lists of token ids")
        if chat:
            return encode_chat(model, [{"role": "user", "content": prompt}])
        return model.tokenizer.encode(prompt, add_bos=True)
    ids = list(prompt)
    if not ids:
        raise InputError("prompt is empty; pass a non-empty string or token ids")
    vocab = model.config.vocab_size
    bad = [t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab]
    if bad:
        raise InputError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or _is_messages(prompts):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InputError("no prompts given; pass a string, token ids, or a list of them")
    if all(isinstance(p, int | np.integer) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _make_requests(
    model: Model,
    prompts: Prompt | Sequence[Prompt],
    chat: bool,
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    kwargs: dict[str, Any],
) -> list[_Request]:
    """Validate everything on the host before any device work."""
    plist = _normalize_prompts(prompts)
    if sampling is None:
        sps = [SamplingParams.from_kwargs(**kwargs)] * len(plist)
    elif kwargs:
        raise InputError(f"pass sampling options either as sampling=... or as keywords, not "
                         f"both (got {sorted(kwargs)})")
    elif isinstance(sampling, SamplingParams):
        sps = [sampling] * len(plist)
    else:
        sps = list(sampling)
        if len(sps) != len(plist):
            raise InputError(f"got {len(sps)} SamplingParams for {len(plist)} prompts; "
                             "give one per prompt or a single one")
    context = model.config.max_position_embeddings
    eos = tuple(model.tokenizer.eos_ids) if model.tokenizer is not None else tuple(
        model.config.eos_token_ids)
    requests = []
    for i, (p, sp) in enumerate(zip(plist, sps, strict=True)):
        ids = _encode(model, p, chat)
        if len(ids) >= context:
            raise InputError(f"prompt {i} has {len(ids)} tokens but the model's context is "
                             f"{context}; shorten the prompt")
        if len(ids) + sp.max_new_tokens > context:
            raise InputError(f"prompt {i} has {len(ids)} tokens and max_new_tokens="
                             f"{sp.max_new_tokens} would overflow the model's context of "
                             f"{context}; lower max_new_tokens to at most {context - len(ids)}")
        if sp.stop and model.tokenizer is None:
            raise InputError("stop strings need a tokenizer; use stop_token_ids instead")
        requests.append(_Request(ids, sp, tuple(dict.fromkeys(eos + sp.stop_token_ids))))
    return requests


_COMPILED: set[tuple[Any, ...]] = set()


def _announce_compile(what: str, key: tuple[Any, ...], detail: str) -> None:
    """Say on stderr, once per shape bucket, that XLA is about to compile a new program.

    The first call with a new (batch, length) bucket blocks for seconds while XLA compiles;
    without a word the user cannot tell that from a hang. ``key`` holds everything that makes
    jit recompile (model config, backend, dtype, shapes); later calls are silent.
    """
    full = (what, *key)
    if full not in _COMPILED:
        _COMPILED.add(full)
        print(f"jaxinfer: compiling {what} for {detail} (once per shape) …", file=sys.stderr,
              flush=True)


def _find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@dataclasses.dataclass
class _Progress:
    """Host view of one sequence while its batch decodes."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    reason: Literal["stop", "length"] = "length"
    text: str | None = None
    t_first: float = 0.0
    t_last: float = 0.0


def _run_batch(
    model: Model, requests: Sequence[_Request], chunk_steps: int | None
) -> Iterator[list[_Progress]]:
    """Generate for up to ``model.max_batch`` requests; yield progress after every chunk.

    ``chunk_steps=None`` runs the whole decode in one device loop unless a request has stop
    strings, which are checked on the host every few steps.
    """
    cfg = model.config
    backend = resolve_backend(model.backend, cfg.head_dim)
    n = len(requests)
    batch = round_batch(model.mesh, _pow2_at_least(n, 1))
    longest = max(len(r.prompt_ids) for r in requests)
    needed = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    cache_len = min(_pow2_at_least(needed, _MIN_CACHE_BUCKET), cfg.max_position_embeddings)
    prompt_len = min(_pow2_at_least(longest, _MIN_PROMPT_BUCKET), cache_len)
    out_len = _pow2_at_least(max(r.sampling.max_new_tokens for r in requests), 1)
    num_stop = _pow2_at_least(max(len(r.stop_ids) for r in requests), 4)

    tokens = np.zeros((batch, prompt_len), np.int32)
    lengths = np.ones((batch,), np.int32)
    seen = np.zeros((batch, cfg.vocab_size), bool)
    stop_ids = np.full((batch, num_stop), -1, np.int32)
    max_new = np.ones((batch,), np.int32)  # padding rows finish after their first token
    for i, r in enumerate(requests):
        tokens[i, : len(r.prompt_ids)] = r.prompt_ids
        lengths[i] = len(r.prompt_ids)
        seen[i, r.prompt_ids] = True
        stop_ids[i, : len(r.stop_ids)] = r.stop_ids
        max_new[i] = r.sampling.max_new_tokens
    sps = [r.sampling for r in requests] + [SamplingParams(seed=0)] * (batch - n)

    static = (cfg, backend, jnp.dtype(model.dtype).name, model.layout)
    _announce_compile("prefill", (*static, batch, prompt_len, cache_len),
                      f"batch {batch}, prompt bucket {prompt_len}, cache {cache_len}")
    _announce_compile("decode loop", (*static, batch, cache_len, out_len, num_stop),
                      f"batch {batch}, cache {cache_len}, up to {out_len} new tokens")
    t_start = time.perf_counter()
    mesh = model.mesh
    cache = new_cache(mesh, cfg, batch, cache_len, model.dtype)
    with on_mesh(mesh):
        cache, logits = prefill(model.params, cache, *put_batch(mesh, (tokens, lengths)),
                                config=cfg, backend=backend, dtype=model.dtype)
        # Unseeded requests draw keys on the host; multi-host runs must share one draw.
        sampling_arrays = put_batch_from_primary(mesh, SamplingArrays.from_params(sps))
        state = start_state(*put_batch(mesh, (seen,)), logits, sampling_arrays,
                            *put_batch(mesh, (max_new, stop_ids)),
                            put_replicated(mesh, np.zeros((out_len,), np.float32)))
    progress = [_Progress() for _ in requests]
    has_stop_strings = any(r.sampling.stop for r in requests)
    steps = chunk_steps or (_STOP_STRING_CHUNK if has_stop_strings else out_len)

    while True:
        out_tokens, out_lp, num_gen, done = to_host(
            (state.out_tokens, state.out_logprobs, state.num_generated, state.done))
        now = time.perf_counter()
        stopped_by_string = _update_progress(model, requests, progress, out_tokens, out_lp,
                                             num_gen, done, now - t_start)
        if stopped_by_string.any():
            state = state.replace(done=state.done | put_batch(
                mesh, np.pad(stopped_by_string, (0, batch - n))))
        yield progress
        if all(p.finished for p in progress):
            return
        with on_mesh(mesh):
            cache, state = decode_loop(model.params, cache, state,
                                       put_replicated(mesh, np.int32(steps)), config=cfg,
                                       backend=backend, dtype=model.dtype)


def _update_progress(
    model: Model,
    requests: Sequence[_Request],
    progress: list[_Progress],
    out_tokens: np.ndarray,
    out_lp: np.ndarray,
    num_gen: np.ndarray,
    done: np.ndarray,
    elapsed: float,
) -> np.ndarray:
    """Copy new tokens to the host view; return which sequences a stop string just ended."""
    stopped = np.zeros(len(requests), bool)
    for i, (r, p) in enumerate(zip(requests, progress, strict=True)):
        if p.finished:
            continue
        count = int(num_gen[i])
        if count and not p.tokens:
            p.t_first = elapsed
        if count > len(p.tokens):
            p.t_last = elapsed
        p.tokens = out_tokens[i, :count].tolist()
        p.logprobs = out_lp[i, :count].tolist()
        if p.tokens and p.tokens[-1] in r.stop_ids:
            p.tokens.pop()
            p.logprobs.pop()
            p.finished, p.reason = True, "stop"
        elif done[i]:
            p.finished, p.reason = True, "length"
        if r.sampling.stop and _trim_at_stop_string(model, r, p):
            stopped[i] = not p.finished
            p.finished, p.reason = True, "stop"
    return stopped


def _trim_at_stop_string(model: Model, r: _Request, p: _Progress) -> bool:
    """If a stop string appears, cut tokens after the one completing it and the text before it."""
    text = model.tokenizer.decode(p.tokens)
    if _find_stop(text, r.sampling.stop) < 0:
        return False
    for k in range(1, len(p.tokens) + 1):
        prefix = model.tokenizer.decode(p.tokens[:k])
        cut = _find_stop(prefix, r.sampling.stop)
        if cut >= 0:
            p.tokens, p.logprobs = p.tokens[:k], p.logprobs[:k]
            p.text = prefix[:cut]
            return True
    return False


def _completion(model: Model, r: _Request, p: _Progress) -> Completion:
    text = p.text
    if text is None:
        text = model.tokenizer.decode(p.tokens) if model.tokenizer is not None else ""
    n = len(p.tokens)
    return Completion(
        text=text,
        token_ids=p.tokens,
        finish_reason=p.reason,
        prompt_token_ids=r.prompt_ids,
        time_to_first_token=p.t_first,
        time_per_output_token=(p.t_last - p.t_first) / (n - 1) if n > 1 else 0.0,
        logprobs=p.logprobs if r.sampling.logprobs else None,
    )


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

    More prompts than ``model.max_batch`` are served by ``jaxinfer.Engine`` (continuous
    batching over a paged KV cache); the tokens are the same as in static batches.

    Returns:
      One ``Completion`` per prompt, in order.
    """
    requests = _make_requests(model, prompts, chat, sampling, sampling_kwargs)
    if len(requests) > model.max_batch:
        # More prompts than one static batch: the continuous-batching engine refills a slot
        # as soon as its request ends instead of waiting for each batch's longest request.
        from jaxinfer.engine import generate_with_engine  # local: engine imports this module

        return generate_with_engine(model, requests)
    results: list[Completion] = []
    for start in range(0, len(requests), model.max_batch):
        group = requests[start: start + model.max_batch]
        *_, progress = _run_batch(model, group, None)
        results.extend(_completion(model, r, p) for r, p in zip(group, progress, strict=True))
    return results


def stream_tokens(
    model: Model,
    prompt: Prompt,
    *,
    chat: bool = False,
    chunk_steps: int = 8,
    **sampling_kwargs: Any,
) -> Iterator[list[int]]:
    """Yield lists of new token ids for one prompt as the device produces them."""
    (request,) = _make_requests(model, prompt, chat, None, sampling_kwargs)
    sent = 0
    for (p,) in _run_batch(model, [request], chunk_steps):
        if len(p.tokens) > sent:
            yield p.tokens[sent:]
            sent = len(p.tokens)


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
    (request,) = _make_requests(model, prompt, chat, None, sampling_kwargs)
    emitted = ""
    for (p,) in _run_batch(model, [request], chunk_steps):
        text = p.text if p.text is not None else model.tokenizer.decode(p.tokens)
        if not p.finished:
            # Hold back an incomplete character and anything that could start a stop string.
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in request.sampling.stop), default=0)
            text = text[: max(len(emitted), len(text) - hold)]
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted):]
            emitted = text


def compute_logits(model: Model, token_ids: Sequence[int]) -> np.ndarray:
    """Float32 logits ``[len(token_ids), vocab]`` of one sequence through the prefill path."""
    if isinstance(token_ids, str):
        raise InputError("compute_logits takes token ids; encode text with model.tokenizer")
    ids = _encode(model, token_ids, chat=False)
    cfg = model.config
    if len(ids) > cfg.max_position_embeddings:
        raise InputError(f"{len(ids)} tokens exceed the model's context of "
                         f"{cfg.max_position_embeddings}; shorten the input")
    length = min(_pow2_at_least(len(ids), _MIN_PROMPT_BUCKET), cfg.max_position_embeddings)
    rows = round_batch(model.mesh, 1)  # one row per data replica; extra rows are padding
    tokens = np.zeros((rows, length), np.int32)
    tokens[0, : len(ids)] = ids
    lengths = np.ones((rows,), np.int32)
    lengths[0] = len(ids)
    cache = new_cache(model.mesh, cfg, rows, length, model.dtype)
    with on_mesh(model.mesh):
        _, logits = prefill(model.params, cache, *put_batch(model.mesh, (tokens, lengths)),
                            config=cfg, backend=resolve_backend(model.backend, cfg.head_dim),
                            dtype=model.dtype, all_logits=True)
    return to_host(logits)[0, : len(ids)].astype(np.float32)
