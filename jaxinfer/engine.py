"""The one engine every request runs through: a host scheduler and a device model runner.

Each ``step()`` plans on the host (plain Python/numpy), runs one jitted program from
``jaxinfer.runner``, and hands the sampled tokens to the output side (``requests.add_tokens``,
the one place stop rules live):

1. **Mixed step** when prompt work is pending (a running sequence still reading its prompt,
   or a waiting request that fits): decoding sequences get one token each, first, then
   prefill chunks of the oldest sequences and newly admitted requests fill the token budget.
   Admission is first come, first served into free slots; the longest cached prefix of a
   prompt is mapped from the prefix cache, not recomputed. The step is padded to the
   smallest token bucket holding its tokens. While prompt work remains, the next mixed step
   is planned and launched before this one's results are read, so the device never waits
   for the host between them: each sequence sampling in this step is planned as if its
   token were known (a placeholder on the host), and the device feeds the token it sampled
   into the next step (``MixedInputs.feed_slots``). A sequence that stops in this step has
   its next step's work discarded, never output.
2. **Decode call** otherwise: every running sequence decodes several tokens (as many as fit
   in about ``decode_call_seconds`` of device time, at most ``decode_steps``; while waiting
   requests need slots, until enough rows have stopped, checked on the device)
   in one device loop. Pages for those tokens are reserved first; stop tokens, token limits
   and the reserved pages are checked on the device, so the host syncs once per call.
   While a request with a ``response_format`` decodes, every step is a mixed step instead:
   its next token's mask depends on the token before, so the host computes the masks
   (``structured.fill_masks``) and the device applies them, one token per round trip.
3. **Speculation** instead of a plain decode call when running requests ask for it
   (``SamplingParams.speculative``) and it pays: each row proposes up to ``k`` tokens, one
   forward pass checks them all, and each row emits the accepted proposals plus one sampled
   token, exactly what plain decoding would emit. Requests of one method run its device
   loop (``runner.ngram_steps``, ``runner.draft_steps``): proposals, verification and stop
   rules on the device for several iterations per host round trip, like a decode call. A
   batch mixing the methods, or asking for top log-probabilities, runs one verify step per
   round trip (``runner.verify_step``), its proposals from ``speculative.propose_ngram`` on
   the host or ``runner.draft_step`` on the device.
   The engine measures each kind per row bucket and speculates only while that is faster
   (``Speculative.adaptive``).

When the pool cannot hold the planned tokens, the youngest running sequence is preempted:
its pages are released (full ones stay in the prefix cache) and it is requeued to be
recomputed later. A sampled token depends only on the request's own seed, token index and
tokens, so an output does not depend on the batch, on chunking, on multi-step decode or on
preemption.

Scoring requests (``requests.make_score_requests``) run the same mixed steps: their
continuation's log-probabilities come out of the forward pass, nothing is sampled, and a
context shared by several continuations is computed once through the prefix cache.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.attention import resolve_backend
from jaxinfer.errors import InputError
from jaxinfer.model import one_row_decode_weights, pool_is_stacked
from jaxinfer.paged_cache import BlockManager, PagePool, check_kv_cache_dtype, pages_for_budget
from jaxinfer.requests import (
    Completion,
    Model,
    Progress,
    Prompt,
    Request,
    ScoreResult,
    add_tokens,
    check_draft,
    completion,
    make_requests,
    score_result,
)
from jaxinfer.runner import (
    DECODE_CHUNK,
    DecodeInputs,
    MixedInputs,
    SpecInputs,
    bucket,
    decode_steps,
    draft_step,
    draft_steps,
    load_counts,
    mixed_step,
    new_counts,
    ngram_steps,
    row_buckets,
    token_buckets,
    verify_step,
    verify_tokens,
)
from jaxinfer.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingArrays,
    SamplingParams,
    is_int,
    is_real,
    prng_key_data,
)
from jaxinfer.speculative import NGRAM_WINDOW, Speculative, propose_ngram
from jaxinfer.structured import TokenMatcher, fill_masks, mask_words
from sharding.mesh import mesh_sizes, spans_processes
from sharding.placement import on_mesh, to_host
from sharding.rules import engine_pool_sharding

Event = tuple[int, list[int], bool]  # (request_id, new_token_ids, finished)

_ANNOUNCED: set[tuple[Any, ...]] = set()  # step programs this process was told about

SCHEDULES = ("fcfs", "longest_first")
"""Admission orders of waiting requests (``Engine(schedule=...)``)."""

CPU_KV_CACHE_BYTES = 128 * 2**20
"""KV pool budget on a device that reports no free memory (CPU): 128 MiB."""

VERIFY_MAX_ROWS = 64
"""Largest row bucket a verify step runs (it samples ``rows x (k + 1)`` vocabulary rows);
beyond it the engine decodes without speculation."""

SPECULATION_RETRY = 16
"""Plain decode calls after which an adaptive speculation loop that did not pay is tried
again."""


def check_max_decode_steps(max_decode_steps: Any) -> None:
    """Raise ``InputError`` unless ``max_decode_steps`` (``step``'s cap) is None or an
    integer >= 1."""
    if max_decode_steps is not None and not (is_int(max_decode_steps) and max_decode_steps >= 1):
        raise InputError(f"max_decode_steps={max_decode_steps!r} must be an integer >= 1 (or "
                         "None: the engine's own call length)")


def step_workspace_bytes(config: Any, slots: int, max_tokens: int,
                         kv_cache_dtype: str | None = None) -> int:
    """Device bytes the steps need besides weights and pool: kept free when sizing the pool.

    Activations of the largest mixed step (float32 upper bound on its widest tensors), the
    sampling rows ``[slots, vocab]`` (logits, log-softmax, penalised and filtered copies,
    and the int32 token-count table), one scoring chunk of logits, and 1 GiB for XLA/cuBLAS
    workspaces and autotuning. A quantized ``kv_cache_dtype`` adds the float32 copies of the
    step's K and V that are quantized before the write (the kernels dequantize in registers:
    no pool-sized buffer).
    """
    c = config
    width = 3 * c.hidden_size + 2 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) \
        * c.head_dim
    activations = 2 * max_tokens * width * 4
    sampling = 5 * slots * c.vocab_size * 4
    scoring = 2 * min(512, max_tokens) * c.vocab_size * 4
    kv_quant = 0 if kv_cache_dtype is None else 2 * max_tokens * c.num_kv_heads * c.head_dim * 4
    return activations + sampling + scoring + kv_quant + 2**30


@dataclasses.dataclass
class RequestMetrics:
    """Timings of one request, in seconds from its submission (None until they happen)."""

    queue_time: float | None  # submission -> first admission
    time_to_first_token: float | None
    time_per_output_token: float | None  # mean gap between later tokens
    num_generated: int
    num_preemptions: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache at admission


@dataclasses.dataclass
class EngineStats:
    """Engine-wide counters; ``tokens_per_second`` counts generated tokens over step time."""

    steps: int
    decode_calls: int  # multi-step decode calls among the steps
    running: int
    waiting: int
    generated_tokens: int
    computed_tokens: int  # tokens run through the model (prefill + decode), padding excluded
    padded_tokens: int  # token slots the compiled shapes computed, padding included
    tokens_per_second: float
    step_seconds: float  # wall time inside step()
    device_seconds: float  # of which: from launching a step program (one launched ahead:
    # from the results before it) to its results on the host
    decode_seconds: float  # of which: in plain multi-step decode calls (the rest: mixed and
    # verify steps, speculation loops included)
    pages_total: int
    pages_used: int  # referenced by live sequences
    pages_cached: int  # unreferenced, kept for the prefix cache (evictable)
    pages_free: int  # neither
    peak_pages_used: int
    tokens_capacity: int  # pages_total * page_size
    tokens_held: int  # positions with K/V in the pool for running sequences
    prefix_cache_hit_rate: float  # cached tokens / prompt tokens looked up at admission
    cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int
    num_programs: int  # distinct step shapes run (each compiled once per process)
    verify_steps: int = 0  # speculative verify steps among the steps
    verified_rows: int = 0  # sequences advanced by them (one per row and step)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, accepted
    draft_seconds: float = 0.0  # of device_seconds: in draft-model proposals of verify steps
    # (a speculation loop's iterations include its draft's time)
    ahead_steps: int = 0  # mixed steps launched before the results of the step before them
    # were read (their host work overlapped the device)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 without speculation)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verify step: accepted proposals + the sampled one."""
        return ((self.accepted_tokens + self.verified_rows) / self.verified_rows
                if self.verified_rows else 0.0)


@dataclasses.dataclass
class _Seq:
    """Host state of one request."""

    rid: int
    req: Request
    key: np.ndarray  # uint32[2] PRNG key data (seed resolved at submission)
    tokens: list[int]  # prompt + generated: what the cache is built from
    progress: Progress = dataclasses.field(default_factory=Progress)
    num_computed: int = 0  # positions whose K/V are in the pool
    draft_computed: int = 0  # positions whose draft-model K/V are in the draft's pool
    slot: int = -1
    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    score_lp: np.ndarray | None = None  # [num_scored] float32 (scoring requests)
    score_greedy: np.ndarray | None = None  # [num_scored] bool
    unknown: int = 0  # the last ``unknown`` of ``tokens`` are placeholders (UNKNOWN): sampled
    # by mixed steps launched but not yet read back (at most two: a step and the one ahead)

    @property
    def first_output(self) -> int:
        """First position whose output is needed: the prompt's last token (generation) or the
        token before the continuation (scoring). The prefix cache maps pages before it only."""
        return len(self.req.prompt_ids) - self.req.num_scored - 1

    @property
    def compute_end(self) -> int:
        """Positions to compute before the next output: all known tokens when generating;
        all but the continuation's last token when scoring (nothing follows it)."""
        return len(self.tokens) - (1 if self.req.is_score else 0)

    def samples_after(self, n: int) -> bool:
        """Whether computing its next ``n`` tokens reaches its last known token, so a token
        is sampled after them (never for a scoring request)."""
        return not self.req.is_score and self.num_computed + n == len(self.tokens)

    @property
    def pending(self) -> int:
        """Tokens still to compute; 1 means a generating sequence is in its decode phase."""
        return self.compute_end - self.num_computed


UNKNOWN = -1
"""Placeholder in ``_Seq.tokens`` for a token a launched mixed step samples (read back at its
collection; the device feeds it to the step launched ahead)."""


class _Entry(NamedTuple):
    """One sequence's part of a launched mixed step."""

    slot: int  # its slot at launch (the packed order; ``seq.slot`` differs once it ended)
    seq: _Seq
    start: int  # first position computed
    n: int  # tokens computed
    samples: bool  # the step samples its next token


@dataclasses.dataclass
class _Call:
    """A step program launched on the device (asynchronously) and what its results mean."""

    out: Any  # the program's results (device arrays)
    launched: float  # perf_counter() at launch
    padded: int  # token slots the program computes
    entries: list[_Entry] | None = None  # mixed step: its sequences in slot order
    score: bool = False  # mixed step: with target log-probabilities
    rows: list[_Seq] | None = None  # decode call: the sequences it advances
    proposals: list[tuple[_Seq, list[int]]] | None = None  # verify step: rows, proposals
    loop: str = ""  # speculation loop on the device: "ngram" or "draft" (``runner``)
    compiled: bool = False  # XLA compiled the program for this call (its time is not a step's)


