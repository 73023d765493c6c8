"""Serving benchmark of the one engine: a synthetic workload through ``jaxinfer.Engine``.

The workload (fixed seed): prompt and output lengths drawn log-uniformly from the given
ranges, prompts of random token ids (never an eos id), outputs forced with
``max_new_tokens``; arrivals all at once (``--rate 0``, offline) or Poisson at ``--rate``
requests/s. Random bf16 weights of the preset's shapes, made on the device and put in the
execution layout (``--layout auto``: the fused, unstacked "fast" layout on one GPU); greedy.
Random weights rarely sample an eos id, but when one does the request ends early, so the
tokens counted are the ones the engine returned.

Before running it prints the workload's device floor (prefill FLOPs at the matmul rate plus
decode bytes at the read bandwidth, ``workload_floor``), then per rate: output tokens/s and
its fraction of the floor, requests/s, TTFT/TPOT percentiles and the engine's counters.
``--batch1-tokens N`` adds one request decoding N tokens alone (the single-stream rate
against its roofline), ``--batch1-repeats`` times (3) with new prompts, recording the median
run and every run's rate (one run's figure moved by a few percent between runs and
machines, bench/NOTES.md r112). ``--kv-cache-dtype int8|fp8`` stores the engine's K/V quantized
(``load_model(kv_cache_dtype=...)``); every run records the pool's capacity in tokens and the
tokens the same bytes would hold in bfloat16, and the floor counts the quantized K/V bytes.

``--response-format json`` gives a share of the requests (``--constrained-fraction``, all by
default) a JSON-schema ``response_format`` (one string field, so the grammar stays in its
costliest state, inside a string, until ``max_new_tokens``) and the tokenizer of
``--tokenizer`` (a tokenizer folder or a GGUF; default the default model's GGUF, only its
vocabulary is read): the cost of structured output against the same run without it (while a
constrained request decodes, the engine runs one token per host round trip and the host
computes its token masks). Constrained requests may end early, when the random model closes
the JSON; the tokens counted are the ones returned.

Usage:
    python scripts/bench_engine.py --preset 8b
    python scripts/bench_engine.py --preset 1b
    python scripts/bench_engine.py --preset 8b --rate 0,20 --batch1-tokens 512 --json auto
    python scripts/bench_engine.py --preset 8b --max-batch 64 --kv-cache-dtype fp8 --json auto
    python scripts/bench_engine.py --preset 8b --quantize int4 --requests 0 --batch1-tokens 512
    python scripts/bench_engine.py --preset 70b --quantize int4-g128 --requests 0 \
        --batch1-tokens 256                                       # one H200: 70B in ~37 GB
    JAX_PLATFORMS=cpu python scripts/bench_engine.py --preset tiny --requests 32 --rate 0,50 \
        --batch1-tokens 16 --json /tmp/x.json                           # CPU smoke run
    python scripts/bench_engine.py --preset 8b --requests 0 --batch1-tokens 256 \
        --speculative draft --draft-preset int4 --always-speculate --json auto
    python scripts/bench_engine.py --preset 1b --requests 256 --response-format json \
        --tokenizer bench/tokenizer_smollm2 --json auto      # structured output's cost

``--speculative ngram|draft`` gives every request ``jaxinfer.Speculative`` (``--draft-preset``
names the draft: ``self``, the target itself, which accepts every greedy proposal and so
measures the mechanism's cost; a quantization such as ``int4``, the target's weights
quantized; or a preset's shapes with random weights). With ``--batch1-tokens`` the batch-1
request then runs twice, plain and speculative, and the record compares their decode rates and
tokens, splits a verify cycle into draft and verify milliseconds and projects the speed-up
at acceptance rates that random weights cannot show (they rarely agree with any draft but
themselves).

Several comma-separated rates run in one process on the same prompts and output lengths
(only arrivals differ), each on a fresh ``Engine`` so no run hits the previous run's prefix
cache; compiled programs are reused, so later warm-ups are short.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from checkpoints.default_model import fetch_default_gguf
from checkpoints.gguf import read_gguf_metadata
from jaxinfer import roofline
from jaxinfer.benchmark import (
    ceilings,
    device_name,
    kv_bytes_per_position,
    quantized_copy,
    record_path,
    workload_floor,
    write_record,
)
from jaxinfer.engine import SCHEDULES
from jaxinfer.loading import cache_dir
from jaxinfer.model import LAYOUTS, apply_layout, init_params, one_device_layout
from jaxinfer.paged_cache import KV_CACHE_CHOICES, PagePool
from jaxinfer.quantize import (
    QUANTIZATIONS,
    decode_weight_bytes,
    random_quantized_params,
)
from jaxinfer.speculative import METHODS as SPECULATIVE_METHODS
from jaxinfer.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]

# Llama-3.1-70B, -8B and Llama-3.2-1B shapes with an 8k context (the engine's block tables
# are as wide as the context), and a CPU-sized model. 70B runs on one GPU only quantized
# (int4: ~37-45 GB; bf16 is 141 GB).
PRESETS: dict[str, jaxinfer.LlamaConfig] = {
    "70b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, max_position_embeddings=8192,
                                eos_token_ids=(128001,)),
    "8b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                               num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                               rope_theta=500000.0, max_position_embeddings=8192,
                               eos_token_ids=(128001,)),
    "1b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                               rope_theta=500000.0, max_position_embeddings=8192,
                               tie_word_embeddings=True, eos_token_ids=(128001,)),
    "tiny": jaxinfer.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=512),
}

# (prompt_min, prompt_max, output_min, output_max) when not given on the command line.
DEFAULT_LENGTHS: dict[str, tuple[int, int, int, int]] = {
    "70b": (32, 1024, 16, 512),
    "8b": (32, 1024, 16, 512),
    "1b": (32, 1024, 16, 512),
    "tiny": (4, 64, 4, 32),
}

# Page-pool bytes when --kv-bytes is not given (otherwise the engine's default). On CPU every
# step's time grows with the pool, and the default 128 MiB holds 500k tiny-model tokens.
DEFAULT_KV_BYTES: dict[str, int] = {"tiny": 2**22}

# --response-format json: a JSON object with one string field, whose content is open until
# the model closes it (the mask computation's costliest grammar state).
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "bench", "schema": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
    "additionalProperties": False}}}


@dataclasses.dataclass
class Workload:
    """Requests of one run: prompt token ids, forced output lengths, arrival times."""

    prompts: list[list[int]]
    output_lens: list[int]
    arrivals_s: list[float]  # seconds after the start; all 0 offline
    constrained: frozenset[int] = frozenset()  # requests given JSON_FORMAT

    @property
    def prompt_lens(self) -> list[int]:
        """Each prompt's length in tokens."""
        return [len(p) for p in self.prompts]


