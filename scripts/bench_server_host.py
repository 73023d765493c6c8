"""The server's host work alone: the HTTP process and its clients against a synthetic engine.

A CPU proxy for ``scripts/bench_server.py``: everything on the host path is the real code
(``jaxinfer.engine_process``'s loop and pipe, the FastAPI app under uvicorn, detokenizing,
SSE, ``scripts/http_clients.py`` in processes of their own); only the engine's device work is
replaced by ``SyntheticEngine``, which sleeps for what each step would take on the device and
makes up its tokens. So the figures say whether the host side keeps up with an engine of a
given speed, here, without a GPU.

The engine's timings default to a 1B engine on an H100: its offline run of the 1,000-request
workload takes ~5.8 s (~23.5k output tok/s; r41's real one: 5.7 s, 24.0k tok/s, 99 steps).
Its "offline" run is the same engine stepped with no HTTP (the sleeps plus its own
bookkeeping); "served" is the workload through the server with one streaming client per
request. Printed and recorded:
both tok/s, their ratio, the CPU seconds the HTTP process and the client processes used
(either near the elapsed time: that process is the bottleneck), and client TTFT/TPOT.

Usage:
    python scripts/bench_server_host.py --json /tmp/host.json       # the 1B workload
    python scripts/bench_server_host.py --http h11 --loop asyncio   # as on the GPU host (no
                                                                    # httptools, uvloop there)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jaxinfer
from jaxinfer.benchmark import record_path, write_record
from jaxinfer.engine import EngineStats
from jaxinfer.engine_process import EngineSpec
from jaxinfer.requests import Completion, Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402 - the sibling scripts, importable once their folder is on the path
import bench_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class SyntheticEngine:
    """The part of ``jaxinfer.Engine``'s interface the engine process uses, with made-up
    tokens and sleeps for device time.

    Each step either admits waiting requests (a mixed step: prompts up to ``token_budget``
    tokens, every running row gets one token, ``mixed_step_s``) or, with nothing to admit,
    runs a decode call (every row gets up to ``decode_steps`` tokens,
    ``decode_steps * decode_iter_s``). A request's tokens are ``(rid * 7919 + position) %
    vocab`` (never an end-of-sequence id) and it finishes at its ``max_new_tokens``.
    """

    def __init__(self, model: jaxinfer.Model, max_batch: int, token_budget: int,
                 mixed_step_s: float, decode_iter_s: float, decode_steps: int) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_seq_len = model.config.max_position_embeddings
        self._budget, self._mixed_s = token_budget, mixed_step_s
        self._iter_s, self._decode_steps = decode_iter_s, decode_steps
        self._eos = set(model.config.eos_token_ids)
        self._next_id = 0
        self._waiting: deque[int] = deque()
        self._running: dict[int, list[int]] = {}  # rid -> its tokens so far
        self._requests: dict[int, tuple[Request, float, float | None]] = {}  # rid -> (req,
        # submitted, first token's time)
        self._results: dict[int, Completion] = {}
        self._steps = self._decode_calls = self._generated = 0
        self._step_time = self._device_time = self._decode_time = 0.0

    def add_request(self, req: Request) -> int:
        """Queue a request; its id."""
        rid, self._next_id = self._next_id, self._next_id + 1
        self._requests[rid] = (req, time.perf_counter(), None)
        self._waiting.append(rid)
        return rid

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self._waiting or self._running)

    def step(self, max_decode_steps: int | None = None) -> list[tuple[int, list[int], bool]]:
        """One step: ``(id, new tokens, finished)`` per advanced request."""
        t0 = time.perf_counter()
        admitted, budget = [], self._budget
        while (self._waiting and len(self._running) + len(admitted) < self.max_batch
               and budget > 0):
            rid = self._waiting.popleft()
            budget -= len(self._requests[rid][0].prompt_ids)
            admitted.append(rid)
        if admitted or not self._running:
            per_row, device_s = 1, self._mixed_s
        else:
            per_row = min(self._decode_steps, max_decode_steps or self._decode_steps)
            device_s = per_row * self._iter_s
            self._decode_calls += 1
            self._decode_time += device_s
        for rid in admitted:
            self._running[rid] = []
        time.sleep(device_s)
        events = []
        now = time.perf_counter()
        vocab = self.model.config.vocab_size
        for rid, tokens in list(self._running.items()):
            req, submitted, first = self._requests[rid]
            n = min(per_row, req.sampling.max_new_tokens - len(tokens))
            new = [t if t not in self._eos else 3 for t in
                   ((rid * 7919 + len(tokens) + i) % vocab for i in range(n))]
            tokens += new
            self._generated += n
            first = now if first is None else first
            self._requests[rid] = (req, submitted, first)
            done = len(tokens) == req.sampling.max_new_tokens
            if done:
                del self._running[rid]
                self._results[rid] = Completion(
                    text=self.model.tokenizer.decode(tokens), token_ids=tokens,
                    finish_reason="length", prompt_token_ids=list(req.prompt_ids),
                    time_to_first_token=first - submitted,
                    time_per_output_token=(now - first) / max(1, len(tokens) - 1))
            events.append((rid, new, done))
        self._steps += 1
        self._device_time += device_s
        self._step_time += time.perf_counter() - t0
        return events

    def result(self, rid: int) -> Completion:
        """A finished request's result (handed over once)."""
        del self._requests[rid]
        return self._results.pop(rid)

    def cancel(self, rid: int) -> bool:
        """Drop a request; whether it was unfinished."""
        unfinished = rid in self._running or rid in self._waiting
        self._running.pop(rid, None)
        if rid in self._waiting:
            self._waiting.remove(rid)
        self._requests.pop(rid, None)
        self._results.pop(rid, None)
        return unfinished

    def forget(self, rid: int) -> bool:
        """Nothing is kept after ``result`` or ``cancel``."""
        return False

    def stats(self) -> EngineStats:
        """The counters ``bench_server`` and ``/metrics`` read (no pages: no KV pool)."""
        return EngineStats(
            steps=self._steps, decode_calls=self._decode_calls, running=len(self._running),
            waiting=len(self._waiting), generated_tokens=self._generated, computed_tokens=0,
            padded_tokens=0,
            tokens_per_second=self._generated / self._step_time if self._step_time else 0.0,
            step_seconds=self._step_time, device_seconds=self._device_time,
            decode_seconds=self._decode_time, pages_total=0, pages_used=0, pages_cached=0,
            pages_free=0, peak_pages_used=0, tokens_capacity=0, tokens_held=0,
            prefix_cache_hit_rate=0.0, cached_tokens=0, num_preemptions=0, num_programs=0)


