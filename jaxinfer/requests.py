"""The request lifecycle on the host: validation, seeds, stop rules and completion building.

Every entry point (``generate``, ``stream``, ``chat``, ``score``, ``batch_eval``, ``Engine``)
turns its input into ``Request`` objects here, before any device work, and every result is
built here from the tokens the engine produced. Nothing in this module touches the device.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import InputError
from jaxinfer.model import params_layout
from jaxinfer.quantize import param_bytes
from jaxinfer.sampling import SamplingParams, prng_key_data
from jaxinfer.structured import ResponseFormat, TokenMatcher, compile_format

Messages = Sequence[dict[str, Any]]  # a chat: [{"role": "user", "content": "..."}, ...]
Prompt = str | Sequence[int] | Messages


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree, tokenizer and compute settings.

    ``params`` are in an execution layout (``jaxinfer.model.LAYOUTS``): the stored, stacked
    layout of ``model.param_shapes``, or one made by ``model.prepare_params`` (e.g. the
    ``"fast"`` layout that ``load_model`` picks on a single GPU). Every entry point runs
    either, through one ``jaxinfer.Engine`` per model (``engine_for``). On one GPU an int4 /
    int8 ``lm_head`` may hold more columns than the vocabulary (``model.one_device_layout``
    pads it for the GEMV's wide tile): the vocabulary is ``config.vocab_size``.
    """

    config: Any  # LlamaConfig
    params: dict[str, Any]
    tokenizer: Any  # jaxinfer.tokenizer.Tokenizer, or None for token-id-only use
    dtype: Any = jnp.bfloat16
    name: str = ""
    backend: Literal["reference", "pallas", "auto"] = "auto"
    # Most sequences the engine runs at once; None sizes it from the KV pool (Engine docs).
    max_batch: int | None = None
    # jax.sharding.Mesh from sharding.make_mesh when the params are sharded (load_model(mesh=)).
    mesh: Any = None
    # Batch-invariant kernels: a request's tokens do not depend on the batch (load_model).
    deterministic: bool = False
    # K/V page pool storage: None (the model's dtype), "int8" or "fp8" (load_model).
    kv_cache_dtype: str | None = None
    # The jaxinfer.Engine serving this model's requests, made on first use (engine_for).
    engine: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def param_bytes(self) -> int:
        """Bytes the weights take on the devices, per copy (int8 weights count as int8)."""
        return param_bytes(self.params)

    @property
    def layout(self) -> str:
        """The execution layout of ``params``: ``"stacked"``, ``"fast"`` or ``"custom"``."""
        return params_layout(self.params)


@dataclasses.dataclass
class Completion:
    """The result of one generation request.

    ``token_ids`` are the generated tokens (without the stop token or the tokens of a stop
    string's tail); ``logprobs`` and ``top_logprobs`` (when asked for) align with them:
    ``top_logprobs[i]`` maps the ``SamplingParams.top_logprobs`` most likely tokens at
    position ``i`` to their log-probabilities (most likely first). With a
    ``response_format``, ``finish_reason`` ``"stop"`` means the output completed its grammar
    (``"length"``: it was cut by ``max_new_tokens``). Times are in seconds from
    the request's submission. ``finish_reason`` ``"error"``: the request failed while it ran
    (``error`` says why); the tokens are those it had before the failure.
    ``draft_tokens`` counts the tokens proposed for it by speculative decoding and
    ``accepted_tokens`` those that verification accepted.
    """

    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "error"]
    prompt_token_ids: list[int]
    time_to_first_token: float
    time_per_output_token: float
    logprobs: list[float] | None = None
    error: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclasses.dataclass
