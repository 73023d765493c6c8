"""The benchmark harness end to end on CPU (structure, never timings), and that what it
times is real work: the timed decode and prefill calls produce the greedy tokens an
independent forward pass (``compute_logits``) gives."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import benchmark, runner
from jaxinfer.cli import main
from jaxinfer.config import LlamaConfig
from jaxinfer.generate import compute_logits
from jaxinfer.model import init_params, pool_is_stacked, prepare_params
from jaxinfer.requests import Model

TINY = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture()
def tiny_config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY.to_hf_dict()))
    return path


@pytest.mark.slow
def test_bench_runs_end_to_end(tiny_config_path, tmp_path, capsys):
    out = tmp_path / "res.json"
    hlo_dir = tmp_path / "hlo"
    main(["bench", "--model", str(tiny_config_path), "--impl",
          "reference,reference+fused+unrolled", "--batch", "1", "--context", "8",
          "--prompt-lens", "16", "--decode-steps", "3", "--repeats", "2", "--ceiling-mb", "1",
          "--matmul-n", "64", "--out", str(out), "--hlo-dir", str(hlo_dir)])
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert set(res["ceilings"]) >= {"read_bw", "copy_bw", "matmul_flops"}
    assert [(r["impl"], r["batch"]) for r in res["decode"]] == [
        ("reference", 1), ("reference+fused+unrolled", 1)]
    assert [r["pool"] for r in res["decode"]] == ["stacked", "per_layer"]
    for r in res["decode"]:
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mbu"]
        assert r["bytes_per_step"] > 0 and len(r["call_times_s"]) == 2
    first = res["decode"][0]
    assert first["hlo"]["loops"]  # the decode while loop and the layer scan were found
    assert len(list(hlo_dir.glob("*.hlo.txt"))) == 2
    assert [r["prompt_len"] for r in res["prefill"]] == [16, 16]
    assert all(r["ttft_ms"] > 0 and r["mfu"] > 0 for r in res["prefill"])
    table = capsys.readouterr().out
    assert "ms/step" in table and "TTFT ms" in table


def test_hlo_census_counts_loop_bodies():
    text = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_computation
  %g = bf16[1024,1024]{1,0} copy(f32[4]{0} %f)
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %f)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body, TRIP
  ROOT %o = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop, calls=%fused_computation
}
"""
    trip = 'backend_config={"known_trip_count":{"n":"16"}}'
    c = benchmark.hlo_census(text.replace("TRIP", trip))
    assert c["entry_launches"] == 1
    assert c["loops"]["body"] == {"trip_count": 16, "launches_per_iteration": 2,
                                  "ops": {"fusion": 1, "copy": 1}}
    assert c["largest_in_loops"][0] == {"bytes": 2 * 1024 * 1024, "what": "copy g"}