def make_workload(cfg: jaxinfer.LlamaConfig, n: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], rate: float, seed: int,
                  constrained_fraction: float = 0.0) -> Workload:
    """Log-uniform lengths (many short, some long, like chat traffic), Poisson arrivals, and
    ``round(constrained_fraction * n)`` requests picked to get ``JSON_FORMAT``.

    The lengths are drawn before the arrivals, so every rate gets the same prompts and
    output lengths from the same seed.
    """
    rng = np.random.default_rng(seed)

    def lengths(lo: int, hi: int) -> list[int]:
        return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int).clip(lo, hi).tolist()

    eos = set(cfg.eos_token_ids)
    vocab = [t for t in range(3, min(cfg.vocab_size, 30000)) if t not in eos]
    prompts = [rng.choice(vocab, size=p).tolist() for p in lengths(*prompt_range)]
    output_lens = lengths(*output_range)
    arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist() if rate > 0 else [0.0] * n
    picked = np.random.default_rng(seed + 1).permutation(n)[: round(constrained_fraction * n)]
    return Workload(prompts, output_lens, arrivals, frozenset(picked.tolist()))


def build_model(cfg: jaxinfer.LlamaConfig, preset: str, layout: str, backend: str,
                seed: int, deterministic: bool = False, quantize: str | None = None,
                kv_cache_dtype: str | None = None) -> jaxinfer.Model:
    """Random bf16 weights of ``cfg``'s shapes, made on the default device, in ``layout``;
    with ``quantize``, quantized.

    ``init_params`` draws each weight on the device; ``apply_layout(donate=True)`` frees each
    stored-layout buffer as soon as it is copied, so the device holds one model plus one
    stacked weight kind at most (8B: 16 GB of weights). Quantized weights are drawn and
    quantized one layer at a time (``random_quantized_params``), so the bf16 model never
    exists (70B: 141 GB).
    """
    key = jax.random.PRNGKey(seed)
    params = (init_params(cfg, key, jnp.bfloat16) if quantize is None
              else random_quantized_params(cfg, quantize, key))
    params = apply_layout(params, layout, donate=True)
    params = one_device_layout(params, jax.devices()[0])  # as load_model does
    return jaxinfer.Model(config=cfg, params=params, tokenizer=None, dtype=jnp.bfloat16,
                          name=preset, backend=backend, deterministic=deterministic,
                          kv_cache_dtype=kv_cache_dtype)