class ScoreResult:
    """Log-likelihood of one continuation given its context.

    ``token_logprobs[i]`` is ``log p(continuation[i] | context, continuation[:i])`` under the
    model's raw distribution; ``logprob`` is their sum; ``greedy`` says whether every
    continuation token is the argmax at its position; ``cached_tokens`` counts context
    tokens whose K/V came from the prefix cache instead of being computed. ``error`` is set
    (and the log-probabilities are NaN) when the request failed while it ran.
    """

    token_logprobs: list[float]
    logprob: float
    greedy: bool
    context_token_ids: list[int]
    continuation_token_ids: list[int]
    cached_tokens: int
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """One validated request.

    A generation request has ``sampling``; a scoring request has ``num_scored`` > 0: its
    last ``num_scored`` token ids are the continuation whose log-probabilities are wanted,
    and nothing is generated. ``grammar`` is the compiled ``sampling.response_format``
    (``structured.compile_format``), None when the output is unconstrained.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    num_scored: int = 0
    grammar: str | None = None

    @property
    def is_score(self) -> bool:
        """Whether this request scores a continuation instead of generating."""
        return self.num_scored > 0


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a chat: a non-empty list of ``{"role", "content"}`` dicts."""
    return (isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0
            and all(isinstance(m, dict) for m in prompt))


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Messages) -> None:
    """Raise ``InputError`` naming the first message that is not a ``{"role", "content"}`` dict
    with a known role and string content."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"chat message {i} is a {type(m).__name__}; each message is a "
                             "{'role': ..., 'content': ...} dict")
        if m.get("role") not in CHAT_ROLES:
            raise InputError(f"chat message {i} has role {m.get('role')!r}; use one of "
                             f"{', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InputError(f"chat message {i} has content {m.get('content')!r}; the content "
                             "must be a string")


def encode_chat(model: Model, messages: Messages) -> list[int]:
    """Token ids of a whole conversation rendered with the model's chat template.

    The template ends with the assistant's generation prompt, so the ids are ready to be
    continued by ``generate``/``stream``; multi-turn chat appends each reply as an
    ``{"role": "assistant", ...}`` message and the next user turn, then re-encodes.
    """
    if isinstance(messages, str | dict) or not isinstance(messages, Sequence) or not messages:
        raise InputError("a chat is a non-empty list of {'role', 'content'} dicts")
    check_messages(messages)
    if model.tokenizer is None:
        raise InputError("this model has no tokenizer; chat messages need one")
    text = model.tokenizer.apply_chat_template(list(messages))
    return model.tokenizer.encode(text, add_bos=False)


def encode(model: Model, prompt: Prompt, *, chat: bool = False, add_bos: bool = True
           ) -> list[int]:
    """Token ids of one prompt: a string, token ids (checked against the vocabulary) or a chat."""
    if is_messages(prompt):
        return encode_chat(model, prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("prompt is empty; pass a non-empty string or token ids")
        if model.tokenizer is None:
            raise InputError("this model has no tokenizer; pass prompts as lists of token ids")
        if chat:
            return encode_chat(model, [{"role": "user", "content": prompt}])
        return model.tokenizer.encode(prompt, add_bos=add_bos)
    if isinstance(prompt, dict):
        raise InputError("a chat is a list of {'role', 'content'} dicts, not one dict")
    if not isinstance(prompt, Sequence | np.ndarray):
        raise InputError(f"a prompt is a string, a list of token ids or a chat, not "
                         f"{type(prompt).__name__} ({prompt!r:.40})")
    ids = list(prompt)
    if not ids:
        raise InputError("prompt is empty; pass a non-empty string or token ids")
    if isinstance(ids[0], dict):
        check_messages(ids)  # a chat with a non-dict message: name that message
    vocab = model.config.vocab_size
    # The usual case, plain ints in range, checked at C speed (with normalize_prompts',
    # make_requests of a 300-id prompt: 34 us, was 178); anything else finds its bad id below.
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:
        return ids
    bad = [t for t in ids if not isinstance(t, int | np.integer) or isinstance(t, bool | np.bool_)
           or not 0 <= t < vocab]
    if bad:
        raise InputError(f"prompt token id {bad[0]!r:.40} is not an integer in the vocabulary "
                         f"[0, {vocab})")
    return [int(t) for t in ids]


def _encode_at(model: Model, prompt: Prompt, where: str, **kwargs: Any) -> list[int]:
    """``encode``, with ``where`` (e.g. ``"prompt 3"``) leading any error message."""
    try:
        return encode(model, prompt, **kwargs)
    except InputError as e:
        if not where:
            raise
        raise InputError(f"{where}: {e}") from None


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of prompts, as a list (a flat list of ints is one prompt)."""
    if isinstance(prompts, str) or is_messages(prompts):
        return [prompts]
    if isinstance(prompts, dict):
        raise InputError("a chat is a list of {'role', 'content'} dicts, not one dict")
    if not isinstance(prompts, Iterable):
        raise InputError(f"prompts must be a string, token ids, a chat or a list of them, not "
                         f"{type(prompts).__name__} ({prompts!r:.40})")
    prompts = list(prompts)
    if not prompts:
        raise InputError("no prompts given; pass a string, token ids, or a list of them")
    if isinstance(prompts[0], dict):
        return [prompts]  # a chat with a bad message: encode names it
    # One prompt given as token ids (plain ints: checked at C speed, see encode).
    if set(map(type, prompts)) == {int} or all(isinstance(p, int | np.integer) for p in prompts):
        return [prompts]
    return prompts


