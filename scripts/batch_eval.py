#!/usr/bin/env python
"""Generate (or score) a JSONL file of prompts across a device mesh, resumably.

    python scripts/batch_eval.py --model M --input prompts.jsonl --output results.jsonl \
        [--tp N] [--dp N] [--quantize M] [--kv-cache-dtype int8|fp8] [--max-new-tokens N] \
        [--temperature T] [sampling flags as the CLI]

Input records: ``{"id": ..., "prompt": "..."}`` (``--chat`` wraps it as a user turn), or
``{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}``; with ``--score`` also a
``"completion"`` whose log-likelihood given the prompt is computed instead of generating.

Output: one JSON line per input record, in input order: ``id``, ``line`` (1-based input line),
then ``text``, ``token_ids``, ``finish_reason``, ``prompt_tokens``, ``ttft_s``, ``tpot_s``
(generation; with ``--speculative`` also ``draft_tokens`` proposed and ``accepted_tokens``) or
``logprob``, ``token_logprobs``, ``num_tokens``, ``greedy``, ``cached_tokens`` (scoring, the
engine path of ``jaxinfer.score``), or ``error`` for a bad record. Bad records
(not JSON, no prompt, wrong types, too long for the model) are reported on stderr with their
line number and written as error records, or stop the run before any generation with
``--on-bad-record fail`` (those the model's tokenizer and context or its engine's
``max_seq_len`` decide, after loading it; the rest before). With ``--replicas processes``
the engine processes check their limits as they take each record, so a record they refuse is
always written as an error record. Blank lines are not records.

All records go to the model's engine at once (continuous batching over a paged KV cache).
Resuming: finished records are appended as soon as they extend the written prefix (flushed
and fsynced), so after an interruption the finished records are a prefix of the input.
Running the same command again checks that prefix against the input, drops a torn last line,
and continues with the next record. With ``--seed``, each record samples with seed
``seed + line`` (modulo 2**63: ``jaxinfer.sampling.offset_seed``), so a resumed run draws the
same tokens as an uninterrupted one.

At the end process 0 prints the throughput, each data replica's steps and tokens (with
``--dp``), TTFT and TPOT percentiles, and the run's device floor: the records run in this
call through ``jaxinfer.benchmark.workload_floor`` (prefill FLOPs at the matmul rate, decode
weight and K/V bytes at the read bandwidth, measured ceilings of this device kind), split
over every device of the mesh, with the fraction of it reached. ``--quantize M`` quantizes
the weights at load (``load_model(quantize=M)``); where the weights are quantized (so, or
stored quantized) the floor counts the bytes they take.

Multi-host: start the same command on every host with ``--coordinator HOST:PORT
--num-processes N --process-id I``; the mesh spans all hosts' devices and process 0 writes the
output.

``--dp N`` on one host of CUDA GPUs (``--replicas auto``, the default; or ``processes``): each
data replica runs in an engine process of its own (``jaxinfer.engine_process.ReplicaProcesses``),
pinned to its ``--tp`` GPUs, with its own interpreter lock; this process reads, routes and
writes and never starts JAX. Each process loads the model and compiles (reported as one
"loading and compiling" time). With ``--replicas threads``, on other platforms, or with a
draft model, the replicas are threads of this process (``DataParallelEngine``); across hosts
one engine runs over the whole mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(REPO))

from jaxinfer.cli import (  # noqa: E402
    add_kv_cache_arg,
    add_mesh_args,
    add_quantize_arg,
    add_replicas_arg,
    add_sampling_args,
    check_load_args,
    load_draft,
    mesh_from_args,
    replica_processes,
    sampling_kwargs,
)
from jaxinfer.errors import InputError, JaxinferError  # noqa: E402

if TYPE_CHECKING:
    from jaxinfer.engine import EngineStats


@dataclasses.dataclass
class Record:
    """One input line: its 1-based line number, id, and prompt (or why it is bad)."""

    line: int
    id: Any
    prompt: Any = None  # str or list of chat messages
    completion: str | None = None
    error: str | None = None


def parse_records(path: Path, score: bool) -> list[Record]:
    """Read the JSONL input; every non-blank line becomes a ``Record`` (bad ones with ``error``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read input {path}: {e}") from None
    records = []
    # "\n" only: str.splitlines would also split on U+2028/U+2029/U+0085 inside JSON strings.
    for n, raw in enumerate(text.split("\n"), start=1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        records.append(_parse_line(n, raw, score))
    return records


def _parse_line(n: int, raw: str, score: bool) -> Record:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return Record(n, None, error=f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return Record(n, None, error=f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", n)
    if "messages" in obj:
        msgs = obj["messages"]
        ok = (isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in msgs))
        if not ok:
            return Record(n, rid, error="'messages' must be a non-empty list of "
                                        "{'role': str, 'content': str}")
        prompt: Any = msgs
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            return Record(n, rid, error="'prompt' must be a non-empty string")
    else:
        return Record(n, rid, error="missing 'prompt' (or 'messages')")
    completion = obj.get("completion")
    if score and (not isinstance(completion, str) or not completion):
        return Record(n, rid, error="--score needs a non-empty string 'completion'")
    return Record(n, rid, prompt, completion)


def check_output(output: Path) -> None:
    """Raise ``InputError`` unless ``output`` can be appended to (checked before any loading)."""
    if output.is_dir():
        raise InputError(f"--output {output} is a directory; give a file path")
    existed = output.exists()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        raise InputError(f"--output {output} cannot be written ({e.strerror}); choose a "
                         "writable file path") from None
    if not existed:
        output.unlink(missing_ok=True)


def resume_point(output: Path, records: Sequence[Record]) -> int:
    """Number of records already in ``output`` (a verified prefix); truncates a torn last
    line (no newline: an interrupted write). Raises ``InputError``, leaving the file as it
    is, where any whole line is not this input's next record (another file, or another
    input's output)."""
    if not output.exists():
        return 0

    def mismatch() -> InputError:
        return InputError(f"{output} does not match {len(records)} records of the input at "
                          f"output line {done + 1}; use a new --output or delete it")

    *lines, tail = output.read_bytes().split(b"\n")  # tail: b"" after a whole last line
    keep, done = 0, 0
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict) or done >= len(records) \
                or obj.get("line") != records[done].line or obj.get("id") != records[done].id:
            raise mismatch()
        keep += len(raw) + 1
        done += 1
    if tail:  # a torn write of the next record (its start, as _evaluate writes it): redone
        if done >= len(records):
            raise mismatch()
        start = json.dumps({"id": records[done].id, "line": records[done].line},
                           ensure_ascii=False)[:-1].encode()
        if not (tail.startswith(start) or start.startswith(tail)):
            raise mismatch()
        with output.open("r+b") as f:
            f.truncate(keep)
    return done


def _percentiles(values: Sequence[float]) -> str:
    import numpy as np

    if not values:
        return "n/a"
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return f"p50 {p50 * 1e3:.1f} ms  p90 {p90 * 1e3:.1f} ms  p99 {p99 * 1e3:.1f} ms"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--input", required=True, type=Path)
    p.add_argument("--output", required=True, type=Path)
    add_mesh_args(p)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "pallas"])
    add_quantize_arg(p)
    add_kv_cache_arg(p)
    p.add_argument("--chat", action="store_true", help="wrap string prompts in the chat template")
    p.add_argument("--batch-size", type=int, default=None,
                   help="most sequences running at once (default: sized from the KV pool)")
    p.add_argument("--on-bad-record", choices=["skip", "fail"], default="skip",
                   help="skip: report and write an error record; fail: stop before any work")
    p.add_argument("--score", action="store_true",
                   help="log-likelihood of each record's 'completion' instead of generating")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compile-cache", default="~/.cache/jaxinfer/xla",
                   help="persistent XLA compilation cache folder ('' turns it off)")
    p.add_argument("--coordinator", default=None, help="multi-host: coordinator HOST:PORT")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    add_replicas_arg(p)
    add_sampling_args(p)
    return p