def _greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, one full forward pass (compute_logits) per token."""
    ids = list(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(compute_logits(model, ids)[-1])))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("fuse,unstack,backend", [
    (False, False, "reference"),  # stacked pool, layer scan
    (True, True, "reference"),  # the fast layout: per-layer pool, unrolled
    (False, False, "pallas"),  # stacked weights, per-layer pool (Pallas interpreter on CPU)
])
def test_timed_decode_produces_the_greedy_tokens(fuse, unstack, backend):
    params = init_params(TINY, jax.random.PRNGKey(0), jnp.float32)
    model = Model(TINY, params, None, dtype=jnp.float32, backend="reference")
    prepared = prepare_params(params, fuse=fuse, unstack=unstack)
    batch, context, steps, ps = 2, 11, 5, 4
    case = benchmark.decode_case(TINY, prepared, backend, batch, context, steps,
                                 jax.random.PRNGKey(5), page_size=ps, dtype=jnp.float32)
    assert case.pool.stacked == pool_is_stacked(prepared, backend)
    leaves = jax.tree.leaves(case.pool)
    assert all(float(jnp.mean(jnp.abs(a))) > 0.1 for a in leaves)  # random, not zeros
    tables = np.asarray(case.inputs.block_tables)
    assert len(set(tables.ravel().tolist())) == tables.size  # distinct pages per row

    # Random K/V decode (what the harness times) runs and stays inside its pages.
    timed = np.asarray(benchmark.run_decode(prepared, TINY, backend, case, jnp.float32))
    assert timed.shape == (steps, batch) and (timed >= 0).all()

    # Replace the random context by a real prompt's K/V (the engine's prefill step), then
    # the same timed call must continue it greedily, twice in a row (identical work).
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, context).astype(np.int32) for _ in range(batch)]
    inp = benchmark.prefill_inputs(prompts, tables, ps)
    case.pool, case.counts, out = runner.mixed_step(
        prepared, case.pool, case.counts, inp, config=TINY, backend=backend, dtype=jnp.float32,
        max_q_len=context, score=False, stochastic=False)
    first = [int(np.argmax(compute_logits(model, p.tolist())[-1])) for p in prompts]
    assert np.asarray(out["tokens"]).tolist() == first  # the prefill step samples greedily
    feed = np.asarray(case.inputs.tokens)
    want = np.array([_greedy(model, [*p.tolist(), int(t)], steps)
                     for p, t in zip(prompts, feed, strict=True)]).T
    for _ in range(2):
        got = np.asarray(benchmark.run_decode(prepared, TINY, backend, case, jnp.float32))
        np.testing.assert_array_equal(got, want)


def test_impl_names():
    assert benchmark.Impl.parse("pallas+fused+unrolled").name == "pallas+fused+unrolled"
    with pytest.raises(ValueError, match="unknown option"):
        benchmark.Impl.parse("pallas+sliced")


def test_idle_before_puts_each_gap_on_the_kernel_after_it():
    """``kernel_gaps``: the idle time before each kernel, from the end of everything that
    started earlier (an overlapped kernel has none, a kernel inside a longer one none);
    ``idle_before`` sums it per name, most idle first, with each name's count."""
    from jaxinfer.benchmark import idle_before, kernel_gaps

    events = [("b", 12, 3.0), ("a", 0, 10.0), ("c", 11, 0.5), ("b", 20, 2.0), ("a", 22, 1.0),
              ("d", 22.5, 0.1), ("e", 23.5, 1.0)]  # out of order on purpose; d inside a
    # e's gap runs from a's end (23), not d's (22.6): the latest end so far counts.
    assert kernel_gaps(events) == [("a", 0.0), ("c", 1.0), ("b", 0.5), ("b", 5.0), ("a", 0.0),
                                   ("d", 0.0), ("e", 0.5)]
    assert idle_before(kernel_gaps(events), 2) == [("b", 5.5, 2), ("c", 1.0, 1)]
    assert kernel_gaps([]) == [] and idle_before([], 3) == []


def test_timeline_split_separates_collectives_and_their_waits():
    """``timeline_split`` per step: span, busy (overlaps once), idle, and the NCCL/all-reduce
    kernels' count, time, mean and the idle just before them, for two steps of a
    tensor-parallel layer (a GEMM, an all-reduce after a wait, a reduction fusion overlapping
    it that is not a collective)."""
    from jaxinfer.benchmark import timeline_split

    step = [("gemm", 0, 10.0), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 14, 6.0),
            ("small_reduce_fusion", 18, 4.0), ("all-reduce-start.1", 30, 2.0)]
    events = step + [(n, s + 40, d) for n, s, d in step]
    got = timeline_split(events, per=2)
    # Busy per step 10 + 8 (14-22) + 2 = 20; idle 4 (before nccl) + 8 (before
    # all-reduce-start) per step and 8 once between the steps: (12 + 8 + 12) / 2 = 16.
    assert got == {"span": 36.0, "busy": 20.0, "idle": 16.0, "collectives": 2.0,
                   "collective_time": 8.0, "collective_mean": 4.0,
                   "idle_before_collectives": 12.0}
    assert timeline_split([], per=3) == {}
    assert timeline_split([("gemm", 0, 5.0)], per=1)["collective_mean"] == 0.0


