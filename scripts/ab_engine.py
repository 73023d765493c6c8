"""Same-machine A/B of ``scripts/bench_engine.py``: two source trees, runs interleaved.

A change's effect on the engine is judged against its base on the same machine: one run's
batch-1 figure moved by ~5% between runs and machines, and a change whose kernels summed to
1.4% less ran 5% slower end to end (bench/NOTES.md r111-r112). This runs
``scripts/bench_engine.py`` with the same arguments from the base tree and from the new one
(default: this one), ``--rounds`` times, in the order base, new, new, base, base, new, ...
(so a steady drift of the machine, clocks or temperature, weighs on both sides alike), each
run in its own process with that tree first on ``PYTHONPATH`` (a package missing from a
tree would still come from an installed jaxinfer) and the caller's working directory (so
relative paths in the arguments mean the same for both). It prints and records each side's
figures (batch-1 decode tok/s, output tok/s of each offline or Poisson run), their medians
and the new side's median over the base's; the record is rewritten after every run, so a
run that fails or runs out of time keeps the earlier ones.

Usage (the base tree made on the host and carried to the device, e.g. in an ignored
``.bench/``)::

    mkdir -p .bench/base && git archive cf3116f | tar -x -C .bench/base
    PYTHONPATH=. python scripts/ab_engine.py --base .bench/base --rounds 2 --json auto -- \\
        --preset 8b --quantize int4-g128 --requests 0 --batch1-tokens 512

Arguments after ``--`` go to ``bench_engine.py`` unchanged (not ``--json``: each run's record
is kept inside this one's); they must ask for a figure (``--requests`` or
``--batch1-tokens``). ``--new-env NAME=VALUE`` (repeatable) sets an environment variable for
the new side's runs only, so one tree can be compared with itself under, say, other
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

from jaxinfer.benchmark import device_folder, record_path, write_record

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
    """One ``bench_engine.py`` run from ``tree`` (first on ``PYTHONPATH``), with ``env`` added
    to this process's environment, its output shown as it goes and its record read back; a
    failed run, or one that wrote no record, stops the comparison with one line."""
    path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(tree / BENCH), *bench_args, "--json",
                           str(json_path)], env=env)
    if proc.returncode != 0:
        raise SystemExit(f"ab_engine: the run from {tree} failed (exit {proc.returncode}); "
                         "its output is above")
    if not json_path.is_file():
        raise SystemExit(f"ab_engine: the run from {tree} wrote no record; give bench_engine "
                         "--requests > 0 or --batch1-tokens > 0")
    return json.loads(json_path.read_text())


def order(rounds: int, start: str = "base") -> list[str]:
    """The sides' run order: ``start``, the other, then the other, ``start``, and so on
    (ABBA)."""
    pair = ("base", "new") if start == "base" else ("new", "base")
    return [side for i in range(rounds) for side in (pair if i % 2 == 0 else pair[::-1])]


def summarize(base: list[dict[str, float]], new: list[dict[str, float]]
              ) -> dict[str, dict[str, Any]]:
    """Per figure both sides have: every run's value, each side's median, and new / base."""
    names = sorted(set.intersection(*(set(f) for f in base + new)))
    out: dict[str, dict[str, Any]] = {}
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
    ap.add_argument("--rounds", type=int, default=2,
                    help="pairs of runs, one per side (order: base new, new base, ...)")
    ap.add_argument("--start", choices=("base", "new"), default="base",
                    help="the side that runs first (a second call of one round each can "
                         "start with the other side)")
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
    if "PYTHONPATH" in args.new_env:
        ap.error("--new-env cannot set PYTHONPATH: each side's tree is put on it; give the "
                 "new tree with --new")
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
    """Run the comparison; returns (and with ``--json`` writes, after every run) its record."""
    args = parse_args(argv)
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    record: dict[str, Any] = dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), base=str(trees["base"]),
        new=str(trees["new"]), new_env=args.new_env, bench_args=args.bench_args,
        order=order(args.rounds, args.start), records={"base": [], "new": []}, summary={})
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, side in enumerate(record["order"]):
            rec = run_bench(trees[side], args.bench_args, Path(tmp) / f"{i}_{side}.json",
                            args.new_env if side == "new" else None)
            record["records"][side].append(rec)
            print(f"ab_engine run {i + 1} of {len(record['order'])}, {side}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in figures(rec).items()), flush=True)
            if path is None and args.json:
                kind = rec["device"]
                path = record_path(args.json, REPO / "bench" / "results" / device_folder(
                    kind, kind.lower().replace(" ", "_"))
                    / f"ab_engine_{time.strftime('%Y%m%d_%H%M%S')}.json")
            if all(record["records"].values()):
                record["summary"] = summarize(*([figures(r) for r in record["records"][s]]
                                                for s in ("base", "new")))
            write_record(path, record)
    for name, s in record["summary"].items():
        runs = {side: ", ".join(f"{v:.1f}" for v in s[side]) for side in ("base", "new")}
        ratio = "no ratio (a zero base)" if s["ratio"] is None else f"{s['ratio']:.3f}x"
        print(f"{name}: base {s['base_median']:.1f} (runs {runs['base']}), new "
              f"{s['new_median']:.1f} (runs {runs['new']}) = {ratio}")
    if path is not None:
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
