"""scripts/bench_engine.py: the tiny preset end to end on CPU, and the floor's arithmetic;
the GEMM list of scripts/bench_gemm.py; profile_engine.py's step timelines."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/<name>.py`` as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_engine")


def test_workload_floor_by_hand(bench):
    from jaxinfer.benchmark import workload_floor

    cfg = bench.PRESETS["tiny"]
    w = bench.Workload(prompts=[[5] * 3, [6] * 5], output_lens=[2, 4], arrivals_s=[0.0, 0.0])
    assert w.prompt_lens == [3, 5]
    f = workload_floor(cfg, w.prompt_lens, w.output_lens, num_slots=1,
                       matmul_flops_per_s=1e12, read_bytes_per_s=1e9, dtype_bytes=2)
    # One slot: every decode token is its own step. Contexts: 3+1; 5+1, 5+2, 5+3 positions.
    assert (f["batch_eff"], f["decode_tokens"], f["decode_steps"]) == (1, 4, 4)
    kv_per_position = 2 * cfg.num_kv_heads * cfg.num_layers * cfg.head_dim * 2
    assert f["decode_kv_bytes"] == (4 + 6 + 7 + 8) * kv_per_position
    weights = cfg.num_params() * 2 - cfg.vocab_size * cfg.hidden_size * 2  # untied table
    assert f["decode_weight_bytes"] == 4 * weights
    assert f["decode_s"] == pytest.approx((4 * weights + 25 * kv_per_position) / 1e9)
    assert f["floor_s"] == pytest.approx(f["prefill_s"] + f["decode_s"])
    assert f["floor_output_tok_per_s"] == pytest.approx(6 / f["floor_s"])
    # More slots than requests: both decode together.
    assert workload_floor(cfg, [3, 5], [2, 4], 8, 1e12, 1e9, 2)["decode_steps"] == 2
    # Four devices split the work: a quarter of each time.
    four = workload_floor(cfg, [3, 5], [2, 4], 1, 1e12, 1e9, 2, devices=4)
    assert four["prefill_s"] == pytest.approx(f["prefill_s"] / 4)
    assert four["floor_s"] == pytest.approx(f["floor_s"] / 4)
    # An fp8 cache: one byte per element plus a 2-byte scale per token and K/V head.
    fp8 = workload_floor(cfg, [3, 5], [2, 4], 1, 1e12, 1e9, 2, kv_cache_dtype="fp8")
    per_position = 2 * cfg.num_kv_heads * cfg.num_layers * (cfg.head_dim + 2)
    assert fp8["decode_kv_bytes"] == 25 * per_position
    # Scoring (prefill only): no decode time.
    assert workload_floor(cfg, [3, 5], [1, 1], 1, 1e12, 1e9, 2)["decode_s"] == 0


def test_ceilings():
    from jaxinfer.benchmark import ceilings

    assert ceilings("NVIDIA H200", None, None)[:2] == (790e12, 4.3e12)
    flops, bandwidth, note = ceilings("cpu", None, 2.0)
    assert (flops, bandwidth) == (634e12, 2.0e12) and "H100" in note


def test_tiny_end_to_end(bench, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--requests", "8", "--rate", "0,200", "--max-batch", "4",
            "--token-budget", "16", "--batch1-tokens", "6", "--json", str(out)]
    record = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["command"].endswith(" ".join(argv))
    floor = record["floor"]
    w = bench.make_workload(bench.PRESETS["tiny"], 8, (4, 64), (4, 32), 0.0, 0)
    assert floor["output_tokens"] == sum(w.output_lens) and floor["batch_eff"] == 4
    assert floor["floor_s"] == pytest.approx(floor["prefill_s"] + floor["decode_s"])

    # The tokens counted are the engine's: the same workload run again gives as many.
    args = bench.parse_args(argv)
    engine = bench.make_engine(bench.build_model(bench.PRESETS["tiny"], "tiny", "auto", "auto",
                                                 0), args)
    ids = [engine.submit(p, max_new_tokens=n)
           for p, n in zip(w.prompts, w.output_lens, strict=True)]
    engine.run_until_done()
    tokens = sum(len(engine.result(i).token_ids) for i in ids)
    assert [r["rate"] for r in record["runs"]] == [0.0, 200.0]
    for run in record["runs"]:
        assert run["output_tokens"] == tokens <= run["planned_output_tokens"]
        assert run["output_tok_per_s"] == pytest.approx(tokens / run["elapsed_s"])
        assert run["fraction_of_floor"] == pytest.approx(
            run["output_tok_per_s"] / floor["floor_output_tok_per_s"])
        assert run["computed_tokens"] <= run["padded_tokens"]
        assert run["programs_compiled_in_run"] == 0  # warmup() compiled every step shape
        assert run["slots"] == 4 and run["max_tokens_per_step"] == 16
        assert run["kv_cache_dtype"] == "bfloat16" and run["tokens_vs_bf16"] == 1.0
        assert run["pool_tokens"] == run["pool_tokens_if_bf16"] > 0

    b1 = record["batch1"]
    assert b1["tokens"] == 6 and b1["decode_tok_per_s"] > 0
    assert b1["fraction_of_floor"] == pytest.approx(b1["decode_tok_per_s"]
                                                    / b1["floor_tok_per_s"])
    # Three batch-1 requests (the default), the record keeping the median one's figures.
    rates = b1["decode_tok_per_s_runs"]
    assert b1["repeats"] == len(rates) == 3 and b1["decode_tok_per_s"] == sorted(rates)[1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch1-repeats", "0"])  # "must be 1 or more", argparse's exit


def test_int4_batch1_counts_the_packed_bytes(bench):
    from jaxinfer import roofline
    from jaxinfer.model import param_shapes
    from jaxinfer.quantize import QuantizedWeight

    cfg = bench.PRESETS["tiny"]
    # Random weights drawn and quantized layer by layer (quantize.random_quantized_params).
    model = bench.build_model(cfg, "tiny", "stacked", "auto", 0, quantize="int4")
    for name, shape in param_shapes(cfg)["layers"].items():
        w = model.params["layers"][name]
        assert w.shape == shape and isinstance(w, QuantizedWeight) == ("norm" not in name)
    wq = model.params["layers"]["wq"]
    assert wq.kind == "int4" and not np.array_equal(wq.q[0], wq.q[1])  # a draw per layer
    args = bench.parse_args(["--preset", "tiny", "--max-batch", "1", "--token-budget", "16"])
    b1 = bench.run_batch1(bench.make_engine(model, args), cfg, 8, 4, 1e12, 2)
    # The roofline reads the int4 weights (packed values, scales, zeros), not bf16 ones.
    bf16 = roofline.decode_step_bytes(cfg, 1, 8 + b1["tokens"] // 2, 2)
    assert b1["step_bytes"] == (bf16 + model.param_bytes - model.params["embed"].nbytes
                                - roofline.weight_bytes_per_step(cfg, 2))
    assert b1["step_bytes"] < bf16 and b1["tokens"] == 4


def test_a_failed_request_stops_the_benchmark_with_its_error(bench, monkeypatch):
    from jaxinfer import engine as engine_module
    from tests.conftest import tiny_engine_model

    monkeypatch.setattr(engine_module, "add_tokens", lambda *a: 1 / 0)
    model = tiny_engine_model()
    engine = engine_module.Engine(model, num_pages=16, page_size=4, verbose=False)
    with pytest.raises(RuntimeError, match="benchmark request failed: .*ZeroDivisionError"):
        bench.run_batch1(engine, model.config, 4, 3, 3e12, 4)


def test_speculative_run_counts_its_proposals_and_compiles_nothing_in_the_run(bench):
    argv = ["--preset", "tiny", "--requests", "6", "--max-batch", "4", "--token-budget", "16",
            "--speculative", "ngram", "--num-speculative-tokens", "3", "--always-speculate"]
    plain = bench.main(argv[:8])["runs"][0]
    run = bench.main(argv)["runs"][0]
    assert run["output_tokens"] == plain["output_tokens"]  # greedy: the same outputs
    assert run["verify_steps"] > 0 and 0 <= run["accepted_tokens"] <= run["draft_tokens"]
    assert run["draft_tokens"] > 0 and plain["draft_tokens"] == 0
    assert run["programs_compiled_in_run"] == 0  # warmup(speculative=...) compiled the verify


@pytest.mark.slow
def test_draft_model_run_compares_batch1_with_plain(bench):
    """--speculative draft --draft-preset self: every greedy proposal of the target itself is
    accepted; the batch-1 request runs plain and speculative and the record compares them."""
    argv = ["--preset", "tiny", "--requests", "3", "--max-batch", "1", "--token-budget", "16",
            "--batch1-tokens", "12", "--speculative", "draft", "--draft-preset", "self",
            "--always-speculate"]
    record = bench.main(argv)
    run, b1 = record["runs"][0], record["batch1"]
    assert run["programs_compiled_in_run"] == 0  # warmup compiled the draft's steps too
    assert run["draft_tokens"] > 0 and b1["draft_tokens"] > 0
    assert b1["plain"]["tokens"] == b1["tokens"] == 12 and "token_ids" not in b1
    assert len(b1["plain"]["decode_tok_per_s_runs"]) == len(b1["decode_tok_per_s_runs"]) == 3
    assert b1["verify_steps"] > 0 and b1["speedup"] > 0
    # The draft loop's device time is verify time, not plain decode time (its iterations
    # include the draft's proposals).
    assert b1["verify_ms_per_step"] > 0 and b1["draft_ms_per_verify"] == 0
    assert set(b1["projected_speedup"]) == {"0.5", "0.6", "0.7", "0.8", "0.9", "1.0"}
    # the projection is the measured cycle: k + 1 tokens per cycle at acceptance 1
    cycle_s = (b1["draft_ms_per_verify"] + b1["verify_ms_per_step"]) / 1e3
    assert b1["projected_speedup"]["1.0"] == pytest.approx(
        5 / b1["plain"]["decode_tok_per_s"] / cycle_s)
    with pytest.raises(SystemExit):
        bench.parse_args(["--speculative", "draft"])  # a draft method needs --draft-preset


def test_tiny_structured_output_run(bench, tmp_path):
    """--response-format json: half the requests constrained, with a tokenizer folder."""
    from tests.conftest import byte_tokenizer

    byte_tokenizer(printable_only=True).save(tmp_path / "tok")
    record = bench.main(["--preset", "tiny", "--requests", "6", "--max-batch", "4",
                         "--token-budget", "16", "--output-max", "12", "--response-format",
                         "json", "--constrained-fraction", "0.5", "--tokenizer",
                         str(tmp_path / "tok")])
    (run,) = record["runs"]
    assert run["constrained_requests"] == 3 and 0 < run["output_tokens"]
    assert run["programs_compiled_in_run"] == 0  # warmup(constrained=True) compiled them
    w = bench.make_workload(bench.PRESETS["tiny"], 6, (4, 64), (4, 12), 0.0, 0, 0.5)
    assert len(w.constrained) == 3 and w.prompts == bench.make_workload(
        bench.PRESETS["tiny"], 6, (4, 64), (4, 12), 0.0, 0).prompts


def test_bench_server_tiny_served_and_offline(tmp_path):
    """scripts/bench_server.py on the same tiny engine sizes as above (its step programs are
    compiled already): the workload through HTTP streaming clients and offline."""
    server_bench = load_script("bench_server")

    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--requests", "12", "--max-batch", "4", "--token-budget", "16",
            "--output-max", "12", "--json", str(out)]
    record = server_bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["command"].endswith(" ".join(argv))
    offline, served = record["offline"], record["served"]
    bench = server_bench.bench_engine
    planned = sum(bench.make_workload(bench.PRESETS["tiny"], 12, (4, 64), (4, 12), 0.0,
                                      0).output_lens)
    assert offline["planned_output_tokens"] == served["planned_output_tokens"] == planned
    # The clients count the tokens the engine generated (usage chunks), every request once.
    assert 0 < served["output_tokens"] == served["engine_generated_tokens"] <= planned
    assert served["clients"] == 12 and served["programs_compiled_in_run"] == 0
    assert 12 <= served["chunks"] <= served["output_tokens"]  # every request got its text
    assert served["output_tok_per_s"] == pytest.approx(served["output_tokens"]
                                                       / served["elapsed_s"])
    assert record["served_over_offline"] == pytest.approx(served["output_tok_per_s"]
                                                          / offline["output_tok_per_s"])
    assert served["ttft_ms"]["p50"] <= served["ttft_ms"]["p99"]
    assert served["tpot_ms"]["p50"] is not None


@pytest.mark.slow
def test_bench_server_dp2_serves_from_two_engine_processes(tmp_path, monkeypatch):
    """``bench_server.py --dp 2``: the served run's engine is two engine processes (a
    ``ReplicaProcesses``), every request is answered and counted once, and the record's
    floor share is over both replicas' floors."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the engine processes inherit it
    server_bench = load_script("bench_server")
    seen = []
    real = server_bench.run_served

    def spy(spec, args, w, **kw):
        seen.append((spec.dp, spec.replica_processes))
        return real(spec, args, w, **kw)

    monkeypatch.setattr(server_bench, "run_served", spy)
    record = server_bench.main(["--preset", "tiny", "--requests", "12", "--max-batch", "4",
                                "--token-budget", "16", "--output-max", "12", "--dp", "2",
                                "--json", str(tmp_path / "r.json")])
    served = record["served"]
    assert seen == [(2, True)] and record["dp"] == 2
    assert 0 < served["output_tokens"] == served["engine_generated_tokens"]
    assert served["output_tokens"] <= served["planned_output_tokens"]
    assert record["served_fraction_of_floor"] == pytest.approx(
        served["output_tok_per_s"] / (2 * record["floor"]["floor_output_tok_per_s"]))


