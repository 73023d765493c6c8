"""Speculative decoding benchmark: plain vs n-gram speculation, one request at a time.

Each prompt asks the model to repeat or summarise a passage it is given, the workload where
prompt lookup pays. For every prompt the same greedy request runs without and with
``Speculative(method="ngram")``; the script checks that the tokens are identical and reports
decode tok/s (1 / time per output token), the speedup, the acceptance rate and the mean
tokens gained per verify step. The record goes to ``--json`` (``auto``:
``bench/results/<device>/spec_issue13/ngram_<model>_<date>.json``).

    python scripts/bench_speculative.py --model smollm2-135m-instruct --json auto
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jaxinfer  # noqa: E402
from jaxinfer.benchmark import device_name, record_path, write_record  # noqa: E402

PASSAGES = [
    "The lighthouse stood at the end of a long stone pier. Every evening the keeper climbed "
    "the narrow stairs, trimmed the wick, polished the great lens and watched the beam sweep "
    "across the water. Ships far out at sea saw the light and knew where the rocks were.",
    "To make bread, mix flour, water, salt and yeast into a rough dough. Knead it for ten "
    "minutes until it is smooth, then leave it covered in a warm place for an hour. Shape the "
    "loaf, let it rise again, and bake it in a hot oven until the crust is brown.",
    "Honey bees live in colonies of many thousands. The queen lays the eggs, the workers "
    "gather nectar and pollen, build the wax comb and care for the young, and the drones mate "
    "with new queens. In winter the bees cluster together to keep the hive warm.",
    "The river rises in the hills, runs through farmland and three small towns, and reaches "
    "the sea at a wide estuary. In spring it floods the low meadows; in summer children swim "
    "in its pools; in autumn the salmon swim upstream to lay their eggs.",
]
TASKS = ["Repeat the following passage word for word:\n\n{}",
         "Summarise the following passage in two sentences, using its own words:\n\n{}"]


def run_one(engine: jaxinfer.Engine, prompt: str, max_new_tokens: int,
            spec: jaxinfer.Speculative | None) -> dict[str, Any]:
    """One greedy chat request alone on ``engine``: its tokens and timings."""
    t0 = time.perf_counter()
    rid = engine.submit(prompt, chat=True, max_new_tokens=max_new_tokens, speculative=spec)
    engine.run_until_done()
    wall = time.perf_counter() - t0
    m = engine.request_metrics(rid)
    r = engine.result(rid)
    if r.error is not None:
        raise RuntimeError(f"benchmark request failed: {r.error}")
    return dict(tokens=r.token_ids, wall_s=wall,
                decode_tok_per_s=1 / m.time_per_output_token if m.time_per_output_token else None,
                draft_tokens=r.draft_tokens, accepted_tokens=r.accepted_tokens)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the JSON record (also written to ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=len(PASSAGES) * len(TASKS),
                    help="how many of the passage x task prompts to run")
    ap.add_argument("--json", default=None, help="record path; 'auto' = bench/results/...")
    args = ap.parse_args(argv)
    model = jaxinfer.load_model(args.model, dtype=args.dtype)
    engine = jaxinfer.Engine(model, verbose=False)
    prompts = [t.format(p) for t in TASKS for p in PASSAGES][: args.prompts]
    specs = {"ngram": jaxinfer.Speculative(num_tokens=args.num_speculative_tokens),
             "ngram_always": jaxinfer.Speculative(num_tokens=args.num_speculative_tokens,
                                                  adaptive=False)}
    engine.warmup(speculative=specs["ngram"])
    run_one(engine, prompts[0], 8, None)  # first-call costs outside the timed runs
    rows = []
    for i, prompt in enumerate(prompts):
        plain = run_one(engine, prompt, args.max_new_tokens, None)
        row: dict[str, Any] = dict(prompt=i, tokens=len(plain["tokens"]),
                                   plain_tok_per_s=plain["decode_tok_per_s"])
        for name, spec in specs.items():
            r = run_one(engine, prompt, args.max_new_tokens, spec)
            row[name] = dict(identical=r["tokens"] == plain["tokens"],
                             tok_per_s=r["decode_tok_per_s"],
                             speedup=(r["decode_tok_per_s"] / plain["decode_tok_per_s"]
                                      if r["decode_tok_per_s"] and plain["decode_tok_per_s"]
                                      else None),
                             draft_tokens=r["draft_tokens"], accepted_tokens=r["accepted_tokens"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for name in specs:
        speedups = [r[name]["speedup"] for r in rows if r[name]["speedup"]]
        drafted = sum(r[name]["draft_tokens"] for r in rows)
        summary[name] = dict(
            all_identical=all(r[name]["identical"] for r in rows),
            median_speedup=float(np.median(speedups)) if speedups else None,
            acceptance_rate=(sum(r[name]["accepted_tokens"] for r in rows) / drafted
                             if drafted else 0.0))
        print(f"{name}: median speedup {summary[name]['median_speedup']}, acceptance "
              f"{summary[name]['acceptance_rate']:.2f}, identical tokens "
              f"{summary[name]['all_identical']}", flush=True)
    stats = engine.stats()
    record = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  device=device_name(), command=" ".join(["python", *(sys.argv if argv is None
                                                                      else [__file__, *argv])]),
                  args=vars(args), rows=rows, summary=summary,
                  engine=dict(verify_steps=stats.verify_steps,
                              mean_accepted_length=stats.mean_accepted_length))
    date = datetime.date.today().strftime("%Y%m%d")
    name = Path(args.model).name.replace("/", "_")
    out = record_path(args.json, REPO / "bench" / "results" / device_name() / "spec_issue13"
                      / f"ngram_{name}_{date}.json")
    if out is not None:
        write_record(out, record)
        print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