def _requests(runner: Runner, good: Sequence[Record], args: argparse.Namespace,
              base_seed: int | None) -> dict[int, Any]:
    """Validate each good record into an engine ``Request`` (line -> Request or error str).

    A record the model or its engine cannot take (too long for its context or the engine's
    ``max_seq_len``, say: ``runner.check``) becomes an error record with the reason, like a
    malformed line, instead of stopping the run.
    """
    model, options = runner.model, runner.options
    from jaxinfer.requests import encode_chat, make_requests, make_score_requests
    from jaxinfer.sampling import SamplingParams, offset_seed

    out: dict[int, Any] = {}
    for r in good:
        try:
            if args.score:
                ctx: Any = r.prompt
                if isinstance(r.prompt, list) or args.chat:
                    msgs = r.prompt if isinstance(r.prompt, list) else [
                        {"role": "user", "content": r.prompt}]
                    ctx = encode_chat(model, msgs)
                (req,) = make_score_requests(model, [(ctx, r.completion)])
            else:
                sp = SamplingParams.from_kwargs(
                    **options, seed=None if base_seed is None else offset_seed(base_seed, r.line))
                (req,) = make_requests(model, r.prompt, args.chat, sp, {})
            runner.check(req)
            out[r.line] = req
        except InputError as e:
            out[r.line] = str(e)
    return out