def test_bench_server_host_synthetic_engine(tmp_path):
    """scripts/bench_server_host.py: the served path (engine process loop, HTTP process,
    aiohttp clients) against the synthetic engine, which needs no compilation."""
    host = load_script("bench_server_host")
    out = tmp_path / "host.json"
    argv = ["--preset", "tiny", "--requests", "24", "--max-batch", "8", "--token-budget", "64",
            "--mixed-step-ms", "1", "--decode-iter-ms", "0.5", "--decode-steps", "4",
            "--client-processes", "3", "--json", str(out)]
    record = host.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    bench = host.bench_engine
    planned = sum(bench.make_workload(bench.PRESETS["tiny"], 24, (4, 64), (4, 32), 0.0,
                                      0).output_lens)
    offline, served = record["offline"], record["served"]
    assert offline["output_tokens"] == served["output_tokens"] == planned
    assert served["engine_generated_tokens"] == planned and served["client_processes"] == 3
    # A text chunk carries all of its request's tokens of one engine step (up to 4 here):
    # at least one per request, fewer than one per token.
    assert 24 <= served["chunks"] < planned


def test_bench_gemm_layer_gemms_cover_the_layer_weights():
    """``benchmark.layer_gemms`` (bench_gemm's and bench_int4's shapes): the fused layer's
    GEMMs (qkv, o, gate|up, down) hold every matrix weight of a layer once, the gate+up pair
    the same columns as the fused gate|up, and the head the LM head's; so each floor counts
    the weight bytes the model reads."""
    import jax

    from jaxinfer.benchmark import layer_gemms
    from jaxinfer.params import init_params
    from jaxinfer.presets import resolve_config

    cfg = resolve_config("smollm2-135m-instruct")
    g = layer_gemms(cfg)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    layer = params["layers"]
    matrices = sum(np.prod(a.shape[1:]) for a in jax.tree.leaves(layer) if a.ndim == 3)
    fused = sum(k * sum(ns) for name, (k, ns) in g.items() if name in ("qkv", "o", "gate_up",
                                                                         "down"))
    assert fused == matrices
    assert g["gate+up"][0] == g["gate_up"][0] and sum(g["gate+up"][1]) == g["gate_up"][1][0]
    assert g["head"] == (cfg.hidden_size, [cfg.vocab_size])


