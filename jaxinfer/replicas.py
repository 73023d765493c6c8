"""Data parallelism: one ``Engine`` per ``data`` replica of a model, driven by one host thread.

A model loaded on a ``(data, model)`` mesh holds a whole copy of its weights on every ``data``
row (split over that row's ``model`` devices). ``DataParallelEngine`` views each row as its own
``Model`` (the same device buffers, no copy) and gives it its own ``Engine``: its own page pool,
slots and step programs, so replicas never wait for each other. A request goes to the replica
with the least outstanding work; its output equals what one engine would give, since a sampled
token depends only on the request's own seed, token index and tokens.

Each replica steps in its own worker thread, so the replicas compute at once: on a GPU a
step program that syncs with the host inside (the decode loop's condition) holds its calling
thread until the program is nearly done, with the interpreter lock released. ``step()``
starts a step on every idle replica that has work and returns the events of whichever
replica finishes first; the others keep running.

The replicas' host work shares this process's interpreter lock; for a model loaded from a
path, ``jaxinfer.engine_process.ReplicaProcesses`` runs each replica in a process of its own
instead (``batch_eval`` / ``jaxinfer serve --dp N``, by default).

``engine_for(model)`` returns the engine that serves ``generate``, ``stream``, ``score`` and
``batch_eval`` for a model: an ``Engine``, or a ``DataParallelEngine`` on a mesh whose
``data`` axis is larger than 1. A mesh across hosts keeps one ``Engine`` that every process
runs in step (single program, multiple data), its replicas computing the same batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.engine import (
    Engine,
    EngineStats,
    Event,
    RequestMetrics,
    StepLoop,
    check_max_decode_steps,
)
from jaxinfer.errors import InputError
from jaxinfer.requests import Completion, Model, Request, ScoreResult
from jaxinfer.speculative import Speculative
from sharding.mesh import DATA, MODEL, mesh_sizes, spans_processes


def replica_model(model: Model, index: int) -> Model:
    """Data replica ``index`` of a model on a ``(data, model)`` mesh, as a ``Model`` of its own.

    Its weights are the buffers the replica's devices already hold (no copy). A replica of one
    device runs without a mesh, like a single-device model, but its LM head is not padded
    for the GEMV's wide tile (``model.one_device_layout`` would copy it on every device;
    batch-1 decode pays ~1%); a tensor-parallel replica runs on the ``(1, model)`` mesh of
    its row.
    """
    row = model.mesh.devices[index]  # [model] devices of this replica
    sub = None if len(row) == 1 else Mesh(row[None, :], (DATA, MODEL),
                                          axis_types=model.mesh.axis_types)

    def view(a: jax.Array) -> jax.Array:
        shards = {s.device: s.data for s in a.addressable_shards}
        if sub is None:
            return shards[row[0]]
        sharding = NamedSharding(sub, a.sharding.spec)
        return jax.make_array_from_single_device_arrays(
            a.shape, sharding, [shards[d] for d in sharding.addressable_devices])

    return dataclasses.replace(model, params=jax.tree.map(view, model.params), mesh=sub)


class DataParallelEngine(StepLoop):
    """``Engine``'s interface over one engine per ``data`` replica of ``model``'s mesh.

    Args:
      model: a ``Model`` on a mesh with ``data > 1`` (``load_model(mesh=make_mesh(data=N,
        model=M))``) whose devices all belong to this process.
      **engine_kwargs: ``Engine`` arguments, applied to each replica (sizes are per replica:
        ``max_batch`` slots and ``kv_cache_bytes`` on each).

    Request ids are this object's own; ``result``, ``request_metrics`` and ``forget`` take
    them. ``stats()`` adds the replicas' counters up; its ``step_seconds`` is the time spent
    in this engine's ``step()``, and ``device_seconds`` the busiest replica's.
    """

    def __init__(self, model: Model, **engine_kwargs: Any) -> None:
        data, _ = mesh_sizes(model.mesh)
        if data < 2:
            raise InputError("DataParallelEngine needs a mesh with data > 1; use "
                             "jaxinfer.Engine(model) for one replica")
        if spans_processes(model.mesh):
            raise InputError("DataParallelEngine runs replicas of one process; a mesh across "
                             "hosts is served by jaxinfer.Engine, every process running the "
                             "same program")
        self.model = dataclasses.replace(model)
        self.replicas = [Engine(replica_model(model, i), **engine_kwargs) for i in range(data)]
        self.max_batch = sum(e.max_batch for e in self.replicas)
        self._where: dict[int, tuple[int, int]] = {}  # id -> (replica, the replica's id)
        self._ids: list[dict[int, int]] = [{} for _ in self.replicas]  # replica's id -> id
        self._load = np.zeros(data, np.int64)  # tokens each replica still has to compute
        self._cost: dict[int, int] = {}  # id -> its tokens, counted in _load until it ends
        self._next_id = 0
        self._step_time = 0.0
        # One worker per replica; a replica's lock is held while it steps, so requests are
        # added to it between steps only.
        self._workers = concurrent.futures.ThreadPoolExecutor(
            data, thread_name_prefix="jaxinfer-replica")
        self._locks = [threading.Lock() for _ in self.replicas]
        self._running: dict[int, concurrent.futures.Future[list[Event]]] = {}

    # ---------------------------------------------------------------- requests
    def check_fits(self, req: Request) -> None:
        """``Engine.check_fits`` (every replica is sized alike)."""
        self.replicas[0].check_fits(req)

    def add_request(self, req: Request) -> int:
        """Queue a validated ``Request`` on the replica with the least work left."""
        i = int(np.argmin(self._load))
        with self._locks[i]:
            local = self.replicas[i].add_request(req)
        rid = self._next_id
        self._next_id += 1
        cost = len(req.prompt_ids) + (0 if req.is_score else req.sampling.max_new_tokens)
        self._where[rid] = (i, local)
        self._ids[i][local] = rid
        self._cost[rid] = cost
        self._load[i] += cost
        return rid

    # ---------------------------------------------------------------- stepping
    def step(self, max_decode_steps: int | None = None, no_arrivals: bool = False
             ) -> list[Event]:
        """Launch a step (``Engine.step``'s arguments) on every replica with work and none in
        flight; return the events of the first replica whose step is done (ids are this
        engine's)."""
        check_max_decode_steps(max_decode_steps)
        t0 = time.perf_counter()
        for i, e in enumerate(self.replicas):
            if i not in self._running and e.has_unfinished():
                self._running[i] = self._workers.submit(self._step_replica, i, max_decode_steps,
                                                        no_arrivals)
        events: list[Event] = []
        if self._running:
            done, _ = concurrent.futures.wait(self._running.values(),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            i = min(i for i, f in self._running.items() if f in done)
            events = self._events(i, self._running.pop(i).result())
        self._step_time += time.perf_counter() - t0
        return events

    def _step_replica(self, i: int, max_decode_steps: int | None, no_arrivals: bool
                      ) -> list[Event]:
        with self._locks[i]:
            return self.replicas[i].step(max_decode_steps, no_arrivals)

    def _events(self, i: int, events: list[Event]) -> list[Event]:
        out = []
        for local, tokens, finished in events:
            rid = self._ids[i].get(local)
            if rid is None:  # cancelled and forgotten while this step ran
                continue
            if finished:
                self._load[i] -= self._cost.pop(rid, 0)
            out.append((rid, tokens, finished))
        return out

    def has_unfinished(self) -> bool:
        """Whether any replica has a request waiting or running, or a step under way."""
        return bool(self._running) or any(e.has_unfinished() for e in self.replicas)

    def check_request(self, request_id: int) -> None:
        """Raise ``InputError`` unless the request was submitted and its result not taken."""
        engine, local = self._replica_of(request_id)
        try:
            engine.check_request(local)
        except InputError:
            raise InputError(f"unknown request id {request_id}") from None

    def finished(self, request_id: int) -> bool:
        """Whether the request's result is ready for ``result()``."""
        engine, local = self._replica_of(request_id)
        return engine.finished(local)

    def _replica_of(self, rid: int) -> tuple[Engine, int]:
        if rid not in self._where:
            raise InputError(f"unknown request id {rid}")
        i, local = self._where[rid]
        return self.replicas[i], local

    def cancel(self, request_id: int) -> bool:
        """Stop a request now (``Engine.cancel``); waits for its replica's step under way."""
        engine, local = self._replica_of(request_id)
        i, _ = self._where[request_id]
        with self._locks[i]:
            live = engine.cancel(local)
        if request_id in self._cost:
            self._load[i] -= self._cost.pop(request_id)
        return live

    def result(self, request_id: int) -> Completion | ScoreResult:
        """The result of a finished request (handed over once)."""
        engine, local = self._replica_of(request_id)
        return engine.result(local)

    def request_metrics(self, request_id: int) -> RequestMetrics:
        """Queue time, time to first token and time per output token of a live request."""
        engine, local = self._replica_of(request_id)
        return engine.request_metrics(local)

    def forget(self, request_id: int) -> None:
        """Drop what is kept of a finished request whose result was taken."""
        engine, local = self._replica_of(request_id)
        if engine.forget(local):
            i, _ = self._where.pop(request_id)
            del self._ids[i][local]

    def warmup(self, generate: bool = True, score: bool = False, sampled: bool = False,
               constrained: bool = False, speculative: Speculative | None = None) -> float:
        """Compile or load every replica's step programs (``Engine.warmup``); return the
        seconds it took.

        Replicas warm up in parallel threads: each replica's programs are compiled for its
        own devices, and XLA compiles without holding the interpreter lock.
        """
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda e: e.warmup(generate, score, sampled, constrained,
                                             speculative),
                          self.replicas))
        return time.perf_counter() - t0

    def stats(self) -> EngineStats:
        """The replicas' counters added up (``combine_stats``), over this engine's step time."""
        return combine_stats([e.stats() for e in self.replicas], self._step_time)


def combine_stats(each: list[EngineStats], wall: float) -> EngineStats:
    """Data replicas' counters as one engine's: counts added up, ``step_seconds`` the
    ``wall`` time the replicas stepped in (their steps overlap), device and decode seconds
    and the program count the busiest replica's, rates and the hit rate recomputed."""
    total = {f.name: sum(getattr(s, f.name) for s in each)
             for f in dataclasses.fields(EngineStats)}
    total["tokens_per_second"] = total["generated_tokens"] / wall if wall else 0.0
    total["step_seconds"] = wall
    total["device_seconds"] = max(s.device_seconds for s in each)
    total["decode_seconds"] = max(s.decode_seconds for s in each)
    looked = sum(s.cached_tokens / s.prefix_cache_hit_rate for s in each
                 if s.prefix_cache_hit_rate)
    total["prefix_cache_hit_rate"] = total["cached_tokens"] / looked if looked else 0.0
    total["num_programs"] = max(s.num_programs for s in each)
    return EngineStats(**total)


def replica_engines(engine: Engine | DataParallelEngine) -> list[Engine]:
    """The engines of ``engine``'s data replicas: its replicas, or itself."""
    return engine.replicas if isinstance(engine, DataParallelEngine) else [engine]


def engine_for(model: Model) -> Engine | DataParallelEngine:
    """The engine that serves ``generate``, ``stream``, ``score`` and ``batch_eval`` for
    ``model``: one ``Engine``, or a ``DataParallelEngine`` when the model's mesh has
    ``data > 1``.

    Built on first use with no sizing arguments (the engines' defaults, ``model.max_batch``
    slots per replica if set) and kept for the model's lifetime, so its compiled steps and
    prefix cache are reused across calls.
    """
    engine = model.engine
    if engine is None:
        data, _ = mesh_sizes(model.mesh)
        replicas = data > 1 and not spans_processes(model.mesh)
        engine = (DataParallelEngine(model, verbose=False) if replicas
                  else Engine(model, verbose=False))
        model.engine = engine
    return engine
