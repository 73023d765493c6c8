"""Continuous-batching engine over a paged KV cache (Orca scheduling, vLLM memory).

Every ``step()`` is one iteration of the scheduler followed by one fused device step:

1. Running sequences get their tokens first: one per decoding sequence, then prefill chunks
   of sequences still reading their prompt, oldest first, within ``max_tokens_per_step``.
   When the pool cannot hold them, the youngest running sequence is preempted: its pages are
   released (full ones stay in the prefix cache) and it is requeued to be recomputed later.
2. Waiting requests are admitted (first come, first served) into free batch slots while the
   token budget and pages last; the longest cached prefix of each is mapped, not recomputed.
3. One jitted step runs the model over the packed tokens of all scheduled sequences
   (``model.forward_ragged``: prefill chunks and decode tokens together, K/V written to their
   pages, ragged paged attention), then samples one token per sequence with the shared
   ``sampling.sample``.

Every device array has a fixed shape (batch slots, token budget, pages per sequence), so
serving any mix of requests compiles the step once. A sampled token depends only on the
request's own seed, token index and tokens, so a request's output does not depend on what
else was in the batch, on chunking, or on preemption.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.attention import resolve_backend
from jaxinfer.config import LlamaConfig
from jaxinfer.errors import InputError
from jaxinfer.generate import (
    Completion,
    Model,
    Prompt,
    _completion,
    _make_requests,
    _Progress,
    _Request,
    _trim_at_stop_string,
)
from jaxinfer.model import Params, forward_ragged, lm_head
from jaxinfer.paged_cache import BlockManager, PagePool, pages_for_budget
from jaxinfer.sampling import SamplingArrays, SamplingParams, sample
from sharding.mesh import mesh_sizes
from sharding.placement import on_mesh, put_replicated, to_host
from sharding.rules import engine_pool_sharding, engine_pool_spec

Event = tuple[int, list[int], bool]  # (request_id, new_token_ids, finished)

_TRACES = collections.Counter()  # step-function traces (= compilations) per engine shape


@struct.dataclass
class _StepInputs:
    """Host-built inputs of one engine step. T = token budget, B = slots, P = pages/seq."""

    tokens: jax.Array  # Int['T'] packed input tokens (0 = padding)
    positions: jax.Array  # Int['T'] absolute position of each token in its sequence
    write_pages: jax.Array  # Int['T'] page receiving each token's K/V; num_pages = drop
    write_offsets: jax.Array  # Int['T'] offset within that page
    block_tables: jax.Array  # Int['B P']
    kv_lens: jax.Array  # Int['B'] keys per slot after this step's tokens
    cu_q_lens: jax.Array  # Int['B+1'] cumulative tokens per slot
    last_index: jax.Array  # Int['B'] packed index of each slot's last token
    gen_index: jax.Array  # Int['B'] index of the token being sampled (folded into the key)
    samples: jax.Array  # Bool['B'] slot finishes its input this step and samples a token
    copy_src: jax.Array  # Int['B'] copy-on-write page copies, src -> dst
    copy_dst: jax.Array  # Int['B'] num_pages = no copy
    sampling: SamplingArrays


@functools.partial(jax.jit, static_argnames=("config", "backend", "dtype"), donate_argnums=(1, 2))
def _engine_step(
    params: Params,
    pool: PagePool,
    seen: jax.Array,
    inp: _StepInputs,
    *,
    config: LlamaConfig,
    backend: Literal["reference", "pallas"],
    dtype: Any,
) -> tuple[PagePool, jax.Array, jax.Array, jax.Array]:
    """One fused step: page copies, ragged forward, one sampled token per slot.

    Returns ``(pool, seen [B, V], tokens [B], logprobs [B])``; rows of slots that do not
    sample this step are garbage and ignored by the host.
    """
    _TRACES[(config, backend, str(dtype), inp.tokens.shape, inp.block_tables.shape)] += 1
    # Copies first: a copied page is then written by this very step.
    k = pool.k.at[:, :, inp.copy_dst].set(pool.k[:, :, inp.copy_src], mode="drop")
    v = pool.v.at[:, :, inp.copy_dst].set(pool.v[:, :, inp.copy_src], mode="drop")
    if not jax.sharding.get_abstract_mesh().empty:  # on a mesh: keep the pool's heads split
        k = jax.lax.with_sharding_constraint(k, engine_pool_spec())
        v = jax.lax.with_sharding_constraint(v, engine_pool_spec())
    h, k, v = forward_ragged(params, config, inp.tokens, inp.positions, k, v, inp.write_pages,
                             inp.write_offsets, inp.block_tables, inp.kv_lens, inp.cu_q_lens,
                             backend=backend, dtype=dtype)
    logits = lm_head(params, h[inp.last_index])  # [B, V]: only each slot's last token
    tokens, logprobs = sample(logits, inp.sampling, seen, inp.gen_index)
    rows = jnp.arange(tokens.shape[0])
    seen = seen.at[rows, tokens].set(seen[rows, tokens] | inp.samples)
    if not jax.sharding.get_abstract_mesh().empty:  # same shardings out as in: no recompile
        k = jax.lax.with_sharding_constraint(k, engine_pool_spec())
        v = jax.lax.with_sharding_constraint(v, engine_pool_spec())
        seen = jax.lax.with_sharding_constraint(seen, jax.sharding.PartitionSpec())
    return PagePool(k=k, v=v), seen, tokens, logprobs


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_seen(seen: jax.Array, row: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Row ``row`` of ``seen [B, V]`` := the tokens in ``token_ids [S]`` (V-padded, dropped)."""
    return seen.at[row].set(False).at[row, token_ids].set(True, mode="drop")


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
    running: int
    waiting: int
    generated_tokens: int
    computed_tokens: int  # tokens run through the model (prefill + decode)
    tokens_per_second: float
    pages_total: int
    pages_used: int  # referenced by live sequences
    pages_cached: int  # unreferenced, kept for the prefix cache (evictable)
    pages_free: int  # neither
    peak_pages_used: int
    tokens_capacity: int  # pages_total * page_size
    tokens_held: int  # positions with K/V in the pool for running sequences
    prefix_cache_hit_rate: float  # cached tokens / prompt tokens looked up at admission
    num_preemptions: int
    num_compilations: int  # step-function compilations by this engine


