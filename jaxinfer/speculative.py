"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

A sequence with ``k`` proposed tokens feeds its last token and the ``k`` proposals to one
ragged forward pass (``runner.verify_step``), which yields the target model's logits at all
``k + 1`` positions. Each position is then sampled exactly as plain decoding would sample it:
same processed logits, same key (the request's seed folded with the token's index). A
proposal is accepted while it equals that sample; the first sample that differs (or the one
after the last proposal) is emitted too. So every emitted token is the token plain decoding
would have produced: greedy and seeded sampling give identical outputs with and without
speculation, and the output distribution is the target's.

Proposals here are deterministic (a point mass ``q``). For a point mass the rejection
sampling rule of Leviathan et al. ("accept ``x`` with probability ``min(1, p(x) / q(x))``,
else draw from ``norm(max(0, p - q))``") accepts with probability ``p(x)`` and otherwise
draws from ``p`` without ``x``: exactly what comparing ``x`` with a draw from ``p`` does.
A draft model's proposals are its greedy tokens, so the same holds for them. The trade-off:
when sampling, a proposal is accepted with probability ``p(x)``, whereas the rule applied to
a *sampled* draft (``q`` the draft's distribution) accepts with ``sum min(p, q)``, which is
higher when the two models agree on a flat distribution. The rule here buys outputs that are
token for token those of plain decoding with the same seed (not only equal in distribution),
and greedy requests, the usual case for speculation, lose nothing.

``ngram`` (prompt lookup) proposes the tokens that followed the latest earlier occurrence of
the sequence's last ``n`` tokens (within its last ``NGRAM_WINDOW`` tokens), for the largest
``n`` in ``[ngram_min, ngram_max]`` that occurs; it needs no second model and pays off when
outputs repeat their input (summaries, edits, extraction, code).

``draft`` proposes the greedy continuation of a second, cheaper model with the target's
vocabulary (a smaller model of the same family, or a quantized copy of the target:
``load_model(path, quantize="int4")``). The engine keeps the draft's K/V in a page pool of
its own, addressed by the target's page tables (``Engine`` says how it is sized), and runs
the draft over the tokens it has not seen and then ``k - 1`` more tokens in one device
program before each verify step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import InputError

METHODS = ("ngram", "draft")
"""Proposal methods ``Speculative(method=...)`` accepts."""

MAX_TOKENS = 16
"""Most tokens one verification may propose (``num_tokens``)."""

NGRAM_WINDOW = 4096
"""Latest tokens of a sequence an n-gram lookup searches: one history shape for the device
loop (``runner.ngram_steps``), so no program is compiled as sequences grow."""


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings of a request (``generate(..., speculative=...)``).

    Args:
      method: ``"ngram"``: prompt-lookup proposals from the request's own tokens;
        ``"draft"``: the greedy tokens of the ``draft`` model.
      num_tokens: tokens proposed per verification (``k``), 1 to ``MAX_TOKENS``.
      ngram_max, ngram_min: lengths of the suffix looked up, longest first (``"ngram"``).
      adaptive: let the engine verify only when it measures speculation (the draft's
        proposals included) to be faster than plain multi-token decode calls for the running
        batch (large batches, low acceptance); False speculates whenever a proposal exists
        (tests, measurements).
      draft: with ``method="draft"``, a ``jaxinfer.Model`` with the target's vocabulary on
        the target's device (checked when a request is made). An engine serves one draft
        model at a time; it attaches a new one while idle. Settings compare equal whatever
        their draft (a model is not comparable).

    Whatever the method, outputs are those of plain decoding (module docstring: when
    sampling, a proposal is accepted with the target's probability of it, a lower rate than
    the draft-distribution rejection rule, in exchange for seed-exact outputs).
    """

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive: bool = True
    draft: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"speculative method={self.method!r} must be one of "
                             f"{', '.join(METHODS)}")
        for name, lo, hi in (("num_tokens", 1, MAX_TOKENS), ("ngram_min", 1, 64),
                             ("ngram_max", 1, 64)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise InputError(f"speculative {name}={value!r} must be an integer in "
                                 f"[{lo}, {hi}]")
        if self.ngram_min > self.ngram_max:
            raise InputError(f"speculative ngram_min={self.ngram_min} must be <= ngram_max="
                             f"{self.ngram_max}")
        if not isinstance(self.adaptive, bool):
            raise InputError(f"speculative adaptive={self.adaptive!r} must be True or False")
        if (self.method == "draft") != (self.draft is not None):
            raise InputError(f"speculative method={self.method!r} "
                             + ("needs a draft model: Speculative(method='draft', draft=model)"
                                if self.draft is None else
                                "takes no draft model; use method='draft' to draft with one"))


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, ngram_max: int,
                  ngram_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens of ``tokens`` (``n`` from ``ngram_max`` down to ``ngram_min``) within its last
    ``NGRAM_WINDOW`` tokens; [] if none."""
    t = np.asarray(tokens, np.int64)[-NGRAM_WINDOW:]
    for n in range(min(ngram_max, len(t) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == t[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start: start + k].tolist()
    return []


def propose_ngram_rows(history: jax.Array, length: jax.Array, num_tokens: jax.Array,
                       ngram_max: jax.Array, ngram_min: jax.Array, *, width: int,
                       longest: int) -> tuple[jax.Array, jax.Array]:
    """``propose_ngram`` for every row at once, on the device (``runner.ngram_steps``).

    ``history [B, L]`` holds each row's tokens in its first ``length [B]`` entries; row
    ``b`` proposes up to ``num_tokens[b]`` tokens for suffixes of ``ngram_max[b]`` down to
    ``ngram_min[b]`` tokens. ``width`` (static) is the largest ``num_tokens`` and
    ``longest`` (static) the largest ``ngram_max``. Returns ``(proposals [B, width], num
    [B])``: row ``b``'s proposals are ``proposals[b, :num[b]]``, the tokens ``propose_ngram``
    returns for ``history[b, :length[b]]`` (which searches its last ``NGRAM_WINDOW``
    tokens; the device loop's history holds at most that many plus a call's output).
    """
    b, n_hist = history.shape
    padded = jnp.pad(history, ((0, 0), (0, longest + width)), constant_values=-1)
    starts = jnp.arange(n_hist)[None, :]  # [1, L]: where an earlier occurrence begins
    rows = jnp.arange(b)[:, None]
    found = jnp.zeros(b, bool)
    start = jnp.zeros(b, jnp.int32)  # first proposed token's index
    for n in range(longest, 0, -1):  # longest suffix first, as propose_ngram
        match = starts <= (length - n - 1)[:, None]  # windows inside tokens[:-1]
        for i in range(n):
            suffix = padded[rows[:, 0], jnp.maximum(length - n + i, 0)]  # [B]
            match &= padded[:, i: i + n_hist] == suffix[:, None]
        latest = jnp.max(jnp.where(match, starts, -1), axis=1)  # [B]
        # A match (latest >= 0) implies n <= length - 1, as propose_ngram's range does.
        hit = ~found & (latest >= 0) & (n <= ngram_max) & (n >= ngram_min)
        start = jnp.where(hit, latest + n, start)
        found |= hit
    proposals = padded[rows, start[:, None] + jnp.arange(width)[None, :]]  # [B, width]
    num = jnp.where(found, jnp.minimum(num_tokens, length - start), 0)
    return proposals.astype(jnp.int32), num.astype(jnp.int32)
