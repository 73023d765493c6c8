"""Structured output: response formats, their grammars and per-request token matchers (host).

A request's ``response_format`` (``SamplingParams.response_format``) is one of

* ``{"type": "text"}`` or None: unconstrained;
* ``{"type": "json_object"}``: any JSON object (on one line, laid out as ``json.dumps``
  does: ``JSON_STYLE``);
* ``{"type": "json_schema", "json_schema": {"schema": {...}, "name": ..., "strict": ...}}``:
  JSON valid against the schema (OpenAI's shape; only ``schema`` is read);
* ``{"type": "regex", "pattern": "..."}``: text matching the regular expression in full
  (Rust ``regex`` syntax: no look-around or back-references);
* ``{"type": "grammar", "grammar": "..."}``: a context-free grammar in Lark syntax (start
  rule ``start``) or llama.cpp's GBNF (start rule ``root``), as llguidance reads them.

Formats are compiled with llguidance (a maintained Rust library; ``bench/NOTES.md``,
"Structured output", says why this one) against the model's tokenizer, once per request, on
the host before any device work; a format that does not compile is an ``InputError``. While
the request runs its ``TokenMatcher`` follows the tokens it produced, and ``fill_masks``
writes the allowed tokens of the next position of many matchers into one bitmask
``[rows, ceil(vocab / 32)]`` (bit ``v % 32`` of word ``v // 32`` allows token ``v``), which
the device sampler applies (``sampling.apply_token_mask``). End-of-sequence ids are allowed
exactly where the grammar may end; a grammar that cannot continue allows only them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfer.errors import InputError

JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""How constrained JSON is laid out: one line, ``json.dumps``' separators. (Free whitespace
would let a model spend its tokens on newlines and indentation, or never stop emitting them.)
A schema may override it with llguidance's ``"x-guidance"`` key."""

FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema",
           "regex": "pattern", "grammar": "grammar"}
"""Response format types and the key holding each one's payload."""


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """A validated, constraining response format (hashable, so ``SamplingParams`` stays so).

    ``type`` is ``"json_object"``, ``"json_schema"``, ``"regex"`` or ``"grammar"``; ``spec``
    is the schema as JSON text, the pattern or the grammar text (empty for json_object).
    """

    type: str
    spec: str = ""

    @classmethod
    def parse(cls, value: object) -> ResponseFormat | None:
        """A ``ResponseFormat`` from the OpenAI-style dict (or one already parsed); None
        when the format does not constrain (None, ``{"type": "text"}``). Raises a one-line
        ``InputError`` naming what is wrong."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        kinds = ", ".join(repr(k) for k in FORMATS)
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise InputError(f"response_format={value!r:.80} must be a dict with a 'type' "
                             f"({kinds}), e.g. {{'type': 'json_object'}}")
        kind = value["type"]
        if kind not in FORMATS:
            raise InputError(f"response_format type {kind!r:.40} is unknown; use one of {kinds}")
        key = FORMATS[kind]
        extra = sorted(set(value) - {"type", key})
        if extra:
            raise InputError(f"response_format of type {kind!r} has unknown key {extra[0]!r:.40}"
                             + (f"; it takes only {key!r}" if key else ""))
        if key is not None and key not in value:
            raise InputError(f"response_format of type {kind!r} needs {key!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        payload = value[key]
        if kind == "json_schema":
            schema = payload.get("schema") if isinstance(payload, dict) else None
            if not isinstance(schema, dict):
                raise InputError("response_format json_schema must be {'schema': {...}, ...} with "
                                 "the JSON schema as a dict")
            try:  # key order kept: properties come out in the schema's order
                text = json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise InputError(f"response_format json_schema is not JSON ({e})") from None
            return cls("json_schema", text)
        if not isinstance(payload, str) or not payload:
            raise InputError(f"response_format {key} must be a non-empty string, not "
                             f"{payload!r:.40}")
        return cls(kind, payload)

    def grammar(self) -> str:
        """The llguidance grammar of this format (not yet checked against a tokenizer)."""
        import llguidance

        if self.type in ("json_object", "json_schema"):
            schema = self.spec if self.type == "json_schema" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        if self.type == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        try:
            return llguidance.grammar_from("grammar", self.spec)
        except ValueError as e:  # GBNF that does not convert to Lark
            raise InputError(f"response_format grammar: {_one_line(str(e))}") from None


def _one_line(message: str) -> str:
    return " ".join(message.split())[:300]


@functools.lru_cache(maxsize=8)
def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of ``tokenizer`` (a ``jaxinfer.tokenizer.Tokenizer``) with
    ``vocab_size`` ids (the model's; ids past the tokenizer's are never allowed) and the
    tokenizer's end-of-sequence ids. Built once per tokenizer (about 0.2 s for 49k tokens)."""
    import llguidance

    if tokenizer.vocab_size > vocab_size:
        raise InputError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{vocab_size}; response_format needs them to agree")
    if not tokenizer.eos_ids:
        raise InputError("response_format needs a tokenizer with an end-of-sequence token")
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_ids))


def compile_format(fmt: ResponseFormat, tokenizer: Any, vocab_size: int) -> str:
    """The grammar of ``fmt`` checked against the model's tokenizer; a one-line
    ``InputError`` if it does not compile (bad schema, regex or grammar)."""
    import llguidance

    if tokenizer is None:
        raise InputError("response_format needs a model with a tokenizer")
    grammar = fmt.grammar()
    error = llguidance.LLMatcher.validate_grammar(grammar,
                                                  grammar_tokenizer(tokenizer, vocab_size))
    if error and not error.startswith("WARNING"):
        raise InputError(f"response_format {fmt.type} does not compile: {_one_line(error)}")
    return grammar


class TokenMatcher:
    """Where one request's output is in its grammar: advanced by each generated token."""

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int):
        """``grammar`` from ``compile_format`` for the same tokenizer and vocabulary size."""
        import llguidance

        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, vocab_size), grammar)

    def consume(self, token: int) -> None:
        """Advance past ``token``; a token the grammar does not allow raises ``ValueError``
        (the device mask makes that impossible unless the mask and matcher disagree)."""
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the response_format grammar "
                             f"({_one_line(self.matcher.get_error())})")

    @property
    def finished(self) -> bool:
        """The grammar is complete and cannot continue (only end-of-sequence is allowed)."""
        return self.matcher.is_stopped()


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor()


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row of a token bitmask over ``vocab_size`` ids."""
    return math.ceil(vocab_size / 32)


def fill_masks(rows: Sequence[tuple[TokenMatcher, int]], out: np.ndarray) -> None:
    """Write each matcher's allowed next tokens into row ``row`` of ``out``
    (``int32 [R, mask_words(vocab)]``, C-contiguous), in parallel over the matchers (Rust
    threads); other rows are left as they are."""
    import llguidance.numpy

    if rows:
        llguidance.numpy.fill_next_token_bitmask_par(
            _executor(), [(m.matcher, row) for m, row in rows], out)