@dataclasses.dataclass
class _Seq:
    """Host state of one request."""

    rid: int
    req: _Request
    key: np.ndarray  # uint32[2] PRNG key data (seed resolved at submission)
    tokens: list[int]  # prompt + generated: what the cache is built from
    progress: _Progress = dataclasses.field(default_factory=_Progress)
    num_computed: int = 0  # positions whose K/V are in the pool
    slot: int = -1
    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0


class Engine:
    """Continuous batching over a paged KV cache for one model.

    Args:
      model: a ``jaxinfer.Model`` (``load_model`` or hand-built).
      max_batch: sequences running at once (fixed batch slots); default ``model.max_batch``.
      kv_cache_bytes: device bytes for the page pool; default ``memory_fraction`` of the free
        device memory (GPU/TPU). ``num_pages`` sets the pool size directly instead.
      page_size: tokens per page (a power of two for the Pallas kernel).
      max_tokens_per_step: token budget of one step (decode tokens + prefill chunks); at
        least ``max_batch``. Bounds each step's latency while a long prompt is read.
      max_seq_len: longest prompt + output; sets pages per sequence. Default: the model's
        context, capped by the pool size.
      chunked_prefill: split long prompts over steps (mixed with decodes). Without it a
        prompt is read in one step and must fit the token budget.
      prefix_caching: share and cache full pages of equal prefixes.
      verbose: print the pool size on stderr.

    On a mesh (``load_model(mesh=...)``, stacked layout) the pool ``[L, kv_heads, pages,
    page_size, D]`` is split by K/V heads on ``model`` and replicated over ``data`` (one pool
    shared by all slots, see ``sharding.rules.engine_pool_spec``); the step inputs are
    replicated and the ragged attention runs per shard in ``shard_map``. ``kv_cache_bytes``
    is then per device. Outputs equal the single-device engine's.
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
        max_tokens_per_step: int = 512,
        max_seq_len: int | None = None,
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        verbose: bool = True,
    ) -> None:
        cfg = model.config
        self.model = model
        self.max_batch = max_batch or model.max_batch
        if self.max_batch < 1:
            raise InputError(f"max_batch={self.max_batch} must be >= 1")
        if page_size < 1 or page_size & (page_size - 1):
            raise InputError(f"page_size={page_size} must be a power of two")
        if max_tokens_per_step < self.max_batch:
            raise InputError(f"max_tokens_per_step={max_tokens_per_step} must be >= max_batch="
                             f"{self.max_batch} so every running sequence can decode each step")
        self.mesh = model.mesh
        _, model_size = mesh_sizes(self.mesh)
        if self.mesh is not None and model.layout != "stacked":
            raise InputError(f"the engine on a mesh {dict(self.mesh.shape)} needs the stacked "
                             f"layout, not {model.layout!r}; load_model(mesh=...) gives it")
        pool_sharding = None if self.mesh is None else engine_pool_sharding(self.mesh, cfg)
        if num_pages is None:
            num_pages = pages_for_budget(cfg, page_size, model.dtype, kv_cache_bytes,
                                         memory_fraction, model_shards=model_size)
        self.page_size = page_size
        self.max_tokens = max_tokens_per_step
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings,
                               cfg.max_position_embeddings, num_pages * page_size)
        self.pages_per_seq = math.ceil(self.max_seq_len / page_size)
        self.chunked_prefill = chunked_prefill
        self.backend = resolve_backend(model.backend, cfg.head_dim)
        self.blocks = BlockManager(num_pages, page_size, prefix_caching)
        self.pool = PagePool.create(cfg, num_pages, page_size, model.dtype,
                                    sharding=pool_sharding)
        self._seen = put_replicated(self.mesh, np.zeros((self.max_batch, cfg.vocab_size), bool))
        if verbose:
            mib = (num_pages * PagePool.bytes_per_page(cfg, page_size, model.dtype) / 2**20
                   / model_size)  # per device
            print(f"jaxinfer engine: KV pool of {num_pages} pages x {page_size} tokens = "
                  f"{num_pages * page_size} tokens ({mib:.1f} MiB"
                  f"{' per device' if model_size > 1 else ''}), {self.max_batch} slots",
                  file=sys.stderr, flush=True)

        self._next_id = 0
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []  # admission order: the last one is the youngest
        self._seqs: dict[int, _Seq] = {}
        self._results: dict[int, Completion] = {}
        self._free_slots = list(range(self.max_batch))
        # Per-slot sampling settings, uploaded with every step (a few bytes per slot).
        b = self.max_batch
        self._temperature = np.zeros(b, np.float32)
        self._top_k = np.zeros(b, np.int32)
        self._top_p = np.ones(b, np.float32)
        self._min_p = np.zeros(b, np.float32)
        self._rep_penalty = np.ones(b, np.float32)
        self._keys = np.zeros((b, 2), np.uint32)
        # Metrics.
        self._steps = 0
        self._step_time = 0.0
        self._generated = 0
        self._computed = 0
        self._peak_used = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._preemptions = 0
        self._trace_key = (cfg, self.backend, str(model.dtype), (self.max_tokens,),
                           (self.max_batch, self.pages_per_seq))
        self._traces_at_start = _TRACES[self._trace_key]

    # ------------------------------------------------------------------ public API
    def submit(
        self,
        prompt: Prompt,
        *,
        chat: bool = False,
        sampling: SamplingParams | None = None,
        **sampling_kwargs: Any,
    ) -> int:
        """Queue one request (same prompt forms and options as ``generate``); returns its id.

        It joins the running batch at the next ``step()`` that has room.
        """
        reqs = _make_requests(self.model, prompt, chat, sampling, sampling_kwargs)
        if len(reqs) != 1:
            raise InputError(f"submit takes one prompt, got {len(reqs)}; call submit once per "
                             "prompt")
        return self._submit(reqs[0])

    def step(self) -> list[Event]:
        """Admit waiting requests, run one fused step; return ``(id, new_tokens, finished)``.

        ``new_tokens`` is empty when a request ended on a stop token (which is not output).
        """
        t0 = time.perf_counter()
        plan, copies = self._schedule()
        if not plan:
            if self._waiting and not self._running:  # unreachable given submit's checks
                raise RuntimeError("the engine cannot admit any waiting request with an empty "
                                   "pool; this is a scheduler bug")
            return []
        inp = put_replicated(self.mesh, self._build_inputs(plan, copies))
        with on_mesh(self.mesh):
            self.pool, self._seen, tokens, logprobs = _engine_step(
                self.model.params, self.pool, self._seen, inp, config=self.model.config,
                backend=self.backend, dtype=self.model.dtype)
        tokens, logprobs = to_host((tokens, logprobs))
        now = time.perf_counter()
        self._peak_used = max(self._peak_used, self.blocks.num_used)
        events = self._advance(plan, tokens, logprobs, now)
        self._steps += 1
        self._step_time += time.perf_counter() - t0
        return events

    def has_unfinished(self) -> bool:
        """Whether any submitted request is still waiting or running."""
        return bool(self._waiting or self._running)

    def events(self) -> Iterator[Event]:
        """Stream events until every submitted request is finished (more may be submitted)."""
        while self.has_unfinished():
            yield from self.step()

    def run_until_done(self) -> None:
        """Step until no request is waiting or running."""
        for _ in self.events():
            pass

    def result(self, request_id: int) -> Completion:
        """The ``Completion`` of a finished request (handed over once, then forgotten)."""
        if request_id in self._results:
            return self._results.pop(request_id)
        if request_id in self._seqs:
            raise InputError(f"request {request_id} is not finished yet; call step() or "
                             "run_until_done() first")
        raise InputError(f"unknown request id {request_id} (or its result was already taken)")

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

    def forget(self, request_id: int) -> None:
        """Drop the metrics of a finished request (long-running servers call this)."""
        if request_id in self._seqs and self._seqs[request_id].progress.finished:
            del self._seqs[request_id]

    def stats(self) -> EngineStats:
        """Throughput, queue sizes, page usage and prefix-cache hit rate so far."""
        bm = self.blocks
        return EngineStats(
            steps=self._steps, running=len(self._running), waiting=len(self._waiting),
            generated_tokens=self._generated, computed_tokens=self._computed,
            tokens_per_second=self._generated / self._step_time if self._step_time else 0.0,
            pages_total=bm.num_pages, pages_used=bm.num_used, pages_cached=bm.num_cached,
            pages_free=bm.num_free - bm.num_cached, peak_pages_used=self._peak_used,
            tokens_capacity=bm.num_pages * self.page_size,
            tokens_held=sum(s.num_computed for s in self._running),
            prefix_cache_hit_rate=self._hit_tokens / max(1, self._lookup_tokens),
            num_preemptions=self._preemptions,
            num_compilations=_TRACES[self._trace_key] - self._traces_at_start)

    # ------------------------------------------------------------------ submission
    def _submit(self, req: _Request) -> int:
        need = len(req.prompt_ids) + req.sampling.max_new_tokens
        if need > self.max_seq_len:
            raise InputError(f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens="
                             f"{req.sampling.max_new_tokens} exceeds the engine's max_seq_len="
                             f"{self.max_seq_len}; shorten it or build a larger Engine")
        if not self.chunked_prefill and len(req.prompt_ids) > self.max_tokens:
            raise InputError(f"prompt of {len(req.prompt_ids)} tokens exceeds "
                             f"max_tokens_per_step={self.max_tokens} without chunked prefill; "
                             "raise it or use chunked_prefill=True")
        sp = req.sampling
        if sp.seed is None:  # resolve now, so a preempted request resumes with the same key
            sp = dataclasses.replace(sp, seed=secrets.randbits(63))
            req = dataclasses.replace(req, sampling=sp)
        key = np.asarray(SamplingArrays.from_params([sp]).keys[0])
        rid = self._next_id
        self._next_id += 1
        seq = _Seq(rid=rid, req=req, key=key, tokens=list(req.prompt_ids),
                   arrival=time.perf_counter())
        self._seqs[rid] = seq
        self._waiting.append(seq)
        return rid

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> tuple[list[tuple[_Seq, int]], list[tuple[int, int]]]:
        """Choose each sequence's tokens for this step and map their pages.

        Returns ``(plan, copies)``: ``(sequence, new token count)`` pairs and the page copies
        (copy-on-write) to apply before the step.
        """
        bm = self.blocks
        while True:  # restarts after each preemption, which frees pages
            plan: list[tuple[_Seq, int]] = []
            budget, free = self.max_tokens, bm.num_free
            # Decodes first so that a long prompt never stalls them (bounded decode latency).
            order = sorted(self._running, key=lambda s: len(s.tokens) - s.num_computed > 1)
            victim = None
            for s in order:
                n = self._fit(s, s.num_computed, min(len(s.tokens) - s.num_computed, budget),
                              free, ())
                if n == 0 and budget > 0:
                    victim = self._running[-1]
                    break
                if n:
                    plan.append((s, n))
                    budget -= n
                    free -= bm.pages_needed(s.rid, s.num_computed, s.num_computed + n)
            if victim is None:
                break
            self._preempt(victim)
        copies = []
        for s, n in plan:
            copies += bm.prepare_write(s.rid, s.num_computed, s.num_computed + n)
        copies += self._admit(plan, budget)
        return plan, copies

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

    def _admit(self, plan: list[tuple[_Seq, int]], budget: int) -> list[tuple[int, int]]:
        """Move waiting requests into free slots (FCFS) while budget and pages allow."""
        bm, ps = self.blocks, self.page_size
        copies: list[tuple[int, int]] = []
        deferred = []
        while self._waiting and self._free_slots and budget > 0:
            s = self._waiting[0]
            hits = bm.match_prefix(s.rid, s.tokens)
            if bm.waits_for_pending(s.rid, s.tokens, len(hits)):
                # Another sequence is computing our next block; share it a step later.
                deferred.append(self._waiting.popleft())
                continue
            start = min(len(hits) * ps, len(s.tokens) - 1)
            n = self._fit(s, start, len(s.tokens) - start, bm.num_free, hits)
            n = min(n, budget) if self._chunks(s) else n * (n <= budget)
            if n == 0:
                break
            self._waiting.popleft()
            bm.admit(s.rid, s.tokens, hits)
            s.num_computed = start
            copies += bm.prepare_write(s.rid, start, start + n)
            s.slot = self._free_slots.pop()
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
        return copies

    def _load_slot(self, s: _Seq) -> None:
        sp, b = s.req.sampling, s.slot
        self._temperature[b], self._top_k[b], self._top_p[b] = sp.temperature, sp.top_k, sp.top_p
        self._min_p[b], self._rep_penalty[b] = sp.min_p, sp.repetition_penalty
        self._keys[b] = s.key
        if sp.repetition_penalty != 1.0:  # rows of other slots are never read by the penalty
            ids = np.full(self.pages_per_seq * self.page_size, self.model.config.vocab_size,
                          np.int32)
            ids[: len(s.tokens)] = s.tokens
            with on_mesh(self.mesh):
                self._seen = _reset_seen(self._seen, *put_replicated(self.mesh,
                                                                     (np.int32(b), ids)))

    def _preempt(self, s: _Seq) -> None:
        """Release ``s``'s pages and slot; it recomputes its tokens when readmitted."""
        self._running.remove(s)
        self.blocks.free(s.rid)
        self._free_slots.append(s.slot)
        s.slot, s.num_computed = -1, 0
        s.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(s)

    # ------------------------------------------------------------------ device step
    def _build_inputs(self, plan: list[tuple[_Seq, int]],
                      copies: list[tuple[int, int]]) -> _StepInputs:
        t, b, n_pages = self.max_tokens, self.max_batch, self.blocks.num_pages
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        write_pages = np.full(t, n_pages, np.int32)
        write_offsets = np.zeros(t, np.int32)
        tables = np.zeros((b, self.pages_per_seq), np.int32)
        kv_lens = np.zeros(b, np.int32)
        q_lens = np.zeros(b, np.int32)
        last = np.zeros(b, np.int32)
        gen = np.zeros(b, np.int32)
        samples = np.zeros(b, bool)
        by_slot = {s.slot: (s, n) for s, n in plan}
        ps, cursor = self.page_size, 0
        for slot in range(b):  # packed in slot order, as cu_q_lens requires
            if slot not in by_slot:
                continue
            s, n = by_slot[slot]
            table = self.blocks.tables[s.rid]
            pos = np.arange(s.num_computed, s.num_computed + n)
            sl = slice(cursor, cursor + n)
            tokens[sl] = s.tokens[s.num_computed: s.num_computed + n]
            positions[sl] = pos
            write_pages[sl] = np.asarray(table)[pos // ps]
            write_offsets[sl] = pos % ps
            tables[slot, : len(table)] = table
            kv_lens[slot] = s.num_computed + n
            q_lens[slot] = n
            cursor += n
            last[slot] = cursor - 1
            gen[slot] = len(s.progress.tokens)
            samples[slot] = s.num_computed + n == len(s.tokens)
        src = np.zeros(b, np.int32)
        dst = np.full(b, n_pages, np.int32)
        for i, (a, c) in enumerate(copies):
            src[i], dst[i] = a, c
        self._computed += cursor
        sampling = SamplingArrays(
            temperature=self._temperature, top_k=self._top_k, top_p=self._top_p,
            min_p=self._min_p, repetition_penalty=self._rep_penalty, keys=self._keys)
        return _StepInputs(
            tokens=tokens, positions=positions, write_pages=write_pages,
            write_offsets=write_offsets, block_tables=tables, kv_lens=kv_lens,
            cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            last_index=last, gen_index=gen, samples=samples, copy_src=src, copy_dst=dst,
            sampling=sampling)

    def _advance(self, plan: list[tuple[_Seq, int]], tokens: np.ndarray,
                 logprobs: np.ndarray, now: float) -> list[Event]:
        """Apply the step's results on the host: new tokens, stops, finished requests."""
        events: list[Event] = []
        for s, n in plan:
            s.num_computed += n
            self.blocks.commit(s.rid, s.tokens, s.num_computed)
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk that did not reach the prompt's end
            tok, p, r = int(tokens[s.slot]), s.progress, s.req
            self._generated += 1
            if s.first_token is None:
                s.first_token = now
                p.t_first = now - s.arrival
            s.last_token, p.t_last = now, now - s.arrival
            new: list[int] = []
            if tok in r.stop_ids:
                p.finished, p.reason = True, "stop"
            else:
                s.tokens.append(tok)
                p.tokens.append(tok)
                p.logprobs.append(float(logprobs[s.slot]))
                new = [tok]
                if r.sampling.stop and _trim_at_stop_string(self.model, r, p):
                    p.finished, p.reason = True, "stop"
                elif len(p.tokens) >= r.sampling.max_new_tokens:
                    p.finished, p.reason = True, "length"
            if p.finished:
                self._finish(s)
            events.append((s.rid, new, p.finished))
        return events

    def _finish(self, s: _Seq) -> None:
        self._running.remove(s)
        self.blocks.free(s.rid)
        self._free_slots.append(s.slot)
        s.slot = -1
        self._results[s.rid] = _completion(self.model, s.req, s.progress)


def generate_with_engine(model: Model, requests: Sequence[_Request]) -> list[Completion]:
    """Run validated requests through an ``Engine`` sized for them; results in order.

    Used by ``jaxinfer.generate`` for more prompts than one static batch holds: the pool gets
    as many pages as ``max_batch`` of the longest requests need, the static path's footprint.
    """
    page_size = 16
    longest = max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in requests)
    num_pages = model.max_batch * math.ceil(longest / page_size)
    engine = Engine(model, num_pages=num_pages, page_size=page_size, verbose=False,
                    max_tokens_per_step=max(512, model.max_batch), max_seq_len=longest)
    ids = [engine._submit(r) for r in requests]
    engine.run_until_done()
    return [engine.result(i) for i in ids]
