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

``ngram`` (prompt lookup) proposes the tokens that followed the latest earlier occurrence of
the sequence's last ``n`` tokens, for the largest ``n`` in ``[ngram_min, ngram_max]`` that
occurs; it needs no second model and pays off when outputs repeat their input (summaries,
edits, extraction, code).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.errors import InputError

METHODS = ("ngram",)
"""Proposal methods ``Speculative(method=...)`` accepts."""

MAX_TOKENS = 16
"""Most tokens one verification may propose (``num_tokens``)."""


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings of a request (``generate(..., speculative=...)``).

    Args:
      method: ``"ngram"``: prompt-lookup proposals from the request's own tokens.
      num_tokens: tokens proposed per verification (``k``), 1 to ``MAX_TOKENS``.
      ngram_max, ngram_min: lengths of the suffix looked up, longest first.
      adaptive: let the engine verify only when it measures speculation to be faster than
        plain multi-token decode calls for the running batch (large batches, low
        acceptance); False speculates whenever a proposal exists (tests, measurements).
    """

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive: bool = True

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


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, ngram_max: int,
                  ngram_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens of ``tokens`` (``n`` from ``ngram_max`` down to ``ngram_min``); [] if none."""
    t = np.asarray(tokens, np.int64)
    for n in range(min(ngram_max, len(t) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == t[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start: start + k].tolist()
    return []
