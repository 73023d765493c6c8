"""``scripts/run_tests.py``: the suite passes over a crashed xdist worker only when the
crashed tests pass when re-run in a fresh process, and never over a real failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import run_tests  # noqa: E402

CRASHED = """....Fatal Python error: Segmentation fault
[gw1] node down: Not properly terminated
F
worker 'gw1' crashed while running 'tests/test_soak.py::test_soak_1000_random_requests'
FAILED tests/test_soak.py::test_soak_1000_random_requests - worker 'gw1' cras...
1 failed, 622 passed in 460.16s (0:07:40)
"""
REAL_AND_CRASHED = CRASHED.replace("1 failed, 622", "2 failed, 621").replace(
    "FAILED tests/test_soak",
    "FAILED tests/test_a.py::test_b - assert 1 == 2\nFAILED tests/test_soak")


def test_parses_crashed_workers_and_the_summary():
    assert run_tests.crashed_tests(CRASHED + CRASHED) == [
        "tests/test_soak.py::test_soak_1000_random_requests"]
    assert run_tests.failures(CRASHED) == 1
    assert run_tests.failures("=== 2 failed, 5 passed, 1 error, 3 warnings in 9.10s ===") == 3
    assert run_tests.failures("=== 7 passed in 1.00s ===") == 0
    assert run_tests.failures("no summary: the run was killed") is None


@pytest.mark.parametrize("first,rerun_status,want,reruns", [
    ((1, CRASHED), 0, 0, 1),            # crash only, the re-run passes: the suite passes
    ((1, CRASHED), 1, 1, 1),            # the crashed test fails alone too: the suite fails
    ((1, REAL_AND_CRASHED), 0, 1, 0),   # a real failure beside the crash: no re-run
    ((0, "5 passed in 1.0s"), 0, 0, 0),
    ((2, "Interrupted: 1 error during collection"), 0, 2, 0),
])
def test_reruns_only_crashed_workers_tests(first, rerun_status, want, reruns):
    calls = []

    def fake_run(cmd):
        calls.append(list(cmd))
        return first if len(calls) == 1 else (rerun_status, "")

    assert run_tests.main(["-q", "-n", "2", "tests"], run=fake_run) == want
    assert calls[0][1:] == ["-m", "pytest", "-q", "-n", "2", "tests"]
    assert len(calls) == 1 + reruns
    if reruns:  # a fresh process, without xdist, on exactly the crashed test
        assert calls[1][1:] == ["-m", "pytest", "-q",
                                "tests/test_soak.py::test_soak_1000_random_requests"]