def test_top_kernels_ranks_names_by_summed_time(tmp_path):
    """``top_kernels`` groups events by name and ranks by total time, not by count or by the
    longest event; ``device_events`` reads a real trace (on CPU it holds no accelerator
    kernels, so none come back)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.benchmark import device_events, top_kernels

    events = [("a", 0, 5.0), ("b", 1, 9.0), ("a", 2, 5.0), ("c", 3, 1.0), ("a", 4, 1.0)]
    assert top_kernels(events, 2) == [("a", [5.0, 5.0, 1.0]), ("b", [9.0])]
    with jax.profiler.trace(str(tmp_path)):
        jnp.ones(8).sum().block_until_ready()
    assert device_events(tmp_path) == []


def test_bench_collectives_checks_and_records_each_variant(tmp_path):
    """``scripts/bench_collectives.py`` on 4 forced CPU devices: every variant (all-reduces
    alone, row-parallel GEMVs with and without them) matches its single-device reference
    before it is timed, and the record holds each one's time and the all-reduce's share."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    rec = tmp_path / "rec.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(repo))
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "bench_collectives.py"), "--hidden", "64",
         "--rows", "2,3", "--iters", "4", "--repeats", "1", "--cold-mib", "1", "--json",
         str(rec)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = json.loads(rec.read_text())["items"]
    assert [(i["variant"], i["rows"]) for i in items] == [
        (v, r) for r in (2, 3) for v in ("psum", "gemv", "gemv+psum", "added by the all-reduce")]
    checked = [i for i in items if "check_rel_err" in i]
    assert len(checked) == 6 and all(i["check_rel_err"] < 0.05 for i in checked)
    # 2 (tp - 1) / tp of the rows x 64 bf16 values leave each device per all-reduce.
    assert [i["allreduce_bytes_per_device"] for i in checked] == [384, 0, 384, 576, 0, 576]
    for r in (2, 3):
        by = {i["variant"]: i["us_per_step"] for i in items if i["rows"] == r}
        assert by["added by the all-reduce"] == pytest.approx(by["gemv+psum"] - by["gemv"],
                                                              abs=1e-3)


