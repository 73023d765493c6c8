"""The one sampling function, and the per-sequence sampling settings it reads.

Every option is a per-sequence array, so one batch can mix greedy and stochastic requests.
Order of logit processing (as in HF transformers): repetition penalty, temperature, top-k,
top-p, min-p; a temperature of 0 means greedy.
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

_INT32 = 2**31  # top_k and token ids live in int32 device arrays


def _is_int(x: object) -> bool:
    """An integer, numpy integers included; bools are not (``True`` is no token id)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _is_real(x: object) -> bool:
    """A real number that is not NaN (bools excluded); ``inf`` is left to the range checks."""
    return _is_int(x) or (isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)
                          and not math.isnan(x))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (host side, validated on construction).

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 and ``min_p`` 0 disable those
    filters; ``repetition_penalty`` 1 disables it; ``seed`` None draws a fresh random seed.
    ``ignore_eos`` keeps generating past the model's end-of-sequence tokens (benchmarks,
    fixed-length outputs); ``stop_token_ids`` still apply. ``speculative`` (a
    ``jaxinfer.Speculative``) verifies proposed tokens in one forward pass; the output is the
    same with or without it.
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
    speculative: Speculative | None = None

    def __post_init__(self) -> None:
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
            (_is_int(self.max_new_tokens) and 1 <= self.max_new_tokens < _INT32,
             f"max_new_tokens={self.max_new_tokens!r} must be an integer in [1, 2**31)"),
            (_is_real(self.temperature) and 0 <= self.temperature < math.inf,
             f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)"),
            (_is_int(self.top_k) and 0 <= self.top_k < _INT32,
             f"top_k={self.top_k!r} must be an integer in [0, 2**31) (0 disables it)"),
            (_is_real(self.top_p) and 0 < self.top_p <= 1,
             f"top_p={self.top_p!r} must be a number in (0, 1]"),
            (_is_real(self.min_p) and 0 <= self.min_p < 1,
             f"min_p={self.min_p!r} must be a number in [0, 1)"),
            (_is_real(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
             f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 "
             "(1 disables it)"),
            (self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
             f"seed={self.seed!r} must be an integer in [0, 2**63) or None"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop={self.stop!r} must be non-empty strings"),
            (all(_is_int(i) and 0 <= i < _INT32 for i in self.stop_token_ids),
             f"stop_token_ids={self.stop_token_ids!r} must be integers in [0, 2**31)"),
            (isinstance(self.logprobs, bool | np.bool_),
             f"logprobs={self.logprobs!r} must be True or False"),
            (isinstance(self.ignore_eos, bool | np.bool_),
             f"ignore_eos={self.ignore_eos!r} must be True or False"),
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
            keys=jnp.asarray(keys, jnp.uint32),
        )


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF-style penalty: seen tokens' positive logits divided, negative multiplied.

    logits ``[B, V]`` float32, seen ``[B, V]`` bool, penalty ``[B]``.
    """
    p = penalty[:, None]
    penalised = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, penalised, logits)


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
                                   interpret=jax.default_backend() != "gpu")
    return m + jnp.log(total)


def sample(
    logits: jax.Array,
    s: SamplingArrays,
    seen: jax.Array,
    step: jax.Array,
    stochastic: bool = True,
    deterministic: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Choose the next token of every sequence.

    Args:
      logits: ``[B, V]`` float32 model logits.
      s: per-sequence settings.
      seen: ``[B, V]`` bool, tokens already in each sequence (for the repetition penalty).
      step: ``[B]`` int32, index of the token being sampled in each sequence; folded into the
        sequence's key, so a request's tokens depend only on its seed and inputs, not on the
        batch it shares.
      stochastic: a static choice made by the caller, who knows the rows' temperatures:
        False when every row is greedy skips the vocabulary sort. (A ``lax.cond`` on the
        temperatures would decide on the device, but XLA:GPU reads such a predicate on the
        host, stalling the stream once per call.) Rows with temperature 0 are greedy either
        way, so both variants give the same tokens for an all-greedy batch.
      deterministic: the log-probabilities through ``logsumexp_rows``' batch-invariant sum.

    Returns:
      ``(tokens [B] int32, logprobs [B] float32)``: the log-probability is that of the chosen
      token under the model's raw distribution (before any sampling filter).
    """
    lse = logsumexp_rows(logits, deterministic)
    penalised = apply_repetition_penalty(logits, seen, s.repetition_penalty)
    tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
    if stochastic:
        filtered = filter_logits(penalised, s)
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.wrap_key_data)(s.keys), step)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        tokens = jnp.where(s.temperature > 0, drawn, tokens)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, chosen