def test_profile_engine_step_timelines_split_a_step_into_lead_span_idle_tail():
    """``profile_engine.step_timelines``: kernels are assigned to the step whose host mark
    they start in; lead, span, idle, tail and the largest gap follow from their times."""
    prof = load_script("profile_engine")
    ms = 1_000_000
    marks = [("s1", 100 * ms, 50 * ms), ("s0", 0, 100 * ms)]  # out of order on purpose
    kernels = [("a", 10 * ms, 20 * ms), ("b", 35 * ms, 10 * ms), ("c", 40 * ms, 30 * ms),
               ("d", 120 * ms, 5 * ms)]
    t0, t1 = prof.step_timelines(prof.step_kernels(marks, kernels))
    assert (t0["kernels"], t0["kernel_ms"], t0["lead_ms"]) == (3, 60.0, 10.0)
    # busy 10-30, idle 30-35, busy 35-70 (b and c overlap); tail 70-100.
    assert (t0["span_ms"], t0["idle_ms"], t0["tail_ms"]) == (60.0, 5.0, 30.0)
    assert (t0["max_gap_ms"], t0["max_gap_before"]) == (5.0, "b")
    assert (t1["kernels"], t1["lead_ms"], t1["span_ms"], t1["tail_ms"]) == (1, 20.0, 5.0, 25.0)
    assert prof.step_timelines(prof.step_kernels([("s", 0, ms)], []))[0]["lead_ms"] == 1.0


