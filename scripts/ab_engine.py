"""Same-machine A/B of ``scripts/bench_engine.py``: two source trees, runs alternating.

A change's effect on the engine is judged against its base on the same machine: one run's
batch-1 figure moved by ~5% between runs and machines, and a change whose kernels summed to
1.4% less ran 5% slower end to end (bench/NOTES.md r111-r112). This runs
``scripts/bench_engine.py`` with the same arguments from the base tree, then from this one,
``--rounds`` times (alternating spreads the machine's drift, clocks or temperature, over both
sides), each run in its own process with that tree on ``PYTHONPATH``; then it prints and
records each side's figures (batch-1 decode tok/s, output tok/s of each offline or Poisson
run) and the ratio of the new side's median to the base's.

Usage (the base tree made on the host and carried to the device, e.g. in an ignored
``.bench/``)::

    git archive cf3116f | tar -x -C .bench/base
    PYTHONPATH=. python scripts/ab_engine.py --base .bench/base --rounds 2 --json auto -- \\
        --preset 8b --quantize int4-g128 --requests 0 --batch1-tokens 512

Arguments after ``--`` go to ``bench_engine.py`` unchanged (not ``--json``: each run's record
is kept inside this one's). ``--new-env NAME=VALUE`` (repeatable) sets an environment variable
for the new side's runs only, so one tree can be compared with itself under, say, other
``XLA_FLAGS`` (``--base . --new-env XLA_FLAGS=...``). A record for bench/NOTES.md, not a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxinfer.benchmark import device_folder

REPO = Path(__file__).resolve().parent.parent
BENCH = Path("scripts") / "bench_engine.py"


def figures(record: dict[str, Any]) -> dict[str, float]:
    """A ``bench_engine.py`` record's headline figures by name: ``batch1_decode_tok_per_s``
    and, per workload run, ``output_tok_per_s@<rate>`` (rate 0: all requests at once)."""
    out = {f"output_tok_per_s@{run['rate']:g}": run["output_tok_per_s"]
           for run in record.get("runs", [])}
    b1 = record.get("batch1")
    if b1 and b1.get("decode_tok_per_s"):
        out["batch1_decode_tok_per_s"] = b1["decode_tok_per_s"]
    return out


def run_bench(tree: Path, bench_args: list[str], json_path: Path,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``bench_engine.py`` run from ``tree`` (its working directory and ``PYTHONPATH``),
    with ``env`` added to this process's environment, its record read back; a failed run
    stops the comparison with its output's tail."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(BENCH), *bench_args, "--json", str(json_path)],
                          cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"ab_engine: the run in {tree} failed (exit {proc.returncode}):\n"
                         + "\n".join(tail))
    return json.loads(json_path.read_text())


def summarize(base: list[dict[str, float]], new: list[dict[str, float]]
              ) -> dict[str, dict[str, Any]]:
    """Per figure both sides have: every run's value, each side's median, and new / base."""
    names = sorted(set.intersection(*(set(f) for f in base + new)))
    out = {}
    for name in names:
        b, n = [f[name] for f in base], [f[name] for f in new]
        mb, mn = statistics.median(b), statistics.median(n)
        out[name] = dict(base=b, new=n, base_median=mb, new_median=mn,
                         ratio=mn / mb if mb else None)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options before ``--``, and the bench_engine arguments after it (``bench_args``)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the base source tree (git archive of a rev)")
    ap.add_argument("--new", default=str(REPO), help="the new source tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="base-then-new pairs to run")
    ap.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the new side's runs only (repeatable)")
    ap.add_argument("--json", default=None, help="write the record here ('auto': bench/"
                    "results/<device>/ab_engine_<date>.json)")
    args = ap.parse_args(argv[:split])
    args.bench_args = argv[split + 1:]
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be 1 or more")
    bad = [e for e in args.new_env if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        ap.error(f"--new-env {bad[0]!r} must be NAME=VALUE")
    args.new_env = dict(e.split("=", 1) for e in args.new_env)
    for side in ("base", "new"):
        if not (Path(getattr(args, side)) / BENCH).is_file():
            ap.error(f"--{side} {getattr(args, side)} holds no {BENCH}; make it with "
                     "`git archive <rev> | tar -x -C <dir>`")
    if not args.bench_args:
        ap.error("give bench_engine.py's arguments after --")
    if any(a == "--json" or a.startswith("--json=") for a in args.bench_args):
        ap.error("leave --json out of bench_engine.py's arguments: each run's record is kept "
                 "in this script's")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; returns (and with ``--json`` writes) its record."""
    args = parse_args(argv)
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    record: dict[str, Any] = dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), base=str(trees["base"]),
        new=str(trees["new"]), new_env=args.new_env, bench_args=args.bench_args,
        records={"base": [], "new": []})
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for side, tree in trees.items():
                rec = run_bench(tree, args.bench_args, Path(tmp) / f"{side}_{i}.json",
                                args.new_env if side == "new" else None)
                record["records"][side].append(rec)
                print(f"round {i + 1} {side}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in figures(rec).items()), flush=True)
    record["summary"] = summarize(*([figures(r) for r in record["records"][side]]
                                    for side in ("base", "new")))
    for name, s in record["summary"].items():
        runs = {side: ", ".join(f"{v:.1f}" for v in s[side]) for side in ("base", "new")}
        ratio = "no ratio (a zero base)" if s["ratio"] is None else f"{s['ratio']:.3f}x"
        print(f"{name}: base {s['base_median']:.1f} (runs {runs['base']}), new "
              f"{s['new_median']:.1f} (runs {runs['new']}) = {ratio}")
    if args.json:
        kind = record["records"]["new"][0]["device"]
        auto = (REPO / "bench" / "results" / device_folder(kind, kind.lower())
                / f"ab_engine_{time.strftime('%Y%m%d_%H%M%S')}.json")
        path = auto if args.json == "auto" else Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