def _record(result: Any, speculative: bool) -> dict[str, Any]:
    """The output fields of one finished ``Completion`` or ``ScoreResult`` (``speculative``:
    the run proposed tokens, so each generation record counts them)."""
    from jaxinfer.requests import ScoreResult

    if result.error is not None:
        return {"error": result.error}
    if isinstance(result, ScoreResult):
        return {"logprob": result.logprob, "token_logprobs": result.token_logprobs,
                "num_tokens": len(result.token_logprobs), "greedy": result.greedy,
                "cached_tokens": result.cached_tokens}
    out = {"text": result.text, "token_ids": result.token_ids,
           "finish_reason": result.finish_reason,
           "prompt_tokens": len(result.prompt_token_ids),
           "ttft_s": result.time_to_first_token, "tpot_s": result.time_per_output_token}
    if speculative:
        out.update(draft_tokens=result.draft_tokens, accepted_tokens=result.accepted_tokens)
    return out


def _report_bad(bad: Sequence[Record], args: argparse.Namespace, what: str = "") -> None:
    """Print each bad record's line and error; with ``--on-bad-record fail`` raise
    ``InputError`` for them (``what``: which check found them)."""
    for r in bad:
        print(f"batch_eval: {args.input}:{r.line}: {r.error}", file=sys.stderr)
    if bad and args.on_bad_record == "fail":
        raise InputError(f"{len(bad)} bad record(s) in {args.input}{what} (first at line "
                         f"{bad[0].line}); fix them or pass --on-bad-record skip")


GENERATION_ONLY = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p",
                   "repetition_penalty", "seed", "stop", "speculative",
                   "num_speculative_tokens", "draft_model", "draft_quantize")
"""``add_sampling_args`` flags (as ``args`` names) that ``--score`` has no use for."""