def test_profile_engine_kernels_by_kind_splits_decode_from_mixed_steps():
    """``profile_engine.kernels_by_kind``: each kind's top kernels come from its own steps
    only, with time per token computed in steps of that kind."""
    prof = load_script("profile_engine")
    ms = 1_000_000
    steps = [{"kind": "decode", "computed_tokens": 64}, {"kind": "mixed", "computed_tokens": 500},
             {"kind": "decode", "computed_tokens": 64}]
    kernels = [(("s0", 0, ms), [("attn", 0, 2 * ms), ("gemv", 0, 1 * ms)]),
               (("s1", ms, ms), [("gemm", ms, 5 * ms), ("attn", ms, 1 * ms)]),
               (("s2", 2 * ms, ms), [("attn", 2 * ms, 2 * ms)])]
    by_kind = prof.kernels_by_kind(steps, kernels)
    decode, mixed = by_kind["decode"], by_kind["mixed"]
    assert [(k["name"], k["count"], k["ms"]) for k in decode] == [("attn", 2, 4.0),
                                                                   ("gemv", 1, 1.0)]
    assert decode[0]["us_per_token"] == 4000.0 / 128 and decode[0]["mean_us"] == 2000.0
    assert [(k["name"], k["ms"]) for k in mixed] == [("gemm", 5.0), ("attn", 1.0)]
    assert mixed[0]["us_per_token"] == 5000.0 / 500