def resolve_seed(sp: SamplingParams) -> SamplingParams:
    """``sp`` with a concrete seed: drawn once here, on process 0 when there are several.

    A request keeps this seed through preemption and recompute, so its tokens depend only on
    the seed, its token index and its inputs. With several processes (multi-host, started
    with ``jax.distributed.initialize``: ``sharding.multihost.initialize``) the draw is
    broadcast, so every process samples the same tokens.
    """
    if sp.seed is not None:
        return sp
    seed = secrets.randbits(63)
    # Several processes exist only after jax.distributed.initialize; asking process_count
    # first would start a backend here, in a process that may not own a device (the HTTP
    # process of ``jaxinfer serve``, batch_eval's with replica processes).
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # As two uint32 halves: without 64-bit types an int64 would be cut to int32.
        hi, lo = multihost_utils.broadcast_one_to_all(prng_key_data(seed))
        seed = (int(hi) << 32) | int(lo)
    return dataclasses.replace(sp, seed=seed)


def _eos_ids(model: Model) -> tuple[int, ...]:
    if model.tokenizer is not None:
        return tuple(model.tokenizer.eos_ids)
    return tuple(model.config.eos_token_ids)


def make_requests(
    model: Model,
    prompts: Prompt | Sequence[Prompt],
    chat: bool,
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    kwargs: dict[str, Any],
) -> list[Request]:
    """Validate generation requests on the host, before any device work; seeds resolved."""
    plist = normalize_prompts(prompts)
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
    eos = _eos_ids(model)
    grammars: dict[ResponseFormat, str] = {}  # each distinct format compiled once
    requests = []
    for i, (p, sp) in enumerate(zip(plist, sps, strict=True)):
        if not isinstance(sp, SamplingParams):
            raise InputError(f"sampling[{i}] is a {type(sp).__name__}, not a SamplingParams")
        ids = _encode_at(model, p, f"prompt {i}" if len(plist) > 1 else "", chat=chat)
        if len(ids) >= context:
            raise InputError(f"prompt {i} has {len(ids)} tokens but the model's context is "
                             f"{context}; shorten the prompt")
        if len(ids) + sp.max_new_tokens > context:
            raise InputError(f"prompt {i} has {len(ids)} tokens and max_new_tokens="
                             f"{sp.max_new_tokens} would overflow the model's context of "
                             f"{context}; lower max_new_tokens to at most {context - len(ids)}")
        if sp.stop and model.tokenizer is None:
            raise InputError("stop strings need a tokenizer; use stop_token_ids instead")
        outside = [t for t in sp.stop_token_ids if t >= model.config.vocab_size]
        if outside:
            raise InputError(f"stop_token_ids {outside} are outside the model's vocabulary of "
                             f"{model.config.vocab_size} tokens, so they could never stop it")
        stops = tuple(dict.fromkeys((() if sp.ignore_eos else eos) + sp.stop_token_ids))
        if sp.speculative is not None and sp.speculative.draft is not None:
            check_draft(model, sp.speculative.draft, len(ids) + sp.max_new_tokens)
        fmt = sp.response_format
        if fmt is not None and fmt not in grammars:
            grammars[fmt] = compile_format(fmt, model.tokenizer, model.config.vocab_size)
        requests.append(Request(tuple(ids), resolve_seed(sp), stops,
                                grammar=None if fmt is None else grammars[fmt]))
    return requests