def run(args: argparse.Namespace) -> int:
    """Run the evaluation described by parsed ``args``; returns the exit status.

    Every good record goes to the model's one engine at once (continuous batching); results
    are written as soon as they form a prefix of the input, so the output is always
    resumable.
    """
    if args.score:  # flags that only shape generation would be silently ignored
        defaults = _parser()
        ignored = [f"--{name.replace('_', '-')}" for name in GENERATION_ONLY
                   if getattr(args, name) != defaults.get_default(name)]
        if ignored:
            raise InputError(f"--score computes the log-likelihood of each record's "
                             f"completion; {', '.join(ignored)} only apply to generation")
    options = sampling_kwargs(args)
    from jaxinfer.sampling import SamplingParams

    SamplingParams.from_kwargs(**options)  # reject bad flags before loading anything
    base_seed = options.pop("seed")
    check_load_args(args)
    if args.batch_size is not None and args.batch_size < 1:
        raise InputError(f"--batch-size={args.batch_size} must be >= 1")
    records = parse_records(args.input, args.score)
    _report_bad([r for r in records if r.error], args)

    processes = replica_processes(args, multihost=_multihost(args),
                                  draft=args.speculative == "draft")
    if processes:
        _check_process_args(args)  # and load_model's checks of the dtype, before any process
        from jaxinfer.loading import parse_dtype

        parse_dtype(args.dtype)
        primary = True
    else:
        from sharding.multihost import initialize, is_primary

        initialize(args.coordinator, args.num_processes, args.process_id)
        primary = is_primary()
    refused, done = None, 0
    if primary:
        try:
            check_output(args.output)
            done = resume_point(args.output, records)
        except InputError as e:
            refused, done = e, -1
    if args.num_processes and args.num_processes > 1:
        from jax.experimental import multihost_utils

        # Every process must run the same requests: agree on process 0's resume point (-1:
        # it refused the output, and every process stops).
        done = int(multihost_utils.broadcast_one_to_all(done))
    if refused is not None:
        raise refused
    if done < 0:
        raise InputError(f"process 0 refused --output {args.output}; see its error")
    if done:
        print(f"batch_eval: resuming after {done} finished record(s) in {args.output}",
              file=sys.stderr)
    todo = records[done:]
    good = [r for r in todo if not r.error]
    runner = (_Processes(args, options, work=bool(good)) if processes
              else _InProcess(args, options))
    try:
        return _evaluate(args, runner, records, todo, done, primary, base_seed)
    finally:
        runner.close()


def _multihost(args: argparse.Namespace) -> bool:
    """Whether the flags start a run across hosts (one process per host)."""
    return bool(args.coordinator) or (args.num_processes or 1) > 1


def _check_process_args(args: argparse.Namespace) -> None:
    """One-line errors for flags that ``--replicas processes`` cannot take."""
    if args.dp < 2:
        raise InputError("--replicas processes runs one process per --dp replica; give "
                         "--dp 2 or more")
    if _multihost(args):
        raise InputError("--replicas processes runs on one host; drop --coordinator/"
                         "--num-processes (a multi-host run is one process per host)")
    if args.speculative == "draft":
        raise InputError("--speculative draft cannot run with --replicas processes (a draft "
                         "model runs on one device); use --speculative ngram, or drop --dp")


class Runner(Protocol):
    """What ``_evaluate`` runs the records on: ``_InProcess`` or ``_Processes``."""

    model: Any  # jaxinfer.Model: its config and tokenizer (weights only in-process)
    options: dict[str, Any]  # the requests' sampling options
    devices: int  # devices of the run, all replicas together
    replicas: int  # data replicas
    device_kind: str  # jax.Device.device_kind, for the floor's ceilings
    max_batch: int  # sequences running at once, all replicas together
    itemsize: int  # bytes of a weight / K/V element
    weight_bytes: int | None  # what a decode step reads of quantized weights (None: itemsize)
    warm_s: float  # seconds loading and compiling before the timed run
    warm_what: str  # what those seconds were spent on, for the summary

    def prepare(self, reqs: dict[int, Any]) -> None:
        """Compile what the requests (line -> Request) need before the timed run."""

    def check(self, req: Any) -> None:
        """Raise ``InputError`` where the engine(s) cannot take this ``Request`` (where known
        up front)."""

    def submit(self, reqs: dict[int, Any]) -> None:
        """Hand the requests (line -> Request) to the engine(s)."""

    def results(self) -> list[tuple[int, Any, str | None]]:
        """Finished requests: ``(line, result, None)`` or ``(line, None, why refused)``."""

    def stats(self) -> Any:
        """All replicas' counters as one engine's (``EngineStats``)."""

    def replica_stats(self) -> list[Any]:
        """Each replica's counters."""

    def close(self) -> None:
        """Release the engine(s)."""


