"""The engine's device side: jitted steps over the page pool, in a few fixed shapes.

Four step functions, all pure (params, pool, ``counts`` where they sample, plain inputs)
-> new state:

* ``mixed_step``: one forward pass over a packed mix of prefill chunks and decode tokens
  (``model.forward_ragged``), then one sampled token per slot that finished its input.
  With ``score=True`` it also returns, for every packed token, the log-probability of a
  given target token and whether that target is the argmax (scoring requests). It is the
  only step that takes a structured-output token mask (one token per row and host round
  trip, so the host can compute each constrained row's mask for the token it samples).
* ``decode_steps``: up to ``num_steps`` decode iterations on the device: every row feeds
  its last token, writes its K/V into pages the host reserved ahead, samples the next token
  and stops on the device at a stop token, its token limit or the end of its reserved pages.
  The host syncs once per call, not once per token.
* ``verify_step``: speculative decoding: each row feeds its last token and up to ``K``
  proposed tokens in one forward pass, samples all ``K + 1`` positions as plain decoding
  would, and accepts the proposals that equal those samples (``jaxinfer.speculative``).
* ``draft_step``: a draft model's greedy proposals for the verify step, on its own pool.

XLA:GPU evaluates a data-dependent ``while_loop`` condition or ``cond`` predicate on the host:
it copies the predicate back and waits for the stream. So the steps avoid them where they can:
the host picks the greedy or stochastic sampler statically (``stochastic``), and the decode
loop checks "any row still active?" only every ``chunk`` iterations (an inner loop with a
static trip count, which XLA runs without reading a predicate).

Shapes come from a few buckets (``token_buckets`` and ``row_buckets``) so a step computes
about the tokens it has while the number of compiled programs stays fixed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import LlamaConfig
from jaxinfer.model import Params, forward_ragged, fp8_gemms, lm_head, with_fp8_activations
from jaxinfer.paged_cache import PagePool
from jaxinfer.quantize import is_quantized
from jaxinfer.sampling import SamplingArrays, logsumexp_rows, record_tokens, sample
from jaxinfer.speculative import propose_ngram_rows
from sharding.mesh import MODEL
from sharding.rules import engine_pool_spec

Backend = Literal["reference", "pallas"]
_SCORE_CHUNK = 512  # rows of scoring logits materialised at once ([rows, vocab] float32)

DECODE_CHUNK = 4
"""Decode iterations between two "is any row still active?" checks (``decode_steps``): each
check costs a host read of a device flag; a call whose rows all stop runs at most
``DECODE_CHUNK - 1`` idle iterations."""


def token_buckets(max_tokens: int, smallest: int, fine: bool = True) -> tuple[int, ...]:
    """Packed-token counts a mixed step is padded to: powers of two ``n`` from ``smallest``
    up to ``max_tokens`` and, if ``fine``, ``3n/2`` between them (at most a third of a step is
    padding, for twice the programs to compile)."""
    out, n = [], smallest
    while n < max_tokens:
        out += [n, 3 * n // 2] if fine else [n]
        n *= 2
    return tuple(sorted({b for b in out if b < max_tokens} | {max_tokens}))


def row_buckets(max_rows: int, few: tuple[int, ...] = (2,)) -> tuple[int, ...]:
    """Row counts a decode call is padded to: the ``few`` small ones (single-request latency),
    then 8, 16, ...

    By default a lone request runs in a 2-row call: XLA rewrites a one-row matmul as
    multiply-and-reduce (dot strength reduction), which reads the 1B model's 2048-wide weights
    at ~1.2 TB/s on an H100; two rows keep XLA's GEMM (1B batch-1 565 -> 670 tok/s,
    bench/NOTES.md r38). The padding row has no keys and costs nothing in a weight-bound step.
    ``few=(1, 2, 4)`` suits weights whose few-row kernel computes every row it is given and
    takes up to 4 (``model.one_row_decode_weights``, ``pallas_kernels.word_gemv.WORD_ROWS``).
    """
    out, n = [min(r, max_rows) for r in few], 8
    while n < max_rows:
        out.append(n)
        n *= 2
    return tuple(sorted({*out, max_rows}))


def verify_tokens(rows: int, width: int, max_tokens: int) -> int:
    """Packed tokens of a verify step over ``rows`` rows proposing up to ``width`` tokens
    each: room for every row's last token and full proposal, rounded up to a multiple of 16
    (a tensor-core tile), at most ``max_tokens``. Not a mixed step's token bucket: a verify
    step is weight-bound like decode, and padding a 2-row verify to 128 tokens made it cost
    two decode steps on an H100 (bench/NOTES.md r45)."""
    return min(-(-rows * (width + 1) // 16) * 16, max_tokens)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``n``."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@struct.dataclass
class MixedInputs:
    """Inputs of one mixed step. T = packed tokens (a bucket), S = slots, P = pages/slot."""

    tokens: jax.Array  # Int['T'] packed input tokens (0 = padding)
    positions: jax.Array  # Int['T'] absolute position of each token in its sequence
    write_pages: jax.Array  # Int['T'] page receiving each token's K/V; num_pages = drop
    write_offsets: jax.Array  # Int['T'] offset within that page
    targets: jax.Array  # Int['T'] token whose logprob is wanted after this one; -1 none
    block_tables: jax.Array  # Int['S P']
    kv_lens: jax.Array  # Int['S'] keys per slot after this step's tokens
    cu_q_lens: jax.Array  # Int['S+1'] cumulative tokens per slot (slot order)
    last_index: jax.Array  # Int['S'] packed index of each slot's last token
    gen_index: jax.Array  # Int['S'] index of the token being sampled (folded into the key)
    samples: jax.Array  # Bool['S'] slot finishes its input this step and samples a token
    sampling: SamplingArrays  # [S]
    # Int['S W'] allowed-token bitmask per slot (sampling.apply_token_mask), W = ceil(V/32);
    # None when no sampling slot is constrained: then nothing is transferred or masked.
    token_mask: jax.Array | None = None
    # Int['T'] slot whose token the previous mixed step sampled is this entry's input, fed
    # on the device (the engine launches a step before reading the last one's tokens); -1:
    # ``tokens`` holds it. None (with ``fed_tokens``): every input is in ``tokens``.
    feed_slots: jax.Array | None = None
    fed_tokens: jax.Array | None = None  # Int['S'] the previous mixed step's ``out["tokens"]``


@struct.dataclass
class DecodeInputs:
    """Inputs of one multi-step decode call over rows = slots ``[0, B)``."""

    tokens: jax.Array  # Int['B'] last sampled token of each row: the first input
    positions: jax.Array  # Int['B'] position that input token takes (= keys so far)
    block_tables: jax.Array  # Int['B P']
    active: jax.Array  # Bool['B'] row decodes in this call
    remaining: jax.Array  # Int['B'] tokens the row may still generate (max_new_tokens left)
    limit: jax.Array  # Int['B'] positions below this have reserved pages
    gen_index: jax.Array  # Int['B'] index of the next token to sample
    stop_ids: jax.Array  # Int['B K'] stop token ids, -1 padded
    num_steps: jax.Array  # Int[] iterations to run at most (<= the static buffer size)
    sampling: SamplingArrays  # [B]
    # Int[] the loop also ends once this many of its rows have stopped (the engine's waiting
    # requests need that many free slots); None: only when every row has.
    stop_after: jax.Array | None = None


@struct.dataclass
class SpecInputs:
    """Inputs of one speculation call (``ngram_steps``, ``draft_steps``) over rows = slots
    ``[0, B)``."""

    decode: DecodeInputs  # rows, stops, reserved positions (limit), iterations, sampling
    history: jax.Array  # Int['B L'] each row's tokens so far (prompt, generated), -1 after
    history_len: jax.Array  # Int['B'] tokens in each row's history
    num_tokens: jax.Array  # Int['B'] most proposals per iteration; 0: the row only decodes
    ngram_max: jax.Array  # Int['B'] longest suffix looked up (n-gram)
    ngram_min: jax.Array  # Int['B'] shortest suffix looked up (n-gram)


def _constrain_pool(k: Any, v: Any) -> tuple[Any, Any]:
    """On a mesh, keep the pool split by K/V heads (same shardings in and out)."""
    if jax.sharding.get_abstract_mesh().empty:
        return k, v
    spec = engine_pool_spec(stacked=not isinstance(k, tuple))
    return (jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), k),
            jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), v))


def _replicated(x: jax.Array) -> jax.Array:
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def target_logprobs(params: Params, h: jax.Array, targets: jax.Array,
                    deterministic: bool = False) -> tuple[jax.Array, jax.Array]:
    """Log-probability of ``targets [T]`` after hidden states ``h [T, hidden]``, and whether
    each target is the argmax; rows with target -1 give 0 / True.

    Logits are made ``_SCORE_CHUNK`` rows at a time, so memory stays ``chunk x vocab``.
    """
    t = h.shape[0]
    chunk = min(_SCORE_CHUNK, t)
    pad = -t % chunk
    hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk, h.shape[1])
    tp = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, chunk)

    def one(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, tc = xs
        logits = lm_head(params, hc, deterministic)  # [chunk, V] float32
        lse = logsumexp_rows(logits, deterministic)
        safe = jnp.maximum(tc, 0)
        picked = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
        greedy = jnp.argmax(logits, axis=-1) == safe
        valid = tc >= 0
        return jnp.where(valid, picked - lse, 0.0), greedy | ~valid

    lp, greedy = jax.lax.map(one, (hp, tp))
    return lp.reshape(-1)[:t], greedy.reshape(-1)[:t]


def new_counts(rows: int, vocab: int) -> np.ndarray:
    """An empty token-count table ``int32 [rows, vocab]`` (``sampling.apply_penalties``)."""
    return np.zeros((rows, vocab), np.int32)


FP8_ACTIVATION_ROWS = 128
"""Token rows from which a step program over ``model.fp8_input_last`` weights runs every fp8
matmul fp8 x fp8 (activations scaled into e4m3 per row) and is compiled with
``CUBLAS_GEMMS``; with fewer, every such matmul converts its weight inside XLA's Triton GEMM.
H100, 8 chained 8B layers (bench/NOTES.md r116): weight-only 157 us per layer at 64 rows
against 166 fp8 x fp8 (cuBLASLt), 197 against 160 at 128, 336 against 205 at 256. The choice
is per program, not per matmul: cuBLAS cannot fuse the weight's convert (a bf16 copy each
call: 508 us at 64 rows), and XLA's own fp8 x fp8 GEMMs compile slowly."""

CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}
"""XLA options of a program whose matmuls run fp8 x fp8 (``gemm_options``): every GEMM a
cuBLAS(Lt) call, none a Triton GEMM XLA autotunes. H100, 8 layers of 8B shapes at 4,096 rows
(bench/NOTES.md r113): compiled in 1.4 s and ran 1.98 ms per layer (bf16: 2.70); with XLA's
Triton GEMMs the same program did not compile in minutes (r88-r89, r106)."""


_XLA_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
# XLA's default command-buffer contents, which both decode-loop option sets extend.

DEVICE_LOOP_GRAPHS = {"xla_gpu_enable_command_buffer": _XLA_COMMANDS + ",WHILE,CONDITIONAL"}
"""The base of ``decode_options``: XLA's default command-buffer contents plus ``WHILE`` and
``CONDITIONAL``, so the whole decode loop (its chunks and their check for active rows) runs
inside one CUDA graph, its predicates read on the device. By default each chunk ends with the
host reading the predicate, and the next chunk's graph launch then starts on an idle GPU
(r148's timeline: ~1.2-1.5 ms per chunk of 4 tokens under the profiler). H100, 8B int4-g128
batch 1 (bench/NOTES.md r150): 377.4 against 356.2 tok/s. Not for the speculation loops:
the draft-model loop ran 39.0 against 18.4 ms per iteration with it (r151). Other backends
ignore the option."""


TP_DEVICE_LOOP_GRAPHS = {"xla_gpu_enable_command_buffer": _XLA_COMMANDS + ",COLLECTIVES"}
"""XLA options of ``decode_steps`` over tensor-parallel params: each loop iteration in one
CUDA graph with its NCCL all-reduces, the loops themselves on the host. ``DEVICE_LOOP_GRAPHS``
cannot hold such a loop: NCCL's all-reduces can be captured, but not inside a graph's
``WHILE`` ("Failed to instantiate CUDA graph", r167). This needs NCCL's all-reduces: XLA's
own one-shot kernels (``kCollectiveKernel`` thunks, its default for small all-reduces)
cannot be captured at all, and only ``XLA_FLAGS`` turns them off (``xla_flags.DEFAULTS``,
set when ``jaxinfer`` is imported). Without either, an iteration ran as ~34 graphs between
66 host-launched all-reduces. 2x H200, 8B tp=2 batch 1 (bench/NOTES.md r161-r171): 292.6
against 259.6-262.8 tok/s; 70B tp=2 46.7 against 45.5-46.4."""


UNSPLIT_K_ROWS = 64
"""Rows from which a decode loop compiles with XLA's split-K off (``UNSPLIT_K``)."""

