"""The one sampling function, and the per-sequence sampling settings it reads.

Every option is a per-sequence array, so one batch can mix greedy and stochastic requests.
Order of logit processing: the structured-output token mask (``apply_token_mask``), the
repetition penalty (as in HF transformers), the presence and frequency penalties (as in
OpenAI's API), then temperature, top-k, top-p, min-p (as in HF); a temperature of 0 means
greedy. Log-probabilities (the chosen token's and the ``top_logprobs`` most likely tokens')
are those of the model's raw distribution, before any of these.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import pallas_kernels
from jaxinfer.errors import InputError
from jaxinfer.speculative import Speculative
from jaxinfer.structured import ResponseFormat

_INT32 = 2**31  # top_k and token ids live in int32 device arrays
MAX_TOP_LOGPROBS = 20
"""Most ``top_logprobs`` a request may ask for (OpenAI's limit); the device computes this
many for every row of a step in which any request asks."""


def is_int(x: object) -> bool:
    """An integer, numpy integers included; bools are not (``True`` is no token id)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def is_real(x: object) -> bool:
    """A real number that is not NaN (bools excluded); ``inf`` is left to the range checks."""
    return is_int(x) or (isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)
                          and not math.isnan(x))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (host side, validated on construction).

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 and ``min_p`` 0 disable those
    filters; ``repetition_penalty`` 1 disables it; ``seed`` None draws a fresh random seed.
    ``ignore_eos`` keeps generating past the model's end-of-sequence tokens (benchmarks,
    fixed-length outputs); ``stop_token_ids`` still apply.

    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], OpenAI's semantics): a token
    already generated ``c > 0`` times by this request (the prompt does not count) has its
    logit lowered by ``presence_penalty + c * frequency_penalty``. ``top_logprobs`` (0 to
    ``MAX_TOP_LOGPROBS``): per generated token, that many most likely tokens and their
    log-probabilities (``Completion.top_logprobs``). ``response_format`` constrains the
    output to JSON, a JSON schema, a regex or a grammar (``jaxinfer.structured``: the dict
    forms it accepts); not with ``ignore_eos``, since a constrained output ends where its
    grammar does. ``speculative`` (a ``jaxinfer.Speculative``) verifies proposed tokens
    in one forward pass; the output is the same with or without it.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: ResponseFormat | dict | None = None
    speculative: Speculative | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        # One string (or one id) is one stop string (or id), never its characters.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str | int | np.integer):
                value = (value,)
            elif value is None:
                value = ()
            elif isinstance(value, Iterable) and not isinstance(value, dict):
                value = tuple(value)
            else:
                raise InputError(f"{name}={value!r} must be a list of "
                                 f"{'strings' if name == 'stop' else 'token ids'}")
            object.__setattr__(self, name, value)
        checks = [
            (is_int(self.max_new_tokens) and 1 <= self.max_new_tokens < _INT32,
             f"max_new_tokens={self.max_new_tokens!r} must be an integer in [1, 2**31)"),
            (is_real(self.temperature) and 0 <= self.temperature < math.inf,
             f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)"),
            (is_int(self.top_k) and 0 <= self.top_k < _INT32,
             f"top_k={self.top_k!r} must be an integer in [0, 2**31) (0 disables it)"),
            (is_real(self.top_p) and 0 < self.top_p <= 1,
             f"top_p={self.top_p!r} must be a number in (0, 1]"),
            (is_real(self.min_p) and 0 <= self.min_p < 1,
             f"min_p={self.min_p!r} must be a number in [0, 1)"),
            (is_real(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
             f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 "
             "(1 disables it)"),
            (self.seed is None or (is_int(self.seed) and 0 <= self.seed < SEEDS),
             f"seed={self.seed!r} must be an integer in [0, 2**63) or None"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop={self.stop!r} must be non-empty strings"),
            (all(is_int(i) and 0 <= i < _INT32 for i in self.stop_token_ids),
             f"stop_token_ids={self.stop_token_ids!r} must be integers in [0, 2**31)"),
            (isinstance(self.logprobs, bool | np.bool_),
             f"logprobs={self.logprobs!r} must be True or False"),
            (isinstance(self.ignore_eos, bool | np.bool_),
             f"ignore_eos={self.ignore_eos!r} must be True or False"),
            (is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs={self.top_logprobs!r} must be an integer in [0, "
             f"{MAX_TOP_LOGPROBS}]"),
            (is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty={self.presence_penalty!r} must be a number in [-2, 2]"),
            (is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty={self.frequency_penalty!r} must be a number in [-2, 2]"),
            (not (self.ignore_eos and self.response_format is not None),
             "ignore_eos=True cannot be combined with response_format: a constrained output "
             "ends where its grammar does"),
            (self.speculative is None or isinstance(self.speculative, Speculative),
             f"speculative={self.speculative!r} must be a jaxinfer.Speculative or None"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        """Build from keyword arguments, naming any unknown option in the error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InputError(f"unknown sampling option {unknown[0]!r}; valid options: "
                             f"{', '.join(sorted(names))}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def penalized(self) -> bool:
        """Whether any penalty reads the request's row of the token-count table."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


SEEDS = 2**63
"""Seeds are integers in ``[0, SEEDS)``."""


def offset_seed(seed: int, offset: int) -> int:
    """``seed + offset`` wrapped into ``[0, SEEDS)``: the seed of a run's ``offset``-th
    request (a batch record's line, a chat's turn, a completion's choice), so that a seeded
    run draws other tokens per request and every valid base seed stays valid. A ``seed``
    outside ``[0, SEEDS)`` comes back as it is, for ``SamplingParams`` to refuse as given."""
    return (seed + offset) % SEEDS if 0 <= seed < SEEDS else seed


def prng_key_data(seed: int) -> np.ndarray:
    """A request's PRNG key as ``uint32[2]`` threefry key data, made on the host.

    ``(seed >> 32, seed & 0xffffffff)``: what ``jax.random.PRNGKey(seed)`` gives with 64-bit
    types enabled, so every 63-bit seed gets its own key, without a device call per request.
    """
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


@struct.dataclass
class SamplingArrays:
    """Device-side sampling settings for a batch: one row per sequence."""

    temperature: jax.Array  # Float['B']
    top_k: jax.Array  # Int['B'], 0 = off
    top_p: jax.Array  # Float['B']
    min_p: jax.Array  # Float['B']
    repetition_penalty: jax.Array  # Float['B']
    presence_penalty: jax.Array  # Float['B']
    frequency_penalty: jax.Array  # Float['B']
    keys: jax.Array  # UInt32['B 2'] one PRNG key per sequence

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        """Stack per-request settings (seeds resolved here, so a None seed is random)."""
        seeds = [p.seed if p.seed is not None else secrets.randbits(63) for p in params]
        keys = np.stack([prng_key_data(s) for s in seeds])
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
            repetition_penalty=jnp.asarray([p.repetition_penalty for p in params], jnp.float32),
            presence_penalty=jnp.asarray([p.presence_penalty for p in params], jnp.float32),
            frequency_penalty=jnp.asarray([p.frequency_penalty for p in params], jnp.float32),
            keys=jnp.asarray(keys, jnp.uint32),
        )


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF-style penalty: seen tokens' positive logits divided, negative multiplied.

    logits ``[B, V]`` float32, seen ``[B, V]`` bool, penalty ``[B]``.
    """
    p = penalty[:, None]
    penalised = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, penalised, logits)


def apply_penalties(logits: jax.Array, counts: jax.Array, s: SamplingArrays) -> jax.Array:
    """The repetition penalty on tokens of the prompt or output, then OpenAI's presence and
    frequency penalties on tokens of the output: ``logit - presence * (c > 0) -
    frequency * c`` for a token generated ``c`` times.

    logits ``[B, V]`` float32; counts ``[B, V]`` int32, the token-count table: ``2 * (times
    the sequence generated token v) + (1 if v is in its prompt)``, so one table (and one
    scatter-add per sampled token, ``record_tokens``) serves both kinds of penalty.
    """
    logits = apply_repetition_penalty(logits, counts > 0, s.repetition_penalty)
    generated = (counts >> 1).astype(jnp.float32)
    return (logits - s.presence_penalty[:, None] * (generated > 0)
            - s.frequency_penalty[:, None] * generated)


def record_tokens(counts: jax.Array, tokens: jax.Array, where: jax.Array) -> jax.Array:
    """Count ``tokens [B]`` as generated in the rows of ``counts [B, V]`` where ``where [B]``
    (``apply_penalties`` says what the table holds)."""
    rows = jnp.arange(tokens.shape[0])
    return counts.at[rows, tokens].add(jnp.where(where, 2, 0).astype(counts.dtype))


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``-inf`` for the tokens a row's bitmask disallows.

    logits ``[B, V]`` float32; mask ``[B, ceil(V / 32)]`` int32, bit ``v % 32`` of word
    ``v // 32`` set when token ``v`` is allowed (all bits set: unconstrained row).
    """
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = (jnp.right_shift(mask[:, ids // 32], ids % 32) & 1).astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def filter_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Temperature, top-k, top-p and min-p applied to ``logits [B, V]`` (float32).

    Removed tokens get ``-inf``. Rows with temperature 0 are returned unscaled (greedy rows
    take the argmax of the penalised logits instead).
    """
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temp
    vocab = logits.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    keep = rank < k
    # top-p and min-p act on the distribution left after top-k, as in HF's processor chain.
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < s.top_p[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    out = jnp.full_like(scaled, -jnp.inf)
    return out.at[jnp.arange(out.shape[0])[:, None], order].set(filtered_sorted)


def logsumexp_rows(x: jax.Array, deterministic: bool = False) -> jax.Array:
    """``log(sum(exp(x), -1))`` of ``x [R, V]`` float32: ``[R]``. ``deterministic``: the sum
    through the batch-invariant ``row_sum`` kernel (the max is exact in any order)."""
    if not deterministic:
        return jax.nn.logsumexp(x, axis=-1)
    m = jnp.max(x, axis=-1)
    total = pallas_kernels.row_sum(jnp.exp(x - m[:, None]),
                                   interpret=pallas_kernels.interpret_here())
    return m + jnp.log(total)


def sample(
    logits: jax.Array,
    s: SamplingArrays,
    counts: jax.Array,
    step: jax.Array,
    stochastic: bool = True,
    deterministic: bool = False,
    mask: jax.Array | None = None,
    num_top: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Choose the next token of every sequence.

    Args:
      logits: ``[B, V]`` float32 model logits.
      s: per-sequence settings.
      counts: ``[B, V]`` int32, each sequence's token-count table (``apply_penalties``).
      step: ``[B]`` int32, index of the token being sampled in each sequence; folded into the
        sequence's key, so a request's tokens depend only on its seed and inputs, not on the
        batch it shares.
      stochastic: a static choice made by the caller, who knows the rows' temperatures:
        False when every row is greedy skips the vocabulary sort. (A ``lax.cond`` on the
        temperatures would decide on the device, but XLA:GPU reads such a predicate on the
        host, stalling the stream once per call.) Rows with temperature 0 are greedy either
        way, so both variants give the same tokens for an all-greedy batch.
      deterministic: the log-probabilities through ``logsumexp_rows``' batch-invariant sum.
      mask: ``[B, ceil(V / 32)]`` int32 allowed-token bitmask (``apply_token_mask``), applied
        before everything else; None (static: nothing is transferred or masked) when no row
        is constrained.
      num_top: static count of most likely tokens to return per row (0 or
        ``MAX_TOP_LOGPROBS``).

    Returns:
      ``(tokens [B] int32, logprobs [B] float32, top_ids [B, num_top] int32,
      top_logprobs [B, num_top] float32)``: log-probabilities under the model's raw
      distribution (before the mask, penalties and filters), the top ones in descending order.
    """
    lse = logsumexp_rows(logits, deterministic)
    allowed = logits if mask is None else apply_token_mask(logits, mask)
    penalised = apply_penalties(allowed, counts, s)
    tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
    if stochastic:
        filtered = filter_logits(penalised, s)
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.wrap_key_data)(s.keys), step)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        tokens = jnp.where(s.temperature > 0, drawn, tokens)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    top_values, top_ids = jax.lax.top_k(logits, num_top)
    return tokens, chosen, top_ids.astype(jnp.int32), top_values - lse[:, None]