class _InProcess:
    """The model and its engine in this process (``engine_for``: one engine, or one per
    data replica stepped in threads, or one across hosts)."""

    def __init__(self, args: argparse.Namespace, options: dict[str, Any]) -> None:
        import jax
        import jax.numpy as jnp

        import jaxinfer
        from jaxinfer.quantize import decode_weight_bytes
        from jaxinfer.replicas import engine_for
        from sharding.mesh import DATA

        if args.compile_cache:  # a re-run (or resume) skips XLA compilation of the shapes
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compile_cache))
        draft = load_draft(args)
        # The requests' sampling options: with a draft model, its Speculative (loaded here).
        self.options = options if draft is None else {
            **options, "speculative": sampling_kwargs(args, draft)["speculative"]}
        self.model = jaxinfer.load_model(args.model, dtype=args.dtype, backend=args.backend,
                                         max_batch=args.batch_size, mesh=mesh_from_args(args),
                                         quantize=args.quantize,
                                         kv_cache_dtype=args.kv_cache_dtype)
        self.engine = engine_for(self.model)
        mesh = self.model.mesh
        self.devices = 1 if mesh is None else mesh.size
        self.replicas = 1 if mesh is None else mesh.shape[DATA]
        self.device_kind = jax.devices()[0].device_kind
        self.max_batch = self.engine.max_batch
        self.itemsize = jnp.dtype(self.model.dtype).itemsize
        self.weight_bytes = decode_weight_bytes(self.model.params,
                                                self.model.config.tie_word_embeddings)
        self.warm_s = 0.0
        self.warm_what = "compiling/loading step programs"
        self._args = args
        self._line_of: dict[int, int] = {}

    def prepare(self, reqs: dict[int, Any]) -> None:
        """Compile (or load) every step program the requests need (line -> Request), so the
        timed run is the steady state."""
        args = self._args
        sampled = any(r.sampling.temperature > 0 for r in reqs.values())
        if reqs:
            self.warm_s = self.engine.warmup(
                generate=not args.score, score=args.score, sampled=sampled,
                speculative=None if args.score else self.options["speculative"])

    def check(self, req: Any) -> None:
        """``Engine.check_fits``."""
        self.engine.check_fits(req)

    def submit(self, reqs: dict[int, Any]) -> None:
        """Queue the requests (line -> Request)."""
        self._line_of = {self.engine.add_request(req): line for line, req in reqs.items()}

    def results(self) -> list[tuple[int, Any, str | None]]:
        """Step the engine once; ``(line, result, None)`` for each request it finished."""
        out = []
        # Every request was submitted up front (as in Engine.run).
        for i, _, is_done in self.engine.step(no_arrivals=True):
            if is_done and i in self._line_of:
                out.append((self._line_of[i], self.engine.result(i), None))
                self.engine.forget(i)
        return out

    def stats(self) -> Any:
        """The engine's counters."""
        return self.engine.stats()

    def replica_stats(self) -> list[Any]:
        """Each data replica's counters (one engine: itself)."""
        from jaxinfer.replicas import replica_engines

        return [e.stats() for e in replica_engines(self.engine)]

    def close(self) -> None:
        """Nothing to release (the model lives as long as this process)."""


