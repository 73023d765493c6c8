"""Serving benchmark: the continuous-batching Engine against static-batch ``generate``.

A synthetic workload (fixed seed): prompt and output lengths drawn log-uniformly from the
given ranges, arrivals either all at once (``--rate 0``, offline) or Poisson at ``--rate``
requests/s. Random weights, greedy: a request may end early on the eos id, but both systems
produce the same tokens, so they do the same work.

Reports output tokens/s, requests/s, TTFT and TPOT p50/p99, KV utilisation (tokens held /
tokens allocatable, averaged over steps) and KV waste (allocated-but-unused slots) for both.

    python scripts/bench_engine.py --preset 8b --requests 1000 --rate 0     # H100, offline
    python scripts/bench_engine.py --preset 8b --requests 1000 --rate 20    # Poisson arrivals
    python scripts/bench_engine.py --preset 1b --requests 256 --rate 0,10 --json out.json
    python scripts/bench_engine.py --preset tiny --requests 64              # CPU smoke run

Several comma-separated rates run in one process (the step program and the static buckets
compile once); every rate uses the same prompts and output lengths, only arrivals differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.generate import Model
from jaxinfer.model import init_params

PRESETS = {
    "8b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                               num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                               rope_theta=500000.0, max_position_embeddings=8192,
                               eos_token_ids=(128001,)),
    # Llama-3.2-1B shapes (tied embeddings).
    "1b": jaxinfer.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                               rope_theta=500000.0, max_position_embeddings=8192,
                               tie_word_embeddings=True, eos_token_ids=(128001,)),
    "tiny": jaxinfer.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=512),
}


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]
    arrivals: list[float]  # seconds after start


def make_workload(cfg: jaxinfer.LlamaConfig, n: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], rate: float, seed: int) -> Workload:
    """Log-uniform lengths (many short, some long, like chat traffic), Poisson arrivals."""
    rng = np.random.default_rng(seed)

    def lengths(lo: int, hi: int) -> list[int]:
        return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int).clip(lo, hi).tolist()

    eos = set(cfg.eos_token_ids)
    vocab = [t for t in range(3, min(cfg.vocab_size, 30000)) if t not in eos]
    prompts = [rng.choice(vocab, size=p).tolist() for p in lengths(*prompt_range)]
    outputs = lengths(*output_range)  # before the arrivals: the same for every rate
    arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist() if rate > 0 else [0.0] * n
    return Workload(prompts, outputs, arrivals)


def percentiles(xs: list[float]) -> str:
    a = np.asarray(xs) * 1e3
    return f"p50 {np.percentile(a, 50):8.1f} ms  p99 {np.percentile(a, 99):8.1f} ms"


def run_engine(model: Model, w: Workload, args: argparse.Namespace) -> dict:
    engine = jaxinfer.Engine(model, max_batch=args.max_batch, kv_cache_bytes=args.kv_bytes,
                             page_size=args.page_size, max_tokens_per_step=args.token_budget,
                             max_seq_len=args.prompt_max + args.output_max)
    # Warm-up: compile the one step program outside the measurement.
    engine.submit(w.prompts[0][:8], max_new_tokens=2)
    engine.run_until_done()
    util, waste = [], []
    ids: list[int] = []
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(w.prompts) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(w.prompts) and w.arrivals[nxt] <= now:
            ids.append(engine.submit(w.prompts[nxt], max_new_tokens=w.outputs[nxt]))
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, w.arrivals[nxt] - now)))
            continue
        engine.step()
        s = engine.stats()
        allocated = s.pages_used * args.page_size
        util.append(s.tokens_held / s.tokens_capacity)
        if allocated:
            waste.append(max(0.0, 1 - s.tokens_held / allocated))
    elapsed = time.perf_counter() - t0
    metrics = [engine.request_metrics(i) for i in ids]
    outs = [engine.result(i) for i in ids]
    s = engine.stats()
    return dict(
        system="engine", elapsed=elapsed, tokens=sum(len(o.token_ids) for o in outs),
        ttft=[m.time_to_first_token for m in metrics],
        tpot=[m.time_per_output_token for m in metrics if m.time_per_output_token],
        kv_util=float(np.mean(util)), kv_waste=float(np.mean(waste)),
        preemptions=s.num_preemptions, compilations=s.num_compilations,
        hit_rate=s.prefix_cache_hit_rate, kv_pages_total=s.pages_total,
        kv_peak_pages_used=s.peak_pages_used,
        kv_peak_tokens_allocated=s.peak_pages_used * args.page_size,
        kv_tokens_capacity=s.tokens_capacity)


def run_static(model: Model, w: Workload, args: argparse.Namespace) -> dict:
    """Static batches of ``max_batch`` in arrival order; a batch starts when its last request
    has arrived and the previous batch is done (what ``generate`` does per call)."""
    b = args.max_batch
    jaxinfer.generate(model, [w.prompts[0][:8]], max_new_tokens=2)
    ttft, tpot, waste, slot_counts = [], [], [], []
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(w.prompts), b):
        idx = range(start, min(start + b, len(w.prompts)))
        ready = max(w.arrivals[i] for i in idx)
        wait = ready - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        began = time.perf_counter() - t0
        outs = jaxinfer.generate(model, [w.prompts[i] for i in idx], sampling=[
            jaxinfer.SamplingParams(max_new_tokens=w.outputs[i]) for i in idx])
        for i, o in zip(idx, outs, strict=True):
            ttft.append(began - w.arrivals[i] + o.time_to_first_token)
            if len(o.token_ids) > 1:
                tpot.append(o.time_per_output_token)
            tokens += len(o.token_ids)
        # The static cache reserves batch x bucketed (prompt + max_new) slots for the whole
        # batch; at best (its last step) it holds each sequence's prompt + output.
        need = max(len(w.prompts[i]) + w.outputs[i] for i in idx)
        slots = (1 << (len(idx) - 1).bit_length()) * max(64, 1 << (need - 1).bit_length())
        held = sum(len(w.prompts[i]) + w.outputs[i] for i in idx)
        waste.append(1 - held / slots)
        slot_counts.append(slots)
    return dict(system="static generate", elapsed=time.perf_counter() - t0, tokens=tokens,
                ttft=ttft, tpot=tpot, kv_util=float("nan"), kv_waste=float(np.mean(waste)),
                kv_peak_tokens_allocated=max(slot_counts))


def report(r: dict, n: int) -> None:
    print(f"\n{r['system']}: {r['elapsed']:.1f} s, {r['tokens'] / r['elapsed']:.0f} output "
          f"tok/s, {n / r['elapsed']:.2f} req/s")
    print(f"  TTFT {percentiles(r['ttft'])}   TPOT {percentiles(r['tpot'])}")
    print(f"  KV utilisation {r['kv_util']:.1%}, KV waste (allocated, unused) "
          f"{r['kv_waste']:.1%}")
    extra = {k: r[k] for k in ("preemptions", "compilations", "hit_rate", "kv_pages_total",
                                "kv_peak_pages_used", "kv_peak_tokens_allocated") if k in r}
    if extra:
        print(f"  {json.dumps(extra)}")


def summary(r: dict, n: int) -> dict:
    """JSON-ready figures of one run (percentiles in ms instead of the raw lists)."""
    out = {k: v for k, v in r.items() if k not in ("ttft", "tpot")}
    out.update(output_tok_per_s=r["tokens"] / r["elapsed"], req_per_s=n / r["elapsed"])
    for name in ("ttft", "tpot"):
        a = np.asarray(r[name]) * 1e3
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(a, q)) if a.size else None
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", default="0", help="requests/s; 0 = all at once; a comma-"
                    "separated list runs each in turn (same lengths, compiled once)")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=1024)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--kv-bytes", type=float, default=None, help="default: 90%% of free memory")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--static-passes", type=int, default=2,
                    help="time the last pass: the first compiles every shape bucket it meets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here (after each rate)")
    args = ap.parse_args()
    if args.preset == "tiny":  # CPU smoke run: small everything unless overridden
        args.prompt_max, args.prompt_min = min(args.prompt_max, 64), min(args.prompt_min, 4)
        args.output_max, args.output_min = min(args.output_max, 32), min(args.output_min, 4)
        args.kv_bytes = args.kv_bytes or 2**22
        args.max_batch, args.token_budget = min(args.max_batch, 16), min(args.token_budget, 64)
    if args.kv_bytes is not None:
        args.kv_bytes = int(args.kv_bytes)
    cfg = PRESETS[args.preset]
    dtype = jnp.float32 if args.preset == "tiny" else jnp.bfloat16
    params = init_params(cfg, jax.random.PRNGKey(0), dtype)
    model = Model(config=cfg, params=params, tokenizer=None, dtype=dtype,
                  backend=args.backend, max_batch=args.max_batch)
    record: dict = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind, jax=jax.__version__,
        command="python " + " ".join(sys.argv), preset=args.preset, dtype=str(dtype.dtype),
        args={k: v for k, v in vars(args).items() if k != "json"}, runs=[])
    static_passes = args.static_passes
    for rate in (float(x) for x in args.rate.split(",")):
        w = make_workload(cfg, args.requests, (args.prompt_min, args.prompt_max),
                          (args.output_min, args.output_max), rate, args.seed)
        print(f"\n== {args.preset}: {args.requests} requests, prompts {args.prompt_min}-"
              f"{args.prompt_max}, outputs {args.output_min}-{args.output_max}, rate "
              f"{rate or 'offline'}, {jax.devices()[0].device_kind}", flush=True)
        eng = run_engine(model, w, args)
        report(eng, args.requests)
        run = dict(rate=rate, engine=summary(eng, args.requests))
        if not args.skip_static:
            for _ in range(static_passes):
                static = run_static(model, w, args)
            static_passes = 1  # the same buckets are compiled now
            report(static, args.requests)
            run["static"] = summary(static, args.requests)
        record["runs"].append(run)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