def check_draft(model: Model, draft: Any, length: int = 0) -> None:
    """One-line errors, before any device work, when ``draft`` cannot propose tokens for
    ``model``'s requests (``Speculative(method="draft")``) of up to ``length`` tokens (0:
    any length)."""
    if not isinstance(draft, Model):
        raise InputError(f"speculative draft must be a jaxinfer.Model (load_model), not a "
                         f"{type(draft).__name__}")
    if draft.config.vocab_size != model.config.vocab_size:
        raise InputError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens "
                         f"but the target's has {model.config.vocab_size}; a draft must use "
                         "the target's tokenizer")
    if model.mesh is not None or draft.mesh is not None:
        raise InputError("speculation with a draft model runs on one device; load the target "
                         "and the draft without a mesh, or use method='ngram'")
    if length > draft.config.max_position_embeddings:
        raise InputError(f"prompt + max_new_tokens = {length} tokens exceeds the draft model's "
                         f"context of {draft.config.max_position_embeddings}; lower "
                         "max_new_tokens or use a draft with a longer context")


ScorePair = tuple[str | Sequence[int], str | Sequence[int]]


def make_score_requests(model: Model, pairs: Sequence[ScorePair]) -> list[Request]:
    """Validate ``(context, continuation)`` pairs; each side a string or token ids.

    A string context gets the tokenizer's BOS; a string continuation is encoded without one
    and must not be empty. Token ids are taken as they are.
    """
    if isinstance(pairs, tuple) and len(pairs) == 2 and not isinstance(pairs[0], tuple):
        pairs = [pairs]  # one pair
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Iterable):
        raise InputError(f"score takes (context, continuation) pairs, or a list of them; got "
                         f"a {type(pairs).__name__}")
    pairs = list(pairs)
    if not pairs:
        raise InputError("no (context, continuation) pairs given")
    context = model.config.max_position_embeddings
    out = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InputError(f"score request {i} must be a (context, continuation) pair, got "
                             f"{type(pair).__name__}")
        ctx, cont = pair
        ctx_ids = _encode_at(model, ctx, f"score request {i} context")
        if isinstance(cont, str) and not cont:
            raise InputError(f"score request {i} has an empty continuation; nothing to score")
        cont_ids = _encode_at(model, cont, f"score request {i} continuation", add_bos=False)
        if len(ctx_ids) + len(cont_ids) > context:
            raise InputError(f"score request {i} has {len(ctx_ids)} context + {len(cont_ids)} "
                             f"continuation tokens, over the model's context of {context}; "
                             "shorten it or use score_rolling for long texts")
        out.append(Request(tuple(ctx_ids + cont_ids), SamplingParams(max_new_tokens=1, seed=0),
                           (), num_scored=len(cont_ids)))
    return out


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@dataclasses.dataclass
class Progress:
    """Host view of one generation while it runs: tokens so far, stop state, timings."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    matcher: TokenMatcher | None = None  # follows the output in its grammar (response_format)
    finished: bool = False
    reason: Literal["stop", "length", "error"] = "length"
    text: str | None = None  # set when a stop string cut the text (or the request failed)
    error: str | None = None  # why the request failed (reason "error")
    t_first: float = 0.0
    t_last: float = 0.0
    draft_tokens: int = 0  # tokens proposed for verification (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted


def add_tokens(model: Model, r: Request, p: Progress, tokens: Sequence[int],
               logprobs: Sequence[float],
               top_logprobs: Sequence[dict[int, float]] | None = None) -> list[int]:
    """Apply the stop rules to newly sampled tokens; return those that become output.

    The one place stop rules live: a stop token ends the request and is not output;
    ``max_new_tokens`` ends it with ``"length"``; an output that completes its grammar
    (``response_format``) ends it with ``"stop"``; a stop string cuts the tokens after the
    one completing it (and the text before the string). Tokens after a stop never reach
    ``p``. ``top_logprobs`` (one dict per token) is required when the request asks for them.
    """
    new: list[int] = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        if p.finished:
            break
        if tok in r.stop_ids:
            p.finished, p.reason = True, "stop"
            break
        if p.matcher is not None:
            p.matcher.consume(tok)
        p.tokens.append(int(tok))
        p.logprobs.append(float(lp))
        if r.sampling.top_logprobs:
            p.top_logprobs.append(top_logprobs[i])
        new.append(int(tok))
        if p.matcher is not None and p.matcher.finished:
            p.finished, p.reason = True, "stop"
        elif len(p.tokens) >= r.sampling.max_new_tokens:
            p.finished, p.reason = True, "length"
    if r.sampling.stop and new:
        kept = len(p.tokens)
        if trim_at_stop_string(model, r, p):
            p.finished, p.reason = True, "stop"
            new = new[: max(0, len(new) - (kept - len(p.tokens)))]
    return new


def trim_at_stop_string(model: Model, r: Request, p: Progress) -> bool:
    """If a stop string appears, cut tokens after the one completing it and the text before it."""
    text = model.tokenizer.decode(p.tokens)
    if find_stop(text, r.sampling.stop) < 0:
        return False
    for k in range(1, len(p.tokens) + 1):
        prefix = model.tokenizer.decode(p.tokens[:k])
        cut = find_stop(prefix, r.sampling.stop)
        if cut >= 0:
            p.tokens, p.logprobs = p.tokens[:k], p.logprobs[:k]
            p.top_logprobs = p.top_logprobs[:k]
            p.text = prefix[:cut]
            return True
    return False


def completion(model: Model, r: Request, p: Progress) -> Completion:
    """The ``Completion`` of a finished generation."""
    text = p.text
    if text is None:
        text = model.tokenizer.decode(p.tokens) if model.tokenizer is not None else ""
    n = len(p.tokens)
    return Completion(
        text=text,
        token_ids=list(p.tokens),
        finish_reason=p.reason,
        prompt_token_ids=list(r.prompt_ids),
        time_to_first_token=p.t_first,
        time_per_output_token=(p.t_last - p.t_first) / (n - 1) if n > 1 else 0.0,
        logprobs=list(p.logprobs) if r.sampling.logprobs else None,
        error=p.error,
        top_logprobs=list(p.top_logprobs) if r.sampling.top_logprobs else None,
        draft_tokens=p.draft_tokens,
        accepted_tokens=p.accepted_tokens,
    )


def score_result(r: Request, token_logprobs: np.ndarray, greedy: np.ndarray,
                 cached_tokens: int, error: str | None = None) -> ScoreResult:
    """The ``ScoreResult`` of a finished scoring request from its per-token outputs (NaN
    log-probabilities when it failed with ``error``)."""
    n = r.num_scored
    ids = list(r.prompt_ids)
    if error is not None:
        token_logprobs = np.full(n, np.nan)
    lps = [float(x) for x in token_logprobs]
    return ScoreResult(token_logprobs=lps, logprob=float(np.sum(token_logprobs, dtype=np.float64)),
                       greedy=error is None and bool(np.all(greedy)), context_token_ids=ids[:-n],
                       continuation_token_ids=ids[-n:], cached_tokens=cached_tokens, error=error)