class _Processes:
    """``--replicas processes``: one engine process per data replica
    (``jaxinfer.engine_process.ReplicaProcesses``), this process never starting JAX."""

    def __init__(self, args: argparse.Namespace, options: dict[str, Any], work: bool) -> None:
        import queue

        import jax.numpy as jnp

        from jaxinfer.engine_process import EngineSpec, ReplicaProcesses
        from jaxinfer.loading import parse_dtype

        spec = EngineSpec(args.model, dtype=args.dtype, backend=args.backend,
                          quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                          tp=args.tp, dp=args.dp,
                          engine={} if args.batch_size is None else {"max_batch": args.batch_size},
                          warmup=work, score=args.score, sampled=options["temperature"] > 0,
                          speculative=None if args.score else options["speculative"],
                          compile_cache=(os.path.expanduser(args.compile_cache)
                                         if args.compile_cache else None),
                          replica_processes=True)
        self._done: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self.pool = ReplicaProcesses(spec, self._done.put, max_queue=2**62)
        t0 = time.perf_counter()
        info = self.pool.start()
        self.warm_s = time.perf_counter() - t0  # loads and compiles, in every process at once
        self.warm_what = f"loading and compiling in {args.dp} replica processes"
        self.model = info.model()
        self.itemsize = jnp.dtype(parse_dtype(args.dtype)).itemsize
        self.weight_bytes = info.weight_bytes
        self.devices, self.replicas = args.dp * args.tp, args.dp
        self.device_kind, self.max_batch = info.device_kind, info.max_batch
        self.options = options  # the requests' sampling options

    def prepare(self, reqs: dict[int, Any]) -> None:
        """Nothing: each engine process compiled its programs before it was ready."""

    def check(self, req: Any) -> None:
        """Nothing: the engine processes check each request as they take it, and a refused
        one comes back from ``results`` with why."""

    def submit(self, reqs: dict[int, Any]) -> None:
        """Queue the requests (line -> Request), each on the replica with the least work."""
        for line, req in reqs.items():
            self.pool.submit(line, [(line, req)], stream=False)

    def results(self) -> list[tuple[int, Any, str | None]]:
        """Wait for finished requests: ``(line, result, None)``, or ``(line, None, why)``
        for one an engine refused (too long for it, say).

        Raises ``RuntimeError`` when an engine failed a request (its step raised, or its
        process died): like the in-process engine's error, it ends the run, and the records
        written so far stay a prefix to resume from.
        """
        out: list[tuple[int, Any, str | None]] = []
        while not out:
            for line, kind, _, payload in self._done.get():
                if kind == "done" and payload is not None:
                    out.append((line, payload, None))
                elif kind == "rejected" and payload is not None:
                    out.append((line, None, payload))
                elif kind != "accepted":
                    raise RuntimeError(f"a replica process could not finish line {line} "
                                       f"({kind}: {payload or 'it is stopping'})")
        return out

    def stats(self) -> Any:
        """The replicas' counters as one engine's."""
        return self.pool.stats

    def replica_stats(self) -> list[Any]:
        """Each replica process's last counters."""
        return [e.stats for e in self.pool.engines]

    def close(self) -> None:
        """Stop the engine processes."""
        self.pool.stop(0.0)


