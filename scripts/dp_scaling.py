"""Data-parallel scaling of ``scripts/batch_eval.py``: one replica, N threads, N processes.

Issue 16 asks ``batch_eval --dp N`` for at least 0.95 N times one GPU. This runs the same
``batch_eval`` workload (each run in its own process, the caller's working directory)
``--repeats`` times in each mode, in the order one, threads, processes, one, ...:

- ``one``: one replica (``--tp`` devices, the first ones the caller's ``CUDA_VISIBLE_DEVICES``
  shows: the variable is narrowed to them);
- ``threads``: ``--dp N --replicas threads``, the replicas as threads of one process
  (``DataParallelEngine``);
- ``processes``: ``--dp N --replicas processes`` (``batch_eval``'s default), an engine
  process per replica.

It parses each run's summary line (tokens, wall, tok/s or records/s, the compile/load time,
the share of the device floor), checks that every run wrote the same number of records, counts
the records whose ``token_ids`` equal the first run's (bf16 near-ties may flip with the batch
mix; float32 runs must agree), and prints and records each mode's median throughput and its
ratio to ``one``. The record is rewritten after every run.

    python scripts/dp_scaling.py --dp 4 --json auto -- --model WL --input WL/prompts.jsonl \\
        --max-new-tokens 128 --temperature 0

Arguments after ``--`` go to ``batch_eval.py`` unchanged (not ``--output``, ``--dp``,
``--tp``, ``--replicas`` or ``--no-progress``: this script sets them). ``--json
auto`` writes ``bench/results/<device>/dp_scaling_<time>.json``. A record for bench/NOTES.md,
not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(REPO))

from jaxinfer.benchmark import device_folder, record_path, write_record  # noqa: E402
from jaxinfer.engine_process import cuda_visible_devices  # noqa: E402

MODES = ("one", "threads", "processes")
OWN_FLAGS = ("--output", "--dp", "--tp", "--replicas", "--no-progress")
SUMMARY = re.compile(
    r"requests (?P<requests>\d+) (?P<mode>generated|scored) .*?tokens (?P<tokens>\d+)\s+"
    r"wall (?P<wall>[\d.]+) s\s+throughput (?P<tok_s>[\d.]+) tok/s\s+(?P<req_s>[\d.]+) req/s"
    r".*?\(after (?P<warm>[\d.]+) s")
FLOOR = re.compile(r"reached (?P<share>[\d.e+-]+)% of it")
REPLICAS = re.compile(r"^replicas: (.*)$", re.MULTILINE)


def parse_summary(stdout: str) -> dict[str, float]:
    """The figures of ``batch_eval``'s summary: requests, tokens, wall, tok/s, req/s,
    warm-up seconds, the share of the device floor, and the per-replica line's text (None
    when not printed)."""
    m = SUMMARY.search(stdout)
    if m is None:
        raise ValueError(f"no batch_eval summary line in its output:\n{stdout[-2000:]}")
    f = FLOOR.search(stdout)
    r = REPLICAS.search(stdout)
    return {"requests": int(m["requests"]), "tokens": int(m["tokens"]),
            "wall_s": float(m["wall"]), "tok_per_s": float(m["tok_s"]),
            "req_per_s": float(m["req_s"]), "warm_s": float(m["warm"]),
            "floor_share": None if f is None else float(f["share"]) / 100,
            "replicas": None if r is None else r[1]}


def device_name() -> str:
    """This machine's GPU name from ``nvidia-smi``, or ``"cpu"``: ``benchmark.device_name``
    would start a JAX backend here, taking GPU memory from the runs."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout.split("\n")
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "cpu"


def mode_args(mode: str, dp: int, tp: int) -> tuple[list[str], dict[str, str]]:
    """``batch_eval`` flags and environment of a mode."""
    if mode == "one":
        # The first tp GPUs of those this process may use (as the replica processes count).
        return ["--tp", str(tp)], {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(
            range(tp), os.environ.get("CUDA_VISIBLE_DEVICES"))}
    return ["--dp", str(dp), "--tp", str(tp), "--replicas", mode], {}


def run_once(mode: str, dp: int, tp: int, passthrough: list[str], out: Path
             ) -> dict[str, Any]:
    """One ``batch_eval`` run of a mode: its command, figures and output token ids."""
    flags, env = mode_args(mode, dp, tp)
    cmd = [sys.executable, str(REPO / "scripts" / "batch_eval.py"), *passthrough,
           "--output", str(out), "--no-progress", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env},
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: batch_eval exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    out.unlink()  # the next run of any mode writes afresh (no resume)
    return {"mode": mode, "env": env, "command": " ".join(cmd[1:]),
            "process_s": round(time.perf_counter() - t0, 1), **parse_summary(proc.stdout),
            "token_ids": [r.get("token_ids") for r in rows]}


def summarise(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per mode: the median of ``key`` over its runs and its ratio to ``one``'s median."""
    med = {m: statistics.median(r[key] for r in runs if r["mode"] == m)
           for m in MODES if any(r["mode"] == m for r in runs)}
    base = med.get("one")
    return {m: {"median": v, "vs_one": None if not base else round(v / base, 3)}
            for m, v in med.items()}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, required=True, help="replicas of the threads/processes modes")
    p.add_argument("--tp", type=int, default=1, help="devices per replica")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + str(MODES))
    p.add_argument("--json", default=None, help="record path, or 'auto'")
    args = p.parse_args(argv[:split])
    passthrough = argv[split + 1:]
    modes = args.modes.split(",")
    if args.dp < 2 or args.tp < 1 or args.repeats < 1 or not set(modes) <= set(MODES):
        p.error(f"need --dp >= 2, --tp >= 1, --repeats >= 1 and --modes among {MODES}")
    if own := [a for a in passthrough  # argparse takes a flag's unique prefix too
               if len(a.split("=")[0]) > 2 and any(f.startswith(a.split("=")[0])
                                                   for f in OWN_FLAGS)]:
        p.error(f"{own} are set by this script; drop them after --")
    device = device_name()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    folder = device_folder(device, "cpu" if device == "cpu" else "gpu")
    path = record_path(args.json, REPO / "bench" / "results" / folder / f"dp_scaling_{stamp}.json")
    rec: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device, "command": "python " + " ".join(sys.argv), "dp": args.dp,
        "tp": args.tp, "runs": []}
    rate = "req_per_s" if "--score" in passthrough else "tok_per_s"
    first_ids = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in modes:
                run = run_once(mode, args.dp, args.tp, passthrough, Path(tmp) / "out.jsonl")
                ids = run.pop("token_ids")
                first_ids = ids if first_ids is None else first_ids
                if len(ids) != len(first_ids):
                    raise RuntimeError(f"{mode} wrote {len(ids)} records, the first run "
                                       f"{len(first_ids)}")
                run["identical_records"] = sum(a == b for a, b in zip(ids, first_ids,
                                                                      strict=True))
                rec["runs"].append({"repeat": r, **run})
                rec["summary"] = {"measure": rate, **summarise(rec["runs"], rate)}
                print(f"{mode:9s} repeat {r}: {run[rate]:,.1f} {rate}  wall {run['wall_s']} s "
                      f"(after {run['warm_s']} s warm-up)  floor share {run['floor_share']}  "
                      f"identical records {run['identical_records']}/{len(ids)}", flush=True)
                write_record(path, rec)
    for mode, s in rec["summary"].items():
        if mode != "measure":
            print(f"{mode:9s} median {s['median']:,.1f}  x one: {s['vs_one']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
