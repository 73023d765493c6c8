"""The engine in a process of its own, for the HTTP server (``jaxinfer serve``).

The server's HTTP process parses requests, tokenizes, detokenizes and writes SSE events; the
engine process owns the devices and the model and runs the step loop. Each has its own
interpreter lock, so HTTP work for many open streams does not delay the engine's host work
between steps (H100 r36, one process: 1B shapes served at 38% of the offline rate).

What crosses the two pipes (pickled ``multiprocessing.Connection`` messages):

- HTTP -> engine, in batches: ``("add", ticket, (jobs, stream))`` with ``jobs`` a list of
  ``(key, requests.Request)`` (prompt token ids, ``SamplingParams``, compiled grammar: plain
  data), ``("cancel", ticket, None)`` (the client went away; the engine frees its pages) and
  ``("stop", None, grace_s)``.
- engine -> HTTP: ``("ready", EngineInfo)`` once the model is loaded (or ``("error", message,
  is_input_error)``), then one ``(messages, EngineStats)`` per loop iteration: every ticket's
  ``(ticket, kind, key, payload)`` of that step — ``"accepted"``, ``"rejected"`` (payload:
  why, None when shutting down), ``"tokens"`` (the new token ids of a streamed request),
  ``"done"`` (its ``Completion`` / ``ScoreResult``; None when cancelled) and ``"failed"``
  (why) — and the engine's counters after it. So the per-token cost of the pipe is a few
  bytes; per step it is one write (by a writer thread: the next step does not wait for the
  HTTP process to read it) and one read.

``EngineSpec`` says what the engine process loads (it is pickled into the spawned process:
JAX is not fork-safe); ``EngineProcess`` is the HTTP process's handle on it. The HTTP process
never initialises a JAX backend: it gets the model's config and tokenizer from the engine
process (``EngineInfo``).

``ReplicaProcesses`` runs one engine process per data replica (``batch_eval`` and ``jaxinfer
serve`` with ``--dp N``: ``--replicas auto`` or ``processes``), each pinned to its replica's
GPUs, and routes requests by work left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from jaxinfer.engine import Engine, EngineStats
from jaxinfer.errors import InputError
from jaxinfer.requests import Model, Request

Message = tuple[Any, str, Any, Any]
"""``(ticket, kind, key, payload)``: kind ``"accepted"``, ``"rejected"``, ``"tokens"``,
``"done"`` or ``"failed"`` (see the module docstring)."""

STOP_TIMEOUT_S = 60.0
"""At shutdown, how long the engine process gets beyond the grace period before it is killed
(it finishes the step it is in, which may be compiling)."""


class QueueFull(Exception):
    """The engine holds ``max_batch + max_queue`` unfinished requests already."""


class ShuttingDown(Exception):
    """The engine takes no new requests: it is stopping, or its process exited (the message
    says which)."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads and how it sizes its engine; picklable.

    ``jaxinfer serve`` fills it from its flags. ``load`` and ``build`` run in the engine
    process; a subclass may override them (a benchmark's random weights, a test's engine)
    and stays picklable if it is defined at a module's top level.

    Args:
      model: ``load_model``'s name or path.
      dtype, backend, quantize, kv_cache_dtype: ``load_model``'s.
      tp, dp: tensor-parallel devices per replica and data-parallel replicas
        (``sharding.make_mesh(data=dp, model=tp)``); 1 and 1: one device.
      engine: ``jaxinfer.Engine`` keyword arguments (sizes: ``max_batch``, ``num_pages``,
        ...); empty: the model's own engine (``engine_for``) with its default sizes.
      warmup: on an accelerator, compile the step programs (greedy and sampled) before
        serving; on CPU they compile on first use (minutes in all otherwise).
      speculative: n-gram speculation every generation request gets (``Speculative(
        method="ngram")``; adaptive, so it runs only while it pays); None: none.
      score: the engine only scores (``batch_eval --score``): the warm-up compiles the
        scoring programs instead of the generation ones.
      sampled: the warm-up compiles the sampled (temperature > 0) generation programs too.
      devices: the local device ids this process uses (one data replica's ``tp`` devices);
        numbered among those this host lets the process see; on GPUs the engine process sees
        only those (``cuda_visible_devices``, set before JAX starts a backend), so several
        engine processes share a host. None: every device.
      compile_cache: persistent XLA compilation cache folder (``jax_compilation_cache_dir``);
        None: none.
      replica_processes: serve the ``dp`` replicas as engine processes of their own
        (``ReplicaProcesses``, one host) instead of threads of one (``DataParallelEngine``).
    """

    model: str
    dtype: str = "bfloat16"
    backend: str = "auto"
    quantize: str | None = None
    kv_cache_dtype: str | None = None
    tp: int = 1
    dp: int = 1
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    warmup: bool = True
    speculative: Any = None  # jaxinfer.Speculative (n-gram) or None
    score: bool = False
    sampled: bool = True
    devices: tuple[int, ...] | None = None
    compile_cache: str | None = None
    replica_processes: bool = False

    def __post_init__(self) -> None:
        if self.replica_processes and self.dp < 2:
            raise InputError("replica processes serve --dp replicas; give --dp 2 or more")

    def replicas(self) -> list[EngineSpec]:
        """One spec per data replica: ``dp`` 1, pinned to the replica's ``tp`` devices."""
        return [dataclasses.replace(self, dp=1, replica_processes=False,
                                    devices=tuple(range(i * self.tp, (i + 1) * self.tp)))
                for i in range(self.dp)]

    def load(self) -> Model:
        """The model (``load_model``), on the mesh ``tp`` and ``dp`` name."""
        from jaxinfer.loading import load_model

        mesh = None
        if (self.tp, self.dp) != (1, 1):
            from sharding import make_mesh

            mesh = make_mesh(data=self.dp, model=self.tp)
        return load_model(self.model, dtype=self.dtype, backend=self.backend,
                          quantize=self.quantize, kv_cache_dtype=self.kv_cache_dtype, mesh=mesh)

    def build(self) -> Any:
        """The engine to serve (an ``Engine`` or ``DataParallelEngine`` whose ``model`` has a
        tokenizer), warmed up as ``warmup`` says."""
        import jax

        from jaxinfer.replicas import DataParallelEngine, engine_for

        model = self.load()
        if self.engine:
            kind = DataParallelEngine if self.dp > 1 else Engine
            engine = kind(model, **{"verbose": False, **self.engine})
        else:
            engine = engine_for(model)
        if self.warmup and jax.default_backend() != "cpu":  # seconds a program
            engine.warmup(generate=not self.score, score=self.score,
                          sampled=self.sampled and not self.score,
                          speculative=self.speculative)
        return engine

    def start_jax(self) -> None:
        """Point JAX at ``devices`` and ``compile_cache``; call before JAX starts a backend.

        Raises ``InputError`` when this host lacks a GPU that ``devices`` names: JAX would
        otherwise run on the CPU without a word. (The CPU runs only when ``JAX_PLATFORMS``
        says so; each process then has its own CPU devices.)
        """
        import jax

        if self.compile_cache:
            jax.config.update("jax_compilation_cache_dir", self.compile_cache)
        if self.devices is None or jax.config.jax_platforms == "cpu":
            return
        # The CUDA driver reads the variable when JAX starts the backend: each process then
        # numbers its GPUs from 0. (`jax_cuda_visible_devices` keeps the host's ids on the
        # devices, and programs placed on id 2 of a one-GPU client failed: r157.)
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(
            self.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if jax.default_backend() != "gpu" or len(jax.devices()) != len(self.devices):
            raise InputError(f"this host has no GPUs {list(self.devices)} "
                             f"({jax.default_backend()}: {len(jax.devices())} device(s) seen); "
                             "lower --dp or --tp, or run the replicas as threads (--replicas "
                             "threads)")


def cuda_visible_devices(devices: Sequence[int], visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a process only ``devices``, numbered
    among the GPUs ``visible`` (the current value; None: all of the host's; empty: none)
    shows. Raises ``InputError`` for an index past them."""
    if visible is None:
        return ",".join(map(str, devices))
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if any(d >= len(names) for d in devices):
        raise InputError(f"devices {list(devices)} need {max(devices) + 1} GPUs, and "
                         f"CUDA_VISIBLE_DEVICES={visible} shows {len(names)}; lower --dp or "
                         "--tp, or show more GPUs")
    return ",".join(names[d] for d in devices)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the HTTP process knows of the served model, sent by the engine process when it
    is ready: enough to tokenize, validate and detokenize without the weights."""

    config: Any  # LlamaConfig
    tokenizer: Any  # jaxinfer.tokenizer.Tokenizer
    name: str
    max_batch: int  # sequences the engine runs at once (all replicas)
    max_seq_len: int  # longest prompt + output it holds
    stats: EngineStats  # its counters at start (after the warm-up)
    device_kind: str = ""  # jax.Device.device_kind of its devices ("NVIDIA H100 80GB HBM3")
    weight_bytes: int | None = None  # what a decode step reads of quantized weights
    # (``quantize.decode_weight_bytes``; None: unquantized)

    def model(self) -> Model:
        """A ``Model`` without weights, for ``requests.make_requests``, ``encode`` and
        ``TextStream`` in the HTTP process."""
        return Model(config=self.config, params={}, tokenizer=self.tokenizer, name=self.name)


# ---------------------------------------------------------------------------- engine process
class EngineLoop:
    """The engine process's loop: commands in from the HTTP process, between steps; every
    ticket's messages of an iteration and the engine's counters out, as one pipe message.

    Args:
      engine: an ``Engine`` or ``DataParallelEngine`` (stepped only here).
      out: the pipe to the HTTP process.
      max_decode_steps: tokens per sequence per decode call (``engine.step``); None keeps
        the engine's own (about ``decode_call_seconds`` of device time), for throughput.
    """

    def __init__(self, engine: Any, out: Connection, max_decode_steps: int | None) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._out = out
        self._max_decode_steps = max_decode_steps
        self._jobs: dict[int, tuple[int, Any]] = {}  # engine id -> (ticket, key), unfinished
        self._by_ticket: dict[int, list[int]] = {}  # ticket -> its engine ids
        self._stream: dict[int, bool] = {}  # ticket -> whether its tokens are sent
        self._outbox: list[Message] = []
        self._deadline: float | None = None  # stop: cancel what is left at this time
        self._pickled: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # to _send

    def run(self) -> None:
        """Serve until a ``stop`` command's grace period ends or nothing is left to run."""
        sender = threading.Thread(target=self._send, name="jaxinfer-results", daemon=True)
        sender.start()
        try:
            self._serve()
        finally:  # every message is written before the process ends
            self._pickled.put(None)
            sender.join()

    def _serve(self) -> None:
        while True:
            self._take(block=not self.engine.has_unfinished())
            if self._deadline is not None and (time.monotonic() >= self._deadline
                                               or not self.engine.has_unfinished()):
                for ticket in list(self._by_ticket):
                    self._cancel(ticket)
                self._take(block=False, refuse=True)  # submissions that raced with stop
                self._flush()
                return
            self._flush()  # acceptances and cancellations now, not after the step
            if not self.engine.has_unfinished():
                continue
            try:
                events = self.engine.step(self._max_decode_steps)
            except Exception as e:  # noqa: BLE001 - a bug must not leave clients hanging
                self._fail_all(f"the engine step raised {type(e).__name__}: {e}")
                self._flush()
                continue
            for rid, tokens, finished in events:
                job = self._jobs.get(rid)
                if job is None:
                    continue
                ticket, key = job
                if tokens and self._stream[ticket]:
                    self._outbox.append((ticket, "tokens", key, tokens))
                if finished:
                    self._forget(rid)
                    self._outbox.append((ticket, "done", key, self.engine.result(rid)))
                    self.engine.forget(rid)
            self._flush(force=True)

    def _flush(self, force: bool = False) -> None:
        """Send the iteration's messages and the counters (``force``: even with none).

        They are pickled here (a snapshot of this step) and written by ``_send``: a message
        larger than the pipe's buffer waits for the HTTP process to read it, whose reader
        thread shares its interpreter lock with the HTTP work; the next step need not wait
        (1B shapes, 1,000 streams: ~2 ms per step, 5% of the run, spent blocked here)."""
        if self._outbox or force:
            self._pickled.put(ForkingPickler.dumps((self._outbox, self.engine.stats())))
            self._outbox = []

    def _send(self) -> None:
        """The engine process's writer thread: pickled messages to the HTTP process, in
        order; stops at None or when the HTTP process has gone (the reader thread stops
        the loop then)."""
        with contextlib.suppress(OSError):
            while (data := self._pickled.get()) is not None:
                self._out.send_bytes(data)

    def _take(self, block: bool, refuse: bool = False) -> None:
        """Apply the inbox's commands; wait for one first when ``block``; ``refuse`` new
        requests (the loop is ending)."""
        try:
            command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, ticket, payload = command
            if kind == "add":
                self._add(ticket, *payload, refuse=refuse)
            elif kind == "cancel":
                self._cancel(ticket)
            else:  # stop
                deadline = time.monotonic() + payload
                self._deadline = min(deadline, self._deadline or deadline)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, ticket: int, jobs: list[tuple[Any, Request]], stream: bool,
             refuse: bool) -> None:
        if refuse or self._deadline is not None:
            self._outbox.append((ticket, "rejected", None, None))
            return
        rids: list[int] = []
        try:
            for _, req in jobs:
                rids.append(self.engine.add_request(req))
        except InputError as e:  # it does not fit this engine (max_seq_len)
            for rid in rids:
                self.engine.cancel(rid)
                self.engine.forget(rid)
            self._outbox.append((ticket, "rejected", None, str(e)))
            return
        for rid, (key, _) in zip(rids, jobs, strict=True):
            self._jobs[rid] = (ticket, key)
        self._by_ticket[ticket] = rids
        self._stream[ticket] = stream
        self._outbox.append((ticket, "accepted", None, None))

    def _cancel(self, ticket: int) -> None:
        for rid in self._by_ticket.get(ticket, []):
            if rid not in self._jobs:
                continue  # finished already
            key = self._jobs[rid][1]
            self._forget(rid)
            self.engine.cancel(rid)
            self.engine.forget(rid)
            self._outbox.append((ticket, "done", key, None))

    def _fail_all(self, why: str) -> None:
        """End every live request with an error (the engine raised); keep serving."""
        for rid, (ticket, key) in list(self._jobs.items()):
            self._forget(rid)
            self.engine.cancel(rid)
            self.engine.forget(rid)
            self._outbox.append((ticket, "failed", key, why))

    def _forget(self, rid: int) -> None:
        ticket, _ = self._jobs.pop(rid)
        if all(r not in self._jobs for r in self._by_ticket[ticket]):
            del self._by_ticket[ticket], self._stream[ticket]


def _read_commands(conn: Connection, inbox: queue.SimpleQueue[tuple[str, Any, Any]]) -> None:
    """The engine process's reader thread: commands into ``inbox`` as they arrive, so the
    pipe never fills while a step runs. If the HTTP process goes away, stop at once."""
    try:
        while True:
            for command in conn.recv():
                inbox.put(command)
    except (EOFError, OSError):
        inbox.put(("stop", None, 0.0))


def engine_main(spec: EngineSpec, commands: Connection, out: Connection,
                max_decode_steps: int | None) -> None:
    """The engine process: build the engine, report ``ready`` (or the error), serve."""
    # Ctrl-C in a terminal reaches the whole process group; the HTTP process decides when
    # to stop (draining first) and tells this one over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import jax

    from jaxinfer.quantize import decode_weight_bytes
    from jaxinfer.replicas import replica_engines

    try:
        spec.start_jax()
        engine = spec.build()
        model = engine.model
        if model.tokenizer is None:
            raise InputError("serving needs a model with a tokenizer (text in and out)")
        engines = replica_engines(engine)
        info = EngineInfo(config=model.config, tokenizer=model.tokenizer,
                          name=model.name or "jaxinfer", max_batch=engine.max_batch,
                          max_seq_len=min(e.max_seq_len for e in engines),
                          stats=engine.stats(), device_kind=jax.devices()[0].device_kind,
                          weight_bytes=decode_weight_bytes(model.params,
                                                           model.config.tie_word_embeddings))
    except Exception as e:  # noqa: BLE001 - reported to the HTTP process, which raises it
        if not isinstance(e, InputError):
            traceback.print_exc()
        out.send(("error", str(e) if isinstance(e, InputError) else f"{type(e).__name__}: {e}",
                  isinstance(e, InputError)))
        return
    loop = EngineLoop(engine, out, max_decode_steps)
    threading.Thread(target=_read_commands, args=(commands, loop.inbox), daemon=True,
                     name="jaxinfer-commands").start()
    out.send(("ready", info))
    loop.run()


# ---------------------------------------------------------------------------- HTTP process
class EngineProcess:
    """The HTTP process's handle on the engine process: start it, submit and cancel
    tickets, stop it. Nothing here touches JAX.

    A ticket is one HTTP request's engine requests (``jobs``: ``(key, Request)`` pairs).
    ``on_messages`` gets, on this object's receiver thread, the messages of each engine
    iteration as ``(ticket, kind, key, payload)`` with ``ticket`` the object passed to
    ``submit``; every job ends with one ``"done"`` or ``"failed"`` message, or the whole
    ticket with ``"rejected"``. If the engine process dies, every unfinished job gets
    ``"failed"`` with ``dead`` as the reason, and ``submit`` raises ``ShuttingDown``.

    Args:
      spec: what the engine process loads.
      on_messages: called with each iteration's messages (on the receiver thread).
      max_queue: requests that may wait for a slot; ``submit`` raises ``QueueFull`` beyond
        ``max_batch + max_queue`` unfinished ones.
      max_decode_steps: see ``EngineLoop``.
    """

    def __init__(self, spec: EngineSpec, on_messages: Callable[[list[Message]], None],
                 max_queue: int, max_decode_steps: int | None = None) -> None:
        if max_queue < 0:
            raise InputError(f"max_queue={max_queue} must be >= 0")
        self.spec = spec
        self.max_queue = max_queue
        self.max_decode_steps = max_decode_steps
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None  # the engine's counters after its last step
        self.dead: str | None = None  # why the engine process is gone, when it is
        self._on_messages = on_messages
        self._lock = threading.Lock()
        self._closing = False
        self._ids = itertools.count()
        self._tickets: dict[int, tuple[Any, set[Any]]] = {}  # id -> (ticket, unfinished keys)
        self._outstanding = 0  # engine requests submitted and not finished
        self._sendq: queue.SimpleQueue[tuple[str, Any, Any] | None] = queue.SimpleQueue()
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def closing(self) -> bool:
        """Whether ``stop`` was called or the engine process died (no new requests)."""
        return self._closing or self.dead is not None

    @property
    def outstanding(self) -> int:
        """Engine requests submitted and not yet finished or cancelled."""
        return self._outstanding

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``start``)."""
        return None if self._process is None else self._process.pid

    def start(self) -> EngineInfo:
        """Spawn the engine process and wait until its model is loaded (warm-up included);
        raise its error (``InputError`` for a user's mistake) if it fails."""
        ctx = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        commands_in, commands_out = ctx.Pipe(duplex=False)
        results_in, results_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=engine_main, name="jaxinfer-engine", daemon=True,
            args=(self.spec, commands_in, results_out, self.max_decode_steps))
        self._process.start()
        if self.closing:  # kill() came before the process existed
            self._process.kill()
        commands_in.close()  # the child's ends: our copies must go for EOF to be seen
        results_out.close()
        self._commands, self._results = commands_out, results_in
        try:
            first = results_in.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) "
                               "before it was ready; see its output above") from None
        if first[0] == "error":
            self._process.join()
            raise (InputError if first[2] else RuntimeError)(first[1])
        self.info = first[1]
        self.stats = self.info.stats
        self._receiver = threading.Thread(target=self._receive, daemon=True,
                                          name="jaxinfer-engine-results")
        self._receiver.start()
        self._sender = threading.Thread(target=self._send, name="jaxinfer-engine-commands",
                                        daemon=True)
        self._sender.start()
        return self.info

    def submit(self, ticket: Any, jobs: list[tuple[Any, Request]], stream: bool) -> int:
        """Send a ticket's jobs (``stream``: with each step's new tokens); return its id for
        ``cancel``. The engine answers ``"accepted"`` or ``"rejected"`` before any tokens.

        Raises ``InputError`` (more jobs than the engine ever holds), ``QueueFull`` or
        ``ShuttingDown``.
        """
        capacity = self.info.max_batch + self.max_queue
        if len(jobs) > capacity:
            raise InputError(f"the request needs {len(jobs)} engine requests (prompts x "
                             f"n, and prompt scoring for echo) but this server holds at most "
                             f"{capacity} at once; split it")
        with self._lock:
            if self.closing:
                raise ShuttingDown(self.dead or "the server is shutting down")
            if self._outstanding + len(jobs) > capacity:
                raise QueueFull
            self._outstanding += len(jobs)
            tid = next(self._ids)
            self._tickets[tid] = (ticket, {key for key, _ in jobs})
        self._sendq.put(("add", tid, (jobs, stream)))
        return tid

    def cancel(self, tid: int) -> None:
        """Cancel a ticket's unfinished jobs (its client went away); their pages free."""
        self._sendq.put(("cancel", tid, None))

    def kill(self) -> None:
        """End an engine process that is still starting (another replica failed): its
        ``start`` then raises. A started one is ended with ``stop``."""
        with self._lock:
            self._closing = True
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def stop(self, grace_s: float) -> None:
        """Take no new requests; let the running ones finish for up to ``grace_s`` seconds,
        then cancel what is left (``"done"`` with None); wait for the engine process."""
        with self._lock:
            self._closing = True
        if self._process is None:
            return
        self._sendq.put(("stop", None, grace_s))
        self._sendq.put(None)
        self._process.join(grace_s + STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._sender.join()
        self._receiver.join()  # the last messages (cancellations) are delivered

    # ------------------------------------------------------------------ threads
    def _send(self) -> None:
        """Commands to the engine process, batched (one pickle and write per wake-up), so
        the event loop never waits on the pipe."""
        while True:
            command = self._sendq.get()
            batch = []
            while command is not None:
                batch.append(command)
                try:
                    command = self._sendq.get_nowait()
                except queue.Empty:
                    break
            with contextlib.suppress(OSError):  # the engine process is gone: _receive says
                if batch:
                    self._commands.send(batch)
            if command is None:  # stop sent; the pipe stays open (its end stops the engine)
                return

    def _receive(self) -> None:
        """Each engine iteration's messages to ``on_messages``; when the pipe ends, fail
        what is left."""
        try:
            while True:
                messages, stats = self._results.recv()
                self.stats = stats
                self._on_messages(self._resolve(messages))
        except (EOFError, OSError):
            pass
        self._process.join()
        with self._lock:
            why = (f"the engine process exited (code {self._process.exitcode}); restart the "
                   "server")
            if not self._closing:
                self.dead = why
            left = [(ticket, "failed", key, why)
                    for ticket, keys in self._tickets.values() for key in keys]
            self._tickets.clear()
            self._outstanding = 0
        if left:
            self._on_messages(left)

    def _resolve(self, messages: list[Message]) -> list[Message]:
        """Ticket ids -> the tickets; count finished jobs."""
        out = []
        with self._lock:
            for tid, kind, key, payload in messages:
                ticket, keys = self._tickets[tid]
                out.append((ticket, kind, key, payload))
                if kind == "rejected":
                    self._outstanding -= len(keys)
                    keys.clear()
                elif kind in ("done", "failed"):
                    keys.discard(key)
                    self._outstanding -= 1
                if not keys:
                    del self._tickets[tid]
        return out


# ---------------------------------------------------------------------------- replicas
class ReplicaProcesses:
    """Data-parallel replicas, each an engine process of its own, behind ``EngineProcess``'s
    interface (``start``, ``submit``, ``cancel``, ``stop``, ``info``, ``stats``, ``dead``,
    ``closing``, ``outstanding``), so the server and ``batch_eval`` drive N engines as one.

    ``DataParallelEngine`` steps its replicas in threads of one process, under one
    interpreter lock: with a small model the host work of every replica's steps (planning,
    inputs, results; ~10 ms a step at 1B shapes) queues on that lock and the GPUs wait
    (4x H100 r153-r156: ``--dp 4`` made 2.1x one GPU at 1B shapes, 3.7x at 8B). Here each
    replica has its own interpreter; the cost is a model load and a compile per process.
    ``EngineSpec.replicas`` pins each engine process to its replica's GPUs.

    A ticket goes whole to the replica with the least work left (its jobs' prompt and new
    tokens), as requests do in ``DataParallelEngine``; a result depends only on its request,
    so outputs equal one engine's. ``on_messages`` gets every replica's messages (on their
    receiver threads); tickets and job keys must be hashable.

    Args:
      spec: the model and sizes of every replica (``spec.dp`` replicas of ``spec.tp``
        devices, ``spec.engine`` sizes each).
      on_messages, max_queue, max_decode_steps: ``EngineProcess``'s, ``max_queue`` per
        replica.
    """

    def __init__(self, spec: EngineSpec, on_messages: Callable[[list[Message]], None],
                 max_queue: int, max_decode_steps: int | None = None) -> None:
        self.spec = spec
        self.info: EngineInfo | None = None
        self.engines = [EngineProcess(s, self._deliver, max_queue, max_decode_steps)
                        for s in spec.replicas()]
        self._on_messages = on_messages
        self._lock = threading.RLock()  # _release takes it inside _deliver's
        self._load = [0] * len(self.engines)  # tokens each replica still has to compute
        self._jobs: dict[Any, tuple[int, dict[Any, int]]] = {}  # ticket -> replica, key -> cost

    def start(self) -> EngineInfo:
        """Start every engine process at once and wait until all are ready; return replica
        0's ``EngineInfo`` with ``max_batch`` and the counters summed over the replicas. When
        one fails, end the others at once (those still loading are killed, not awaited) and
        raise its error (``InputError`` for a user's mistake)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
            futures = [pool.submit(e.start) for e in self.engines]
            done, _ = concurrent.futures.wait(
                futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures
                           if f in done and f.exception() is not None), None)
            if failed is not None:  # leaving the pool waits for the killed ones to return
                for e in self.engines:
                    if e.info is None:
                        e.kill()
                self.stop(0.0)
                raise failed
        infos = [e.info for e in self.engines]
        self.info = dataclasses.replace(infos[0], max_batch=sum(i.max_batch for i in infos),
                                        max_seq_len=min(i.max_seq_len for i in infos),
                                        stats=self.stats)
        return self.info

    @property
    def stats(self) -> EngineStats | None:
        """The replicas' last counters as one engine's (``replicas.combine_stats``)."""
        from jaxinfer.replicas import combine_stats

        each = [e.stats for e in self.engines if e.stats is not None]
        return combine_stats(each, max(s.step_seconds for s in each)) if each else None

    @property
    def dead(self) -> str | None:
        """Why a replica's engine process is gone, if one is."""
        return next((e.dead for e in self.engines if e.dead is not None), None)

    @property
    def closing(self) -> bool:
        """Whether ``stop`` was called or a replica's engine process died."""
        return any(e.closing for e in self.engines)

    @property
    def outstanding(self) -> int:
        """Engine requests submitted and not yet finished or cancelled, over all replicas."""
        return sum(e.outstanding for e in self.engines)

    def submit(self, ticket: Any, jobs: list[tuple[Any, Request]], stream: bool) -> int:
        """``EngineProcess.submit`` on the replica with the least work left (the next one
        when its queue is full); returns an id for ``cancel``."""
        if self.dead is not None:
            raise ShuttingDown(self.dead)
        costs = {key: len(r.prompt_ids) + (0 if r.is_score else r.sampling.max_new_tokens)
                 for key, r in jobs}
        with self._lock:
            order = sorted(range(len(self.engines)), key=self._load.__getitem__)
        for n, i in enumerate(order):
            with self._lock:  # before submit: its messages may come at once
                self._jobs[ticket] = (i, dict(costs))
                self._load[i] += sum(costs.values())
            try:
                inner = self.engines[i].submit(ticket, jobs, stream)
            except QueueFull:
                self._release(ticket)
                if n < len(order) - 1:
                    continue
                raise
            except BaseException:
                self._release(ticket)
                raise
            return inner * len(self.engines) + i  # the replica and its id, in one int
        raise QueueFull  # no replicas: cannot happen (spec.dp >= 2)

    def cancel(self, tid: int) -> None:
        """Cancel a ticket's unfinished jobs (``EngineProcess.cancel``)."""
        inner, i = divmod(tid, len(self.engines))
        self.engines[i].cancel(inner)

    def stop(self, grace_s: float) -> None:
        """``EngineProcess.stop`` on every started replica at once."""
        started = [e for e in self.engines if e.info is not None]
        if started:
            with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:
                list(pool.map(lambda e: e.stop(grace_s), started))

    def _deliver(self, messages: list[Message]) -> None:
        """A replica's messages: give finished jobs' tokens back, then pass them on."""
        with self._lock:
            for ticket, kind, key, _ in messages:
                if kind == "rejected":
                    self._release(ticket)
                elif kind in ("done", "failed") and ticket in self._jobs:
                    i, costs = self._jobs[ticket]
                    self._load[i] -= costs.pop(key, 0)
                    if not costs:
                        del self._jobs[ticket]
        self._on_messages(messages)

    def _release(self, ticket: Any) -> None:
        """Forget a ticket's jobs and give their tokens back (its replica did not take it)."""
        with self._lock:
            i, costs = self._jobs.pop(ticket, (0, {}))
            self._load[i] -= sum(costs.values())


def open_engine(spec: EngineSpec, on_messages: Callable[[list[Message]], None],
                max_queue: int, max_decode_steps: int | None = None
                ) -> EngineProcess | ReplicaProcesses:
    """The handle that serves ``spec``: one ``EngineProcess``, or ``ReplicaProcesses`` when
    ``spec.replica_processes`` asks for an engine process per data replica."""
    kind = ReplicaProcesses if spec.replica_processes else EngineProcess
    return kind(spec, on_messages, max_queue, max_decode_steps)