UNSPLIT_K = {"xla_gpu_experimental_force_split_k": 1}
"""XLA's split-K off (``decode_options``, ``tp_decode_options``). With split-K, XLA splits
a GEMM's K over programs and sums their partials in a reduce kernel after it. At 64 rows its
autotuner then picks unsplit GEMMs (cuBLAS's), and the reduces go (profiled at tp=2, 427
against 491 kernels a step, bench/NOTES.md r287; one device not profiled). At one row it
picks cuBLAS kernels that split K themselves and run slower: 2x H200, tp=2, 278.8 against
297.7 tok/s (8B), 49.7 against 50.9 (70B) (r286)."""


def decode_options(rows: int) -> dict[str, Any]:
    """XLA options of ``decode_steps`` over params on one device (or split over ``data``
    only) at ``rows`` rows: ``DEVICE_LOOP_GRAPHS``, and from ``UNSPLIT_K_ROWS`` rows
    ``UNSPLIT_K``. One H200, 8B engine at 64 slots, 400 requests (bench/NOTES.md r289, two
    runs a side): bf16 4,941 against 4,857 output tok/s, its decode calls 7.40 against 7.62 s
    of device time; int8, whose matmuls at up to 64 rows are all Pallas kernels that the
    option does not reach, 4,034 against 4,078 (0.989x, the size of the run-to-run spread).
    ``rows`` counts every row of the program (with params split over ``data``, all the
    replicas' together)."""
    return {**DEVICE_LOOP_GRAPHS, **UNSPLIT_K} if rows >= UNSPLIT_K_ROWS else DEVICE_LOOP_GRAPHS


def tp_decode_options(rows: int) -> dict[str, Any]:
    """XLA options of ``decode_steps`` over tensor-parallel params at ``rows`` rows:
    ``TP_DEVICE_LOOP_GRAPHS``, and from ``UNSPLIT_K_ROWS`` rows ``UNSPLIT_K``. 2x H200, 8B
    tp=2 at 64 rows (bench/NOTES.md r286-r287): 13,955 against 13,485 tok/s on one machine,
    with 427 kernels a step against 491."""
    return ({**TP_DEVICE_LOOP_GRAPHS, **UNSPLIT_K} if rows >= UNSPLIT_K_ROWS
            else TP_DEVICE_LOOP_GRAPHS)


def gemm_options(params: Params | Sequence[Params], rows: int) -> dict[str, Any] | None:
    """The XLA compiler options of a program over ``params`` (one model's, or several:
    target and draft) whose largest matmuls take ``rows`` rows: ``CUBLAS_GEMMS`` where its
    fp8 matmuls run fp8 x fp8 (some params are ``model.fp8_gemms``, and at least
    ``FP8_ACTIVATION_ROWS`` rows), else None (XLA's defaults)."""
    models = [params] if isinstance(params, dict) else list(params)
    fp8 = any(fp8_gemms(p) for p in models)
    return CUBLAS_GEMMS if fp8 and rows >= FP8_ACTIVATION_ROWS else None


def tensor_parallel(params: Params | Sequence[Params]) -> bool:
    """Whether some weight of ``params`` (one model's, or several) is split over a ``model``
    mesh axis of more than one device: its programs then hold tensor-parallel all-reduces
    (``TP_DEVICE_LOOP_GRAPHS``). Weights on one device, replicated, or split only over
    ``data`` are not. Concrete arrays only: inside a trace every model reads as not split."""
    models = [params] if isinstance(params, dict) else list(params)
    for model in models:
        for leaf in jax.tree.leaves(model):
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                continue
            if len(sharding.device_set) == 1:
                break  # this model lives on one device: none of its weights is split
            if (isinstance(sharding, jax.sharding.NamedSharding)
                    and sharding.mesh.shape.get(MODEL, 1) > 1
                    and any(MODEL in (axes if isinstance(axes, tuple) else (axes,))
                            for axes in sharding.spec if axes is not None)):
                return True
    return False