@pytest.mark.slow
def test_tp_scaling_records_each_case(tmp_path):
    """``scripts/tp_scaling.py`` run as a file (no ``PYTHONPATH``) on 2 forced CPU devices:
    the read test, a tiny model split over both devices (each holds about half the
    weights), its decode of exactly ``--new`` tokens per row, and the profile's record (on
    CPU the trace holds no kernels)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    rec = tmp_path / "rec.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "tp_scaling.py"), "--cases", "tiny:2",
         "--batches", "1", "--new", "6", "--prompt-len", "8", "--repeats", "1",
         "--read-gib", "0.001", "--profile", "--json", str(rec)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = json.loads(rec.read_text())["items"]
    assert [i["what"] for i in items] == ["read bandwidth", "init", "decode", "profile"]
    read, init, decode, profile = items
    assert read["bytes_per_gpu"] == 2 * 8192 * 65  # --read-gib rounded down to whole rows
    per_gpu = init["param_bytes_per_gpu"]
    assert sorted(per_gpu) == ["0", "1"]
    assert max(per_gpu.values()) < 0.6 * init["param_bytes_total"] <= sum(per_gpu.values())
    assert (decode["tp"], decode["mesh"], decode["batch"], decode["tokens_per_row"]) == (
        2, True, 1, 6)
    assert profile == {"what": "profile", "model": "tiny", "tp": 2, "batch": 1, "kernels": 0,
                       "t": profile["t"]}


@pytest.fixture
def checked_bench_kernels(monkeypatch):
    """``scripts/bench_kernels.py`` on CPU with the paged kernel interpreted and its GPU
    timing loop replaced by one call checked against ``paged_attention_reference`` (every
    sequence holding ``ctx[0]`` valid keys, a count or one per row: set it before a
    sweep)."""
    import functools
    import time
    from pathlib import Path

    import pallas_kernels

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "RESULTS", {"copy_bw_TBps": 1.0})
    monkeypatch.setattr(bench_kernels, "paged_attention",
                        functools.partial(pallas_kernels.paged_attention, interpret=True))
    ctx = [0]

    def once(fn, arg_sets):
        q, kp, vp, bt = arg_sets[0]
        lengths = jnp.broadcast_to(jnp.asarray(ctx[0], jnp.int32), (q.shape[0],))
        t = time.perf_counter()
        got = jax.block_until_ready(fn(*arg_sets[0]))
        want = pallas_kernels.paged_attention_reference(q, kp, vp, bt, lengths)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=3e-2)
        return time.perf_counter() - t

    monkeypatch.setattr(bench_kernels, "time_in_jit", once)
    return bench_kernels, ctx


@pytest.mark.slow  # 22 interpreted kernel calls of up to 512 programs: ~50 s uncached
def test_bench_kernels_split_sweep_covers_each_split_on_real_tables(checked_bench_kernels):
    """``scripts/bench_kernels.py``'s split sweep (quick) on CPU, the kernel interpreted:
    every timed call attends over its shuffled page table as the reference does, and the
    sweep records the default and each split count up to one per block of the default
    launch's keys."""
    bench_kernels, ctx = checked_bench_kernels
    ctx[0] = 192  # both quick contexts: 192 keys in a 256- or an 8,192-key table
    bench_kernels.bench_splits(quick=True)
    rows = bench_kernels.RESULTS["splits"]
    want = [(b, hkv, width, s) for b, hkv in ((1, 8), (1, 2)) for width, top in
            ((256, 2), (8192, 64)) for s in [None] + [x for x in (1, 2, 4, 8, 16, 32, 64)
                                                       if x <= top]]
    assert [(r["batch"], r["kv_heads"], r["table_keys"], r["splits"]) for r in rows] == want
    assert all(r["ctx"] == 192 and r["frac_of_copy_bw"] == r["TBps"] for r in rows)


def test_bench_kernels_times_kernels_not_wall_time(monkeypatch):
    """``time_in_jit`` divides the traced kernels' summed duration by the calls it traced;
    the program it traces runs ``fn`` on every input set in turn, and a trace without
    device kernels (a CPU) is an error, never a time of zero."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels

    seen = []

    def fake_traced(program, repeats):
        seen.append([np.asarray(o).item() for o in program()])
        return [("k", 0.0, 3_000.0)] * (repeats * 4) + [("combine", 0.0, 1_000.0)] * repeats

    monkeypatch.setattr(bench_kernels, "traced_kernels", fake_traced)
    sets = [(jnp.float32(i),) for i in range(3)]
    t = bench_kernels.time_in_jit(lambda x: x * 10, sets, calls=4, trials=5)
    # per trial 4 x 3 us + 1 us over 4 calls
    assert t == pytest.approx(13e-6 / 4)
    assert seen == [[0.0, 10.0, 20.0, 0.0]]
    monkeypatch.setattr(bench_kernels, "traced_kernels", lambda program, repeats: [])
    with pytest.raises(RuntimeError, match="no device kernels"):
        bench_kernels.time_in_jit(lambda x: x, sets)


@pytest.mark.slow  # 3 interpreted kernel calls of up to 256 programs
def test_bench_kernels_config_sweep_records_each_launch_setting(checked_bench_kernels):
    """The launch-settings sweep (quick) on CPU, on the engine's mix of lengths: the default
    launch and each (splits, stages, pages per block) compute what the reference does over
    shuffled tables and get their own record, the default's with the settings it chose."""
    bench_kernels, ctx = checked_bench_kernels
    lens = bench_kernels.engine_lengths(8)
    assert lens.min() >= 32 and lens.max() <= 1024 + 512 and len(set(lens)) > 1
    ctx[0] = lens
    bench_kernels.bench_configs(quick=True)
    rows = bench_kernels.RESULTS["configs"]
    assert [(r["default"], r["splits"], r["num_stages"], r["pages_per_block"])
            for r in rows] == [(True, 8, 1, 8), (False, 1, 1, 4), (False, 8, 3, 8)]
    assert all((r["batch"], r["kv_heads"], r["ctx"]) == (8, 4, "mixed")
               and r["mean_keys"] == lens.mean() and r["frac_of_copy_bw"] == r["TBps"]
               for r in rows)


