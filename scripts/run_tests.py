"""The test suite as ``make test`` runs it: pytest with the given arguments, then, if an
xdist worker crashed, a re-run of every test that got no result.

Why: a long-lived xdist worker has died with a segmentation fault inside jaxlib's
``deserialize_executable`` while it read a program from the persistent compilation cache,
in a different test each time and in about one clean-clone run in four (bench/NOTES.md,
twenty-sixth and twenty-ninth sessions). xdist reports the test that worker was running as
failed ("worker 'gw1' crashed while running '...'"). With ``--max-worker-restart=0`` (the
Makefile's: a dead worker must not hang the run) it then shuts the session down, so the
tests still queued for that worker never run, and pytest's summary does not say so (one
clean-clone run: "1 failed, 516 passed" of 642). So the run records each test that
finished (``tests/conftest.py`` appends its node id to ``$JAXINFER_TEST_RESULTS``) and,
when every failure pytest reported is such a crash, runs the same command again with every
finished test deselected: the crashed tests and the never-run ones, in fresh processes. A
test that fails for its own reasons fails again there. Up to ``RERUNS`` times, while each
re-run finishes more tests; every run prints everything, and each re-run is announced in
one line.

Usage: python scripts/run_tests.py PYTEST_ARGS...
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

CRASH = re.compile(r"worker '(gw\d+)' crashed while running '([^']+)'")
# pytest's last line, e.g. "1 failed, 622 passed in 460.16s (0:07:40)" (with -q) or the same
# between "=" signs.
SUMMARY = re.compile(r"\b(\d+ (?:failed|passed|errors?|skipped)\b.*) in [\d.]+s")
RESULTS_ENV = "JAXINFER_TEST_RESULTS"  # the file tests/conftest.py appends finished ids to
RERUNS = 3
Run = Callable[[Sequence[str], Mapping[str, str]], tuple[int, str]]


def crashed_tests(output: str) -> list[str]:
    """Node ids of the tests whose xdist worker crashed, in order, each once."""
    return list(dict.fromkeys(m.group(2) for m in CRASH.finditer(output)))


def failures(output: str) -> int | None:
    """Failed tests plus errors in pytest's summary line (the last one in ``output``), or
    None when there is no summary line."""
    summaries = SUMMARY.findall(output)
    if not summaries:
        return None
    counts = dict((kind.rstrip("s"), int(n)) for n, kind in
                  re.findall(r"(\d+) (failed|errors?)", summaries[-1]))
    return counts.get("failed", 0) + counts.get("error", 0)


def run_streamed(cmd: Sequence[str], env: Mapping[str, str]) -> tuple[int, str]:
    """Run ``cmd`` in ``env``, echoing its output as it comes; returns its exit status and
    output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


def main(argv: Sequence[str], run: Run = run_streamed) -> int:
    """Run pytest with ``argv``; after a crash, re-run what got no result as the module
    docstring says. Returns the exit status for the whole suite."""
    pytest = [sys.executable, "-m", "pytest"]
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "finished.txt"
        results.touch()
        env = {**os.environ, RESULTS_ENV: str(results)}
        status, output = run([*pytest, *argv], env)
        for _ in range(RERUNS):
            crashed = crashed_tests(output)
            if status != 1 or not crashed or failures(output) != len(crashed):
                return status
            finished = list(dict.fromkeys(results.read_text().splitlines()))
            print(f"run_tests: {len(crashed)} failure(s) were crashed xdist workers, not test "
                  f"results; re-running every test without a result ({len(finished)} "
                  f"finished): {' '.join(crashed)} and any never started", flush=True)
            status, output = run([*pytest, *argv,
                                  *(a for t in finished for a in ("--deselect", t))], env)
            if len(set(results.read_text().splitlines())) == len(finished):
                break  # the re-run finished nothing new: report it as it is
        return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