class StepLoop:
    """The caller-side methods of an engine, on top of its ``model``, ``add_request``,
    ``step``, ``has_unfinished``, ``check_request``, ``finished``, ``result`` and ``forget``
    (shared by ``Engine`` and ``replicas.DataParallelEngine``)."""

    def submit(
        self,
        prompt: Prompt,
        *,
        chat: bool = False,
        sampling: SamplingParams | None = None,
        **sampling_kwargs: Any,
    ) -> int:
        """Queue one generation request (same prompt forms and options as ``generate``).

        Returns its id; it joins the running batch at the next ``step()`` that has room.
        """
        reqs = make_requests(self.model, prompt, chat, sampling, sampling_kwargs)
        if len(reqs) != 1:
            raise InputError(f"submit takes one prompt, got {len(reqs)}; call submit once per "
                             "prompt")
        return self.add_request(reqs[0])

    def events(self) -> Iterator[Event]:
        """Stream events until every submitted request is finished (more may be submitted)."""
        while self.has_unfinished():
            yield from self.step()

    def run_until_done(self) -> None:
        """Step until no request is waiting or running, with ``no_arrivals``: nothing can be
        submitted while the caller waits here."""
        while self.has_unfinished():
            self.step(no_arrivals=True)

    def run(self, request_ids: Sequence[int]) -> list[Completion | ScoreResult]:
        """Step until the given requests finish; return their results in order (and forget
        them: ``request_metrics`` no longer knows these ids).

        Steps with ``no_arrivals``: nothing can be submitted while the caller waits here."""
        pending = set(request_ids)
        while pending:
            for i in pending:
                self.check_request(i)
            pending = {i for i in pending if not self.finished(i)}
            if pending:
                self.step(no_arrivals=True)
        results = [self.result(i) for i in request_ids]
        for i in request_ids:  # the caller holds the results; keep no per-request state
            self.forget(i)
        return results


