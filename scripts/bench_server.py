"""Serving benchmark over HTTP: the OpenAI-compatible server against the offline engine.

Runs ``scripts/bench_engine.py``'s offline workload (same presets, lengths and seed: prompts
of random token ids, output lengths forced with ``max_tokens``, greedy) twice, each on a
fresh ``Engine`` of the same sizes (``BenchSpec``), each in a process of its own:

1. offline: every request submitted to the engine at once (``bench_engine.run_workload``),
   in a spawned process that exits before the server starts (it frees the devices);
2. served: the server as ``jaxinfer serve`` runs it: ``jaxinfer.server.create_app`` under
   uvicorn in this process (the HTTP process: it never starts a JAX backend), its engine in
   the engine process it spawns; and, in ``--client-processes`` processes of their own
   (``scripts/http_clients.py``), one concurrent streaming HTTP client per request (or
   ``--clients N`` clients taking requests from a shared queue), each posting
   ``/v1/completions`` with ``"stream": true`` and reading the SSE chunks.

With ``--dp N`` the server runs an engine process per GPU (``ReplicaProcesses``, as ``jaxinfer
serve --dp N`` does), each with the same engine; the offline run stays on one GPU, so the ratio
reads as the scaling over one engine (ideal: N).

It prints and records output tok/s of both, their ratio (the issue's target: >= 0.9), the
fraction of the workload's device floor (``jaxinfer.benchmark.workload_floor``), and the clients'
TTFT (request sent -> first text chunk) and TPOT ((last chunk - first chunk) / (tokens - 1))
percentiles. A preset's random model has no tokenizer; it gets one that spells token ``i``
as ``<i>`` (a word-level vocabulary of the preset's size), so the server detokenizes as it
would for a real model.

The record also has the CPU seconds of the HTTP process and of the client processes over the
run (``http_process_cpu_s``, ``clients_cpu_s``: either near ``elapsed_s`` times the
processes means that side set the rate) and the text chunks the clients got (``chunks``).
``scripts/bench_server_host.py`` runs the same served path against a synthetic engine, on a
CPU.

Needs fastapi, uvicorn, starlette, prometheus-client and aiohttp (the clients; no openai
package).

Usage:
    python scripts/bench_server.py --preset 1b --json auto
    python scripts/bench_server.py --preset 8b --requests 1000 --json auto
    JAX_PLATFORMS=cpu python scripts/bench_server.py --preset tiny --requests 16 \
        --max-batch 4 --token-budget 16 --json /tmp/x.json                     # CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxinfer
from jaxinfer.benchmark import ceilings, device_name, record_path, workload_floor, write_record
from jaxinfer.engine_process import EngineSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402 - the sibling script, importable once its folder is on the path

REPO = Path(__file__).resolve().parents[1]


def numbered_tokenizer(cfg: jaxinfer.LlamaConfig) -> Any:
    """A ``jaxinfer.tokenizer.Tokenizer`` spelling token ``i`` as ``<i>`` (space-joined)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from jaxinfer.tokenizer import Tokenizer

    backend = HFTokenizer(models.WordLevel({f"<{i}>": i for i in range(cfg.vocab_size)},
                                           unk_token="<0>"))
    return Tokenizer(backend, bos_id=cfg.bos_token_id, eos_ids=cfg.eos_token_ids)


@dataclasses.dataclass(frozen=True)
class BenchSpec(EngineSpec):
    """The benchmark's engine, for both runs: ``--model`` loaded, or the preset's random
    weights with a numbered tokenizer; sized by the flags (``bench_engine.make_engine``) and
    warmed up (every greedy step shape compiled) before it serves."""

    args: argparse.Namespace | None = None

    def load(self) -> jaxinfer.Model:
        """The model to serve."""
        args = self.args
        if args.model:
            return jaxinfer.load_model(args.model, backend=args.backend)
        cfg = bench_engine.PRESETS[args.preset]
        model = bench_engine.build_model(cfg, args.preset, args.layout, args.backend, args.seed)
        model.tokenizer = numbered_tokenizer(cfg)
        return model

    def build(self) -> jaxinfer.Engine:
        """The sized, warmed-up engine."""
        engine = bench_engine.make_engine(self.load(), self.args)
        bench_engine.warmup(engine)
        return engine