def load_tokenizer(path: str | None) -> Tokenizer:
    """A tokenizer folder, or a GGUF's vocabulary (default: the default model's GGUF)."""
    if path is None:
        path = str(fetch_default_gguf(cache_dir() / "downloads"))
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    return Tokenizer.from_pretrained_dir(path)


def make_engine(model: jaxinfer.Model, args: argparse.Namespace) -> jaxinfer.Engine:
    """``jaxinfer.Engine(model)`` with only the sizing flags that were given."""
    gc.collect()  # free the previous run's page pool before this one sizes itself on free memory
    overrides = dict(max_batch=args.max_batch, max_tokens_per_step=args.token_budget,
                     kv_cache_bytes=None if args.kv_bytes is None else int(args.kv_bytes),
                     decode_steps=args.decode_steps, page_size=args.page_size,
                     schedule=args.schedule, decode_call_seconds=args.decode_call_seconds)
    return jaxinfer.Engine(model, **{k: v for k, v in overrides.items() if v is not None})


def pool_capacity(engine: jaxinfer.Engine) -> dict[str, Any]:
    """The engine's pool: tokens, bytes (per device), and the tokens the same bytes would hold
    in bfloat16 (``tokens_vs_bf16`` = the ratio; 1 for a bfloat16 pool)."""
    cfg, kv = engine.model.config, engine.model.kv_cache_dtype
    page_bytes = PagePool.bytes_per_page(cfg, engine.page_size, engine.model.dtype, kv)
    bf16_page_bytes = PagePool.bytes_per_page(cfg, engine.page_size, jnp.bfloat16)
    tokens = engine.num_pages * engine.page_size
    nbytes = engine.num_pages * page_bytes
    bf16_tokens = nbytes // bf16_page_bytes * engine.page_size
    return dict(kv_cache_dtype=kv or str(jnp.dtype(engine.model.dtype)), pool_tokens=tokens,
                pool_bytes=nbytes, pool_tokens_if_bf16=bf16_tokens,
                tokens_vs_bf16=tokens / bf16_tokens)


def build_draft(target: jaxinfer.Model, args: argparse.Namespace) -> jaxinfer.Model | None:
    """The ``--draft-preset`` model for ``--speculative draft`` (None without it): the target
    itself, its weights quantized, or random weights of a preset's shapes (seed + 1). A
    draft other than the target runs the fast kernels even with ``--deterministic``: its
    numerics affect which proposals are accepted, never the output."""
    if args.draft_preset is None:
        return None
    if args.draft_preset == "self":
        return target
    if args.draft_preset in QUANTIZATIONS:
        return quantized_copy(target, args.draft_preset)
    return build_model(PRESETS[args.draft_preset], args.draft_preset, args.layout,
                       args.backend, args.seed + 1, False, None, args.kv_cache_dtype)


def speculative(args: argparse.Namespace, draft: jaxinfer.Model | None = None
                ) -> jaxinfer.Speculative | None:
    """The ``--speculative`` settings every request gets (None: plain decoding)."""
    if args.speculative is None:
        return None
    return jaxinfer.Speculative(method=args.speculative, num_tokens=args.num_speculative_tokens,
                                adaptive=not args.always_speculate, draft=draft)


def projected_speedups(k: int, plain_s: float, draft_s: float, verify_s: float
                       ) -> dict[str, float]:
    """Batch-1 speed-up over plain decoding (``plain_s`` per token) of verify cycles costing
    ``draft_s + verify_s``, at acceptance rates ``a`` (each proposal accepted with
    probability ``a``): a cycle yields ``(1 - a^(k+1)) / (1 - a)`` tokens."""
    out = {}
    for a in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        tokens = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
        out[f"{a:.1f}"] = tokens * plain_s / (draft_s + verify_s)
    return out


def warmup(engine: jaxinfer.Engine, constrained: bool = False,
           spec: jaxinfer.Speculative | None = None) -> float:
    """Compile every step shape (``engine.warmup``), with the token-masking mixed steps when
    ``constrained`` and the verify steps of ``spec``; return the seconds it took."""
    t0 = time.perf_counter()
    engine.warmup(constrained=constrained, speculative=spec)
    return time.perf_counter() - t0