class Engine(StepLoop):
    """Continuous batching over a paged KV cache for one model; serves every entry point.

    ``Engine(model)`` needs no sizing arguments: the pool takes ``memory_fraction`` of the
    free device memory (``CPU_KV_CACHE_BYTES`` on CPU), and slots and the token budget follow
    from the pool and the device. Every argument below overrides one of those choices.

    Args:
      model: a ``jaxinfer.Model`` (``load_model`` or hand-built).
      max_batch: sequences running at once (slots). Default ``model.max_batch`` if set, else
        256 on an accelerator (32 on CPU), capped at one slot per 256 pool tokens (H100, 1B
        shapes: 512 slots ran slower than 256, bench/NOTES.md).
      kv_cache_bytes: device bytes for the page pool (per device on a mesh); a model with
        an int8/fp8 ``kv_cache_dtype`` fits about twice the pages in them.
        ``num_pages`` sets the pool size directly instead.
      page_size: tokens per page (a power of two for the Pallas kernel).
      max_tokens_per_step: token budget of a mixed step (decode tokens + prefill chunks), the
        largest token bucket. Default 4096 on an accelerator (large prefill chunks run near
        the matmul rate), 256 on CPU; at least ``max_batch``.
      max_seq_len: longest prompt + output. Default: the model's context, capped by the pool.
      decode_steps: most tokens a sequence decodes per host round trip (a compiled buffer
        size).
      decode_call_seconds: device time one decode call aims at: the engine measures each row
        bucket's time per iteration and runs ``decode_call_seconds / that`` iterations (at
        least 4, at most ``decode_steps``). Longer calls spread the per-call host work over
        more tokens; shorter ones let new requests in sooner. While waiting requests need
        slots, a call runs up to ``decode_steps`` and ends on the device once enough rows
        have stopped (they could not be admitted sooner anyway). With none waiting and none
        to come (``step(no_arrivals=True)``: ``run``, so ``generate`` and ``score``), a call
        runs up to ``decode_steps`` and ends when all its rows have stopped.
      schedule: order in which waiting requests are admitted. ``"fcfs"``: first come, first
        served (online serving: no request waits behind later ones). ``"longest_first"``:
        the largest ``max_new_tokens`` first (stable among equals), for offline batches
        whose requests are all known: long generations start early and short ones fill the
        slots they free, so the batch does not end in a long, mostly empty tail of a few
        long requests. Preempted requests resume first under both.
      chunked_prefill: split long prompts over steps. Without it a prompt is read in one step
        and must fit the token budget.
      prefix_caching: share and cache full pages of equal prefixes.
      verbose: print the pool size on stderr.

    Speculation with a draft model (``Speculative(method="draft", draft=...)``): the first
    such request (or ``warmup``) attaches the draft to the idle engine. The draft's K/V live
    in a second page pool with the target's page count and page size, addressed by the
    target's block tables, so one allocator serves both. When the pool was sized from a byte
    budget (``num_pages`` not given), the two pools share it: the page count becomes
    ``budget / (target + draft bytes per page)``; a quantized copy of the target as draft
    halves the tokens the pool holds, a draft of 1B shapes beside 8B costs a fifth. The
    draft's weights are not in the budget (load the draft before the engine sizes its pool).

    On a mesh (``load_model(mesh=...)``) each layer's pool ``[kv_heads, pages, page_size,
    D]`` is split by K/V heads on ``model`` and replicated over ``data``; the step inputs are
    replicated and the ragged attention runs per shard in ``shard_map``. Outputs equal the
    single-device engine's.
    """

    def __init__(
        self,
        model: Model,
        *,
        max_batch: int | None = None,
        kv_cache_bytes: int | None = None,
        num_pages: int | None = None,
        memory_fraction: float = 0.9,
        page_size: int = 16,
        max_tokens_per_step: int | None = None,
        max_seq_len: int | None = None,
        decode_steps: int = 64,
        decode_call_seconds: float = 0.2,
        schedule: str = "fcfs",
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        verbose: bool = True,
    ) -> None:
        cfg = model.config
        # A copy sharing params and tokenizer: the model may keep this engine (engine_for)
        # without a reference cycle, so dropping the model frees the pool at once.
        self.model = dataclasses.replace(model)
        check_kv_cache_dtype(model.kv_cache_dtype, cfg.head_dim)
        accelerator = jax.default_backend() != "cpu"
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len),
                            ("max_tokens_per_step", max_tokens_per_step),
                            ("num_pages", num_pages), ("kv_cache_bytes", kv_cache_bytes),
                            ("page_size", page_size), ("decode_steps", decode_steps)):
            if value is not None and not (is_int(value) and value >= 1):
                raise InputError(f"{name}={value!r} must be an integer >= 1 (or None for the "
                                 "default)")
        if page_size & (page_size - 1):
            raise InputError(f"page_size={page_size} must be a power of two")
        if num_pages is not None and kv_cache_bytes is not None:
            raise InputError("pass num_pages or kv_cache_bytes, not both: either sizes the "
                             "KV page pool")
        if not (is_real(decode_call_seconds) and 0 < decode_call_seconds < math.inf):
            raise InputError(f"decode_call_seconds={decode_call_seconds!r} must be a finite "
                             "number of seconds > 0")
        if schedule not in SCHEDULES:
            raise InputError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
        self.mesh = model.mesh
        data_size, model_size = mesh_sizes(self.mesh)
        if data_size > 1 and not spans_processes(self.mesh):
            raise InputError(f"the model's mesh has data={data_size} replicas; serve it with "
                             "jaxinfer.DataParallelEngine(model) (one engine per replica)")
        default_slots = 256 if accelerator else 32
        slots = max_batch or model.max_batch
        budget = max_tokens_per_step or max(4096 if accelerator else 256, slots or 0)
        # The pool, step inputs and outputs live where the weights are (a data replica of a
        # DataParallelEngine is not on the default device).
        device = min(jax.tree.leaves(model.params)[0].sharding.addressable_devices,
                     key=lambda d: d.id)
        self._placement = (jax.sharding.SingleDeviceSharding(device) if self.mesh is None
                           else NamedSharding(self.mesh, PartitionSpec()))
        sized = num_pages is None  # from a byte budget: a draft's pool shares it
        if num_pages is None:
            if kv_cache_bytes is None and not (device.memory_stats() or {}):
                kv_cache_bytes = CPU_KV_CACHE_BYTES
            reserve = step_workspace_bytes(cfg, slots or default_slots, budget,
                                           model.kv_cache_dtype)
            num_pages = pages_for_budget(cfg, page_size, model.dtype, kv_cache_bytes,
                                         memory_fraction, model_shards=model_size,
                                         reserve_bytes=reserve, device=device,
                                         kv_cache_dtype=model.kv_cache_dtype)
        capacity = num_pages * page_size
        slots = slots or max(1, min(default_slots, capacity // 256))
        if slots < 1:
            raise InputError(f"max_batch={slots} must be >= 1")
        if budget < slots:
            raise InputError(f"max_tokens_per_step={budget} must be >= max_batch={slots} so "
                             "every running sequence can decode each step")
        self.max_batch = slots
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_tokens = budget
        self.decode_steps = decode_steps
        self.decode_chunk = min(DECODE_CHUNK, decode_steps)
        # The loop's output buffer holds whole chunks.
        self._decode_buffer = -(-decode_steps // self.decode_chunk) * self.decode_chunk
        self.decode_call_seconds = decode_call_seconds
        self.schedule = schedule
        self._unordered = False  # requests arrived since the waiting queue was last ordered
        self._iteration_s: dict[int, float] = {}  # row bucket -> measured s per iteration
        self._verify_s: dict[int, float] = {}  # row bucket -> measured s per verify step
        # Speculation loops, by method, then row bucket: seconds per iteration, tokens per
        # row and iteration, plain decode calls since the loop was last tried.
        self._loop_s: dict[str, dict[int, float]] = collections.defaultdict(dict)
        self._loop_gain: dict[str, dict[int, float]] = collections.defaultdict(dict)
        self._loop_skips: dict[str, dict[int, int]] = collections.defaultdict(dict)
        self._acceptance = 0.5  # running mean of accepted / proposed tokens (verify steps)
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings,
                               cfg.max_position_embeddings, capacity)
        self.pages_per_seq = math.ceil(self.max_seq_len / page_size)
        self.chunked_prefill = chunked_prefill
        self.backend = resolve_backend(model.backend, cfg.head_dim, model.deterministic,
                                       tensor_parallel=model_size > 1)
        # Fine buckets where padding costs device time; powers of two on CPU, where compile
        # time dominates.
        self.token_buckets = token_buckets(budget, min(budget, 128 if accelerator else 16),
                                           fine=accelerator)
        # A lone request decodes in one row where every matmul is a few-row int4 / int8
        # kernel's (a padding row would cost it work), in two rows otherwise.
        self.row_buckets = row_buckets(slots, self._few_rows(model))
        # The draft-model speculation loop's row buckets: its draft decodes one token a row
        # and iteration, the target verifies several, so only the draft's matmuls decide
        # whether one row suffices (``_use_draft``).
        self.draft_row_buckets = self.row_buckets
        self.prefix_caching = prefix_caching
        self._pool_budget = (num_pages * PagePool.bytes_per_page(cfg, page_size, model.dtype,
                                                                 model.kv_cache_dtype)
                             if sized else None)
        self._draft: Model | None = None  # the draft model of Speculative(method="draft")
        self._draft_key: tuple[Any, ...] = ()  # what identifies its compiled programs
        self._draft_backend = ""
        self._draft_pool: PagePool | None = None
        self._draft_s: dict[int, float] = {}  # row bucket -> measured s per draft proposal
        self._new_device_state()
        self._inflight: tuple[str, list[_Seq]] = ("", [])  # the step last launched, its requests
        # Steps launched whose results are not read yet, oldest first: one, or two while a
        # mixed step runs ahead of the one before it (``_launch_ahead``).
        self._launched: collections.deque[_Call] = collections.deque()
        self._collected = 0.0  # perf_counter() when a call's results last reached the host
        if verbose:
            mib = (num_pages * PagePool.bytes_per_page(cfg, page_size, model.dtype,
                                                       model.kv_cache_dtype) / 2**20
                   / model_size)  # per device
            stored = f", {model.kv_cache_dtype}" if model.kv_cache_dtype else ""
            print(f"jaxinfer engine: KV pool of {num_pages} pages x {page_size} tokens = "
                  f"{capacity} tokens ({mib:.1f} MiB{' per device' if model_size > 1 else ''}"
                  f"{stored}), {slots} slots, {budget} tokens per step", file=sys.stderr,
                  flush=True)

        self._next_id = 0
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []  # admission order: the last one is the youngest
        self._seqs: dict[int, _Seq] = {}
        self._results: dict[int, Completion | ScoreResult] = {}
        self._taken: set[int] = set()  # ids whose result was handed over
        self._cancelled: set[int] = set()  # ids cancelled before their result was taken
        self._free_slots = list(range(slots))  # a heap: lowest slots first keeps rows packed
        # Per-slot request settings, uploaded with every step (a few bytes per slot).
        self._temperature = np.zeros(slots, np.float32)
        self._top_k = np.zeros(slots, np.int32)
        self._top_p = np.ones(slots, np.float32)
        self._min_p = np.zeros(slots, np.float32)
        self._rep_penalty = np.ones(slots, np.float32)
        self._presence = np.zeros(slots, np.float32)
        self._frequency = np.zeros(slots, np.float32)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._stop_width = 4
        # Host mirror of each slot's block table, extended as pages are reserved, so step
        # inputs are built with array indexing instead of a loop over sequences.
        self._tables = np.zeros((slots, self.pages_per_seq), np.int32)
        self._table_len = np.zeros(slots, np.int64)
        self._stop_ids = np.full((slots, self._stop_width), -1, np.int32)
        # Metrics.
        self._steps = self._decode_calls = self._ahead_steps = 0
        self._step_time = self._device_time = self._decode_time = 0.0
        self._generated = self._computed = self._padded = 0
        self._peak_used = 0
        self._lookup_tokens = self._hit_tokens = 0
        self._preemptions = 0
        self._verify_steps = self._verified_rows = 0
        self._draft_tokens = self._accepted_tokens = 0
        self._draft_time = 0.0
        self._programs: set[tuple[Any, ...]] = set()
        self._quiet_compiles = False

    # ------------------------------------------------------------------ public API
    def check_fits(self, req: Request) -> None:
        """Raise ``InputError`` unless ``req`` fits this engine: its prompt and output within
        ``max_seq_len``, its prompt within one step without chunked prefill."""
        need = len(req.prompt_ids) + (0 if req.is_score else req.sampling.max_new_tokens)
        if need > self.max_seq_len:
            raise InputError(f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens="
                             f"{req.sampling.max_new_tokens} exceeds the engine's max_seq_len="
                             f"{self.max_seq_len}; shorten it or give the Engine a larger KV "
                             "pool")
        if not self.chunked_prefill and len(req.prompt_ids) > self.max_tokens:
            raise InputError(f"prompt of {len(req.prompt_ids)} tokens exceeds "
                             f"max_tokens_per_step={self.max_tokens} without chunked prefill; "
                             "raise it or use chunked_prefill=True")

    def add_request(self, req: Request) -> int:
        """Queue a validated ``Request`` (``requests.make_requests`` or
        ``make_score_requests``); returns its id. Checks that it fits this engine
        (``check_fits``)."""
        self.check_fits(req)
        if req.sampling.seed is None:
            raise InputError("requests reach the engine with a resolved seed; build them with "
                             "requests.make_requests")
        spec = req.sampling.speculative
        if spec is not None and spec.draft is not None:
            self._use_draft(spec.draft)
        key = prng_key_data(req.sampling.seed)
        rid = self._next_id
        self._next_id += 1
        seq = _Seq(rid=rid, req=req, key=key, tokens=list(req.prompt_ids),
                   arrival=time.perf_counter())
        if req.is_score:
            seq.score_lp = np.zeros(req.num_scored, np.float32)
            seq.score_greedy = np.zeros(req.num_scored, bool)
        if req.grammar is not None:
            seq.progress.matcher = TokenMatcher(req.grammar, self.model.tokenizer,
                                                self.model.config.vocab_size)
        self._seqs[rid] = seq
        self._waiting.append(seq)
        self._unordered = True
        return rid

    def step(self, max_decode_steps: int | None = None, no_arrivals: bool = False
             ) -> list[Event]:
        """Plan and run one step; return ``(id, new_tokens, finished)`` per advanced request.

        ``new_tokens`` is empty when a request ended on a stop token (which is not output) and
        for scoring requests. ``max_decode_steps`` caps this step's decode loop (streaming
        uses it to yield sooner); by default it follows ``decode_call_seconds``, or, with
        ``no_arrivals`` (the caller submits nothing before this step returns) and no request
        waiting, runs up to ``decode_steps``: ``decode_call_seconds`` bounds how long a new
        request waits, and with none to come a shorter call only adds its host work (2x
        H200, 70B tp=2 batch 1, ~14 ms per call: 51.0 against 46.7 tok/s, bench/NOTES.md
        r171-r172).
        """
        check_max_decode_steps(max_decode_steps)
        t0 = time.perf_counter()
        self._order_waiting()
        if no_arrivals and max_decode_steps is None and not self._waiting:
            max_decode_steps = self.decode_steps
        try:
            calls = self._launched  # launched, results not read yet: oldest first
            if not calls:
                first = (self._launch_mixed() if self._prompt_work_pending() or self._constrained()
                         else self._launch_decode_step(max_decode_steps))
                if first is not None:
                    calls.append(first)
            failure = None
            if len(calls) == 1 and calls[0].entries is not None:
                try:  # the next mixed step runs while this one's results are handled
                    ahead = self._launch_ahead()
                    if ahead is not None:
                        calls.append(ahead)
                except jax.errors.JaxRuntimeError as e:
                    failure = e  # its requests fail once this step's results are kept
            events = self._collect(calls[0]) if calls else []
            if calls:
                calls.popleft()  # only once its results are kept
            if failure is not None:
                raise failure
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                self._abandon_launched()
                raise
            events = self._out_of_memory(e)
        except BaseException:  # Ctrl-C, or a bug: keep the engine consistent, then raise
            self._abandon_launched()
            raise
        self._peak_used = max(self._peak_used, self.blocks.num_used)
        self._steps += 1
        self._step_time += time.perf_counter() - t0
        return events

    def has_unfinished(self) -> bool:
        """Whether any submitted request is still waiting or running."""
        return bool(self._waiting or self._running)

    def check_request(self, request_id: int) -> None:
        """Raise ``InputError`` unless the request was submitted and its result not taken."""
        if (request_id not in self._seqs and request_id not in self._results
                or request_id in self._taken):
            raise InputError(f"unknown request id {request_id}")

    def cancel(self, request_id: int) -> bool:
        """Stop a request now: a waiting or running one leaves the engine, its slot and pages
        freed (full pages stay in the prefix cache); a finished one's result is dropped.
        ``result()`` then says it was cancelled. Returns whether it was still unfinished; an
        id this engine never issued is an ``InputError``.

        Also what the entry points do with their requests when interrupted (``Ctrl-C`` in
        ``generate``, a ``stream`` closed early), so the engine stays usable: it copes with
        a request caught half-way through an interrupted step.
        """
        if not (is_int(request_id) and 0 <= request_id < self._next_id):
            raise InputError(f"unknown request id {request_id!r}")
        s = self._seqs.get(request_id)
        if request_id in self._taken or request_id in self._cancelled or s is None:
            return False
        self._cancelled.add(request_id)
        if self._results.pop(request_id, None) is not None:
            self._seqs.pop(request_id, None)
            return False
        if s in self._running:
            self._running.remove(s)
        elif s in self._waiting:
            self._waiting.remove(s)
        if request_id in self.blocks.tables:
            self.blocks.free(request_id)
        if s.slot >= 0 and s.slot not in self._free_slots:
            heapq.heappush(self._free_slots, s.slot)
        s.slot = -1  # a launched step's results for it are dropped
        del self._seqs[request_id]
        return True

    def result(self, request_id: int) -> Completion | ScoreResult:
        """The result of a finished request (handed over once, then forgotten)."""
        if request_id in self._results:
            self._taken.add(request_id)
            return self._results.pop(request_id)
        if request_id in self._taken:
            raise InputError(f"the result of request {request_id} was already taken; result() "
                             "hands each result over once")
        if request_id in self._cancelled:
            raise InputError(f"request {request_id} was cancelled; it has no result")
        if request_id in self._seqs:
            raise InputError(f"request {request_id} is not finished yet; call step() or "
                             "run_until_done() first")
        raise InputError(f"unknown request id {request_id}")

    def request_metrics(self, request_id: int) -> RequestMetrics:
        """Queue time, time to first token and time per output token of a live request."""
        s = self._seqs.get(request_id)
        if s is None:
            raise InputError(f"unknown request id {request_id}")
        n = len(s.progress.tokens)
        ttft = None if s.first_token is None else s.first_token - s.arrival
        tpot = None
        if s.first_token is not None and n > 1:
            tpot = (s.last_token - s.first_token) / (n - 1)
        return RequestMetrics(
            queue_time=None if s.admitted is None else s.admitted - s.arrival,
            time_to_first_token=ttft, time_per_output_token=tpot, num_generated=n,
            num_preemptions=s.preemptions, cached_prompt_tokens=s.cached_tokens)

    def finished(self, request_id: int) -> bool:
        """Whether the request's result is ready for ``result()``."""
        return request_id in self._results

    def forget(self, request_id: int) -> bool:
        """Drop what the engine keeps of a finished request whose result was taken (its
        metrics), or of a cancelled one; long-running callers call this so host memory stays
        bounded. Returns whether there was something to drop."""
        if request_id in self._cancelled:
            self._cancelled.discard(request_id)
            return True
        if request_id not in self._taken:
            return False
        self._taken.discard(request_id)
        self._seqs.pop(request_id, None)
        return True

    def stats(self) -> EngineStats:
        """Throughput, queue sizes, page usage and prefix-cache hit rate so far."""
        bm = self.blocks
        return EngineStats(
            steps=self._steps, decode_calls=self._decode_calls, ahead_steps=self._ahead_steps,
            running=len(self._running),
            waiting=len(self._waiting), generated_tokens=self._generated,
            computed_tokens=self._computed, padded_tokens=self._padded,
            tokens_per_second=self._generated / self._step_time if self._step_time else 0.0,
            step_seconds=self._step_time, device_seconds=self._device_time,
            decode_seconds=self._decode_time,
            pages_total=bm.num_pages, pages_used=bm.num_used, pages_cached=bm.num_cached,
            pages_free=bm.num_free - bm.num_cached, peak_pages_used=self._peak_used,
            tokens_capacity=bm.num_pages * self.page_size,
            tokens_held=sum(s.num_computed for s in self._running),
            prefix_cache_hit_rate=self._hit_tokens / max(1, self._lookup_tokens),
            cached_tokens=self._hit_tokens, num_preemptions=self._preemptions,
            num_programs=len(self._programs), verify_steps=self._verify_steps,
            verified_rows=self._verified_rows, draft_tokens=self._draft_tokens,
            accepted_tokens=self._accepted_tokens, draft_seconds=self._draft_time)

    def warmup(self, generate: bool = True, score: bool = False, sampled: bool = False,
               constrained: bool = False, speculative: Speculative | None = None
               ) -> float:
        """Compile (or load from JAX's compilation cache) every step shape now; return the
        seconds it took.

        ``generate``: each token bucket's mixed step and each decode row bucket, greedy;
        ``score``: each token bucket's scoring variant; ``sampled``: also the variants that
        sample with a temperature above 0; ``constrained``: also the mixed steps that apply
        token masks (``response_format``); ``speculative``: its method's device loop
        (``runner.ngram_steps`` or ``draft_steps``) of each row bucket up to
        ``VERIFY_MAX_ROWS`` for its ``num_tokens``, and with a draft model (attached here)
        the draft's catching-up step of each token bucket. Runs them on all-padding
        inputs, which write no page and sample for no slot, so the engine's state is
        unchanged. Benchmarks and ``batch_eval`` call this before timing.
        """
        if self.has_unfinished():
            raise InputError("warmup() runs on an idle engine; call it before submitting")
        t0 = time.perf_counter()
        samplers = (False, True) if sampled else (False,)
        mixed = [(sc, st, False) for sc in (False,) * generate + (True,) * score
                 for st in samplers]
        mixed += [(False, st, True) for st in samplers if generate and constrained]
        decode = samplers if generate else ()
        drafts = speculative is not None and speculative.draft is not None
        if drafts:
            self._use_draft(speculative.draft)
        loops = self.draft_row_buckets if drafts else self.row_buckets
        verify = [b for b in loops if b <= VERIFY_MAX_ROWS] if speculative else []
        n = (len(self.token_buckets) * (len(mixed) + drafts) + len(self.row_buckets)
             * len(decode) + len(verify) * len(samplers))
        print(f"jaxinfer: preparing {n} engine step programs (compiled once per shape) …",
              file=sys.stderr, flush=True)
        self._quiet_compiles = True
        everything = np.full((self.max_batch, mask_words(self.model.config.vocab_size)), -1,
                             np.int32)  # a mask that allows every token
        for t in self.token_buckets:
            for sc, st, masked in mixed:
                inp = self._mixed_inputs([], t, sc)
                if masked:
                    inp = inp.replace(token_mask=everything)
                to_host(self._dispatch_mixed(inp, t, sc, st))
        for b in self.row_buckets:
            for st in decode:
                to_host(self._dispatch_decode(self._decode_inputs([], b, 1), st))
        for t in self.token_buckets if drafts else ():  # the draft catching up
            to_host(self._dispatch_draft([], self.max_batch, t, 0))
        for b in verify:
            k = speculative.num_tokens
            for st in samplers:  # the speculation loop
                to_host(self._dispatch_loop(speculative.method, self._loop_inputs([], b, 1, k),
                                            k, speculative.ngram_max, st))
        self._quiet_compiles = False
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ scheduling
    def _order_waiting(self) -> None:
        """Under ``longest_first``, sort new arrivals into the waiting queue (behind the
        preempted requests, which resume first)."""
        if self.schedule == "fcfs" or not self._unordered:
            return
        self._unordered = False
        resumed = [s for s in self._waiting if s.admitted is not None]
        fresh = sorted((s for s in self._waiting if s.admitted is None),
                       key=lambda s: 0 if s.req.is_score else -s.req.sampling.max_new_tokens)
        self._waiting = collections.deque(resumed + fresh)

    def _prompt_work_pending(self) -> bool:
        """Whether the next step is a mixed one: a prompt is being read, or waiting requests
        can be admitted. Admissions are batched: with a backlog, the engine keeps decoding
        several tokens per call until an eighth of the slots are free, so prompts are read
        in large, efficient steps rather than one small step per finished request."""
        if any(s.pending > 1 or s.req.is_score and s.pending for s in self._running):
            return True
        if not self._waiting or self._slots_wanted():
            return False
        if not self._running:  # an idle engine admits whatever fits (_admit decides)
            return True
        s = self._waiting[0]
        start = min(len(self.blocks.match_prefix(s.rid, s.tokens)) * self.page_size,
                    s.first_output)
        first = min(s.compute_end - start, self.max_tokens - len(self._running))
        # A chunked prompt can start with one page; a whole prompt needs all of its pages.
        pages = 1 if self._chunks(s) else math.ceil(first / self.page_size)
        return pages + len(self._running) <= self.blocks.num_free  # + a page per decode

    def _slots_wanted(self) -> int:
        """Slots still to free before the waiting requests are admitted (an eighth of the
        slots, or all the waiting requests if fewer; ``_prompt_work_pending``); 0 when none
        wait or enough are free."""
        if not self._waiting:
            return 0
        enough = min(len(self._waiting), max(1, self.max_batch // 8))
        return max(0, enough - len(self._free_slots))

    def _constrained(self) -> bool:
        """Whether a running request has a ``response_format``: its mask for each token
        depends on the token before, so the engine runs mixed steps (one token per sequence
        and host round trip) instead of multi-token decode calls while it runs."""
        return any(s.progress.matcher is not None for s in self._running)

    def _fit(self, s: _Seq, start: int, n: int, free: int, hits: Sequence[int]) -> int:
        """Largest count ``<= n`` of tokens from position ``start`` whose pages fit in ``free``.

        ``hits`` are the prefix pages a not-yet-admitted sequence would map. Without chunked
        prefill the answer is all (``n``) or nothing.
        """
        if n <= 0:
            return 0
        bm, ps = self.blocks, self.page_size
        if bm.pages_needed(s.rid, start, start + n, hits) <= free:
            return n
        if not self._chunks(s):
            return 0
        base = bm.pages_needed(s.rid, start, start + 1, hits)
        if base > free:
            return 0
        mapped = len(bm.tables.get(s.rid, hits))
        pages = max(mapped, start // ps + 1) + (free - base)
        return max(0, min(n, pages * ps - start))

    def _chunks(self, s: _Seq) -> bool:
        # A preempted request's prompt + output may exceed the token budget, so its recompute
        # is chunked even when prompts are not; otherwise it could never be readmitted.
        return self.chunked_prefill or s.preemptions > 0

    def _plan_mixed(self, ahead: bool = False) -> list[tuple[_Seq, int]] | None:
        """Tokens per sequence for a mixed step: running ones first, then admissions.

        Decoding sequences (one token each, a new page only at a page boundary) go first so
        a long prompt never stalls them; prompt chunks of the oldest sequences follow.
        ``ahead``: planned while the last step's results are unread; None (nothing changed)
        if it would preempt, which waits for them.
        """
        bm, ps = self.blocks, self.page_size
        while True:  # restarts after each preemption, which frees pages
            plan: list[tuple[_Seq, int]] = []
            budget, free = self.max_tokens, bm.num_free
            victim = None
            for s in self._running:
                if s.pending != 1 or budget == 0 or self._last_launched(s):
                    continue
                need = int(s.num_computed >= self._table_len[s.slot] * ps)
                if need > free:
                    victim = self._running[-1]
                    break
                plan.append((s, 1))
                budget -= 1
                free -= need
            for s in self._running if victim is None else ():
                if s.pending <= 1:  # decoding, or a scoring request awaiting its results
                    continue
                n = self._fit(s, s.num_computed, min(s.pending, budget), free, ())
                if n == 0 and budget > 0:
                    victim = self._running[-1]
                    break
                if n:
                    plan.append((s, n))
                    budget -= n
                    free -= bm.pages_needed(s.rid, s.num_computed, s.num_computed + n)
            if victim is None:
                break
            if ahead:
                return None
            self._preempt(victim)
        for s, n in plan:
            if n > 1 or s.num_computed >= self._table_len[s.slot] * ps:
                self._reserve(s, s.num_computed + n)
        self._admit(plan, budget)
        return plan

    @staticmethod
    def _last_launched(s: _Seq) -> bool:
        """Whether ``s`` has reached its ``max_new_tokens`` counting the tokens of launched
        steps (it finishes when they are read; a step ahead would compute past its end)."""
        return len(s.progress.tokens) + s.unknown >= s.req.sampling.max_new_tokens

    def _reserve(self, s: _Seq, end: int) -> None:
        # Writes start at a page boundary or inside the sequence's own last page, and the
        # prefix cache maps only pages before the first output, so no page is ever shared
        # when written: copy-on-write cannot happen here.
        copies = self.blocks.prepare_write(s.rid, s.num_computed, end)
        if copies:
            raise RuntimeError(f"unexpected copy-on-write {copies} for request {s.rid}; "
                               "this is a scheduler bug")
        table, known = self.blocks.tables[s.rid], self._table_len[s.slot]
        if len(table) > known:  # mirror the new pages into the slot's row of the host table
            self._tables[s.slot, known: len(table)] = table[known:]
            self._table_len[s.slot] = len(table)

    def _admit(self, plan: list[tuple[_Seq, int]], budget: int) -> None:
        """Move waiting requests into free slots (FCFS) while budget and pages allow."""
        bm, ps = self.blocks, self.page_size
        deferred = []
        while self._waiting and self._free_slots and budget > 0:
            s = self._waiting[0]
            hits = bm.match_prefix(s.rid, s.tokens)[: s.first_output // ps]
            if bm.waits_for_pending(s.rid, s.tokens, len(hits)):
                # Another sequence is computing our next block; share it a step later.
                deferred.append(self._waiting.popleft())
                continue
            start = len(hits) * ps
            n = self._fit(s, start, s.compute_end - start, bm.num_free, hits)
            n = min(n, budget) if self._chunks(s) else n * (n <= budget)
            if n == 0:
                break
            self._waiting.popleft()
            bm.admit(s.rid, s.tokens, hits)
            s.num_computed = start
            s.slot = heapq.heappop(self._free_slots)
            self._table_len[s.slot] = 0
            self._reserve(s, start + n)
            if s.admitted is None:
                s.admitted = time.perf_counter()
                s.cached_tokens = start
                self._lookup_tokens += len(s.tokens)
                self._hit_tokens += start
            self._load_slot(s)
            self._running.append(s)
            plan.append((s, n))
            budget -= n
        self._waiting.extendleft(reversed(deferred))

    def _new_device_state(self) -> None:
        """An empty page pool (and its block manager) and an empty token-count table. The old
        pools' buffers are freed first: a pool fills most of the device, so holding two at
        once (attaching a draft, recovering from a failed step) runs out of memory."""
        for x in jax.tree.leaves((getattr(self, "pool", None), getattr(self, "_counts", None),
                                  getattr(self, "_draft_pool", None))):
            if not x.is_deleted():
                x.delete()
        cfg, dtype = self.model.config, self.model.dtype
        num_pages = self.num_pages
        self.blocks = BlockManager(num_pages, self.page_size, self.prefix_caching)
        stacked = pool_is_stacked(self.model.params, self.backend)
        sharding = (self._placement if self.mesh is None
                    else engine_pool_sharding(self.mesh, cfg, stacked))
        self.pool = PagePool.create(cfg, num_pages, self.page_size, dtype, sharding=sharding,
                                    stacked=stacked, kv_cache_dtype=self.model.kv_cache_dtype)
        self._counts = jax.device_put(new_counts(self.max_batch, cfg.vocab_size),
                                      self._placement)
        # The tokens the last mixed step sampled (``MixedInputs.fed_tokens``).
        self._fed = jax.device_put(np.zeros(self.max_batch, np.int32), self._placement)
        if self._draft is not None:
            d = self._draft
            self._draft_pool = PagePool.create(
                d.config, num_pages, self.page_size, d.dtype, sharding=self._placement,
                stacked=pool_is_stacked(d.params, self._draft_backend),
                kv_cache_dtype=d.kv_cache_dtype)

    def _few_rows(self, *models: Model) -> tuple[int, ...]:
        """The decode row buckets below 8 for ``models`` (decode calls and verify steps: the
        target and its draft, whose proposals there run at the target's row bucket; the
        draft loop: the draft alone): 1, 2 and 4 when every matmul of each is
        a few-row int4 or int8 kernel's (``model.one_row_decode_weights``), else 2
        (``runner.row_buckets``)."""
        one_device = mesh_sizes(self.mesh)[1] == 1
        platform = jax.default_backend()
        if one_device and all(one_row_decode_weights(m.params, platform) for m in models):
            return (1, 2, 4)
        return (2,)

    def _use_draft(self, draft: Model) -> None:
        """Propose with ``draft`` from now on (``Speculative(method="draft")``): make its page
        pool, first splitting the pool budget between the two pools (class docstring). The
        pools are made anew, so a new draft is attached only to an idle engine."""
        if draft is self._draft:
            return
        check_draft(self.model, draft)
        if self.has_unfinished():
            raise InputError("this engine is running requests with another draft model (or "
                             "none); it attaches a new draft model only while idle, so submit "
                             "this request after those finish")
        if self._pool_budget is not None:
            self.num_pages = max(1, self._pool_budget // sum(
                PagePool.bytes_per_page(m.config, self.page_size, m.dtype, m.kv_cache_dtype)
                for m in (self.model, draft)))
            self.max_seq_len = min(self.max_seq_len, self.num_pages * self.page_size)
        self._draft = draft
        # A draft that is not all int4 / int8 would run one-row XLA matmuls in a one-row
        # bucket.
        self.row_buckets = row_buckets(self.max_batch, self._few_rows(self.model, draft))
        self.draft_row_buckets = row_buckets(self.max_batch, self._few_rows(draft))
        self._draft_backend = resolve_backend(draft.backend, draft.config.head_dim,
                                              draft.deterministic)
        self._draft_key = (draft.config, str(draft.dtype), draft.layout, draft.kv_cache_dtype,
                           draft.param_bytes, self._draft_backend)
        self._draft_s.clear()  # the old draft's timings and gains judged another model
        for stats in (self._loop_s, self._loop_gain, self._loop_skips):
            stats.pop("draft", None)
        self._new_device_state()

    def _out_of_memory(self, e: Exception) -> list[Event]:
        """The device ran out of memory in the step just launched: its requests end with an
        error naming the step's shape, and their pages are freed. If the failed program had
        already taken the pool (donated buffers), the pool starts empty and the other running
        requests recompute their tokens when readmitted."""
        what = self._inflight[0]
        seqs = self._launched_seqs()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        why = (f"the device ran out of memory in the engine's {what} ({first}); give the "
               "engine a smaller max_tokens_per_step, max_batch or memory_fraction")
        # With a mixed step launched ahead, the results of the step before it may be lost
        # too: its requests fail with the same error.
        self._launched.clear()
        failed = [s for s in self._running if id(s) in seqs]
        for s in failed:
            self._fail(s, why)
        print(f"jaxinfer: {why}; requests {[s.rid for s in failed]} ended with this error",
              file=sys.stderr, flush=True)
        if any(x.is_deleted() for x in jax.tree.leaves((self.pool, self._counts,
                                                         self._draft_pool))):
            for s in list(reversed(self._running)):
                self._preempt(s)
            self._new_device_state()
        return [(s.rid, [], True) for s in failed]

    def _launched_seqs(self) -> dict[int, _Seq]:
        """The running requests of every program launched whose results are not kept yet
        (and of the one being launched), by ``id``."""
        seqs = list(self._inflight[1])
        for call in self._launched:
            seqs += [e.seq for e in call.entries or ()]
            seqs += [s for s, _ in call.proposals or ()] + list(call.rows or ())
        return {id(s): s for s in seqs if s.slot >= 0}

    def _abandon_launched(self) -> None:
        """``step()`` was interrupted between launching programs and keeping their results:
        forget those programs and preempt their requests, which recompute their tokens (the
        same ones) when readmitted, so no placeholder or half-advanced request remains."""
        seqs = self._launched_seqs()
        self._launched.clear()
        for s in list(self._running):
            if id(s) in seqs:
                self._preempt(s)

    def _put(self, tree: Any) -> Any:
        """Host arrays for a step program: on one device, the numpy arrays themselves, which
        the jitted program copies in next to its committed weights from C++ (~5 us an array;
        ``jax.device_put`` of a step's ~10 arrays costs ~0.4 ms of Python, paid between the
        draft and verify steps of speculative decoding while the device idles); on a mesh,
        put whole on each device, since a program may otherwise shard a numpy input."""
        return tree if self.mesh is None else jax.device_put(tree, self._placement)

    def _load_slot(self, s: _Seq) -> None:
        sp, b = s.req.sampling, s.slot
        self._temperature[b], self._top_k[b], self._top_p[b] = sp.temperature, sp.top_k, sp.top_p
        self._min_p[b], self._rep_penalty[b] = sp.min_p, sp.repetition_penalty
        self._presence[b], self._frequency[b] = sp.presence_penalty, sp.frequency_penalty
        self._keys[b] = s.key
        stops = s.req.stop_ids
        if len(stops) > self._stop_width:  # rare: widen (one more decode program per bucket)
            self._stop_width = 1 << (len(stops) - 1).bit_length()
            wider = np.full((self.max_batch, self._stop_width), -1, np.int32)
            wider[:, : self._stop_ids.shape[1]] = self._stop_ids
            self._stop_ids = wider
        self._stop_ids[b] = -1
        self._stop_ids[b, : len(stops)] = stops
        if sp.penalized:  # rows of other slots are never read by the penalties
            # Prompt and generated ids (a preempted request has both), padded to one shape.
            n_prompt = len(s.req.prompt_ids)
            prompt, generated = (np.full(self.pages_per_seq * self.page_size,
                                         self.model.config.vocab_size, np.int32)
                                 for _ in range(2))
            prompt[:n_prompt] = s.tokens[:n_prompt]
            generated[: len(s.tokens) - n_prompt] = s.tokens[n_prompt:]
            with on_mesh(self.mesh):
                self._counts = load_counts(self._counts,
                                           *self._put((np.int32(b), prompt, generated)))

    def _preempt(self, s: _Seq) -> None:
        """Release ``s``'s pages and slot; it recomputes its tokens when readmitted."""
        self._running.remove(s)
        self.blocks.free(s.rid)
        heapq.heappush(self._free_slots, s.slot)
        s.slot, s.num_computed, s.draft_computed = -1, 0, 0
        self._drop_unknown(s)
        s.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(s)

    @staticmethod
    def _drop_unknown(s: _Seq) -> None:
        """Forget the placeholders of tokens ``s`` will not read back (it ended or restarts;
        a restarted request samples them again, the same tokens)."""
        if s.unknown:
            del s.tokens[-s.unknown:]
            s.unknown = 0

    def _program_key(self, program: tuple[Any, ...]) -> tuple[Any, ...]:
        """What identifies a compiled step program in this process."""
        return (*program, self.model.config, self.backend, str(self.model.dtype),
                self.blocks.num_pages, self.max_batch, self.pages_per_seq, self.decode_steps,
                self.pool.stacked, self.model.layout, self.model.deterministic,
                self.model.kv_cache_dtype)

    def _announce(self, program: tuple[Any, ...], what: str) -> None:
        """Count a step program; say on stderr, once per process and shape, that XLA is
        about to compile it (seconds of silence otherwise look like a hang)."""
        self._programs.add(program)
        key = self._program_key(program)
        if key not in _ANNOUNCED:
            _ANNOUNCED.add(key)
            if not self._quiet_compiles:
                print(f"jaxinfer: compiling the engine's {what} (once per shape) …",
                      file=sys.stderr, flush=True)

    def _finish(self, s: _Seq) -> None:
        self._running.remove(s)
        self.blocks.free(s.rid)
        heapq.heappush(self._free_slots, s.slot)
        s.slot = -1
        self._drop_unknown(s)
        p = s.progress
        if s.req.is_score:
            self._results[s.rid] = score_result(s.req, s.score_lp, s.score_greedy,
                                                s.cached_tokens, p.error)
            return
        try:
            self._results[s.rid] = completion(self.model, s.req, p)
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer cannot decode the tokens
            p.reason, p.text = "error", ""
            p.error = f"building its result raised {type(e).__name__}: {e}"
            self._results[s.rid] = completion(self.model, s.req, p)

    def _fail(self, s: _Seq, why: str) -> None:
        """End running request ``s`` with an error result; its slot and pages are freed."""
        p = s.progress
        p.finished, p.reason, p.text = True, "error", ""
        p.error = f"request {s.rid} failed: {why}"
        self._finish(s)

    # ------------------------------------------------------------------ mixed step
    def _sampling(self, rows: int) -> SamplingArrays:
        # Copies: a launched program may still read its inputs (zero-copy on CPU) while the
        # host plans the next step, which rewrites the slots of finished requests.
        return SamplingArrays(
            temperature=self._temperature[:rows].copy(), top_k=self._top_k[:rows].copy(),
            top_p=self._top_p[:rows].copy(), min_p=self._min_p[:rows].copy(),
            repetition_penalty=self._rep_penalty[:rows].copy(),
            presence_penalty=self._presence[:rows].copy(),
            frequency_penalty=self._frequency[:rows].copy(), keys=self._keys[:rows].copy())

    def _mixed_inputs(self, plan: list[tuple[_Seq, int]], t: int, score: bool) -> MixedInputs:
        """Packed inputs in slot order; one-token entries (decodes) are filled with array
        indexing, only prompt chunks loop over their sequences. Sequences with a
        ``response_format`` that sample get their next token's mask (``token_mask`` None
        when there are none)."""
        s_rows, n_pages, ps = self.max_batch, self.blocks.num_pages, self.page_size
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        write_pages = np.full(t, n_pages, np.int32)
        write_offsets = np.zeros(t, np.int32)
        targets = np.full(t, -1, np.int32)
        kv_lens = np.zeros(s_rows, np.int32)
        q_lens = np.zeros(s_rows, np.int32)
        last = np.zeros(s_rows, np.int32)
        gen = np.zeros(s_rows, np.int32)
        samples = np.zeros(s_rows, bool)
        feed = np.full(t, -1, np.int32)
        if plan:
            m = len(plan)
            slots = np.fromiter((q.slot for q, _ in plan), np.int64, m)
            ns = np.fromiter((n for _, n in plan), np.int32, m)
            starts = np.fromiter((q.num_computed for q, _ in plan), np.int32, m)
            q_lens[slots] = ns
            cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            off = cu[slots]  # packed index of each entry's first token
            kv_lens[slots] = starts + ns
            last[slots] = off + ns - 1
            gen[slots] = np.fromiter((len(q.progress.tokens) + q.unknown for q, _ in plan),
                                     np.int32, m)
            samples[slots] = np.fromiter((q.samples_after(n) for q, n in plan), bool, m)
            scoring = np.fromiter((q.req.is_score for q, _ in plan), bool, m)
            one = (ns == 1) & ~scoring  # decode tokens; score entries need their targets
            idx = off[one]
            known = np.fromiter(
                (q.tokens[q.num_computed] for (q, _), o in zip(plan, one, strict=True) if o),
                np.int32, int(one.sum()))
            tokens[idx] = np.maximum(known, 0)
            fed = known == UNKNOWN  # sampled by the step launched last: fed on the device
            feed[idx[fed]] = slots[one][fed]
            positions[idx] = starts[one]
            write_pages[idx] = self._tables[slots[one], starts[one] // ps]
            write_offsets[idx] = starts[one] % ps
            for i in np.flatnonzero(~one):
                q, n, o, start = plan[i][0], int(ns[i]), int(off[i]), int(starts[i])
                seq_tokens = np.asarray(q.tokens[start: start + n + 1], np.int32)
                pos = self._fill_row(tokens, positions, write_pages, write_offsets, q.slot, o,
                                     start, seq_tokens[:n])
                if q.req.is_score:  # position p predicts token p + 1 from first_output on
                    targets[o: o + n] = np.where(pos >= q.first_output, seq_tokens[1: n + 1],
                                                 -1)
        else:
            cu = np.zeros(s_rows + 1, np.int32)
        constrained = [(q.progress.matcher, q.slot) for q, _ in plan
                       if q.progress.matcher is not None and samples[q.slot]]
        token_mask = None
        if constrained:
            token_mask = np.full((s_rows, mask_words(self.model.config.vocab_size)), -1,
                                 np.int32)
            fill_masks(constrained, token_mask)
        return MixedInputs(
            tokens=tokens, positions=positions, write_pages=write_pages,
            write_offsets=write_offsets, targets=targets, block_tables=self._tables.copy(),
            kv_lens=kv_lens, cu_q_lens=cu, last_index=last, gen_index=gen, samples=samples,
            sampling=self._sampling(s_rows), token_mask=token_mask, feed_slots=feed,
            fed_tokens=self._fed)

    def _dispatch_mixed(self, inp: MixedInputs, t: int, score: bool, stochastic: bool,
                        num_top: int = 0) -> dict[str, jax.Array]:
        """Launch one mixed step program (asynchronously); the pool and ``counts`` advance."""
        constrained = inp.token_mask is not None
        self._announce(("mixed", t, score, stochastic, num_top, constrained),
                       f"mixed step for {t} tokens" + (" with scoring" if score else "")
                       + (", sampled" if stochastic else "")
                       + (", top log-probabilities" if num_top else "")
                       + (", token masks" if constrained else ""))
        with on_mesh(self.mesh):
            self.pool, self._counts, out = mixed_step(
                self.model.params, self.pool, self._counts, self._put(inp),
                config=self.model.config, backend=self.backend, dtype=self.model.dtype,
                max_q_len=t, score=score, stochastic=stochastic,
                deterministic=self.model.deterministic, num_top=num_top)
        self._fed = out["tokens"]
        return out

    def _launch_ahead(self) -> _Call | None:
        """Launch the next mixed step before the last one's results are read, when it is
        one: prompt work remains, no token mask waits for a sampled token, and it needs no
        preemption."""
        if self._constrained() or not self._prompt_work_pending():
            return None
        call = self._launch_mixed(ahead=True)
        self._ahead_steps += call is not None
        return call

    def _launch_mixed(self, ahead: bool = False) -> _Call | None:
        """Plan and launch a mixed step (``_plan_mixed``); mark each sequence's computed
        tokens, and a placeholder for each token sampled, as if its results were read."""
        plan = self._plan_mixed(ahead)
        if not plan:
            if not ahead and self._waiting and not self._running:
                raise RuntimeError("the engine cannot admit any waiting request with an empty "
                                   "pool; this is a scheduler bug")  # add_request's checks
            return None
        t = bucket(sum(n for _, n in plan), self.token_buckets)
        score = any(s.req.is_score and s.num_computed + n > s.first_output for s, n in plan)
        stochastic = any(s.req.sampling.temperature > 0 for s, _ in plan if not s.req.is_score)
        num_top = _num_top(s for s, _ in plan)
        self._inflight = (f"mixed step of {t} tokens", [s for s, _ in plan])
        launched = time.perf_counter()
        out = self._dispatch_mixed(self._mixed_inputs(plan, t, score), t, score, stochastic,
                                   num_top)
        entries = []
        for s, n in sorted(plan, key=lambda p: p[0].slot):
            start, end, samples = s.num_computed, s.num_computed + n, s.samples_after(n)
            entries.append(_Entry(s.slot, s, start, n, samples))
            s.num_computed = end
            if end // self.page_size > start // self.page_size and not s.unknown:
                # Pages it fills, hashed now (its tokens are known): a step launched later
                # may map them (the device runs steps in order). Else at its results.
                self.blocks.commit(s.rid, s.tokens, end)
            if samples:
                s.tokens.append(UNKNOWN)
                s.unknown += 1
        return _Call(out=out, launched=launched, padded=t, entries=entries, score=score)

    def _results_of(self, call: _Call) -> tuple[Any, float]:
        """Bring a call's results to the host; return them and the seconds from its launch."""
        out = to_host(call.out)
        now = time.perf_counter()
        # From its launch, or (a step launched ahead) from the results before it.
        seconds = now - max(call.launched, self._collected)
        self._collected = now
        self._device_time += seconds
        return out, seconds

    def _collect(self, call: _Call) -> list[Event]:
        if call.entries is not None:
            return self._collect_mixed(call)
        if call.proposals is not None:
            return self._collect_verify(call)
        if call.loop:
            return self._collect_loop(call)
        return self._collect_decode(call)

    def _collect_mixed(self, call: _Call) -> list[Event]:
        out, _ = self._results_of(call)
        now = time.perf_counter()
        self._padded += call.padded
        events: list[Event] = []
        cursor = 0  # packed index of the entry's first token
        for slot, s, start, n, samples in call.entries:
            cursor += n
            if s.slot != slot:  # it ended (a stop, a cancel) after this step was launched
                continue
            self._computed += n
            end = start + n
            if end // self.page_size > start // self.page_size:  # if not hashed at launch
                self.blocks.commit(s.rid, s.tokens, end)
            if s.req.is_score:
                lo = max(start, s.first_output)
                if call.score and lo < end:
                    idx = slice(lo - s.first_output, end - s.first_output)
                    rows = slice(cursor - end + lo, cursor)
                    s.score_lp[idx] = out["target_logprobs"][rows]
                    s.score_greedy[idx] = out["target_greedy"][rows]
                if end == s.compute_end:
                    self._finish(s)
                    events.append((s.rid, [], True))
                continue
            if not samples:
                continue  # a prefill chunk that did not reach the prompt's end
            top = None
            if s.req.sampling.top_logprobs:
                top = _top_dicts(out["top_ids"][s.slot: s.slot + 1],
                                 out["top_logprobs"][s.slot: s.slot + 1],
                                 s.req.sampling.top_logprobs)
            events.append(self._emit(s, [int(out["tokens"][s.slot])],
                                     [float(out["logprobs"][s.slot])], now, top))
        return events

    def _emit(self, s: _Seq, tokens: list[int], logprobs: list[float], now: float,
              top_logprobs: list[dict[int, float]] | None = None) -> Event:
        """Hand sampled tokens to the output side; finish the request if a stop rule fired."""
        self._generated += len(tokens)
        p = s.progress
        if s.first_token is None:
            s.first_token = now
            p.t_first = now - s.arrival
        s.last_token, p.t_last = now, now - s.arrival
        if s.unknown:  # a mixed step's token (one): the oldest placeholder
            s.tokens[len(s.tokens) - s.unknown] = tokens[0]
            s.unknown -= 1
        else:
            s.tokens.extend(tokens)
        try:
            new = add_tokens(self.model, s.req, p, tokens, logprobs, top_logprobs)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            self._fail(s, f"its output handling raised {type(e).__name__}: {e}")
            return s.rid, [], True
        if p.finished:
            self._finish(s)
        return s.rid, new, p.finished

    # ------------------------------------------------------------------ decode calls
    def _plan_decode(self, max_steps: int, widths: dict[int, int] | None = None) -> int:
        """Reserve pages for up to ``k`` iterations per running sequence; return ``k``.

        An iteration takes one token, or ``widths[rid]`` (a speculation loop: its last token
        and its proposals); no sequence reserves past its ``max_new_tokens``. Halves ``k``
        until the reservation fits the free pages, then preempts the youngest sequence if
        even one iteration each does not fit.
        """
        bm = self.blocks
        widths = widths or {}
        while self._running:
            left = [s.req.sampling.max_new_tokens - len(s.progress.tokens) for s in self._running]
            k = min(max_steps, max(left))
            while k >= 1:
                ends = [s.num_computed + min(k * widths.get(s.rid, 1), r)
                        for s, r in zip(self._running, left, strict=True)]
                need = sum(bm.pages_needed(s.rid, s.num_computed, e)
                           for s, e in zip(self._running, ends, strict=True))
                if need <= bm.num_free:
                    for s, e in zip(self._running, ends, strict=True):
                        self._reserve(s, e)
                    return k
                k //= 2
            self._preempt(self._running[-1])
        return 0

    def _decode_inputs(self, rows: list[_Seq], b: int, k: int, stop_after: int = 0
                       ) -> DecodeInputs:
        """Inputs of a decode call over slots ``[0, b)``, built with array indexing; it ends
        early once ``stop_after`` rows have stopped (0: when all have)."""
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        active = np.zeros(b, bool)
        remaining = np.zeros(b, np.int32)
        gen = np.zeros(b, np.int32)
        if rows:
            m = len(rows)
            slots = np.fromiter((q.slot for q in rows), np.int64, m)
            tokens[slots] = np.fromiter((q.tokens[-1] for q in rows), np.int32, m)
            positions[slots] = np.fromiter((q.num_computed for q in rows), np.int32, m)
            active[slots] = True
            gen[slots] = np.fromiter((len(q.progress.tokens) for q in rows), np.int32, m)
            remaining[slots] = np.fromiter((q.req.sampling.max_new_tokens for q in rows),
                                           np.int32, m) - gen[slots]
        return DecodeInputs(
            tokens=tokens, positions=positions, block_tables=self._tables[:b], active=active,
            remaining=remaining, limit=(self._table_len[:b] * self.page_size).astype(np.int32),
            gen_index=gen, stop_ids=self._stop_ids[:b], num_steps=np.int32(k),
            sampling=self._sampling(b), stop_after=np.int32(stop_after or b + 1))

    def _dispatch_decode(self, inp: DecodeInputs, stochastic: bool, num_top: int = 0
                         ) -> dict[str, jax.Array]:
        """Launch one decode call program (asynchronously); the pool and ``counts`` advance."""
        b = inp.block_tables.shape[0]
        self._announce(self._decode_program(b, stochastic, num_top),
                       f"decode loop for {b} rows" + (", sampled" if stochastic else "")
                       + (", top log-probabilities" if num_top else ""))
        with on_mesh(self.mesh):
            self.pool, self._counts, out = decode_steps(
                self.model.params, self.pool, self._counts, self._put(inp),
                config=self.model.config, backend=self.backend, dtype=self.model.dtype,
                max_steps=self._decode_buffer, chunk=self.decode_chunk, stochastic=stochastic,
                deterministic=self.model.deterministic, num_top=num_top)
        return out

    def _decode_program(self, b: int, stochastic: bool, num_top: int) -> tuple[Any, ...]:
        return ("decode", b, self._stop_width, stochastic, num_top)

    def _call_length(self, b: int, max_steps: int | None,
                     measured: dict[int, float] | None = None) -> int:
        """Iterations for a decode call over ``b`` rows: ``decode_call_seconds`` of measured
        device time (``measured``: seconds per iteration by row bucket, default the plain
        decode loop's; 16 before the first measure), within ``[4, decode_steps]``, in whole
        chunks of ``decode_chunk`` (the loop checks for stopped rows once per chunk)."""
        if max_steps is None:
            per = (self._iteration_s if measured is None else measured).get(b)
            max_steps = 16 if per is None else max(4, round(self.decode_call_seconds / per))
        k = min(max_steps, self.decode_steps)
        return max(k - k % self.decode_chunk, min(k, self.decode_chunk))

    def _launch_decode(self, max_steps: int | None) -> _Call | None:
        if not self._running:
            return None
        b = bucket(max(s.slot for s in self._running) + 1, self.row_buckets)
        # Requests wait for free slots: decode until enough rows stop (on the device), up to
        # ``decode_steps``; a shorter call would only add host round trips before they can
        # be admitted. Otherwise about ``decode_call_seconds``, so arrivals wait little.
        wanted = self._slots_wanted() if max_steps is None else 0
        k = self._plan_decode(self._call_length(b, self.decode_steps if wanted else max_steps))
        if k == 0:
            return None
        rows = list(self._running)  # planning may have preempted some
        stochastic = any(s.req.sampling.temperature > 0 for s in rows)
        num_top = _num_top(rows)
        compiled = (self._program_key(self._decode_program(b, stochastic, num_top))
                    not in _ANNOUNCED)
        self._inflight = (f"decode call of {b} rows x {k} iterations", rows)
        launched = time.perf_counter()
        out = self._dispatch_decode(self._decode_inputs(rows, b, k, wanted), stochastic,
                                    num_top)
        return _Call(out=out, launched=launched, padded=b * k, rows=rows, compiled=compiled)

    def _collect_decode(self, call: _Call) -> list[Event]:
        out, seconds = self._results_of(call)
        out_t = out["tokens"]
        self._decode_time += seconds
        b = out_t.shape[1]
        ran = int(np.count_nonzero((out_t >= 0).any(axis=1)))
        if ran and not call.compiled:  # a compile's seconds would shorten later calls
            per = seconds / ran
            _update_mean(self._iteration_s, b, per)
        self._decode_calls += 1
        # Token slots it computed: whole chunks up to its last token (it may end early).
        self._padded += b * min(-(-ran // self.decode_chunk) * self.decode_chunk,
                                call.padded // b)
        return self._emit_columns(call.rows, out)

    def _emit_columns(self, rows: list[_Seq], out: dict[str, np.ndarray]) -> list[Event]:
        """Emit each row's tokens from a device loop's ``out["tokens"] [N, B]`` (its slot's
        column, up to the first -1) with their log-probabilities (and top log-probabilities)."""
        out_t, out_lp = out["tokens"], out["logprobs"]
        now = time.perf_counter()
        events: list[Event] = []
        for s in rows:
            col = out_t[:, s.slot]
            n = int(np.count_nonzero(col >= 0))
            self._computed += n
            start = s.num_computed
            s.num_computed += n
            top = None
            if s.req.sampling.top_logprobs:
                top = _top_dicts(out["top_ids"][:n, s.slot], out["top_logprobs"][:n, s.slot],
                                 s.req.sampling.top_logprobs)
            events.append(self._emit(s, col[:n].tolist(), out_lp[:n, s.slot].tolist(), now,
                                     top))
            if s.slot >= 0 and s.num_computed // self.page_size > start // self.page_size:
                self.blocks.commit(s.rid, s.tokens, s.num_computed)
        return events

    # ------------------------------------------------------------------ speculation loops
    def _loop_pays(self, method: str, b: int, decode_b: int) -> bool:
        """Whether the ``method`` speculation loop over the ``b`` row bucket is expected to
        yield more tokens per second than a plain decode call over ``decode_b`` rows (the
        draft loop may take fewer, ``draft_row_buckets``): tried first, then one decode call
        is measured, then the faster runs; a losing loop is tried again every
        ``SPECULATION_RETRY`` decode calls (acceptance changes as outputs go on)."""
        if not all(s.req.sampling.speculative.adaptive
                   for s in self._running if s.req.sampling.speculative):
            return True
        loop_s, skips = self._loop_s[method], self._loop_skips[method]
        if b not in loop_s or decode_b not in self._iteration_s:
            return b not in loop_s
        if self._loop_gain[method][b] / loop_s[b] > 1 / self._iteration_s[decode_b]:
            return True
        skips[b] = skips.get(b, 0) + 1
        if skips[b] < SPECULATION_RETRY:
            return False
        skips[b] = 0
        return True

    def _launch_loop(self, method: str, b: int, max_steps: int | None) -> _Call | None:
        """A call of ``runner.ngram_steps`` or ``runner.draft_steps``: every running sequence
        proposes, verifies and emits on the device for several iterations (those without
        speculation decode one token an iteration). A draft first reads every token it has
        not seen but the newest (``_draft_catch_up``)."""
        specs = {s.rid: s.req.sampling.speculative for s in self._running}
        widths = {rid: sp.num_tokens + 1 for rid, sp in specs.items() if sp}
        k = self._plan_decode(self._call_length(b, max_steps, self._loop_s[method]), widths)
        if k == 0:
            return None
        rows = list(self._running)  # planning may have preempted some
        width = max(sp.num_tokens for sp in specs.values() if sp)
        longest = max(sp.ngram_max for sp in specs.values() if sp)
        stochastic = any(s.req.sampling.temperature > 0 for s in rows)
        compiled = method == "draft" and self._draft_catch_up(rows)
        inp = self._loop_inputs(rows, b, k, width)
        program = self._loop_program(method, b, width, longest, stochastic)
        compiled |= self._program_key(program) not in _ANNOUNCED
        self._inflight = (f"{method} speculation call of {b} rows x {k} iterations", rows)
        launched = time.perf_counter()
        out = self._dispatch_loop(method, inp, width, longest, stochastic)
        return _Call(out=out, launched=launched, padded=b * k * (width + 1), rows=rows,
                     compiled=compiled, loop=method)

    def _loop_inputs(self, rows: list[_Seq], b: int, k: int, width: int) -> SpecInputs:
        """Inputs of a speculation call over slots ``[0, b)``: the decode call's, and each
        row's last ``NGRAM_WINDOW`` tokens in a history with room for the tokens a call emits
        (one shape: ``k`` is at most the loop's buffer of iterations)."""
        n_hist = NGRAM_WINDOW + self._decode_buffer * (width + 1)
        history = np.full((b, n_hist), -1, np.int32)
        length = np.zeros(b, np.int32)
        num_tokens = np.zeros(b, np.int32)
        ngram_max = np.ones(b, np.int32)
        ngram_min = np.ones(b, np.int32)
        for s in rows:
            recent = s.tokens[-NGRAM_WINDOW:]
            history[s.slot, : len(recent)] = recent
            length[s.slot] = len(recent)
            spec = s.req.sampling.speculative
            if spec is not None:
                num_tokens[s.slot] = spec.num_tokens
                ngram_max[s.slot], ngram_min[s.slot] = spec.ngram_max, spec.ngram_min
        return SpecInputs(decode=self._decode_inputs(rows, b, k), history=history,
                           history_len=length, num_tokens=num_tokens, ngram_max=ngram_max,
                           ngram_min=ngram_min)

    def _loop_program(self, method: str, b: int, width: int, longest: int, stochastic: bool
                      ) -> tuple[Any, ...]:
        if method == "draft":
            return ("draft loop", b, width, self._stop_width, stochastic, *self._draft_key)
        return ("ngram", b, width, longest, self._stop_width, stochastic)

    def _dispatch_loop(self, method: str, inp: SpecInputs, width: int, longest: int,
                       stochastic: bool) -> dict[str, jax.Array]:
        """Launch one speculation call program (asynchronously); the pools and ``counts``
        advance."""
        b = inp.history.shape[0]
        self._announce(self._loop_program(method, b, width, longest, stochastic),
                       f"{method} speculation loop for {b} rows x {width + 1} tokens"
                       + (", sampled" if stochastic else ""))
        kw = dict(config=self.model.config, backend=self.backend, dtype=self.model.dtype,
                  width=width, max_steps=self._decode_buffer, chunk=self.decode_chunk,
                  stochastic=stochastic, deterministic=self.model.deterministic)
        with on_mesh(self.mesh):
            if method == "ngram":
                self.pool, self._counts, out = ngram_steps(
                    self.model.params, self.pool, self._counts, self._put(inp),
                    longest=longest, **kw)
            else:
                d = self._draft
                self.pool, self._draft_pool, self._counts, out = draft_steps(
                    self.model.params, d.params, self.pool, self._draft_pool, self._counts,
                    self._put(inp), draft_config=d.config,
                    draft_backend=self._draft_backend, draft_dtype=d.dtype,
                    draft_deterministic=d.deterministic, **kw)
        return out

    def _collect_loop(self, call: _Call) -> list[Event]:
        out, seconds = self._results_of(call)  # verify time (not ``decode_seconds``)
        b = out["tokens"].shape[1]
        iterations = int(out["iterations"])
        slots = [s.slot for s in call.rows]
        verified = int(out["verified"][slots].sum())
        proposed = int(out["proposed"][slots].sum())
        accepted = int(out["accepted"][slots].sum())
        if iterations and not call.compiled:  # a compile's seconds would shorten later calls
            _update_mean(self._loop_s[call.loop], b, seconds / iterations)
        emitted = int((out["tokens"][:, slots] >= 0).sum())
        if verified:
            _update_mean(self._loop_gain[call.loop], b, emitted / verified)
        for s in call.rows:
            s.progress.draft_tokens += int(out["proposed"][s.slot])
            s.progress.accepted_tokens += int(out["accepted"][s.slot])
        self._count_verified(iterations, verified, proposed, accepted)
        self._padded += call.padded
        # Run through the model: each row's last token and proposals per iteration (the
        # emitted tokens are counted as they are emitted).
        self._computed += verified + proposed - emitted
        events = self._emit_columns(call.rows, out)
        if call.loop == "draft":  # the draft's K/V cover all but its lag before the last
            for s in call.rows:
                s.draft_computed = s.num_computed - int(out["draft_lag"][s.slot])
        return events

    # ------------------------------------------------------------------ verify steps
    def _proposal_room(self, s: _Seq) -> int:
        """Tokens ``s`` may have proposed now: its ``num_tokens``, within the tokens it may
        still generate less the one verification always yields (0: it does not speculate)."""
        spec = s.req.sampling.speculative
        if spec is None:
            return 0
        room = min(s.req.sampling.max_new_tokens - len(s.progress.tokens),
                   self.max_seq_len - len(s.tokens)) - 1
        return max(0, min(spec.num_tokens, room))

    def _propose(self, rooms: dict[int, int], drafted: list[tuple[_Seq, int]], b: int
                 ) -> list[tuple[_Seq, list[int]]]:
        """Proposals of every running sequence: up to ``rooms[rid]`` tokens, from an n-gram
        lookup on the host or, for the ``drafted`` rows, from one draft-model program over
        the ``b`` row bucket (empty for rows without speculation or room)."""
        from_draft = self._propose_draft(drafted, b) if drafted else {}
        out = []
        for s in self._running:
            spec, k = s.req.sampling.speculative, rooms[s.rid]
            if k == 0:
                out.append((s, []))
            elif spec.method == "draft":
                out.append((s, from_draft[s.rid]))
            else:
                out.append((s, propose_ngram(s.tokens, k, spec.ngram_max, spec.ngram_min)))
        return out

    def _draft_ready(self, b: int, rooms: dict[int, int], drafted: list[tuple[_Seq, int]]
                     ) -> bool:
        """Before the draft runs: whether the verify step it feeds is expected to pay and
        fits the step's token budget and the free pages; if so, reserve the pages of the
        drafted rows' verification (which the draft writes into first)."""
        wanted = [k for k in rooms.values() if k]  # at most, per speculating row
        width = max(s.req.sampling.speculative.num_tokens for s, _ in drafted)
        ends = [(s, s.num_computed + 1 + k) for s, k in drafted]
        if (not self._verify_pays(b, wanted, drafting=True)
                or sum(1 + k for k in wanted) > self._verify_tokens(b, width)
                or sum(self.blocks.pages_needed(s.rid, s.num_computed, e) for s, e in ends)
                > self.blocks.num_free):
            return False
        for s, e in ends:
            self._reserve(s, e)
        return True

    def _propose_draft(self, rows: list[tuple[_Seq, int]], b: int) -> dict[int, list[int]]:
        """The draft model's greedy proposals, ``k`` tokens for each ``(sequence, k)`` row.

        The draft reads the tokens it has not seen (one or two after a verify step) and
        proposes in one program over the ``b`` row bucket (``runner.draft_step``), whose
        ``b * (width + 1)`` packed tokens hold up to ``width + 1`` per row. A row with more
        unseen tokens (the prompt after a prefill, the tokens of a decode call) first has
        all but its newest read by catching-up steps, packed like mixed steps. Afterwards
        the draft's K/V cover the sequence's tokens and its first ``k - 1`` proposals;
        verification keeps those that were accepted.
        """
        width = max(s.req.sampling.speculative.num_tokens for s, _ in rows)
        launched = time.perf_counter()
        compiled = False
        if any(len(s.tokens) - s.draft_computed > width + 1 for s, _ in rows):
            compiled = self._draft_catch_up([s for s, _ in rows])
        t = b * (width + 1)
        compiled |= self._program_key(self._draft_program(b, t, width)) not in _ANNOUNCED
        out = to_host(self._dispatch_draft(
            [(s, len(s.tokens) - s.draft_computed, k) for s, k in rows], b, t, width))
        seconds = time.perf_counter() - launched
        self._device_time += seconds
        self._draft_time += seconds
        if not compiled:
            _update_mean(self._draft_s, b, seconds)
        for s, k in rows:
            s.draft_computed = len(s.tokens) + k - 1
        return {s.rid: out[s.slot, :k].tolist() for s, k in rows}

    def _draft_catch_up(self, seqs: list[_Seq]) -> bool:
        """Run the draft over all but the newest token of each of ``seqs`` that it has not
        seen, in steps of at most the token budget over every slot, padded to a token
        bucket (the programs ``warmup`` compiles); return whether one was compiled."""
        compiled = False
        while True:
            plan, room = [], self.max_tokens
            for s in seqs:
                n = min(len(s.tokens) - 1 - s.draft_computed, room)
                if n > 0:
                    plan.append((s, n, 0))
                    room -= n
            if not plan:
                return compiled
            t = bucket(self.max_tokens - room, self.token_buckets)
            compiled |= (self._program_key(self._draft_program(self.max_batch, t, 0))
                         not in _ANNOUNCED)
            self._dispatch_draft(plan, self.max_batch, t, 0)
            for s, n, _ in plan:
                s.draft_computed += n

    def _draft_program(self, b: int, t: int, num_steps: int) -> tuple[Any, ...]:
        return ("draft", b, t, num_steps, *self._draft_key)

    def _dispatch_draft(self, plan: list[tuple[_Seq, int, int]], b: int, t: int,
                        num_steps: int) -> jax.Array:
        """Launch one draft-model step (asynchronously) over ``(sequence, tokens to read,
        proposals wanted)`` entries; the draft's pool advances. Returns the proposals
        ``[b, num_steps]`` (device)."""
        d = self._draft
        self._announce(self._draft_program(b, t, num_steps),
                       f"draft model's step for {b} rows x {t} tokens"
                       + (f", {num_steps} proposals" if num_steps else ""))
        self._inflight = (f"draft model's step of {b} rows x {t} tokens", [q for q, *_ in plan])
        inp = self._packed_inputs(
            [(q, q.draft_computed, q.tokens[q.draft_computed: q.draft_computed + n])
             for q, n, _ in plan], b, t)
        wanted = np.zeros(b, np.int32)
        for q, _, k in plan:
            wanted[q.slot] = k
        self._draft_pool, out = draft_step(
            d.params, self._draft_pool, self._put(inp), self._put(wanted), config=d.config,
            backend=self._draft_backend, dtype=d.dtype,
            max_q_len=num_steps + 1 if num_steps else t,  # proposing: up to k + 1 per row
            num_steps=num_steps, deterministic=d.deterministic)
        return out

    def _verify_pays(self, b: int, proposed: list[int], drafting: bool = False) -> bool:
        """Whether a verify step with ``proposed`` tokens per row (after draft-model
        proposals if ``drafting``) is expected to yield more tokens per second than a decode
        call over the same ``b`` rows (measured per row bucket; each kind is tried once, the
        verify step first)."""
        if not all(s.req.sampling.speculative.adaptive
                   for s in self._running if s.req.sampling.speculative):
            return True
        if b not in self._verify_s or b not in self._iteration_s:
            return b not in self._verify_s
        gain = sum(1 + self._acceptance * n for n in proposed)
        cost = self._verify_s[b] + (self._draft_s.get(b, 0.0) if drafting else 0.0)
        return gain / cost > len(proposed) / self._iteration_s[b]

    def _launch_decode_step(self, max_steps: int | None) -> _Call | None:
        """The step after a mixed one: a verify step when running sequences speculate, their
        row bucket is small enough, the pages fit and it is expected to be faster (judged
        before a draft model runs, so a loss costs no draft work); a decode call otherwise,
        a short one while speculation pays but nothing can be proposed yet (new tokens may
        start to repeat earlier ones)."""
        specs = [s.req.sampling.speculative for s in self._running
                 if s.req.sampling.speculative]
        if not specs:
            return self._launch_decode(max_steps)
        used = max(s.slot for s in self._running) + 1  # slots [0, used)
        b = bucket(used, self.row_buckets)
        if b > VERIFY_MAX_ROWS:
            return self._launch_decode(max_steps)
        methods = {sp.method for sp in specs}
        if len(methods) == 1 and not _num_top(self._running):
            # Proposals, verification and stops on the device, several iterations a call.
            method = methods.pop()
            lb = b if method == "ngram" else bucket(used, self.draft_row_buckets)
            if self._loop_pays(method, lb, b):
                return self._launch_loop(method, lb, max_steps)
            return self._launch_decode(max_steps)
        rooms = {s.rid: self._proposal_room(s) for s in self._running}
        drafted = [(s, rooms[s.rid]) for s in self._running
                   if rooms[s.rid] and s.req.sampling.speculative.method == "draft"]
        if drafted and not self._draft_ready(b, rooms, drafted):
            return self._launch_decode(max_steps)
        proposals = self._propose(rooms, drafted, b)
        if not any(p for _, p in proposals):
            if not self._verify_pays(b, [sp.num_tokens for sp in specs]):
                return self._launch_decode(max_steps)
            short = max(sp.num_tokens for sp in specs) + 1
            return self._launch_decode(short if max_steps is None else min(max_steps, short))
        if not drafted and not self._verify_pays(b, [len(p) for _, p in proposals]):
            return self._launch_decode(max_steps)
        bm = self.blocks
        ends = [s.num_computed + 1 + len(p) for s, p in proposals]
        width = max(s.req.sampling.speculative.num_tokens for s, p in proposals if p)
        if (sum(e - s.num_computed for (s, _), e in zip(proposals, ends, strict=True))
                > self._verify_tokens(b, width)  # more tokens than the step's budget
                or sum(bm.pages_needed(s.rid, s.num_computed, e)
                       for (s, _), e in zip(proposals, ends, strict=True)) > bm.num_free):
            for s, _ in drafted:  # the draft's K/V of unverified proposals are not kept
                s.draft_computed = min(s.draft_computed, len(s.tokens))
            return self._launch_decode(max_steps)  # its planning preempts as needed
        for (s, _), e in zip(proposals, ends, strict=True):
            self._reserve(s, e)
        stochastic = any(s.req.sampling.temperature > 0 for s, _ in proposals)
        num_top = _num_top(s for s, _ in proposals)
        program = self._verify_program(b, width, stochastic, num_top)
        compiled = self._program_key(program) not in _ANNOUNCED
        self._inflight = (f"verify step of {b} rows x {width + 1} tokens",
                          [s for s, _ in proposals])
        launched = time.perf_counter()
        out = self._dispatch_verify(proposals, b, width, stochastic, num_top)
        return _Call(out=out, launched=launched, padded=self._verify_tokens(b, width),
                     proposals=proposals, compiled=compiled)

    def _verify_tokens(self, b: int, width: int) -> int:
        """Packed tokens of a verify step over ``b`` rows proposing up to ``width`` (one
        program serves each row bucket)."""
        return verify_tokens(b, width, self.max_tokens)

    def _verify_program(self, b: int, width: int, stochastic: bool, num_top: int
                        ) -> tuple[Any, ...]:
        return ("verify", b, width, stochastic, num_top)

    def _dispatch_verify(self, proposals: list[tuple[_Seq, list[int]]], b: int, width: int,
                         stochastic: bool, num_top: int = 0) -> dict[str, jax.Array]:
        """Launch one verify step program (asynchronously); the pool and ``counts`` advance."""
        t = self._verify_tokens(b, width)
        self._announce(self._verify_program(b, width, stochastic, num_top),
                       f"verify step for {b} rows x {width + 1} tokens"
                       + (", sampled" if stochastic else ""))
        inp, drafts, counts = self._verify_inputs(proposals, b, t, width)
        with on_mesh(self.mesh):
            self.pool, self._counts, out = verify_step(
                self.model.params, self.pool, self._counts, self._put(inp), *self._put(
                    (drafts, counts)), config=self.model.config, backend=self.backend,
                dtype=self.model.dtype, max_q_len=t, stochastic=stochastic,
                deterministic=self.model.deterministic, num_top=num_top)
        return out

    def _verify_inputs(self, proposals: list[tuple[_Seq, list[int]]], b: int, t: int,
                       width: int) -> tuple[MixedInputs, np.ndarray, np.ndarray]:
        """Packed inputs of a verify step over slots ``[0, b)``: each row's last token, then
        its proposals; and the proposals ``[b, width]`` and their counts ``[b]``."""
        drafts = np.zeros((b, width), np.int32)
        counts = np.zeros(b, np.int32)
        for s, p in proposals:
            drafts[s.slot, : len(p)] = p
            counts[s.slot] = len(p)
        inp = self._packed_inputs([(s, s.num_computed, [s.tokens[-1], *p])
                                   for s, p in proposals], b, t)
        return inp, drafts, counts

    def _fill_row(self, tokens: np.ndarray, positions: np.ndarray, write_pages: np.ndarray,
                  write_offsets: np.ndarray, slot: int, offset: int, start: int,
                  toks: Sequence[int]) -> np.ndarray:
        """Write one sequence's ``toks`` into packed step inputs ``[T]`` from index
        ``offset``, at positions from ``start`` (K/V to their slots of ``slot``'s pages);
        returns the positions ``[len(toks)]``."""
        n = len(toks)
        pos = np.arange(start, start + n, dtype=np.int32)
        sl = slice(offset, offset + n)
        tokens[sl] = toks
        positions[sl] = pos
        write_pages[sl] = self._tables[slot, pos // self.page_size]
        write_offsets[sl] = pos % self.page_size
        return pos

    def _packed_inputs(self, rows: list[tuple[_Seq, int, Sequence[int]]], b: int, t: int
                       ) -> MixedInputs:
        """Packed inputs over slots ``[0, b)`` (``t`` tokens): each ``(sequence, start,
        tokens)`` row feeds ``tokens`` at positions from ``start``, writes their K/V and
        samples (``samples``, ``last_index``) after the last; other slots feed nothing."""
        n_pages = self.blocks.num_pages
        q_lens = np.zeros(b, np.int32)
        kv_lens = np.zeros(b, np.int32)
        gen = np.zeros(b, np.int32)
        samples = np.zeros(b, bool)
        for s, start, toks in rows:
            q_lens[s.slot] = len(toks)
            kv_lens[s.slot] = start + len(toks)
            gen[s.slot] = len(s.progress.tokens)
            samples[s.slot] = True
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        last = np.maximum(cu[1:] - 1, 0).astype(np.int32)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        write_pages = np.full(t, n_pages, np.int32)
        write_offsets = np.zeros(t, np.int32)
        for s, start, toks in rows:
            self._fill_row(tokens, positions, write_pages, write_offsets, s.slot,
                           int(cu[s.slot]), start, toks)
        return MixedInputs(
            tokens=tokens, positions=positions, write_pages=write_pages,
            write_offsets=write_offsets, targets=np.full(t, -1, np.int32),
            block_tables=self._tables[:b], kv_lens=kv_lens, cu_q_lens=cu, last_index=last,
            gen_index=gen, samples=samples, sampling=self._sampling(b))

    def _collect_verify(self, call: _Call) -> list[Event]:
        out, seconds = self._results_of(call)
        b = out["tokens"].shape[0]
        if not call.compiled:
            _update_mean(self._verify_s, b, seconds)
        now = time.perf_counter()
        self._padded += call.padded
        proposed = accepted = 0
        events: list[Event] = []
        for s, p in call.proposals:
            a = int(out["accepted"][s.slot])
            proposed, accepted = proposed + len(p), accepted + a
            s.progress.draft_tokens += len(p)
            s.progress.accepted_tokens += a
            start = s.num_computed
            s.num_computed += 1 + a
            s.draft_computed = min(s.draft_computed, s.num_computed)  # its accepted inputs
            self._computed += 1 + len(p)
            top = None
            if s.req.sampling.top_logprobs:
                top = _top_dicts(out["top_ids"][s.slot, : a + 1],
                                 out["top_logprobs"][s.slot, : a + 1], s.req.sampling.top_logprobs)
            events.append(self._emit(s, out["tokens"][s.slot, : a + 1].tolist(),
                                     out["logprobs"][s.slot, : a + 1].tolist(), now, top))
            if s.slot >= 0 and s.num_computed // self.page_size > start // self.page_size:
                self.blocks.commit(s.rid, s.tokens, s.num_computed)
        self._count_verified(1, len(call.proposals), proposed, accepted)
        return events

    def _count_verified(self, steps: int, rows: int, proposed: int, accepted: int) -> None:
        """Add verify passes (``rows`` sequences advanced over ``steps`` passes) to the
        engine's counters and the running acceptance rate."""
        self._verify_steps += steps
        self._verified_rows += rows
        self._draft_tokens += proposed
        self._accepted_tokens += accepted
        if proposed:
            self._acceptance = 0.5 * (self._acceptance + accepted / proposed)


def _update_mean(means: dict[Any, float], key: Any, value: float) -> None:
    """``means[key]``: the running mean (each new value weighs half) of measurements that
    drift as the batch changes; the first value as it is."""
    means[key] = 0.5 * (means.get(key, value) + value)


def _num_top(seqs: Iterator[_Seq] | Sequence[_Seq]) -> int:
    """Most likely tokens a step returns per row: ``MAX_TOP_LOGPROBS`` when any of its
    generation requests asks for top log-probabilities, else 0 (nothing computed or sent)."""
    wants = any(not s.req.is_score and s.req.sampling.top_logprobs for s in seqs)
    return MAX_TOP_LOGPROBS if wants else 0


def _top_dicts(ids: np.ndarray, logprobs: np.ndarray, k: int) -> list[dict[int, float]]:
    """One ``{token id: log-probability}`` dict of the ``k`` most likely tokens per row of
    ``ids, logprobs [n, MAX_TOP_LOGPROBS]`` (most likely first)."""
    return [dict(zip(i[:k].tolist(), lp[:k].tolist(), strict=True))
            for i, lp in zip(ids, logprobs, strict=True)]