def run_offline(spec: BenchSpec) -> dict[str, Any]:
    """In a process of its own: the workload straight through the engine; the device, the
    workload and the run's figures."""
    args = spec.args
    t0 = time.perf_counter()
    engine = spec.build()
    startup_s = time.perf_counter() - t0
    model, cfg = engine.model, engine.model.config
    kind = jax.devices()[0].device_kind
    flops, bandwidth, note = ceilings(kind, args.matmul_tflops, args.read_tbps)
    w = bench_engine.make_workload(cfg, args.requests, (args.prompt_min, args.prompt_max),
                                   (args.output_min, args.output_max), 0.0, args.seed)
    floor = workload_floor(cfg, w.prompt_lens, w.output_lens, engine.max_batch, flops,
                           bandwidth, jnp.dtype(model.dtype).itemsize)
    offline = dict(startup_s=startup_s, **bench_engine.run_workload(engine, w))
    return dict(device=kind, device_name=device_name(), jax=jax.__version__,
                layout=model.layout, dtype=str(jnp.dtype(model.dtype)),
                ceilings=dict(matmul_flops_per_s=flops, read_bytes_per_s=bandwidth,
                              source=note),
                slots=engine.max_batch, max_tokens_per_step=engine.max_tokens,
                workload=w, floor=floor, offline=offline)


class ServerThread:
    """uvicorn serving an app on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any, http: str = "auto", loop: str = "auto") -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", backlog=4096,
                                                    http=http, loop=loop))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn")

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start; see its log above")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join()


def run_served(spec: EngineSpec, args: argparse.Namespace, w: bench_engine.Workload,
               http: str = "auto", loop: str = "auto") -> dict[str, Any]:
    """The workload through the server (its engine process fresh and warmed up; uvicorn
    with the ``http`` and ``loop`` implementations); the run's figures. Engine counters come
    from the engine process with each step's message. ``http_process_cpu_s`` and
    ``clients_cpu_s``: CPU time of this process (the HTTP process) and of the client
    processes (summed) during the run; either near ``elapsed_s`` times the processes means
    that side is the bottleneck."""
    from jaxinfer.server import create_app

    t0 = time.perf_counter()
    app = create_app(spec, name="bench", max_queue=len(w.prompts))
    startup_s = time.perf_counter() - t0
    engine = app.state.server.engine
    before = engine.stats
    with ServerThread(app, http, loop) as srv:
        cpu0 = time.process_time()
        clients = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("http_clients.py")), srv.url, "bench",
             str(args.clients), str(args.client_processes)],
            input=json.dumps({"prompts": w.prompts, "output_lens": w.output_lens}),
            capture_output=True, text=True, check=False)
        http_cpu_s = time.process_time() - cpu0
    if clients.returncode != 0:
        raise RuntimeError(f"the HTTP clients failed:\n{clients.stderr}")
    result = json.loads(clients.stdout)
    per, elapsed = result["requests"], result["elapsed_s"]
    if any(r["tokens"] > n for r, n in zip(per, w.output_lens, strict=True)):
        raise RuntimeError("a request got more tokens than its max_tokens: the clients' "
                           "results are not in workload order")
    s = engine.stats  # after the engine process stopped: its last counters
    tokens = sum(r["tokens"] for r in per)
    return dict(
        startup_s=startup_s, clients=args.clients or len(w.prompts),
        client_processes=result["processes"], elapsed_s=elapsed,
        output_tokens=tokens, planned_output_tokens=sum(w.output_lens),
        output_tok_per_s=tokens / elapsed, req_per_s=len(per) / elapsed,
        http_process_cpu_s=http_cpu_s, clients_cpu_s=result["cpu_s"],
        chunks=sum(r["chunks"] for r in per),
        ttft_ms=bench_engine.percentiles_ms([r["ttft_s"] for r in per]),
        tpot_ms=bench_engine.percentiles_ms([r["tpot_s"] for r in per
                                             if r["tpot_s"] is not None]),
        engine_generated_tokens=s.generated_tokens - before.generated_tokens,
        steps=s.steps - before.steps, decode_calls=s.decode_calls - before.decode_calls,
        step_s=s.step_seconds - before.step_seconds,
        device_s=s.device_seconds - before.device_seconds,
        preemptions=s.num_preemptions - before.num_preemptions,
        programs_compiled_in_run=s.num_programs - before.num_programs)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The served workload's flags: requests, clients and their processes, lengths, seed."""
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=0,
                    help="concurrent HTTP clients; 0 (default) = one per request, all at once")
    ap.add_argument("--client-processes", type=int, default=4,
                    help="processes the HTTP clients are spread over (default 4: one Python "
                         "process of aiohttp clients takes ~0.5 s to open 1,000 streams)")
    for name in ("prompt-min", "prompt-max", "output-min", "output-max"):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help="default: bench_engine's for the preset")
    ap.add_argument("--seed", type=int, default=0)