class StepProgram:
    """``fn(*models, *args, **kwargs)`` jitted (``jit_kwargs``) with the XLA options a call
    needs: ``base(rows)`` (no ``base``: XLA's defaults), or ``tp_base(rows)`` where the
    models are ``tensor_parallel`` (when given), each with ``CUBLAS_GEMMS`` added where
    ``gemm_options`` picks it for those params and ``rows(*args, **kwargs)``; ``models`` are
    the first ``num_models`` arguments (model params), their fp8 matmuls set to match
    (``model.with_fp8_activations``: fp8 x fp8 in the cuBLAS program, weight-only in the
    other). Each program is compiled on first use."""

    def __init__(self, fn: Callable[..., Any], rows: Callable[..., int], num_models: int = 1,
                 base: Callable[[int], dict[str, Any]] | None = None,
                 tp_base: Callable[[int], dict[str, Any]] | None = None, **jit_kwargs: Any):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._rows = rows
        self._num_models = num_models
        self._base = base
        self._tp_base = tp_base
        self._jit_kwargs = jit_kwargs
        self._jits: dict[tuple[tuple[str, Any], ...], Any] = {}  # options' items -> jit

    def options(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        """The compiler options of the program a call with these arguments runs (None:
        XLA's defaults)."""
        return self._options(args, kwargs)[0]

    def _options(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """``(options, gemms)`` of a call: its program's compiler options, and the part of
        them ``gemm_options`` adds (None: none), from the call's rows counted once."""
        models = args[:self._num_models]
        rows = self._rows(*args[self._num_models:], **kwargs)
        gemms = gemm_options(models, rows)
        if self._tp_base is not None and tensor_parallel(models):
            base = self._tp_base(rows)
        else:
            base = self._base(rows) if self._base is not None else None
        return ({**(base or {}), **gemms} if gemms else base), gemms

    def compiled(self) -> dict[str, int]:
        """Programs compiled so far: ``{"default": n, "cublas": m}`` (``cublas``: those with
        ``CUBLAS_GEMMS``)."""
        counts = {"default": 0, "cublas": 0}
        for items, program in self._jits.items():
            cublas = all(item in items for item in CUBLAS_GEMMS.items())
            counts["cublas" if cublas else "default"] += program._cache_size()
        return counts

    def _cache_size(self) -> int:
        """Programs compiled so far, all variants together: ``jax.jit``'s count, so tests
        that watch for recompilation treat this like any jitted step."""
        return sum(self.compiled().values())

    def _program(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, tuple[Any, ...]]:
        options, gemms = self._options(args, kwargs)
        models = tuple(m if not fp8_gemms(m) else with_fp8_activations(m, gemms is not None)
                       for m in args[:self._num_models])
        key = tuple(sorted((options or {}).items()))
        program = self._jits.get(key)
        if program is None:  # replica threads may race here: setdefault keeps one jit
            program = self._jits.setdefault(
                key, jax.jit(self._fn, compiler_options=options, **self._jit_kwargs))
        return program, models + args[self._num_models:]

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The program a call with these arguments runs, lowered (``jax.jit(...).lower``)."""
        program, args = self._program(args, kwargs)
        return program.lower(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``fn``'s result, from the program ``options`` picks."""
        program, args = self._program(args, kwargs)
        return program(*args, **kwargs)


def step_program(rows: Callable[..., int], num_models: int = 1,
                 base: Callable[[int], dict[str, Any]] | None = None,
                 tp_base: Callable[[int], dict[str, Any]] | None = None,
                 **jit_kwargs: Any) -> Callable[[Callable[..., Any]], StepProgram]:
    """Decorator: ``StepProgram(fn, rows, num_models, base, tp_base, **jit_kwargs)``."""
    return lambda fn: StepProgram(fn, rows, num_models, base, tp_base, **jit_kwargs)


@step_program(lambda pool, counts, inp, **_: inp.tokens.shape[0],
              static_argnames=("config", "backend", "dtype", "max_q_len", "score",
                               "stochastic", "deterministic", "num_top"),
              donate_argnums=(1, 2))
def mixed_step(
    params: Params,
    pool: PagePool,
    counts: jax.Array,
    inp: MixedInputs,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    max_q_len: int,
    score: bool,
    stochastic: bool,
    deterministic: bool = False,
    num_top: int = 0,
) -> tuple[PagePool, jax.Array, dict[str, jax.Array]]:
    """One forward pass over packed tokens, then one sampled token per sampling slot.

    ``stochastic`` (static): some sampling slot has a temperature above 0 (``sample``).
    ``deterministic`` (static): batch-invariant kernels (``forward_ragged``).
    ``num_top`` (static): most likely tokens returned per slot (``sample``).
    ``counts [S, V]`` is each slot's token-count table for the penalties (the host loads a
    slot's row with ``load_counts`` when a request that uses a penalty is admitted);
    ``inp.token_mask`` (None or ``[S, W]``) constrains the sampled tokens; entries with
    ``inp.feed_slots >= 0`` take their input token from ``inp.fed_tokens``. Returns
    ``(pool, counts, out)`` with ``out["tokens"], out["logprobs"]`` ``[S]`` (rows of slots
    that do not sample are garbage), with ``num_top`` ``out["top_ids"]`` and
    ``out["top_logprobs"]`` ``[S, num_top]``, and with ``score``
    ``out["target_logprobs"]`` and ``out["target_greedy"]`` ``[T]``.
    """
    tokens = inp.tokens  # [T]
    if inp.feed_slots is not None:
        fed = inp.fed_tokens[jnp.maximum(inp.feed_slots, 0)]  # [T]
        tokens = jnp.where(inp.feed_slots >= 0, fed, tokens)
    h, k, v = forward_ragged(params, config, tokens, inp.positions, pool.k, pool.v,
                             inp.write_pages, inp.write_offsets, inp.block_tables, inp.kv_lens,
                             inp.cu_q_lens, max_q_len=max_q_len, backend=backend, dtype=dtype,
                             deterministic=deterministic)
    k, v = _constrain_pool(k, v)
    logits = lm_head(params, h[inp.last_index], deterministic)  # [S, V]: each slot's last token
    tokens, logprobs, top_ids, top_lps = sample(logits, inp.sampling, counts, inp.gen_index,
                                                stochastic, deterministic, inp.token_mask,
                                                num_top)
    counts = _replicated(record_tokens(counts, tokens, inp.samples))
    out = {"tokens": tokens, "logprobs": logprobs}
    if num_top:
        out["top_ids"], out["top_logprobs"] = top_ids, top_lps
    if score:
        out["target_logprobs"], out["target_greedy"] = target_logprobs(params, h, inp.targets,
                                                                       deterministic)
    return PagePool(k=k, v=v), counts, out


@functools.partial(jax.jit, donate_argnums=(0,))
def load_counts(counts: jax.Array, row: jax.Array, prompt_ids: jax.Array,
                generated_ids: jax.Array) -> jax.Array:
    """Row ``row`` of ``counts [S, V]`` := the table of a sequence with ``prompt_ids [N]``
    and ``generated_ids [M]`` (both V-padded; padding is dropped)."""
    counts = counts.at[row].set(0).at[row, prompt_ids].set(1, mode="drop")
    return counts.at[row, generated_ids].add(2, mode="drop")


@step_program(lambda pool, counts, inp, **_: inp.tokens.shape[0], base=decode_options,
              tp_base=tp_decode_options,
              static_argnames=("config", "backend", "dtype", "max_steps", "chunk", "stochastic",
                               "deterministic", "num_top"),
              donate_argnums=(1, 2))
def decode_steps(
    params: Params,
    pool: PagePool,
    counts: jax.Array,
    inp: DecodeInputs,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    max_steps: int,
    chunk: int,
    stochastic: bool,
    deterministic: bool = False,
    num_top: int = 0,
) -> tuple[PagePool, jax.Array, dict[str, jax.Array]]:
    """Decode up to ``inp.num_steps`` tokens per active row without leaving the device.

    Rows are slots ``[0, B)``; ``counts`` is the engine's ``[S, V]`` token-count table (rows
    ``[0, B)`` used). A row stops after sampling a stop token (recorded, so the host knows
    why), after ``remaining`` tokens, or when its next input position reaches ``limit``. The
    loop ends at the first multiple of ``chunk`` (static, dividing ``max_steps``) iterations
    where no row is active, ``inp.stop_after`` rows have stopped, or ``num_steps`` is
    reached; iterations past a row's stop compute but write nothing. ``stochastic``
    (static): some active row has a temperature above 0; ``deterministic`` (static):
    batch-invariant kernels (``forward_ragged``); ``num_top`` (static): most likely tokens
    returned per row and iteration (``sample``). No row is
    constrained by a token mask (the engine runs those through ``mixed_step``).

    Returns ``(pool, counts, out)``: ``out["tokens"]`` ``[max_steps, B]`` (-1 where a row
    was not active at that iteration), ``out["logprobs"]`` ``[max_steps, B]`` and, with
    ``num_top``, ``out["top_ids"]`` and ``out["top_logprobs"]`` ``[max_steps, B, num_top]``.
    """
    if max_steps % chunk:
        raise ValueError(f"max_steps={max_steps} must be a multiple of chunk={chunk}")
    b = inp.tokens.shape[0]
    page_size = pool.page_size
    num_pages = pool.num_pages
    rows = jnp.arange(b)

    def iteration(_: Any, carry: tuple) -> tuple:
        step, pool_k, pool_v, counts_b, active, tokens, pos, remaining, gen, out = carry
        p = _in_loop(params)
        page = inp.block_tables[rows, jnp.minimum(pos // page_size,
                                                   inp.block_tables.shape[1] - 1)]
        write_pages = jnp.where(active, page, num_pages)  # inactive rows write nothing
        kv_lens = jnp.where(active, pos + 1, 0)
        h, pool_k, pool_v = forward_ragged(
            p, config, tokens, pos, pool_k, pool_v, write_pages, pos % page_size,
            inp.block_tables, kv_lens, jnp.arange(b + 1, dtype=jnp.int32), max_q_len=1,
            backend=backend, dtype=dtype, deterministic=deterministic)
        pool_k, pool_v = _constrain_pool(pool_k, pool_v)
        new, lp, top_ids, top_lps = sample(lm_head(p, h, deterministic), inp.sampling,
                                           counts_b, gen, stochastic, deterministic,
                                           num_top=num_top)
        out = {"tokens": out["tokens"].at[step].set(jnp.where(active, new, -1)),
               "logprobs": out["logprobs"].at[step].set(lp),
               "top_ids": out["top_ids"].at[step].set(top_ids),
               "top_logprobs": out["top_logprobs"].at[step].set(top_lps)}
        counts_b = record_tokens(counts_b, new, active)
        stopped = jnp.any(new[:, None] == inp.stop_ids, axis=-1)
        pos = pos + active
        remaining = remaining - active
        gen = gen + active
        tokens = jnp.where(active, new, tokens)
        active = (active & ~stopped & (remaining > 0) & (pos < inp.limit)
                  & (step + 1 < inp.num_steps))
        return step + 1, pool_k, pool_v, counts_b, active, tokens, pos, remaining, gen, out

    def keep_going(carry: tuple) -> jax.Array:  # read on the host, once per chunk
        if inp.stop_after is None:
            return jnp.any(carry[4])
        stopped = jnp.sum(started & ~carry[4])
        return jnp.any(carry[4]) & (stopped < inp.stop_after)

    def chunk_of_iterations(carry: tuple) -> tuple:  # static trip count: no host read
        return jax.lax.fori_loop(0, chunk, iteration, carry)

    started = inp.active & (inp.remaining > 0) & (inp.num_steps > 0)  # [B]
    out = {"tokens": jnp.full((max_steps, b), -1, jnp.int32),
           "logprobs": jnp.zeros((max_steps, b), jnp.float32),
           "top_ids": jnp.zeros((max_steps, b, num_top), jnp.int32),
           "top_logprobs": jnp.zeros((max_steps, b, num_top), jnp.float32)}
    carry = (jnp.int32(0), pool.k, pool.v, counts[:b], started, inp.tokens, inp.positions,
             inp.remaining, inp.gen_index, out)
    _, k, v, counts_b, *_, out = jax.lax.while_loop(keep_going, chunk_of_iterations, carry)
    counts = _replicated(jax.lax.dynamic_update_slice(counts, counts_b, (0, 0)))
    if not num_top:
        del out["top_ids"], out["top_logprobs"]
    return PagePool(k=k, v=v), counts, out


@struct.dataclass
class SpecState:
    """Per-row state of a speculation loop (``ngram_steps``, ``draft_steps``), ``[B]`` each."""

    active: jax.Array  # Bool: the row runs this iteration
    last: jax.Array  # Int: its last token (the next input)
    pos: jax.Array  # Int: the position that token takes (= keys so far)
    remaining: jax.Array  # Int: tokens it may still generate
    gen: jax.Array  # Int: index of its next sampled token
    history: jax.Array  # Int['B L'] its tokens so far, -1 after
    history_len: jax.Array  # Int: tokens in its history


def _pack_rows(feed: jax.Array, fpos: jax.Array, q_lens: jax.Array, block_tables: jax.Array,
               page_size: int, num_pages: int, gen: jax.Array, active: jax.Array,
               sampling: SamplingArrays) -> MixedInputs:
    """The ragged inputs of up to ``W`` tokens per row, on the device: row ``r`` feeds
    ``feed[r, :q_lens[r]]`` (``[B, W]``) at positions ``fpos[r]`` (``[B, W]``, consecutive),
    packed row after row into ``B * W`` slots; its K/V go to its pages, and it samples after
    its last token when ``active``."""
    b, w = feed.shape
    t = b * w
    wide = jnp.arange(w)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
    dest = jnp.where(wide < q_lens[:, None], cu[:-1, None] + wide, t).reshape(-1)

    def packed(values: jax.Array, fill: int) -> jax.Array:
        return jnp.full(t, fill, jnp.int32).at[dest].set(values.reshape(-1).astype(jnp.int32),
                                                         mode="drop")

    page = block_tables[jnp.arange(b)[:, None],
                        jnp.clip(fpos // page_size, 0, block_tables.shape[1] - 1)]
    return MixedInputs(
        tokens=packed(feed, 0), positions=packed(fpos, 0), write_pages=packed(page, num_pages),
        write_offsets=packed(fpos % page_size, 0), targets=jnp.full(t, -1, jnp.int32),
        block_tables=block_tables, kv_lens=jnp.where(active, fpos[:, 0] + q_lens, 0),
        cu_q_lens=cu, last_index=jnp.maximum(cu[1:] - 1, 0), gen_index=gen, samples=active,
        sampling=sampling)


def _speculation_loop(params: Params, pool: PagePool, counts: jax.Array, inp: SpecInputs,
                      extra: Any, propose: Any, settle: Any, *, config: LlamaConfig,
                      backend: Backend, dtype: Any, width: int, max_steps: int, chunk: int,
                      stochastic: bool, deterministic: bool
                      ) -> tuple[PagePool, jax.Array, Any, dict[str, jax.Array]]:
    """The loop both speculation methods run: each iteration, ``propose(state, room,
    extra) -> (proposals [B, width], num [B], extra)`` proposes up to ``room [B]`` tokens
    per active row (its ``num_tokens``, within its remaining tokens and reserved positions),
    one ragged forward pass verifies them (``verify_step``'s body), the accepted proposals and
    one sampled token are emitted up to a stop token (emitted, then the row stops) or the
    row's token limit, and ``settle(extra, emitted [B], num [B]) -> extra`` updates the
    proposer's state. Returns ``(pool, counts, extra, out)`` (``ngram_steps`` says what
    ``out`` holds)."""
    if max_steps % chunk:
        raise ValueError(f"max_steps={max_steps} must be a multiple of chunk={chunk}")
    d = inp.decode
    b = d.tokens.shape[0]
    ps, num_pages = pool.page_size, pool.num_pages
    rows = jnp.arange(b)
    wide = jnp.arange(width + 1)
    out_len = max_steps * (width + 1)
    hist_len = inp.history.shape[1]

    def iteration(_: Any, carry: tuple) -> tuple:
        step, pool_k, pool_v, counts, st, extra, out, stats = carry
        p = _in_loop(params)
        # One sampled token always comes out: propose at most remaining - 1, and write K/V
        # only inside the reserved positions.
        room = jnp.where(st.active, jnp.clip(jnp.minimum(
            inp.num_tokens, jnp.minimum(st.remaining - 1, d.limit - st.pos - 1)), 0), 0)
        props, num, extra = propose(st, room, extra)
        num = jnp.where(st.active, jnp.minimum(num, room), 0)
        feed = jnp.concatenate([st.last[:, None], props], axis=1)  # [B, width + 1]
        mixed = _pack_rows(feed, st.pos[:, None] + wide, jnp.where(st.active, num + 1, 0),
                           d.block_tables, ps, num_pages, st.gen, st.active, d.sampling)
        pool_k, pool_v, counts, v = _verify(
            p, pool_k, pool_v, counts, mixed, props, num, config=config, backend=backend,
            dtype=dtype, max_q_len=width + 1, stochastic=stochastic,
            deterministic=deterministic, num_top=0)
        toks = v["tokens"]  # [B, width + 1]
        ok = wide[None, :] <= v["accepted"][:, None]
        stop = jnp.any(toks[:, :, None] == d.stop_ids[:, None, :], axis=-1) & ok
        stopped = jnp.any(stop, axis=1)
        e = jnp.where(stopped, jnp.argmax(stop, axis=1) + 1, v["accepted"] + 1)
        e = jnp.where(st.active, jnp.minimum(e, st.remaining), 0)  # [B] emitted
        emit = wide[None, :] < e[:, None]  # [B, width + 1]
        cursor = stats["emitted"]
        at = jnp.where(emit, cursor[:, None] + wide, out_len)
        out = {"tokens": out["tokens"].at[at, rows[:, None]].set(toks, mode="drop"),
               "logprobs": out["logprobs"].at[at, rows[:, None]].set(v["logprobs"],
                                                                     mode="drop")}
        extra = settle(extra, e, num)
        stats = {"emitted": cursor + e, "proposed": stats["proposed"] + num,
                 "accepted": stats["accepted"] + v["accepted"],
                 "verified": stats["verified"] + st.active,
                 "iterations": stats["iterations"] + jnp.any(st.active)}
        pos, remaining = st.pos + e, st.remaining - e
        st = SpecState(
            active=(st.active & ~stopped & (remaining > 0) & (pos < d.limit)
                    & (step + 1 < d.num_steps)),
            last=jnp.where(e > 0, toks[rows, jnp.maximum(e - 1, 0)], st.last), pos=pos,
            remaining=remaining, gen=st.gen + e,
            history=st.history.at[rows[:, None], jnp.where(
                emit, st.history_len[:, None] + wide, hist_len)].set(toks, mode="drop"),
            history_len=st.history_len + e)
        return step + 1, pool_k, pool_v, counts, st, extra, out, stats

    def keep_going(carry: tuple) -> jax.Array:  # read on the host, once per chunk
        return jnp.any(carry[4].active)

    def chunk_of_iterations(carry: tuple) -> tuple:  # static trip count: no host read
        return jax.lax.fori_loop(0, chunk, iteration, carry)

    st = SpecState(active=d.active & (d.remaining > 0) & (d.num_steps > 0)
                   & (d.positions < d.limit), last=d.tokens, pos=d.positions,
                   remaining=d.remaining, gen=d.gen_index, history=inp.history,
                   history_len=inp.history_len)
    zeros = jnp.zeros(b, jnp.int32)
    out = {"tokens": jnp.full((out_len, b), -1, jnp.int32),
           "logprobs": jnp.zeros((out_len, b), jnp.float32)}
    stats = {"emitted": zeros, "proposed": zeros, "accepted": zeros, "verified": zeros,
             "iterations": jnp.int32(0)}
    carry = (jnp.int32(0), pool.k, pool.v, counts, st, extra, out, stats)
    _, k, v, counts, _, extra, out, stats = jax.lax.while_loop(keep_going,
                                                               chunk_of_iterations, carry)
    del stats["emitted"]
    return PagePool(k=k, v=v), counts, extra, {**out, **stats}


@step_program(lambda pool, counts, inp, *, width, **_: inp.decode.tokens.shape[0] * (width + 1),
              static_argnames=("config", "backend", "dtype", "width", "longest", "max_steps",
                               "chunk", "stochastic", "deterministic"),
              donate_argnums=(1, 2))
def ngram_steps(
    params: Params,
    pool: PagePool,
    counts: jax.Array,
    inp: SpecInputs,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    width: int,
    longest: int,
    max_steps: int,
    chunk: int,
    stochastic: bool,
    deterministic: bool = False,
) -> tuple[PagePool, jax.Array, dict[str, jax.Array]]:
    """Up to ``inp.decode.num_steps`` n-gram speculation iterations without leaving the device.

    Each iteration, every active row proposes up to ``num_tokens`` tokens by prompt lookup in
    its own history (``speculative.propose_ngram_rows``; ``width`` and ``longest`` are the
    static bounds of ``num_tokens`` and ``ngram_max``), verifies them with its last token in
    one ragged forward pass (``verify_step``'s body) and emits the accepted proposals plus
    one sampled token: the tokens plain decoding emits. A row proposes no more than its
    remaining tokens allow and writes K/V only below ``limit`` (its reserved pages); it stops
    at a stop token (emitted, as in ``decode_steps``), at its token limit or at ``limit``.
    The loop checks for active rows every ``chunk`` iterations.

    Returns ``(pool, counts, out)``: ``out["tokens"]``, ``out["logprobs"]`` ``[max_steps *
    (width + 1), B]``: each row's emitted tokens in order, then -1; ``out["proposed"]``,
    ``out["accepted"]``, ``out["verified"]`` ``[B]``: proposals made, accepted (equal to the
    target's samples; those past a stop are not emitted) and iterations run per row;
    ``out["iterations"]``: iterations with a row active.
    """
    def propose(st: SpecState, room: jax.Array, extra: Any) -> tuple:
        props, num = propose_ngram_rows(st.history, st.history_len, room, inp.ngram_max,
                                        inp.ngram_min, width=width, longest=longest)
        return props, num, extra

    pool, counts, _, out = _speculation_loop(
        params, pool, counts, inp, None, propose, lambda extra, e, num: extra, config=config,
        backend=backend, dtype=dtype, width=width, max_steps=max_steps, chunk=chunk,
        stochastic=stochastic, deterministic=deterministic)
    return pool, counts, out


@step_program(lambda pool, draft_pool, counts, inp, *, width, **_:
              inp.decode.tokens.shape[0] * (width + 1), num_models=2, static_argnames=(
                  "config", "backend", "dtype", "draft_config", "draft_backend", "draft_dtype",
                  "width", "max_steps", "chunk", "stochastic", "deterministic",
                  "draft_deterministic"),
              donate_argnums=(2, 3, 4))
def draft_steps(
    params: Params,
    draft_params: Params,
    pool: PagePool,
    draft_pool: PagePool,
    counts: jax.Array,
    inp: SpecInputs,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    draft_config: LlamaConfig,
    draft_backend: Backend,
    draft_dtype: Any,
    width: int,
    max_steps: int,
    chunk: int,
    stochastic: bool,
    deterministic: bool = False,
    draft_deterministic: bool = False,
) -> tuple[PagePool, PagePool, jax.Array, dict[str, jax.Array]]:
    """``ngram_steps`` with a draft model's greedy proposals (``draft_step``) instead of
    prompt lookups. Every iteration the draft reads the tokens it has not seen (its row's
    last token, and the one before when the previous iteration accepted every proposal; on
    entry the draft must have read every token before the last), proposes ``num_tokens``
    tokens on its own pool (addressed by the target's block tables), and the target verifies
    them. The history gives the token before the last (``inp.ngram_*`` are unused). Returns
    ``(pool, draft_pool, counts, out)``: ``out`` as ``ngram_steps``'s, plus
    ``out["draft_lag"] [B]``: tokens before each row's last that the draft has not read.
    """
    b = inp.decode.tokens.shape[0]
    rows = jnp.arange(b)

    def propose(st: SpecState, room: jax.Array, extra: Any) -> tuple:
        pool_k, pool_v, lag = extra
        dp = _in_loop(draft_params)
        before = st.history[rows, jnp.maximum(st.history_len - 2, 0)]
        feed = jnp.where(lag[:, None] == 1, jnp.stack([before, st.last], 1),
                         jnp.stack([st.last, st.last], 1))  # [B, 2]
        mixed = _pack_rows(feed, st.pos[:, None] - lag[:, None] + jnp.arange(2),
                           jnp.where(st.active, lag + 1, 0), inp.decode.block_tables,
                           draft_pool.page_size, draft_pool.num_pages, st.gen, st.active,
                           inp.decode.sampling)
        pool_k, pool_v, props = _draft_proposals(
            dp, draft_config, pool_k, pool_v, mixed, room, num_pages=draft_pool.num_pages,
            page_size=draft_pool.page_size, num_steps=width, max_q_len=2,
            backend=draft_backend, dtype=draft_dtype, deterministic=draft_deterministic)
        return props, room, (pool_k, pool_v, lag)

    def settle(extra: Any, e: jax.Array, num: jax.Array) -> Any:
        # The draft holds K/V for the last token and the proposals it fed (all but the
        # last); after e emitted tokens it lags by the one it never fed when all were taken.
        pool_k, pool_v, lag = extra
        return pool_k, pool_v, jnp.where(e > 0, jnp.clip(e - jnp.maximum(num, 1), 0, 1), lag)

    pool, counts, (dk, dv, lag), out = _speculation_loop(
        params, pool, counts, inp, (draft_pool.k, draft_pool.v, jnp.zeros(b, jnp.int32)),
        propose, settle,
        config=config, backend=backend, dtype=dtype, width=width, max_steps=max_steps,
        chunk=chunk, stochastic=stochastic, deterministic=deterministic)
    return pool, PagePool(k=dk, v=dv), counts, {**out, "draft_lag": lag}


def _in_loop(params: Params) -> Params:
    """``params`` for use inside a loop body. The weights are loop-invariant, so XLA would
    hoist a quantized weight's dequantization (the XLA path of ``model._dense``) out of the
    loop and keep a bf16 copy of the model; an optimization barrier keeps it inside."""
    return jax.lax.optimization_barrier(params) if is_quantized(params) else params


@step_program(lambda pool, inp, num_proposed, **_: inp.tokens.shape[0],
              static_argnames=("config", "backend", "dtype", "max_q_len", "num_steps",
                               "deterministic"),
              donate_argnums=(1,))
def draft_step(
    params: Params,
    pool: PagePool,
    inp: MixedInputs,
    num_proposed: jax.Array,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    max_q_len: int,
    num_steps: int,
    deterministic: bool = False,
) -> tuple[PagePool, jax.Array]:
    """A draft model's proposals: one forward pass over packed tokens, then greedy decoding.

    Rows are slots ``[0, S)`` of the draft's pool (addressed by the target's block tables).
    The packed tokens are those each row's draft has not seen yet, up to its last token;
    then the rows propose ``num_steps`` (static) tokens: the argmax after their last token,
    then ``num_steps - 1`` single-token iterations on the device, each feeding the previous
    proposal and writing its K/V at the next position while the row wants another of its
    ``num_proposed [S]`` proposals (so nothing is written past the pages the host
    reserved). With ``num_steps`` 0 the step only catches the draft up (a prompt too long
    for one step). Returns ``(pool, proposals [S, num_steps])``; a row's proposals past its
    ``num_proposed`` are garbage.
    Greedy whatever the request's sampling: verification accepts a proposal only where the
    target's own sample equals it (``verify_step``), so the draft's choice affects the
    acceptance rate, never the output.
    """
    pool_k, pool_v, out = _draft_proposals(
        params, config, pool.k, pool.v, inp, num_proposed, num_pages=pool.num_pages,
        page_size=pool.page_size, num_steps=num_steps, max_q_len=max_q_len, backend=backend,
        dtype=dtype, deterministic=deterministic)
    return PagePool(k=pool_k, v=pool_v), out


def _draft_proposals(params: Params, config: LlamaConfig, pool_k: Any, pool_v: Any,
                     inp: MixedInputs, num_proposed: jax.Array, *, num_pages: int,
                     page_size: int, num_steps: int, max_q_len: int, backend: Backend,
                     dtype: Any, deterministic: bool) -> tuple[Any, Any, jax.Array]:
    """``draft_step`` on the pool's arrays (also the proposer of ``draft_steps``)."""
    h, pool_k, pool_v = forward_ragged(
        params, config, inp.tokens, inp.positions, pool_k, pool_v, inp.write_pages,
        inp.write_offsets, inp.block_tables, inp.kv_lens, inp.cu_q_lens, max_q_len=max_q_len,
        backend=backend, dtype=dtype, deterministic=deterministic)
    b = inp.kv_lens.shape[0]
    if num_steps == 0:
        return pool_k, pool_v, jnp.zeros((b, 0), jnp.int32)
    first = jnp.argmax(lm_head(params, h[inp.last_index], deterministic), axis=-1)  # [S]
    rows = jnp.arange(b)

    def iteration(j: jax.Array, carry: tuple) -> tuple:
        pool_k, pool_v, tokens, pos, out = carry
        p = _in_loop(params)
        active = j + 1 < num_proposed  # [S]: proposal j + 1 is wanted
        page = inp.block_tables[rows, jnp.minimum(pos // page_size,
                                                   inp.block_tables.shape[1] - 1)]
        h, pool_k, pool_v = forward_ragged(
            p, config, tokens, pos, pool_k, pool_v,
            jnp.where(active, page, num_pages), pos % page_size, inp.block_tables,
            jnp.where(active, pos + 1, 0), jnp.arange(b + 1, dtype=jnp.int32),
            max_q_len=1, backend=backend, dtype=dtype, deterministic=deterministic)
        new = jnp.argmax(lm_head(p, h, deterministic), axis=-1).astype(jnp.int32)
        return pool_k, pool_v, new, pos + 1, out.at[:, j + 1].set(new)

    out = jnp.zeros((b, num_steps), jnp.int32).at[:, 0].set(first)
    # The first proposal takes position kv_lens (the keys after the packed tokens).
    pool_k, pool_v, _, _, out = jax.lax.fori_loop(
        0, num_steps - 1, iteration, (pool_k, pool_v, first.astype(jnp.int32), inp.kv_lens,
                                      out))
    return pool_k, pool_v, out


def accepted_lengths(samples: jax.Array, proposals: jax.Array, num_proposed: jax.Array
                     ) -> jax.Array:
    """Proposals accepted per row: the length of the longest prefix of ``proposals [R, K]``
    (the first ``num_proposed [R]`` of each row) equal to ``samples [R, K + 1]``."""
    k = proposals.shape[1]
    match = (samples[:, :k] == proposals) & (jnp.arange(k)[None, :] < num_proposed[:, None])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


@step_program(lambda pool, counts, inp, proposals, num_proposed, **_: inp.tokens.shape[0],
              static_argnames=("config", "backend", "dtype", "max_q_len", "stochastic",
                               "deterministic", "num_top"),
              donate_argnums=(1, 2))
def verify_step(
    params: Params,
    pool: PagePool,
    counts: jax.Array,
    inp: MixedInputs,
    proposals: jax.Array,
    num_proposed: jax.Array,
    *,
    config: LlamaConfig,
    backend: Backend,
    dtype: Any,
    max_q_len: int,
    stochastic: bool,
    deterministic: bool = False,
    num_top: int = 0,
) -> tuple[PagePool, jax.Array, dict[str, jax.Array]]:
    """Verify proposed tokens: one forward pass, then every position sampled.

    Rows are slots ``[0, B)``; row ``r`` packs its last token and its ``num_proposed [B]``
    proposals (``proposals [B, K]``) at ``inp.cu_q_lens[r]`` (``inp.samples [B]`` marks the
    rows that verify). Position ``j`` of a row is sampled with the row's token index
    ``gen_index + j`` and, for the penalties, with the proposals before it counted as
    generated: what plain decoding samples there if those proposals are accepted. Returns
    ``(pool, counts, out)`` with ``out["tokens"], out["logprobs"]`` ``[B, K + 1]`` (with
    ``num_top``, ``out["top_ids"], out["top_logprobs"]`` ``[B, K + 1, num_top]``) and
    ``out["accepted"] [B]``: the row emits ``tokens[:accepted + 1]``. K/V of rejected
    proposals stay in the pool past the row's length, where later tokens overwrite them.
    """
    pool_k, pool_v, counts, out = _verify(
        params, pool.k, pool.v, counts, inp, proposals, num_proposed, config=config,
        backend=backend, dtype=dtype, max_q_len=max_q_len, stochastic=stochastic,
        deterministic=deterministic, num_top=num_top)
    return PagePool(k=pool_k, v=pool_v), counts, out


def _verify(params: Params, pool_k: Any, pool_v: Any, counts: jax.Array, inp: MixedInputs,
            proposals: jax.Array, num_proposed: jax.Array, *, config: LlamaConfig,
            backend: Backend, dtype: Any, max_q_len: int, stochastic: bool,
            deterministic: bool, num_top: int) -> tuple[Any, Any, jax.Array, dict]:
    """``verify_step`` on the pool's arrays (also the verification of the speculation
    loops)."""
    b, k = proposals.shape
    h, pool_k, pool_v = forward_ragged(
        params, config, inp.tokens, inp.positions, pool_k, pool_v, inp.write_pages,
        inp.write_offsets, inp.block_tables, inp.kv_lens, inp.cu_q_lens, max_q_len=max_q_len,
        backend=backend, dtype=dtype, deterministic=deterministic)
    pool_k, pool_v = _constrain_pool(pool_k, pool_v)
    width = jnp.arange(k + 1)
    packed = jnp.minimum(inp.cu_q_lens[:-1, None] + width, inp.tokens.shape[0] - 1)
    logits = lm_head(params, h[packed.reshape(-1)], deterministic)  # [B * (K + 1), V]
    per_row = jax.tree.map(lambda a: jnp.repeat(a, k + 1, axis=0), inp.sampling)
    # Row r, position j has generated the proposals before j: count them in a copy of its
    # row (pairs past the position, or past the row's proposals, go to the dropped column V).
    vocab = counts.shape[1]
    earlier = (width[:, None] > jnp.arange(k)[None, :])[None] & (
        jnp.arange(k)[None, None, :] < num_proposed[:, None, None])  # [B, K + 1, K]
    cols = jnp.where(earlier, proposals[:, None, :], vocab)
    rows = jnp.repeat(counts[:b], k + 1, axis=0).reshape(b, k + 1, vocab)
    rows = rows.at[jnp.arange(b)[:, None, None], width[None, :, None], cols].add(
        2, mode="drop").reshape(b * (k + 1), vocab)
    gen = (inp.gen_index[:, None] + width).reshape(-1)
    tokens, logprobs, top_ids, top_lps = sample(logits, per_row, rows, gen, stochastic,
                                                deterministic, None, num_top)
    tokens, logprobs = tokens.reshape(b, k + 1), logprobs.reshape(b, k + 1)
    accepted = jnp.where(inp.samples, accepted_lengths(tokens, proposals, num_proposed), 0)
    emitted = (width[None, :] <= accepted[:, None]) & inp.samples[:, None]  # [B, K + 1]
    counts_b = counts[:b].at[jnp.arange(b)[:, None], jnp.where(emitted, tokens, vocab)].add(
        2, mode="drop")
    counts = _replicated(jax.lax.dynamic_update_slice(counts, counts_b, (0, 0)))
    out = {"tokens": tokens, "logprobs": logprobs, "accepted": accepted}
    if num_top:
        out["top_ids"] = top_ids.reshape(b, k + 1, num_top)
        out["top_logprobs"] = top_lps.reshape(b, k + 1, num_top)
    return pool_k, pool_v, counts, out
