"""The test suite as ``make test`` runs it: pytest with the given arguments, then one re-run,
each in a fresh process, of the tests whose pytest-xdist worker crashed under them.

Why: a long-lived xdist worker has died with a segmentation fault inside jaxlib's
``deserialize_executable`` while it read a program from the persistent compilation cache,
in a different test each time and in about one clean-clone run in four (bench/NOTES.md,
twenty-sixth and twenty-ninth sessions). xdist reports the test that worker was running as
failed ("worker 'gw1' crashed while running '...'") and gives the worker's other files to
the other worker. A test that fails for its own reasons fails again in a fresh process; one
whose worker died under it passes there. So the run passes when every failure pytest
reported is such a crash and each crashed test passes when run again alone. Both runs print
everything; the re-run is announced in one line.

Usage: python scripts/run_tests.py PYTEST_ARGS...
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Sequence

CRASH = re.compile(r"worker '(gw\d+)' crashed while running '([^']+)'")
# pytest's last line, e.g. "1 failed, 622 passed in 460.16s (0:07:40)" (with -q) or the same
# between "=" signs.
SUMMARY = re.compile(r"\b(\d+ (?:failed|passed|errors?|skipped)\b.*) in [\d.]+s")


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


def run_streamed(cmd: Sequence[str]) -> tuple[int, str]:
    """Run ``cmd``, echoing its output as it comes; returns its exit status and output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


def main(argv: Sequence[str],
         run: Callable[[Sequence[str]], tuple[int, str]] = run_streamed) -> int:
    """Run pytest with ``argv``; re-run crashed workers' tests as the module docstring says.
    Returns the exit status for the whole suite."""
    pytest = [sys.executable, "-m", "pytest"]
    status, output = run([*pytest, *argv])
    crashed = crashed_tests(output)
    if status != 1 or not crashed or failures(output) != len(crashed):
        return status
    print(f"run_tests: {len(crashed)} failure(s) were crashed xdist workers, not test results; "
          f"re-running in a fresh process: {' '.join(crashed)}", flush=True)
    status, _ = run([*pytest, "-q", *crashed])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