def finish_workload_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the unset lengths with ``bench_engine``'s for ``args.preset``; reject bad client
    counts (one line, through ``ap.error``)."""
    for name, value in zip(("prompt_min", "prompt_max", "output_min", "output_max"),
                           bench_engine.DEFAULT_LENGTHS[args.preset], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.clients < 0 or args.client_processes < 1:
        ap.error("--clients must be >= 0 and --client-processes >= 1")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """``bench_engine``'s flags (one offline rate) plus ``--model`` and ``--clients``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(bench_engine.PRESETS), default="tiny")
    ap.add_argument("--model", default=None,
                    help="a model folder or name (load_model) instead of a preset's random "
                         "weights; its config sets the workload's vocabulary")
    add_workload_args(ap)
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--backend", default="auto", choices=("auto", "pallas", "reference"))
    ap.add_argument("--max-batch", type=int, default=None, help="engine slots")
    ap.add_argument("--token-budget", type=int, default=None, help="max_tokens_per_step")
    ap.add_argument("--kv-bytes", type=float, default=None)
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--decode-call-seconds", type=float, default=None,
                    help="device time a decode call aims at (Engine(decode_call_seconds=))")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--schedule", default=None, choices=("fcfs", "longest_first"))
    ap.add_argument("--matmul-tflops", type=float, default=None)
    ap.add_argument("--read-tbps", type=float, default=None)
    ap.add_argument("--compile-cache", default=None,
                    help="JAX persistent compilation cache folder")
    ap.add_argument("--dp", type=int, default=1,
                    help="serve from this many engine processes, one per GPU "
                         "(``--replicas processes``); the offline run stays on one GPU")
    ap.add_argument("--json", default=None,
                    help="write the record here; 'auto' = bench/results/<device>/"
                         "server_issue14/server_<preset>_<date>.json")
    args = ap.parse_args(argv)
    if args.dp < 1:
        ap.error(f"--dp={args.dp} must be >= 1")
    if args.kv_bytes is None:
        args.kv_bytes = bench_engine.DEFAULT_KV_BYTES.get(args.preset)
    finish_workload_args(ap, args)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both; return the JSON record (also written to ``--json``)."""
    args = parse_args(argv)
    if args.compile_cache:  # the engine processes inherit it
        os.environ["JAX_COMPILATION_CACHE_DIR"] = args.compile_cache
    label = args.preset if args.model is None else Path(args.model).name
    spec = BenchSpec(model=label, args=args)
    now = datetime.datetime.now(datetime.UTC)
    print(f"== {label}: {args.requests} requests, prompts {args.prompt_min}-{args.prompt_max}, "
          f"outputs {args.output_min}-{args.output_max}", flush=True)
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        run = pool.submit(run_offline, spec).result()
    offline, floor, w = run["offline"], run["floor"], run["workload"]
    print(f"-- offline engine ({run['layout']} layout, {run['device']}): "
          f"{offline['output_tokens']} tokens in {offline['elapsed_s']:.2f} s"
          f" = {offline['output_tok_per_s']:.0f} output tok/s "
          f"({offline['output_tok_per_s'] / floor['floor_output_tok_per_s']:.1%} of the floor "
          f"{floor['floor_output_tok_per_s']:.4g} tok/s)", flush=True)

    served = run_served(dataclasses.replace(spec, dp=args.dp, replica_processes=args.dp > 1),
                        args, w)
    ratio = served["output_tok_per_s"] / offline["output_tok_per_s"]
    # Each replica has a whole floor.
    served_share = served["output_tok_per_s"] / (floor["floor_output_tok_per_s"] * args.dp)
    print(f"-- served over HTTP ({served['clients']} streaming clients in "
          f"{served['client_processes']} processes, {args.dp} engine process(es)): "
          f"{served['output_tokens']} tokens in {served['elapsed_s']:.2f} s = "
          f"{served['output_tok_per_s']:.0f} output tok/s = {ratio:.1%} of offline on one GPU, "
          f"{served_share:.1%} of the floor")
    print(f"   client TTFT ms {served['ttft_ms']}  TPOT ms {served['tpot_ms']}", flush=True)
    record = dict(
        date=now.isoformat(timespec="seconds"), device=run["device"], jax=run["jax"],
        command=" ".join(["python", *(sys.argv if argv is None
                                      else ["scripts/bench_server.py", *argv])]),
        model=label, layout=run["layout"], dtype=run["dtype"], args=vars(args),
        ceilings=run["ceilings"], floor=floor, slots=run["slots"],
        max_tokens_per_step=run["max_tokens_per_step"], offline=offline, served=served,
        served_over_offline=ratio, dp=args.dp,
        served_fraction_of_floor=served_share)
    path = record_path(args.json, REPO / "bench" / "results" / run["device_name"]
                       / "server_issue14" / f"server_{label}_{now.strftime('%Y%m%d')}.json")
    if path is not None:
        write_record(path, record)
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