def test_profile_engine_timeline_names_the_host_events_behind_long_gaps(tmp_path):
    """``profile_engine.write_timeline``: one line per kernel with its start, gap and
    duration (us); a gap of 20 us or more is followed by the host events covering at least
    half of it, innermost first, and a short gap by none."""
    prof = load_script("profile_engine")
    us = 1_000
    kernels = [("a", 10 * us, 5 * us), ("b", 16 * us, 4 * us), ("c", 60 * us, 2 * us)]
    host = [("t1", "outer", 0, 100 * us), ("t2", "launch", 22 * us, 36 * us),
            ("t2", "brief", 25 * us, 5 * us)]
    out = tmp_path / "timeline.txt"
    prof.write_timeline(out, [(("step0", 0, 100 * us), kernels)], host)
    lines = out.read_text().splitlines()
    assert lines[0] == "== step0: 100.0 us, 3 kernels"
    assert lines[1].split() == ["10.0", "0.0", "5.0", "a"]
    assert lines[2].split() == ["16.0", "1.0", "4.0", "b"]  # 1 us: no host lines
    assert lines[3].split() == ["60.0", "40.0", "2.0", "c"]
    assert [ln.split()[-1] for ln in lines[4:]] == ["launch", "outer"]  # "brief" covers 5 of 40


