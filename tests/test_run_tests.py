"""``scripts/run_tests.py``: the suite passes over a crashed xdist worker only when every
test without a result (the crashed ones and those the shut-down session never ran) passes
when re-run, and never over a real failure."""

from __future__ import annotations

import os
import subprocess
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


FINISHED = ["tests/test_a.py::test_one", "tests/test_a.py::test_two[a b]"]


@pytest.mark.parametrize("runs,want", [
    # crash only; the re-run passes: the suite passes
    ([(1, CRASHED), (0, "3 passed in 1.0s")], 0),
    # the crashed test fails in the re-run too: the suite fails
    ([(1, CRASHED), (1, "1 failed, 2 passed in 1.0s")], 1),
    # the re-run crashes too, then passes: one more re-run
    ([(1, CRASHED), (1, CRASHED), (0, "1 passed in 1.0s")], 0),
    # a real failure beside the crash: no re-run
    ([(1, REAL_AND_CRASHED)], 1),
    ([(0, "5 passed in 1.0s")], 0),
    ([(2, "Interrupted: 1 error during collection")], 2),
])
def test_reruns_every_test_without_a_result_after_a_crash(runs, want):
    """The first run gets ``$JAXINFER_TEST_RESULTS``; after a crash-only failure the same
    command runs again with each test that finished deselected (its node id, spaces and
    all), until a run passes, fails for real, or finishes nothing new."""
    calls = []

    def fake_run(cmd, env):
        calls.append(list(cmd))
        with open(env[run_tests.RESULTS_ENV], "a") as f:  # each run finishes one more test
            f.write(FINISHED[0] + "\n" if len(calls) == 1 else f"tests/test_c.py::t{len(calls)}\n")
            if len(calls) == 1:
                f.write(FINISHED[1] + "\n" + FINISHED[0] + "\n")  # a duplicate id
        return runs[len(calls) - 1]

    assert run_tests.main(["-q", "-n", "2", "tests"], run=fake_run) == want
    assert len(calls) == len(runs)
    base = [sys.executable, "-m", "pytest", "-q", "-n", "2", "tests"]
    assert calls[0] == base
    if len(calls) > 1:
        assert calls[1] == [*base, "--deselect", FINISHED[0], "--deselect", FINISHED[1]]
    if len(calls) > 2:
        assert calls[2] == [*calls[1], "--deselect", "tests/test_c.py::t2"]


def test_stops_when_a_rerun_finishes_nothing_new():
    """A re-run that crashes again without finishing any test is reported as it is."""
    calls = []

    def fake_run(cmd, env):
        calls.append(list(cmd))
        return 1, CRASHED

    assert run_tests.main(["tests"], run=fake_run) == 1
    assert len(calls) == 2


def test_conftest_records_each_finished_test(tmp_path):
    """``tests/conftest.py`` appends the node id of every test that finished, passed, failed
    or skipped, to ``$JAXINFER_TEST_RESULTS`` (a real pytest run in a fresh process)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip(): pass\n"
        "@pytest.mark.parametrize('v', ['a b'])\ndef test_param(v): pass\n")
    (tmp_path / "conftest.py").write_text((root / "tests" / "conftest.py").read_text())
    out = tmp_path / "finished.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_x.py")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, run_tests.RESULTS_ENV: str(out)})
    assert "1 failed, 2 passed, 1 skipped" in proc.stdout, proc.stdout
    assert sorted(out.read_text().splitlines()) == [
        "test_x.py::test_fail", "test_x.py::test_param[a b]", "test_x.py::test_pass",
        "test_x.py::test_skip"]


def test_a_crashed_worker_leaves_no_test_unrun(tmp_path, capsys):
    """End to end on a small suite under ``-n 2 --dist loadfile --max-worker-restart=0`` (the
    Makefile's flags): one test aborts its worker the first time it runs. xdist then shuts the
    session down with other files still queued; the re-run runs those and the crashed test,
    so every test runs and the suite passes."""
    (tmp_path / "conftest.py").write_text(
        (Path(__file__).resolve().parent / "conftest.py").read_text())
    log = tmp_path / "ran.txt"
    marker = tmp_path / "crashed-once"
    (tmp_path / "test_crash.py").write_text(
        "import os, pathlib\n"
        "def test_crash():\n"
        f"    m = pathlib.Path({str(marker)!r})\n"
        "    if not m.exists():\n"
        "        m.touch(); os.abort()\n"
        f"    open({str(log)!r}, 'a').write('test_crash\\n')\n")
    names = [f"test_{f}_{i}" for f in "abcdef" for i in range(3)]
    for f in "abcdef":
        (tmp_path / f"test_{f}.py").write_text("".join(
            f"def test_{f}_{i}():\n    open({str(log)!r}, 'a').write('test_{f}_{i}\\n')\n"
            for i in range(3)))
    env_keep = os.environ.pop("PYTEST_XDIST_WORKER", None)
    try:
        status = run_tests.main(["-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                                 "loadfile", "--max-worker-restart=0", str(tmp_path)])
    finally:
        if env_keep is not None:
            os.environ["PYTEST_XDIST_WORKER"] = env_keep
    out = capsys.readouterr().out
    assert "crashed while running" in out and "re-running every test" in out, out
    assert status == 0, out
    assert sorted(log.read_text().split()) == sorted(names + ["test_crash"])


def test_release_programs_over_a_mapping_budget():
    """``conftest.release_programs_over``: over the budget it drops JAX's caches (a jitted
    function's compiled program goes), under it nothing changes."""
    import jax
    import jax.numpy as jnp
    from conftest import map_count, map_limit, release_programs_over

    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.ones(4))
    assert f._cache_size() == 1
    assert 0 < map_count() < map_limit()
    assert release_programs_over(map_limit()) is False and f._cache_size() == 1
    assert release_programs_over(0) is True and f._cache_size() == 0
