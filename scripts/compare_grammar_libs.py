"""Per-token mask time of the structured-output libraries on the default model's tokenizer.

For each of llguidance, xgrammar and outlines-core that imports here, and for a JSON schema,
"any JSON object" and a regex: compile the format once, then walk a matching text token by
token, timing the computation of each next-token bitmask (a ``[1, ceil(vocab / 32)]`` int32
buffer, what ``jaxinfer.structured.fill_masks`` hands to the device) and checking that the
text's next token is allowed. Prints one JSON line per library and format: compile ms,
per-token mask µs (median, p90, mean), tokens walked. Host only; CPU timings.

Usage (the libraries jaxinfer does not depend on can be installed elsewhere and put on the
path, e.g. ``pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi``):
    PYTHONPATH=.:/tmp/xgr python scripts/compare_grammar_libs.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpoints.default_model import fetch_default_gguf
from checkpoints.gguf import read_gguf_metadata
from jaxinfer.loading import cache_dir
from jaxinfer.structured import JSON_STYLE, mask_words
from jaxinfer.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
JSON_TEXT = ('{"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "tags": ["mathematics", '
             '"poetical science", "the Analytical Engine", "Bernoulli numbers"]}')
REGEX = r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4} [a-z ]+\."
REGEX_TEXT = "Call 555-1234 tomorrow after the meeting."

# (library, format) -> (make a matcher, advance it by a token, fill row 0 of a bitmask)
Lib = tuple[Callable[[], Any], Callable[[Any, int], None], Callable[[Any, np.ndarray], None]]


def llguidance_libs(tok: Tokenizer, vocab: int) -> dict[str, Lib]:
    """llguidance's matchers for each format (JSON schema, any JSON object, regex) over
    ``tok``'s vocabulary of ``vocab`` tokens."""
    import llguidance
    import llguidance.numpy

    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=list(tok.eos_ids))
    grammars = {
        "json_schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA,
                                                                     defaults=JSON_STYLE),
        "json_object": llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                     defaults=JSON_STYLE),
        "regex": llguidance.LLMatcher.grammar_from_regex(REGEX)}

    def consume(m: Any, t: int) -> None:
        assert m.consume_token(t), m.get_error()

    return {name: (lambda g=g: llguidance.LLMatcher(lt, g), consume,
                   llguidance.numpy.fill_next_token_bitmask) for name, g in grammars.items()}


def xgrammar_libs(tok: Tokenizer, vocab: int) -> dict[str, Lib]:
    """xgrammar's matchers for each format, its tokenizer info built from ``tok``'s HF
    tokenizer (one compile thread, as the others)."""
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                  stop_token_ids=list(tok.eos_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    grammars = {"json_schema": lambda: compiler.compile_json_schema(
                    json.dumps(SCHEMA), any_whitespace=False),
                "json_object": compiler.compile_builtin_json_grammar,
                "regex": lambda: compiler.compile_regex(REGEX)}

    def fill(m: Any, out: np.ndarray) -> None:
        m.fill_next_token_bitmask(torch.from_numpy(out))  # shares the numpy buffer

    def consume(m: Any, t: int) -> None:
        assert m.accept_token(t)

    return {name: (lambda g=g: xgrammar.GrammarMatcher(g()), consume, fill)
            for name, g in grammars.items()}


def outlines_core_libs(tok: Tokenizer, vocab: int) -> dict[str, Lib]:
    """outlines-core's guides for the JSON schema (as its regex) and the regex: it has no
    "any JSON object" grammar. Its vocabulary is ``tok``'s tokens as bytes."""
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import decoders

    # Byte-level token strings back to their bytes (outlines-core's Vocabulary wants bytes).
    byte_of = {c: b for b, c in enumerate(_byte_level_symbols())}
    assert isinstance(tok.backend.decoder, decoders.ByteLevel), "a byte-level vocabulary"
    words: dict[bytes, list[int]] = {}
    for t in range(tok.vocab_size):
        piece = tok.backend.id_to_token(t)
        if t not in tok.eos_ids and piece and all(c in byte_of for c in piece):
            words.setdefault(bytes(byte_of[c] for c in piece), []).append(t)
    voc = Vocabulary(tok.eos_ids[0], words)
    regexes = {"json_schema": build_regex_from_schema(json.dumps(SCHEMA)), "regex": REGEX}

    def fill(g: Any, out: np.ndarray) -> None:
        g.write_mask_into(out.ctypes.data, out.size, out.itemsize)

    return {name: (lambda r=r: Guide(Index(r, voc)), lambda g, t: g.advance(t), fill)
            for name, r in regexes.items()}


def _byte_level_symbols() -> list[str]:
    """GPT-2's printable stand-ins for bytes 0..255, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def measure(lib: Lib, tok: Tokenizer, vocab: int, text: str, repeats: int) -> dict[str, Any]:
    """Walk ``text``'s tokens through a fresh matcher ``repeats`` times: the median compile
    time and the per-token mask time (median, p90, mean), each token checked as allowed."""
    make, consume, fill = lib
    ids = tok.encode(text, add_bos=False)
    out = np.zeros((1, mask_words(vocab)), np.int32)
    compile_s, times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = make()
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            fill(m, out)
            times.append(time.perf_counter() - t0)
            assert out[0, t // 32] >> (t % 32) & 1, f"token {t} not allowed"
            consume(m, t)
    times_us = np.array(times) * 1e6
    return {"compile_ms": round(1e3 * statistics.median(compile_s), 2),
            "mask_us_median": round(float(np.median(times_us)), 1),
            "mask_us_p90": round(float(np.percentile(times_us, 90)), 1),
            "mask_us_mean": round(float(times_us.mean()), 1), "tokens": len(ids)}


def main() -> None:
    """Measure every importable library on every format it has; print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(
        fetch_default_gguf(cache_dir() / "downloads")))
    vocab = tok.vocab_size
    texts = {"json_schema": JSON_TEXT, "json_object": JSON_TEXT, "regex": REGEX_TEXT}
    for name, build in (("llguidance", llguidance_libs), ("xgrammar", xgrammar_libs),
                        ("outlines-core", outlines_core_libs)):
        try:
            libs = build(tok, vocab)
        except ImportError as e:
            print(json.dumps({"library": name, "error": f"not importable: {e}"}), flush=True)
            continue
        for fmt, lib in libs.items():
            row = {"library": name, "format": fmt, "vocab": vocab,
                   **measure(lib, tok, vocab, texts[fmt], args.repeats)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