def test_quantized_copy_is_a_fast_draft_of_the_target(monkeypatch):
    """``benchmark.quantized_copy`` (bench_engine's and profile_engine's quantized drafts):
    the target's weights quantized, named after the method, on the fast kernels even for a
    deterministic target, and laid out for one device as ``load_model`` leaves them
    (``model.one_device_layout``); the target itself keeps its weights."""
    import dataclasses

    import jax

    from jaxinfer import benchmark
    from jaxinfer.quantize import is_quantized
    from tests.conftest import tiny_engine_model

    laid = []
    layout = benchmark.one_device_layout
    monkeypatch.setattr(benchmark, "one_device_layout",
                        lambda p, device: laid.append(device) or layout(p, device))
    target = dataclasses.replace(tiny_engine_model(), name="tiny", deterministic=True)
    draft = benchmark.quantized_copy(target, "fp8")
    assert laid == [jax.devices()[0]]
    assert is_quantized(draft.params) and not is_quantized(target.params)
    assert draft.name == "tiny-fp8" and not draft.deterministic and target.deterministic
    assert draft.config == target.config


def test_profile_batch1_records_kernels_and_the_idle_before_them(monkeypatch, tmp_path):
    """``profile_engine.profile_batch1`` on a traced run (the trace's device events and step
    marks replaced by a fixed timeline: a CPU trace holds no kernels): kernels per token and
    the idle time before each kernel name within engine steps, per generated token."""
    from jaxinfer.engine import Engine
    from tests.conftest import tiny_engine_model

    prof = load_script("profile_engine")
    us = 1_000
    timeline = [("gemv", 0, 10 * us), ("norm", 12 * us, 1 * us), ("gemv", 13 * us, 10 * us),
                ("norm", 30 * us, 1 * us)]
    monkeypatch.setattr(prof, "device_events", lambda *a: timeline)
    # Two engine steps: the 7 us between them is the host's, not a gap before "norm".
    steps = [("s0", 0, 24 * us), ("s1", 25 * us, 10 * us)]
    monkeypatch.setattr(prof, "host_marks", lambda *a: steps)
    model = tiny_engine_model()
    engine = Engine(model, num_pages=80, page_size=4, verbose=False)
    out = tmp_path / "p.json"
    prof.profile_batch1(engine, model, 3, str(out))
    record = json.loads(out.read_text())
    tokens = record["tokens"]
    assert tokens == 2  # the prompt step gives the first of 3 outside the trace
    assert record["kernels_per_token"] == 4 / tokens
    assert record["idle_before"] == [
        {"name": "norm", "per_token": 2 / tokens, "idle_us_per_token": 2 / tokens},
        {"name": "gemv", "per_token": 2 / tokens, "idle_us_per_token": 0.0}]