def percentiles_ms(xs_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 of durations in seconds, in milliseconds (None when there are none)."""
    a_ms = np.asarray(xs_s, float) * 1e3
    return {f"p{q}": float(np.percentile(a_ms, q)) if a_ms.size else None for q in (50, 90, 99)}


def run_workload(engine: jaxinfer.Engine, w: Workload,
                 spec: jaxinfer.Speculative | None = None) -> dict[str, Any]:
    """Submit each request at its arrival time and step until all finish; the run's figures.

    TTFT counts from the scheduled arrival (a request that arrives during a step is submitted
    after it). Engine counters are differences over the timed run, excluding the warm-up.
    """
    before = engine.stats()
    ids: list[int] = []
    late_s: list[float] = []  # submission time - scheduled arrival
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(w.prompts) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(w.prompts) and w.arrivals_s[nxt] <= now:
            ids.append(engine.submit(w.prompts[nxt], max_new_tokens=w.output_lens[nxt],
                                     speculative=spec,
                                     response_format=(JSON_FORMAT if nxt in w.constrained
                                                      else None)))
            late_s.append(time.perf_counter() - t0 - w.arrivals_s[nxt])
            nxt += 1
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(max(0.0, w.arrivals_s[nxt] - now))
    elapsed_s = time.perf_counter() - t0
    metrics = [engine.request_metrics(i) for i in ids]
    output_tokens = sum(len(_completed(engine, i).token_ids) for i in ids)
    s = engine.stats()
    computed, padded = (s.computed_tokens - before.computed_tokens,
                        s.padded_tokens - before.padded_tokens)
    return dict(
        elapsed_s=elapsed_s, output_tokens=output_tokens, constrained_requests=len(w.constrained),
        planned_output_tokens=sum(w.output_lens),
        output_tok_per_s=output_tokens / elapsed_s, req_per_s=len(ids) / elapsed_s,
        ttft_ms=percentiles_ms([m.time_to_first_token + late
                                 for m, late in zip(metrics, late_s, strict=True)]),
        tpot_ms=percentiles_ms([m.time_per_output_token for m in metrics
                                 if m.time_per_output_token is not None]),
        steps=s.steps - before.steps, decode_calls=s.decode_calls - before.decode_calls,
        ahead_steps=s.ahead_steps - before.ahead_steps, step_s=s.step_seconds - before.step_seconds,
        device_s=s.device_seconds - before.device_seconds,
        decode_device_s=s.decode_seconds - before.decode_seconds,
        computed_tokens=computed, padded_tokens=padded,
        padding_fraction=1 - computed / padded if padded else 0.0,
        preemptions=s.num_preemptions - before.num_preemptions,
        num_programs=s.num_programs, programs_compiled_in_run=s.num_programs - before.num_programs,
        peak_pages_used=s.peak_pages_used, pages_total=s.pages_total,
        cached_tokens=s.cached_tokens - before.cached_tokens,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        slots=engine.max_batch, max_tokens_per_step=engine.max_tokens,
        verify_steps=s.verify_steps - before.verify_steps,
        draft_tokens=s.draft_tokens - before.draft_tokens,
        accepted_tokens=s.accepted_tokens - before.accepted_tokens)


def _completed(engine: jaxinfer.Engine, rid: int) -> jaxinfer.Completion:
    """A request's result; a failed request (a device OOM, say) stops the benchmark, whose
    figures would otherwise count it."""
    result = engine.result(rid)
    if result.error is not None:
        raise RuntimeError(f"benchmark request failed: {result.error}")
    return result


def run_batch1(engine: jaxinfer.Engine, cfg: jaxinfer.LlamaConfig, prompt_len: int,
               new_tokens: int, read_bytes_per_s: float, dtype_bytes: int,
               spec: jaxinfer.Speculative | None = None, seed: int = 1) -> dict[str, Any]:
    """One request alone: decode tok/s = (tokens - 1) / (t_last - t_first), and its roofline.
    Its prompt is ``prompt_len`` tokens drawn with ``seed``.

    The roofline reads the weights (``roofline.weight_bytes_per_step``, or when they are
    quantized ``quantize.decode_weight_bytes``: the model's own bytes less an untied
    embedding table) and the K/V of the mean
    context once per token (``kv_bytes_per_position``), at the read bandwidth.
    """
    vocab = [t for t in range(3, cfg.vocab_size) if t not in set(cfg.eos_token_ids)]
    prompt = np.random.default_rng(seed).choice(vocab, size=prompt_len).tolist()
    before = engine.stats()
    rid = engine.submit(prompt, max_new_tokens=new_tokens, speculative=spec)
    engine.run_until_done()
    m = engine.request_metrics(rid)
    token_ids = _completed(engine, rid).token_ids
    tokens = len(token_ids)
    s = engine.stats()
    decode_tok_per_s = 1 / m.time_per_output_token if m.time_per_output_token else None
    context = prompt_len + tokens // 2
    weights = decode_weight_bytes(engine.model.params, cfg.tie_word_embeddings)
    step_bytes = ((roofline.weight_bytes_per_step(cfg, dtype_bytes) if weights is None
                   else weights)
                  + context * kv_bytes_per_position(cfg, dtype_bytes, engine.model.kv_cache_dtype))
    floor_tok_per_s = read_bytes_per_s / step_bytes
    verify_steps = s.verify_steps - before.verify_steps
    draft_s = s.draft_seconds - before.draft_seconds
    # Device time of the verify steps (speculation loop iterations included): all of it but the
    # prompt's step, plain decode calls and the draft's proposals.
    verify_s = (s.device_seconds - before.device_seconds - m.time_to_first_token
                - (s.decode_seconds - before.decode_seconds) - draft_s)
    proposed = s.draft_tokens - before.draft_tokens
    return dict(prompt_len=prompt_len, max_new_tokens=new_tokens, tokens=tokens,
                token_ids=token_ids,
                ttft_ms=m.time_to_first_token * 1e3, decode_tok_per_s=decode_tok_per_s,
                step_bytes=step_bytes, floor_tok_per_s=floor_tok_per_s,
                fraction_of_floor=(decode_tok_per_s / floor_tok_per_s
                                   if decode_tok_per_s else None),
                verify_steps=verify_steps, decode_calls=s.decode_calls - before.decode_calls,
                draft_tokens=proposed, accepted_tokens=s.accepted_tokens - before.accepted_tokens,
                acceptance=(s.accepted_tokens - before.accepted_tokens) / proposed
                if proposed else None,
                draft_ms_per_verify=draft_s / verify_steps * 1e3 if verify_steps else None,
                verify_ms_per_step=verify_s / verify_steps * 1e3 if verify_steps else None)


def run_batch1_median(engine: jaxinfer.Engine, cfg: jaxinfer.LlamaConfig,
                      args: argparse.Namespace, read_bytes_per_s: float, dtype_bytes: int,
                      spec: jaxinfer.Speculative | None = None
                      ) -> tuple[dict[str, Any], list[list[int]]]:
    """``run_batch1`` ``args.batch1_repeats`` times on ``engine``, prompt ``i`` drawn with seed
    ``i + 1`` (a new prompt each time, so no run reuses an earlier one's cached prefix): the
    run with the median decode rate (the lower one of an even count; its ``prompt_seed``
    recorded), every run's rate in ``decode_tok_per_s_runs`` (None: under 2 tokens), and
    each run's tokens (to compare a speculative run's with a plain one's). The runs share
    the engine, so the first starts from its state after warm-up and the later ones from the
    decode-call lengths and speculation gains it measured."""
    runs = [dict(run_batch1(engine, cfg, args.batch1_prompt, args.batch1_tokens,
                            read_bytes_per_s, dtype_bytes, spec, seed=i + 1), prompt_seed=i + 1)
            for i in range(args.batch1_repeats)]
    token_ids = [r.pop("token_ids") for r in runs]
    rates = [r["decode_tok_per_s"] for r in runs]
    median = sorted(range(len(runs)), key=lambda i: rates[i] or 0.0)[(len(runs) - 1) // 2]
    return dict(runs[median], decode_tok_per_s_runs=rates), token_ids


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """The first ``(run, token)`` where two runs' token lists differ (a token past the end of
    the shorter list counts), or None if they are identical."""
    for run, (x, y) in enumerate(zip(a, b, strict=True)):
        for i in range(max(len(x), len(y))):
            if i >= min(len(x), len(y)) or x[i] != y[i]:
                return run, i
    return None


def compare_speculative(spec: dict[str, Any], plain: dict[str, Any],
                        spec_ids: list[list[int]], plain_ids: list[list[int]], k: int
                        ) -> dict[str, Any]:
    """Speculative batch-1 runs against plain ones on the same prompts (``spec_ids``,
    ``plain_ids``: each run's tokens): the speed-up of the median runs, whether every run's
    tokens are identical (else the first differing ``(run, token)``), and the speed-ups the
    median speculative run's measured cycle costs would give at other acceptance rates."""
    differ = first_difference(spec_ids, plain_ids)
    out: dict[str, Any] = dict(plain=plain, identical_tokens=differ is None,
                               first_difference=differ,
                               speedup=None, projected_speedup=None)
    if spec["decode_tok_per_s"] and plain["decode_tok_per_s"]:
        out["speedup"] = spec["decode_tok_per_s"] / plain["decode_tok_per_s"]
        if spec["verify_steps"]:
            out["projected_speedup"] = projected_speedups(
                k, 1 / plain["decode_tok_per_s"], spec["draft_ms_per_verify"] / 1e3,
                spec["verify_ms_per_step"] / 1e3)
    return out


def report_speculative(b1: dict[str, Any]) -> None:
    """Print a speculative batch-1 run's comparison with plain decoding."""
    plain = b1["plain"]
    print(f"   plain {plain['decode_tok_per_s'] or 0:.1f} tok/s; speculative "
          f"{b1['decode_tok_per_s'] or 0:.1f} tok/s = {b1['speedup'] or 0:.2f}x, identical "
          f"tokens: {b1['identical_tokens']}"
          + ("" if b1["first_difference"] is None else
             f" (first difference in run {b1['first_difference'][0] + 1} at token "
             f"{b1['first_difference'][1]}: bf16 near-ties, see --deterministic)")
          + f"; {b1['verify_steps']} verify steps, "
          f"{b1['accepted_tokens']} of {b1['draft_tokens']} proposals accepted, "
          f"{b1['decode_calls']} decode calls", flush=True)
    if b1["projected_speedup"]:
        cycle = (f"draft {b1['draft_ms_per_verify']:.2f} ms + verify "
                 f"{b1['verify_ms_per_step']:.2f} ms" if b1["draft_ms_per_verify"] else
                 f"{b1['verify_ms_per_step']:.2f} ms per loop iteration (proposals included)")
        print(f"   a cycle: {cycle} (plain {1e3 / plain['decode_tok_per_s']:.2f} "
              "ms/token); projected speed-up at acceptance "
              + ", ".join(f"{a}: {x:.2f}x" for a, x in b1["projected_speedup"].items()),
              flush=True)


def _fmt_ms(p: dict[str, float | None]) -> str:
    return "  ".join(f"{k} {v:7.1f}" if v is not None else f"{k}   -" for k, v in p.items())


def report(run: dict[str, Any], floor: dict[str, Any]) -> None:
    """Print one run's figures."""
    print(f"  {run['elapsed_s']:.2f} s (warm-up {run['warmup_s']:.1f} s before): "
          f"{run['output_tokens']} tokens, {run['output_tok_per_s']:.0f} output tok/s, "
          f"{run['req_per_s']:.2f} req/s")
    print(f"  floor {floor['floor_s']:.4g} s -> {floor['floor_output_tok_per_s']:.4g} output "
          f"tok/s; measured {run['output_tok_per_s']:.0f} tok/s = "
          f"{100 * run['fraction_of_floor']:.3g}% of the floor")
    if run["output_tokens"] != run["planned_output_tokens"]:
        print(f"  note: {run['planned_output_tokens'] - run['output_tokens']} planned tokens not "
              "generated (eos sampled); the floor counts the planned ones")
    if run["constrained_requests"]:
        print(f"  {run['constrained_requests']} requests constrained to JSON (response_format)")
    print(f"  TTFT ms {_fmt_ms(run['ttft_ms'])}   TPOT ms {_fmt_ms(run['tpot_ms'])}")
    print(f"  time in step() {run['step_s']:.2f} s, of which waiting on the device "
          f"{run['device_s']:.2f} s ({run['decode_device_s']:.2f} s in plain decode calls, the "
          "rest in mixed and verify steps); the rest is host planning and output handling")
    if run["verify_steps"]:
        print(f"  speculative: {run['verify_steps']} verify steps, {run['accepted_tokens']} of "
              f"{run['draft_tokens']} proposed tokens accepted")
    print(f"  steps {run['steps']} (decode calls {run['decode_calls']}, mixed steps launched "
          f"ahead {run['ahead_steps']}), tokens computed "
          f"{run['computed_tokens']} of {run['padded_tokens']} padded "
          f"({run['padding_fraction']:.1%} padding), preemptions {run['preemptions']}, "
          f"programs {run['num_programs']} ({run['programs_compiled_in_run']} compiled in the "
          f"run), peak pages {run['peak_pages_used']}/{run['pages_total']}, prefix-cache hits "
          f"{run['cached_tokens']} tokens ({run['prefix_cache_hit_rate']:.1%})", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags; unset length ranges take the preset's ``DEFAULT_LENGTHS``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--requests", type=int, default=1000,
                    help="requests of the workload; 0 runs none (only --batch1-tokens)")
    ap.add_argument("--rate", default="0", help="requests/s; 0 = all at once; a comma-"
                    "separated list runs each in turn (same lengths, compiled once)")
    for name in ("prompt-min", "prompt-max", "output-min", "output-max"):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help="default 32-1024 prompt, 16-512 output tokens (tiny: 4-64, 4-32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=LAYOUTS, default="auto",
                    help="execution layout of the weights (auto: fast on one GPU)")
    ap.add_argument("--backend", default="auto", choices=("auto", "pallas", "reference"))
    # Engine sizing: unset flags keep the engine's own choice (``Engine(model)``).
    ap.add_argument("--max-batch", type=int, default=None, help="engine slots")
    ap.add_argument("--token-budget", type=int, default=None, help="max_tokens_per_step")
    ap.add_argument("--kv-bytes", type=float, default=None,
                    help="page pool bytes (tiny: 4 MiB)")
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--decode-call-seconds", type=float, default=None,
                    help="device time a decode call aims at (Engine(decode_call_seconds=))")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                    help="weight-only quantization (load_model(quantize=...))")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_CHOICES, default=None,
                    help="store K/V quantized in the page pool (load_model(kv_cache_dtype=...))")
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant kernels (load_model(deterministic=True))")
    ap.add_argument("--schedule", choices=SCHEDULES, default=None,
                    help="admission order (Engine(schedule=...)); default fcfs")
    ap.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                    help="speculative decoding for every request (jaxinfer.Speculative)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--always-speculate", action="store_true",
                    help="verify whenever there is a proposal (Speculative(adaptive=False))")
    ap.add_argument("--draft-preset", default=None,
                    choices=("self", *QUANTIZATIONS, *sorted(PRESETS)),
                    help="with --speculative draft: the draft model: self (the target: every "
                    "greedy proposal accepted), a quantization of the target's weights (int4, "
                    "...), or a preset's shapes with random weights (1b beside 8b)")
    ap.add_argument("--matmul-tflops", type=float, default=None,
                    help="bf16 matmul rate for the floor (default: measured H100 634, H200 790)")
    ap.add_argument("--read-tbps", type=float, default=None,
                    help="read bandwidth for the floor (default: measured H100 3.0, H200 4.3)")
    ap.add_argument("--batch1-tokens", type=int, default=0,
                    help="> 0: also decode this many tokens for one request alone")
    ap.add_argument("--batch1-prompt", type=int, default=128,
                    help="prompt tokens of the batch-1 request")
    ap.add_argument("--batch1-repeats", type=int, default=3,
                    help="batch-1 requests run one after another (new prompts); the record "
                         "keeps the one with the median decode rate (the lower median of an "
                         "even count)")
    ap.add_argument("--compile-cache", default=None,
                    help="JAX persistent compilation cache folder (reused across processes)")
    ap.add_argument("--response-format", choices=("none", "json"), default="none",
                    help="json: constrain requests to JSON_FORMAT (structured output's cost)")
    ap.add_argument("--constrained-fraction", type=float, default=1.0,
                    help="share of the requests constrained with --response-format json")
    ap.add_argument("--tokenizer", default=None,
                    help="with --response-format json: a tokenizer folder or GGUF (default: "
                         "the default model's GGUF)")
    ap.add_argument("--json", default=None,
                    help="write the record here after each run; 'auto' = bench/results/"
                         "<device>/engine_<preset>_<date>.json")
    args = ap.parse_args(argv)
    if args.requests < 0:
        ap.error(f"--requests {args.requests} must be 0 or more")
    if args.batch1_repeats < 1:
        ap.error(f"--batch1-repeats {args.batch1_repeats} must be 1 or more")
    if (args.speculative == "draft") != (args.draft_preset is not None):
        ap.error("--speculative draft needs --draft-preset, which is only for it")
    if args.kv_bytes is None:
        args.kv_bytes = DEFAULT_KV_BYTES.get(args.preset)
    for name, value in zip(("prompt_min", "prompt_max", "output_min", "output_max"),
                           DEFAULT_LENGTHS[args.preset], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the JSON record (also written to ``--json``)."""
    args = parse_args(argv)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    cfg = PRESETS[args.preset]
    dtype_bytes = jnp.dtype(jnp.bfloat16).itemsize
    kind = jax.devices()[0].device_kind
    flops, bandwidth, ceiling_note = ceilings(kind, args.matmul_tflops, args.read_tbps)
    now = datetime.datetime.now(datetime.UTC)
    out_path = record_path(args.json, REPO / "bench" / "results" / device_name()
                           / f"engine_{args.preset}_{now.strftime('%Y%m%d')}.json")
    command = " ".join(["python", *(sys.argv if argv is None else ["scripts/bench_engine.py",
                                                                  *argv])])
    model = build_model(cfg, args.preset, args.layout, args.backend, args.seed,
                        args.deterministic, args.quantize, args.kv_cache_dtype)
    spec = speculative(args, build_draft(model, args))
    fraction = args.constrained_fraction if args.response_format == "json" else 0.0
    if fraction:
        model = dataclasses.replace(model, tokenizer=load_tokenizer(args.tokenizer))
    record: dict[str, Any] = dict(
        date=now.isoformat(timespec="seconds"), device=kind, jax=jax.__version__,
        command=command, preset=args.preset, layout=model.layout, dtype="bfloat16",
        args={k: v for k, v in vars(args).items() if k != "json"},
        ceilings=dict(matmul_flops_per_s=flops, read_bytes_per_s=bandwidth, source=ceiling_note),
        floor=None, runs=[], batch1=None)

    print(f"== {args.preset} ({model.layout} layout) on {kind}: {args.requests} requests, "
          f"prompts {args.prompt_min}-{args.prompt_max}, outputs {args.output_min}-"
          f"{args.output_max}; ceilings {flops / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s "
          f"({ceiling_note})", flush=True)
    rates = [float(x) for x in args.rate.split(",")] if args.requests > 0 else []
    for rate in rates:
        w = make_workload(cfg, args.requests, (args.prompt_min, args.prompt_max),
                          (args.output_min, args.output_max), rate, args.seed, fraction)
        engine = make_engine(model, args)
        if record["floor"] is None:  # the same prompts and lengths, slots and rates every run
            record["floor"] = workload_floor(
                cfg, w.prompt_lens, w.output_lens, engine.max_batch, flops, bandwidth,
                dtype_bytes, args.kv_cache_dtype, weight_bytes_per_step=decode_weight_bytes(
                    model.params, cfg.tie_word_embeddings))
            f = record["floor"]
            print(f"floor {f['floor_s']:.4g} s -> {f['floor_output_tok_per_s']:.4g} output tok/s"
                  f" (prefill {f['prefill_flops'] / 1e12:.4g} TFLOP = {f['prefill_s']:.4g} s; "
                  f"decode {f['decode_tokens']} tokens in ~{f['decode_steps']:.0f} steps of "
                  f"{f['batch_eff']}: {(f['decode_weight_bytes'] + f['decode_kv_bytes']) / 1e9:.1f}"
                  f" GB = {f['decode_s']:.4g} s)", flush=True)
        warmup_s = warmup(engine, constrained=bool(w.constrained), spec=spec)
        pool = pool_capacity(engine)
        print(f"\n-- rate {rate or 'offline'}: {engine.max_batch} slots, {engine.max_tokens} "
              f"tokens per step; pool {pool['pool_tokens']} tokens in "
              f"{pool['pool_bytes'] / 2**30:.2f} GiB {pool['kv_cache_dtype']} = "
              f"{pool['tokens_vs_bf16']:.3f}x the {pool['pool_tokens_if_bf16']} tokens of "
              "bfloat16", flush=True)
        run = dict(rate=rate, warmup_s=warmup_s, **pool,
                   **run_workload(engine, w, spec))
        run["fraction_of_floor"] = (run["output_tok_per_s"]
                                    / record["floor"]["floor_output_tok_per_s"])
        report(run, record["floor"])
        record["runs"].append(run)
        write_record(out_path, record)
        del engine
    if args.batch1_tokens > 0:
        plain = None
        if spec is not None:  # the same requests without speculation, to compare with
            engine = make_engine(model, args)
            warmup(engine)
            plain, plain_ids = run_batch1_median(engine, cfg, args, bandwidth, dtype_bytes)
            del engine
        engine = make_engine(model, args)
        warmup_s = warmup(engine, spec=spec)
        b1, token_ids = run_batch1_median(engine, cfg, args, bandwidth, dtype_bytes, spec)
        b1 = dict(warmup_s=warmup_s, repeats=args.batch1_repeats, **b1)
        if plain is not None:
            b1.update(compare_speculative(b1, plain, token_ids, plain_ids,
                                          args.num_speculative_tokens))
        b1_tok_per_s = b1["decode_tok_per_s"]
        each = ", ".join(f"{r or 0:.1f}" for r in b1["decode_tok_per_s_runs"])
        print(f"\n-- batch 1: {b1['tokens']} tokens after a {b1['prompt_len']}-token prompt: "
              + (f"decode {b1_tok_per_s:.1f} tok/s (median of {each}), roofline "
                 f"{b1['floor_tok_per_s']:.4g} tok/s "
                 f"({b1['step_bytes'] / 1e9:.3f} GB per step) = "
                 f"{100 * b1['fraction_of_floor']:.3g}%"
                 if b1_tok_per_s else "under 2 tokens, no decode rate")
              + f"; TTFT {b1['ttft_ms']:.1f} ms", flush=True)
        if plain is not None:
            report_speculative(b1)
        record["batch1"] = b1
        write_record(out_path, record)
    if out_path is not None:
        print(f"\nwrote {out_path}")
    return record


if __name__ == "__main__":
    main()