def test_bench_load_times_a_checked_load_and_refuses_bad_arguments(tmp_path, monkeypatch,
                                                                   capsys):
    """``scripts/bench_load.py`` on a small untied config whose transposed weights span
    several ``transpose_copy`` blocks: the record holds the file's size, the timed loads and
    the floor; a loader that returns a wrong weight fails the run; a non-empty ``--dir``
    and a bad ``--layers`` are refused in one line before anything is written."""
    import dataclasses
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_load

    config = dataclasses.replace(TINY, vocab_size=260, intermediate_size=300,
                                 tie_word_embeddings=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_hf_dict()))
    rec = bench_load.main(["--preset", str(path), "--repeats", "2", "--copy-mib", "8",
                           "--json", str(tmp_path / "rec.json")])
    assert json.loads((tmp_path / "rec.json").read_text()) == rec
    values = sum(int(np.prod(bench_load.hf_tensor_shape(n, config)))
                 for n in bench_load.hf_tensor_names(config))
    assert rec["file_bytes"] > 2 * values and len(rec["load_s_all"]) == 2
    assert rec["frac_of_floor"] == pytest.approx(rec["floor_s"] / rec["load_s"])
    f16 = bench_load.main(["--preset", str(path), "--dtype", "float16", "--repeats", "1",
                           "--copy-mib", "8"])
    assert f16["dtype"] == "float16" and abs(f16["file_bytes"] - rec["file_bytes"]) < 1024

    def wrong(folder):  # the real loader, then one wq element changed
        cfg, params = load_hf_checkpoint(folder)
        params["layers"]["wq"][0, 0, 0] += 1
        return cfg, params

    load_hf_checkpoint = bench_load.load_hf_checkpoint
    monkeypatch.setattr(bench_load, "load_hf_checkpoint", wrong)
    with pytest.raises(AssertionError, match="wq"):
        bench_load.main(["--preset", str(path), "--repeats", "1", "--copy-mib", "8"])

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    for argv, message in ((["--dir", str(tmp_path / "full")], "is not empty"),
                          (["--layers", "9"], "--layers must be 1-")):
        with pytest.raises(SystemExit, match=message):
            bench_load.main(["--preset", str(path), *argv])
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("packed", ["awq", "gptq"])
def test_bench_load_packed_folders_load_as_int4(tmp_path, monkeypatch, packed):
    """``scripts/bench_load.py --packed``: the random AWQ / GPTQ export it writes loads
    through the packed path (every layer linear an int4 weight, the file's scales kept), and
    a loader that changes a scale fails the run."""
    import dataclasses
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_load

    config = dataclasses.replace(TINY, hidden_size=128, intermediate_size=256, num_heads=2,
                                 num_kv_heads=1, vocab_size=260)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_hf_dict()))
    folder = tmp_path / "model"
    rec = bench_load.main(["--preset", str(path), "--packed", packed, "--repeats", "1",
                           "--copy-mib", "8", "--dir", str(folder)])
    assert rec["packed"] == packed
    _, params = bench_load.load_hf_checkpoint(folder)
    assert {k: getattr(w, "kind", None) for k, w in params["layers"].items()
            if k not in ("attn_norm", "mlp_norm")} == dict.fromkeys(
                ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"), "int4")

    def wrong(folder):
        cfg, params = load_hf_checkpoint(folder)
        params["layers"]["wq"].scale[0, 0, 0] += 1
        return cfg, params

    load_hf_checkpoint = bench_load.load_hf_checkpoint
    monkeypatch.setattr(bench_load, "load_hf_checkpoint", wrong)
    with pytest.raises(AssertionError, match="scales"):
        bench_load.main(["--preset", str(path), "--packed", packed, "--repeats", "1",
                         "--copy-mib", "8"])