def test_ab_engine_refuses_bad_trees_and_arguments(tmp_path, capsys):
    """Bad arguments are argparse errors (one line saying what is wrong, exit 2); the
    summary of runs."""
    ab = load_script("ab_engine")
    for argv, says in [
            (["--base", str(tmp_path), "--", "--preset", "tiny"], "holds no scripts"),
            (["--base", str(REPO), "--", "--preset", "tiny", "--json", "x.json"],
             "leave --json out"),
            (["--base", str(REPO)], "arguments after --"),
            (["--base", str(REPO), "--rounds", "0", "--", "--preset", "tiny"],
             "--rounds 0 must be 1 or more"),
            (["--base", str(REPO), "--new-env", "XLA_FLAGS", "--", "--preset", "t"],
             "must be NAME=VALUE"),
            (["--base", str(REPO), "--new-env", "PYTHONPATH=x", "--", "--preset", "t"],
             "cannot set PYTHONPATH")]:
        with pytest.raises(SystemExit) as exit_:
            ab.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and says in err, err
    args = ab.parse_args(["--base", str(REPO), "--rounds", "3", "--new-env", "A=x=1", "--",
                          "--preset", "tiny"])
    assert (args.rounds, args.bench_args, args.new_env) == (3, ["--preset", "tiny"],
                                                            {"A": "x=1"})
    # The summary: each figure's runs, medians and new / base.
    base = [{"b1": 10.0, "only_base": 1.0}, {"b1": 14.0}, {"b1": 12.0}]
    new = [{"b1": 9.0}, {"b1": 9.5}, {"b1": 30.0}]
    s = ab.summarize(base, new)
    assert list(s) == ["b1"] and s["b1"]["base_median"] == 12.0
    assert s["b1"]["new_median"] == 9.5 and s["b1"]["ratio"] == pytest.approx(9.5 / 12.0)