def _evaluate(args: argparse.Namespace, runner: Runner, records: Sequence[Record],
              todo: Sequence[Record], done: int, primary: bool, base_seed: int | None) -> int:
    """Run ``todo``'s good records on ``runner`` (with its sampling ``options``) and write
    every record of ``todo`` in input order as soon as it extends the written prefix; print
    the summary."""
    reqs = _requests(runner, [r for r in todo if not r.error], args, base_seed)
    refused = []  # records the model or its engine cannot take (too long, ...)
    for r in todo:
        if isinstance(reqs.get(r.line), str):
            r.error = reqs.pop(r.line)
            refused.append(r)
    _report_bad(refused, args, " for this model")
    runner.prepare(reqs)
    stats = {"requests": len(reqs), "bad": sum(1 for r in records if r.error), "tokens": 0,
             "ttft": [], "tpot": [], "prompt_lens": [], "output_lens": []}
    bar = None
    if primary and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records), initial=done, unit="rec", file=sys.stderr,
                   dynamic_ncols=True)
    t0 = time.perf_counter()
    runner.submit(reqs)  # replica processes start on them at once: timed
    args.output.parent.mkdir(parents=True, exist_ok=True)
    out_f = args.output.open("a", encoding="utf-8") if primary else None
    finished: dict[int, dict[str, Any]] = {}
    written = 0
    try:
        while written < len(todo):
            while written < len(todo) and (todo[written].error
                                           or todo[written].line in finished):
                r = todo[written]
                rec = {"id": r.id, "line": r.line}
                rec.update({"error": r.error} if r.error else finished.pop(r.line))
                if out_f is not None:
                    out_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                written += 1
                if bar is not None:
                    bar.update(1)
            if out_f is not None:
                out_f.flush()
                os.fsync(out_f.fileno())
            if written == len(todo):
                break
            for line, result, why in runner.results():
                if result is None:
                    finished[line] = {"error": why}
                    continue
                finished[line] = _record(result, bool(runner.options["speculative"]))
                if result.error is None:  # the work the device did, for the floor
                    stats["prompt_lens"].append(len(reqs[line].prompt_ids))
                    stats["output_lens"].append(1 if args.score else len(result.token_ids))
                if not args.score:
                    stats["tokens"] += len(result.token_ids)
                    stats["ttft"].append(result.time_to_first_token)
                    if len(result.token_ids) > 1:
                        stats["tpot"].append(result.time_per_output_token)
            if bar is not None:
                elapsed = time.perf_counter() - t0
                bar.set_postfix_str(f"{stats['tokens'] / max(elapsed, 1e-9):.1f} tok/s")
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print(f"batch_eval: interrupted; finished records are in {args.output}, run the same "
              "command again to resume", file=sys.stderr)
        return 130
    finally:
        if out_f is not None:
            out_f.close()
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    if primary:
        mode = "scored" if args.score else "generated"
        es = runner.stats()
        print(f"requests {stats['requests']} {mode} (+{done} resumed, {stats['bad']} bad)  "
              f"tokens {stats['tokens']}  wall {wall:.2f} s  "
              f"throughput {stats['tokens'] / max(wall, 1e-9):.1f} tok/s  "
              f"{stats['requests'] / max(wall, 1e-9):.2f} req/s  "
              f"prefix-cache hits {es.cached_tokens} tokens  "
              f"(after {runner.warm_s:.1f} s {runner.warm_what})  "
              f"(engine: {es.steps} steps, {es.step_seconds:.2f} s in steps, "
              f"{es.device_seconds:.2f} s waiting on the device)")
        if len(each := runner.replica_stats()) > 1:  # one engine across hosts: none
            print(_replicas_line(each))
        if not args.score:
            print(f"TTFT  {_percentiles(stats['ttft'])}")
            print(f"TPOT  {_percentiles(stats['tpot'])}")
        if stats["prompt_lens"]:
            print(_floor_line(runner, stats, args.kv_cache_dtype, wall))
    return 0


def _replicas_line(each: Sequence[EngineStats]) -> str:
    """Per data replica: steps, seconds in steps and waiting on the device, generated and
    computed tokens (an uneven split or one slow replica shows here)."""
    def col(f: Callable[[EngineStats], str]) -> str:
        return "/".join(f(s) for s in each)

    return (f"replicas: steps {col(lambda s: str(s.steps))}  s in steps "
            f"{col(lambda s: f'{s.step_seconds:.2f}')}  s on the device "
            f"{col(lambda s: f'{s.device_seconds:.2f}')}  generated "
            f"{col(lambda s: str(s.generated_tokens))}  computed "
            f"{col(lambda s: str(s.computed_tokens))}")


def _floor_line(runner: Runner, stats: dict[str, Any], kv_cache_dtype: str | None,
                wall: float) -> str:
    """The run's device floor (``jaxinfer.benchmark.workload_floor`` over the records run
    here, on every device of the run) and the fraction of it the run reached."""
    from jaxinfer.benchmark import ceilings, workload_floor

    flops, bandwidth, note = ceilings(runner.device_kind, None, None)
    f = workload_floor(runner.model.config, stats["prompt_lens"], stats["output_lens"],
                       runner.max_batch // runner.replicas, flops, bandwidth, runner.itemsize,
                       kv_cache_dtype, devices=runner.devices,
                       weight_bytes_per_step=runner.weight_bytes)
    return (f"floor {f['floor_s']:.4g} s on {runner.devices} device(s) (prefill "
            f"{f['prefill_s']:.4g} s at {flops / 1e12:.0f} TFLOP/s, decode {f['decode_s']:.4g} s "
            f"at {bandwidth / 1e12:.2f} TB/s, {note}): the run reached "
            f"{100 * f['floor_s'] / max(wall, 1e-9):.3g}% of it")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors print one line and exit 2."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except JaxinferError as e:
        print(f"batch_eval: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