@dataclasses.dataclass(frozen=True)
class SyntheticSpec(EngineSpec):
    """A ``SyntheticEngine`` for the preset's config and numbered tokenizer, sized and timed
    by the flags (pickled into the engine process)."""

    args: argparse.Namespace | None = None

    def build(self) -> SyntheticEngine:
        """The synthetic engine."""
        a = self.args
        cfg = bench_engine.PRESETS[a.preset]
        model = jaxinfer.Model(config=cfg, params={},
                               tokenizer=bench_server.numbered_tokenizer(cfg), name=a.preset)
        return SyntheticEngine(model, a.max_batch, a.token_budget, a.mixed_step_ms / 1e3,
                               a.decode_iter_ms / 1e3, a.decode_steps)


def run_offline(spec: SyntheticSpec, w: bench_engine.Workload) -> dict[str, Any]:
    """The workload straight through the synthetic engine (all submitted at once)."""
    from jaxinfer.requests import make_requests
    from jaxinfer.sampling import SamplingParams

    engine = spec.build()
    reqs = [make_requests(engine.model, p, False, SamplingParams(max_new_tokens=n,
                                                                  temperature=0.0), {})[0]
            for p, n in zip(w.prompts, w.output_lens, strict=True)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(new) for _, new, _ in engine.step())
    elapsed = time.perf_counter() - t0
    s = engine.stats()
    return dict(elapsed_s=elapsed, output_tokens=tokens, output_tok_per_s=tokens / elapsed,
                steps=s.steps, decode_calls=s.decode_calls, step_s=s.step_seconds,
                device_s=s.device_seconds)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The workload's flags (``bench_server``'s defaults), the synthetic engine's sizes and
    timings, and uvicorn's HTTP and event-loop implementations."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(bench_engine.PRESETS), default="1b",
                    help="the config whose vocabulary and default lengths the workload uses")
    bench_server.add_workload_args(ap)
    ap.add_argument("--max-batch", type=int, default=256, help="engine slots")
    ap.add_argument("--token-budget", type=int, default=4096,
                    help="prompt tokens admitted per mixed step")
    ap.add_argument("--mixed-step-ms", type=float, default=15.0,
                    help="device time of a step that admits requests")
    ap.add_argument("--decode-iter-ms", type=float, default=4.5,
                    help="device time of one decode iteration (with --mixed-step-ms: the 1B "
                         "workload's offline rate on an H100, ~24k tok/s)")
    ap.add_argument("--decode-steps", type=int, default=32,
                    help="iterations per decode call (the engine's ~0.2 s decode calls)")
    ap.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                    help="uvicorn's HTTP implementation (auto: httptools when installed)")
    ap.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                    help="uvicorn's event loop (auto: uvloop when installed)")
    ap.add_argument("--json", default=None,
                    help="write the record here; 'auto' = bench/results/cpu/server_issue14/"
                         "host_<preset>_<date>.json")
    args = ap.parse_args(argv)
    bench_server.finish_workload_args(ap, args)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both; return the JSON record (also written to ``--json``)."""
    args = parse_args(argv)
    spec = SyntheticSpec(model=f"synthetic-{args.preset}", args=args)
    cfg = bench_engine.PRESETS[args.preset]
    w = bench_engine.make_workload(cfg, args.requests, (args.prompt_min, args.prompt_max),
                                   (args.output_min, args.output_max), 0.0, args.seed)
    print(f"== synthetic {args.preset} engine: {args.requests} requests, prompts "
          f"{args.prompt_min}-{args.prompt_max}, outputs {args.output_min}-{args.output_max}; "
          f"uvicorn http={args.http} loop={args.loop}", flush=True)
    offline = run_offline(spec, w)
    print(f"-- offline: {offline['output_tokens']} tokens in {offline['elapsed_s']:.2f} s = "
          f"{offline['output_tok_per_s']:.0f} output tok/s ({offline['steps']} steps)",
          flush=True)
    served = bench_server.run_served(spec, args, w, http=args.http, loop=args.loop)
    ratio = served["output_tok_per_s"] / offline["output_tok_per_s"]
    print(f"-- served over HTTP ({served['clients']} streaming clients in "
          f"{served['client_processes']} processes): "
          f"{served['output_tokens']} tokens in {served['elapsed_s']:.2f} s = "
          f"{served['output_tok_per_s']:.0f} output tok/s = {ratio:.1%} of offline")
    print(f"   CPU seconds: HTTP process {served['http_process_cpu_s']:.2f}, clients "
          f"{served['clients_cpu_s']:.2f}; SSE chunks {served['chunks']} "
          f"({served['output_tokens'] / max(1, served['chunks']):.1f} tokens each)")
    print(f"   client TTFT ms {served['ttft_ms']}  TPOT ms {served['tpot_ms']}", flush=True)
    now = datetime.datetime.now(datetime.UTC)
    record = dict(date=now.isoformat(timespec="seconds"),
                  command=" ".join(["python", *(sys.argv if argv is None else
                                                ["scripts/bench_server_host.py", *argv])]),
                  args=vars(args), offline=offline, served=served, served_over_offline=ratio)
    path = record_path(args.json, REPO / "bench" / "results" / "cpu" / "server_issue14"
                       / f"host_{args.preset}_{now.strftime('%Y%m%d')}.json")
    if path is not None:
        write_record(path, record)
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