def test_ab_engine_runs_bench_engine_from_both_trees(tmp_path):
    """Two copies of this tree, one round, the real bench_engine: each side's run is a record
    of its own, and the summary compares their batch-1 and offline figures."""
    import shutil

    ab = load_script("ab_engine")
    base = tmp_path / "base"
    for name in ("jaxinfer", "pallas_kernels", "sharding", "checkpoints", "scripts"):
        shutil.copytree(REPO / name, base / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    record = ab.main(["--base", str(base), "--rounds", "1", "--json", str(out), "--",
                      "--preset", "tiny", "--requests", "4", "--max-batch", "2",
                      "--token-budget", "16", "--batch1-tokens", "4", "--batch1-repeats", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert [len(record["records"][side]) for side in ("base", "new")] == [1, 1]
    assert "--batch1-repeats 1 --json" in record["records"]["base"][0]["command"]
    summary = record["summary"]
    assert set(summary) == {"batch1_decode_tok_per_s", "output_tok_per_s@0"}
    for s in summary.values():
        assert len(s["base"]) == len(s["new"]) == 1 and s["ratio"] > 0


def test_ab_engine_runs_each_tree_in_abba_order_with_its_env(tmp_path, monkeypatch):
    """Two stub trees whose bench_engine.py records what it saw: each run has its own tree
    first on PYTHONPATH (the caller's entries after it) and the caller's working directory;
    ``--new-env`` reaches the new side's runs only (its value is their batch-1 rate); the
    runs go base, new, new, base; a stub that writes no record stops it with one line."""
    ab = load_script("ab_engine")
    log = tmp_path / "order.log"
    stub = ("import json, os, sys\n"
            "out = sys.argv[sys.argv.index('--json') + 1]\n"
            "rate = float(os.environ.get('AB_RATE', '2'))\n"
            "tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n"
            f"open({str(log)!r}, 'a').write(os.path.basename(tree) + '\\n')\n"
            "json.dump({'device': 'cpu', 'command': ' '.join(sys.argv), 'runs': [],\n"
            "           'path': os.environ['PYTHONPATH'], 'cwd': os.getcwd(),\n"
            "           'batch1': {'decode_tok_per_s': rate}}, open(out, 'w'))\n")
    for side in ("base", "new"):
        (tmp_path / side / "scripts").mkdir(parents=True)
        (tmp_path / side / "scripts" / "bench_engine.py").write_text(stub)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ab.json"
    record = ab.main(["--base", "base", "--new", "new", "--rounds", "2", "--json", str(out),
                      "--new-env", "AB_RATE=7", "--", "--preset", "tiny"])
    s = record["summary"]["batch1_decode_tok_per_s"]
    assert (s["base"], s["new"], s["ratio"]) == ([2.0, 2.0], [7.0, 7.0], 3.5)
    assert log.read_text().split() == record["order"] == ["base", "new", "new", "base"]
    assert ab.order(3, "new") == ["new", "base", "base", "new", "new", "base"]
    for side in ("base", "new"):
        for rec in record["records"][side]:
            path = rec["path"].split(os.pathsep)
            assert path == [str(tmp_path / side), "/elsewhere"] and rec["cwd"] == str(tmp_path)
    assert json.loads(out.read_text())["summary"] == record["summary"]
    (tmp_path / "new" / "scripts" / "bench_engine.py").write_text("pass\n")
    with pytest.raises(SystemExit, match="wrote no record"):
        ab.main(["--base", "base", "--new", "new", "--rounds", "1", "--", "--preset", "t"])


@pytest.mark.parametrize("rates, kept", [([3.0, 1.0], 1.0), ([3.0, 1.0, 4.0, 2.0], 2.0),
                                         ([5.0, None, 4.0], 4.0)])
def test_batch1_median_keeps_the_lower_median_run_with_its_seed(bench, monkeypatch, rates,
                                                                kept):
    """``run_batch1_median``: one prompt seed per run (1, 2, ...), the run with the (lower)
    median rate kept with its seed, every rate recorded (None: no decode rate, sorted as 0),
    each run's tokens apart."""
    seen = []

    def fake(engine, cfg, prompt_len, new_tokens, bw, db, spec=None, seed=1):
        seen.append(seed)
        return dict(decode_tok_per_s=rates[seed - 1], token_ids=[seed] * 2)

    monkeypatch.setattr(bench, "run_batch1", fake)
    args = bench.parse_args(["--batch1-tokens", "4", "--batch1-repeats", str(len(rates))])
    run, ids = bench.run_batch1_median(None, None, args, 1e12, 2)
    assert seen == list(range(1, len(rates) + 1)) and ids == [[s] * 2 for s in seen]
    assert run["decode_tok_per_s"] == kept and run["decode_tok_per_s_runs"] == rates
    assert run["prompt_seed"] == rates.index(kept) + 1


def test_first_difference_names_the_run_and_token(bench):
    assert bench.first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert bench.first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert bench.first_difference([[1, 2], [3]], [[1, 2], [3, 4]]) == (1, 1)  # shorter
    out = bench.compare_speculative({"decode_tok_per_s": 2.0, "verify_steps": 0},
                                    {"decode_tok_per_s": 1.0}, [[1], [2]], [[1], [9]], 4)
    assert (out["identical_tokens"], out["first_difference"], out["speedup"]) == (
        False, (1, 0), 2.0)


def test_bench_int4_layer_shapes_follow_the_presets():
    """``bench_int4.SHAPES``: each layer weight's ``(K, N)`` in the fast layout, from the
    preset's published config (8B's by hand), so the floor is the bytes the model reads."""
    b = load_script("bench_int4")
    assert b.SHAPES["8b"] == [("qkv", 4096, 6144), ("o", 4096, 4096),
                              ("gate_up", 4096, 28672), ("down", 14336, 4096)]
    # 70B: 64 q heads + 2 x 8 kv heads of 128; the MLP is 28,672 wide.
    assert b.SHAPES["70b"][0] == ("qkv", 8192, 10240)
    assert b.SHAPES["70b"][3] == ("down", 28672, 8192)


@pytest.mark.parametrize("script, argv, says", [
    ("bench_int4", ["--programs", "512,x"], "comma-separated whole numbers"),
    ("bench_int4", ["--rows", "0"], "must be positive"),
    ("bench_int4", ["--programs", "0"], "must be positive"),
    ("bench_int4", ["--shapes", "13b"], "invalid choice"),
    ("profile_engine", ["--max-batch", "0"], "must be positive")])
def test_gpu_profilers_refuse_bad_arguments_in_one_line(script, argv, says, monkeypatch,
                                                        capsys):
    """Bad arguments to the GPU-only profilers are argparse errors (exit 2) before any
    device work, on any machine."""
    mod = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_:
        mod.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and says in err, err
