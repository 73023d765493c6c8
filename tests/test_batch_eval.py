"""scripts/batch_eval.py: sharded run == single-device generate, bad records, resume, scoring."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_script(name: str = "batch_eval"):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


def write_input(path: Path, n: int, bad: bool = True) -> list[str]:
    """``n`` records (prompts, chats, some bad when ``bad``); returns the raw lines."""
    lines = []
    for i in range(n):
        if bad and i == 3:
            lines.append(json.dumps({"id": f"r{i}", "text": "no prompt field"}))
        elif bad and i == 6:
            lines.append('{"id": "r6", "prompt": "unterminated')
        elif i % 7 == 5:
            lines.append(json.dumps({"id": f"r{i}", "messages": [
                {"role": "user", "content": f"Question {i}?"}]}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": f"Record {i}: " + "ab " * (i % 5)}))
    path.write_text("\n".join(lines) + "\n")
    return lines


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from sharding.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _run_args(model: Path, inp: Path, out: Path) -> list[str]:
    return ["--model", str(model), "--input", str(inp), "--output", str(out), "--dtype",
            "float32", "--backend", "reference", "--batch-size", "4", "--no-progress",
            "--compile-cache", ""]  # no cache in the user's home


def _args(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [*_run_args(model, inp, out), "--max-new-tokens", "6", *extra]


def _score_args(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    """``--score`` arguments (no generation flags: --score refuses them)."""
    return [*_run_args(model, inp, out), "--score", *extra]


def test_bad_records_resume_and_interrupt(tiny_dir, tmp_path, capsys, monkeypatch):
    be = _load_script()
    inp = tmp_path / "in.jsonl"
    write_input(inp, 12)
    full = tmp_path / "full.jsonl"
    assert be.main(_args(tiny_dir, inp, full)) == 0
    err = capsys.readouterr().err
    assert "in.jsonl:4: missing 'prompt'" in err and "in.jsonl:7: not valid JSON" in err
    rows = [json.loads(x) for x in full.read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 13))
    assert "error" in rows[3] and "error" in rows[6] and rows[0]["id"] == "r0"
    assert all(len(r["token_ids"]) == 6 for i, r in enumerate(rows) if i not in (3, 6))

    # --on-bad-record fail stops before any generation and writes nothing: records bad as
    # JSON before loading, a prompt too long for the model's context after.
    failed = tmp_path / "failed.jsonl"
    assert be.main(_args(tiny_dir, inp, failed, "--on-bad-record", "fail")) == 2
    assert "2 bad record(s)" in capsys.readouterr().err and not failed.exists()
    long_inp = tmp_path / "long.jsonl"
    long_inp.write_text(json.dumps({"id": "ok", "prompt": "hi"}) + "\n"
                        + json.dumps({"id": "long", "prompt": "word " * 5000}) + "\n")
    assert be.main(_args(tiny_dir, long_inp, failed, "--on-bad-record", "fail")) == 2
    err = capsys.readouterr().err
    assert "long.jsonl:2:" in err and "1 bad record(s)" in err and "for this model" in err
    assert not failed.exists()

    # Interrupt once some records have finished (all of them go to the engine at once and
    # finished ones are written as they extend the prefix), then tear the next line as a
    # crash mid-write would.
    from jaxinfer.engine import Engine

    real_step, real_add = Engine.step, Engine.add_request
    finished = 0

    def interrupted(self, *a, **kw):
        nonlocal finished
        if finished >= 4:
            raise KeyboardInterrupt
        events = real_step(self, *a, **kw)
        finished += sum(done for _, _, done in events)
        return events

    monkeypatch.setattr(Engine, "step", interrupted)
    part = tmp_path / "part.jsonl"
    assert be.main(_args(tiny_dir, inp, part)) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    written = [json.loads(x) for x in part.read_text().splitlines()]
    n = len(written)
    assert 4 <= n < 12 and [r["line"] for r in written] == list(range(1, n + 1))
    with part.open("a") as f:
        f.write(f'{{"id": "r{n}", "line": {n + 1}, "te')

    added: list[int] = []

    def counting(self, req):
        added.append(len(req.prompt_ids))
        return real_add(self, req)

    monkeypatch.setattr(Engine, "step", real_step)
    monkeypatch.setattr(Engine, "add_request", counting)
    assert be.main(_args(tiny_dir, inp, part)) == 0
    assert f"resuming after {n} finished" in capsys.readouterr().err
    # Only the good records after the written prefix run again; none of 1..n is redone.
    assert len(added) == sum(1 for i in range(n, 12) if i not in (3, 6))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("ttft_s", "tpot_s")}
                          for r in rows]
    assert strip(map(json.loads, part.read_text().splitlines())) == strip(rows)

    # An output file from different input is refused rather than silently mixed.
    other = tmp_path / "other.jsonl"
    write_input(other, 12, bad=False)
    assert be.main(_args(tiny_dir, other, part)) == 2
    assert "does not match" in capsys.readouterr().err


def test_resume_point_keeps_only_a_verified_prefix_and_never_clobbers_other_files(tmp_path):
    """``resume_point``: records of this input in order are kept and a torn last line (no
    newline) is cut; a file whose whole lines are anything else (text, JSON that is not an
    object, a bad line before good ones, another input's records) is refused with the
    one-line error and left exactly as it was."""
    be = _load_script()
    records = [be.Record(line=i + 1, id=f"r{i}") for i in range(4)]
    good = [json.dumps({"id": f"r{i}", "line": i + 1, "text": "x"}) + "\n" for i in range(4)]
    out = tmp_path / "out.jsonl"
    assert be.resume_point(out, records) == 0  # no file yet
    out.write_text("".join(good[:2]) + '{"id": "r2", "li')
    assert be.resume_point(out, records) == 2
    assert out.read_text() == "".join(good[:2])
    out.write_text("".join(good))
    assert be.resume_point(out, records) == 4 and out.read_text() == "".join(good)
    for text in ("my notes\n", "my notes", "a\rb\n", "[1, 2]\n",
                 good[0] + "not json\n" + good[1], good[0] + '{"id": "r9", "li',
                 good[1] + good[0], "".join(good[:3]) + good[0], "".join(good) + '{"id"'):
        out.write_bytes(text.encode())
        with pytest.raises(be.InputError, match="does not match 4 records"):
            be.resume_point(out, records)
        assert out.read_bytes() == text.encode()


def test_records_the_engine_cannot_take_are_bad_records(tiny_dir, tmp_path, capsys,
                                                         monkeypatch):
    """A record within the model's context that the engine refuses (``Engine.check_fits``:
    here, every prompt of over 5 tokens) is a bad record: an error record with ``skip``, the
    rest of the run going on; with ``fail`` the run stops before any generation."""
    from jaxinfer.engine import Engine
    from jaxinfer.errors import InputError

    real = Engine.check_fits

    def small(self, req):
        if len(req.prompt_ids) > 5:
            raise InputError("prompt too long for this engine")
        real(self, req)

    monkeypatch.setattr(Engine, "check_fits", small)
    be = _load_script()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "short", "prompt": "Hi"}) + "\n"
                   + json.dumps({"id": "long", "prompt": "one two three four five six"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert be.main(_args(tiny_dir, inp, out, "--on-bad-record", "fail")) == 2
    assert "1 bad record(s)" in capsys.readouterr().err and not out.exists()
    assert be.main(_args(tiny_dir, inp, out)) == 0
    short, long = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(short["token_ids"]) == 6 and long["error"] == "prompt too long for this engine"


def test_seeds_of_records_wrap_below_2_63(tiny_dir, tmp_path):
    """``--seed`` S: record line ``i`` samples with ``offset_seed(S, i)``, so the largest seed
    runs every record (its lines' seeds wrap to 0, 1, ...) instead of refusing them."""
    import jaxinfer
    from jaxinfer.sampling import offset_seed

    be = _load_script()
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                           for i, p in enumerate(["The sky", "A cat"])))
    out = tmp_path / "out.jsonl"
    seed = 2**63 - 1
    assert be.main(_args(tiny_dir, inp, out, "--seed", str(seed), "--temperature", "1")) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    model = jaxinfer.load_model(tiny_dir, dtype="float32", backend="reference")
    want = jaxinfer.generate(model, ["The sky", "A cat"], sampling=[
        jaxinfer.SamplingParams(max_new_tokens=6, temperature=1.0, seed=offset_seed(seed, line))
        for line in (1, 2)])
    assert [r["token_ids"] for r in rows] == [w.token_ids for w in want]


def test_summary_states_the_device_floor_of_the_records_run(tiny_dir, tmp_path, capsys):
    """The last summary line is the floor of exactly the records this run generated (their
    prompt and output tokens from the output file), at this device kind's ceilings; scoring
    counts its prompts' prefill only."""
    import re

    import jaxinfer
    from jaxinfer.benchmark import ceilings, workload_floor

    be = _load_script()
    inp = tmp_path / "in.jsonl"
    write_input(inp, 9)
    out = tmp_path / "out.jsonl"
    assert be.main(_args(tiny_dir, inp, out)) == 0
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if "error" not in r]
    cfg = jaxinfer.load_model(tiny_dir, dtype="float32", backend="reference").config
    flops, bandwidth, note = ceilings("cpu", None, None)
    want = workload_floor(cfg, [r["prompt_tokens"] for r in rows],
                          [len(r["token_ids"]) for r in rows], 4, flops, bandwidth, 4)
    line = capsys.readouterr().out.splitlines()[-1]
    got = re.match(r"floor (\S+) s on 1 device\(s\) .*reached (\S+)% of it$", line)
    assert got, line
    assert float(got[1]) == pytest.approx(want["floor_s"], rel=1e-3) and note in line
    assert want["decode_s"] > 0 and 0 < float(got[2])
    # Scoring: the floor of the contexts' prefill alone.
    inp.write_text(json.dumps({"id": 1, "prompt": "The sky is", "completion": " blue"}) + "\n")
    assert be.main(_score_args(tiny_dir, inp, tmp_path / "scored.jsonl")) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert re.match(r"floor \S+ s on 1 device\(s\) \(prefill \S+ s .*decode 0 s", line), line


def test_quantize_runs_the_quantized_model_and_counts_its_bytes(tiny_dir, tmp_path, capsys):
    """``--quantize int8``: the records are what the model loaded with ``quantize="int8"``
    generates, and the floor reads the quantized weights' bytes per step
    (``quantize.decode_weight_bytes``), fewer than the float32 weights'; an unknown method is
    one line and exit 2 before the input is read."""
    import re

    import jaxinfer
    from jaxinfer import roofline
    from jaxinfer.benchmark import ceilings, workload_floor
    from jaxinfer.quantize import decode_weight_bytes

    be = _load_script()
    inp = tmp_path / "in.jsonl"
    prompts = [json.loads(x)["prompt"] for x in write_input(inp, 5, bad=False)]
    out = tmp_path / "out.jsonl"
    assert be.main(_args(tiny_dir, inp, out, "--quantize", "int8")) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    model = jaxinfer.load_model(tiny_dir, dtype="float32", backend="reference",
                                quantize="int8")
    want = jaxinfer.generate(model, prompts, max_new_tokens=6)
    assert [r["token_ids"] for r in rows] == [c.token_ids for c in want]
    weights = decode_weight_bytes(model.params, model.config.tie_word_embeddings)
    assert 0 < weights < roofline.weight_bytes_per_step(model.config, 4) / 2
    plain = jaxinfer.load_model(tiny_dir, dtype="float32", backend="reference")
    assert decode_weight_bytes(plain.params, False) is None  # the config's bytes count then
    flops, bandwidth, _ = ceilings("cpu", None, None)
    floor = workload_floor(model.config, [r["prompt_tokens"] for r in rows],
                           [len(r["token_ids"]) for r in rows], 4, flops, bandwidth, 4,
                           weight_bytes_per_step=weights)
    line = capsys.readouterr().out.splitlines()[-1]
    got = re.match(r"floor (\S+) s on 1 device", line)
    assert got and float(got[1]) == pytest.approx(floor["floor_s"], rel=1e-3), line
    assert not (tmp_path / "bad.jsonl").exists()
    assert be.main(_args(tiny_dir, tmp_path / "absent.jsonl", tmp_path / "bad.jsonl",
                         "--quantize", "int3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quantize='int3' must be one of" in err, err


def test_score_mode(tiny_dir, tmp_path, capsys):
    import numpy as np

    import jaxinfer

    be = _load_script()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "The sky is", "completion": " blue"}) + "\n")
    out = tmp_path / "out.jsonl"
    # Flags that only shape generation are refused, not silently dropped, before loading.
    assert be.main(_score_args(tiny_dir, inp, out, "--temperature", "0.5", "--seed", "3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--temperature, --seed only apply to generation" in err
    assert not out.exists()
    assert be.main(_score_args(tiny_dir, inp, out)) == 0
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    model = jaxinfer.load_model(tiny_dir, dtype="float32", backend="reference")
    p = model.tokenizer.encode("The sky is", add_bos=True)
    c = model.tokenizer.encode(" blue", add_bos=False)
    logits = jaxinfer.compute_logits(model, p + c).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = sum(logp[len(p) + i - 1, t] for i, t in enumerate(c))
    assert row["num_tokens"] == len(c) and abs(row["logprob"] - want) < 1e-4


MESHES = [(2, 2), (2, 4), (4, 2), (2, 3)]  # (dp, tp); tp=3 on a model of 3 K/V heads


@pytest.mark.slow
def test_sharded_batch_eval_matches_single_device(tmp_path):
    """``batch_eval --dp D --tp T --replicas threads`` on 8 forced CPU devices writes the
    single-device
    ``generate``'s tokens and text for every record, and a one-line error for each bad one."""
    from test_sharding import run_with_devices

    res = run_with_devices([__file__, "worker", str(tmp_path)])
    assert sorted(res) == [f"{dp}x{tp}" for dp, tp in sorted(MESHES)]
    for mesh, r in res.items():
        assert r["bad_lines"] == [4, 7], mesh
        assert r["mismatches"] == [], (mesh, r["mismatches"][:3])
        assert r["n"] == 50, mesh


def _worker(tmp: Path) -> None:
    import jaxinfer
    from sharding.testing import tiny_config, write_tiny_model

    inp = tmp / "in.jsonl"
    lines = write_input(inp, 50)
    recs = [json.loads(x) if i not in (3, 6) else None for i, x in enumerate(lines)]
    good = [(i, r) for i, r in enumerate(recs) if r is not None]
    be = _load_script()
    models, result = {}, {}
    for dp, tp in MESHES:
        kv_heads = 3 if tp == 3 else 2
        if kv_heads not in models:
            config = tiny_config(num_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=8,
                                 intermediate_size=192)
            model_dir = write_tiny_model(tmp / f"model{kv_heads}", config)
            single = jaxinfer.load_model(model_dir, dtype="float32", backend="reference")
            want = jaxinfer.generate(single, [r.get("prompt", r.get("messages"))
                                              for _, r in good], max_new_tokens=8)
            models[kv_heads] = model_dir, want
        model_dir, want = models[kv_heads]
        out = tmp / f"out{dp}x{tp}.jsonl"
        rc = be.main(["--model", str(model_dir), "--input", str(inp), "--output", str(out),
                      "--dtype", "float32", "--backend", "reference", "--max-new-tokens", "8",
                      "--tp", str(tp), "--dp", str(dp), "--replicas", "threads",
                      "--no-progress", "--compile-cache", ""])
        assert rc == 0, (dp, tp)
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        result[f"{dp}x{tp}"] = {
            "n": len(rows), "bad_lines": [r["line"] for r in rows if "error" in r],
            "mismatches": [(i, rows[i]["token_ids"], c.token_ids)
                           for (i, _), c in zip(good, want, strict=True)
                           if rows[i]["token_ids"] != c.token_ids or rows[i]["text"] != c.text]}
    print(json.dumps(result))


@pytest.mark.slow
def test_replica_processes_match_single_device(tmp_path):
    """``--dp 2 --tp 2 --replicas processes``: two engine processes of two forced CPU
    devices each write the single-device ``generate``'s tokens and text for
    every record, and the process that runs batch_eval never starts a JAX backend (on GPUs it
    would take memory on every device)."""
    from test_sharding import run_with_devices

    from sharding.testing import tiny_config, write_tiny_model

    config = tiny_config(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=192)
    write_tiny_model(tmp_path / "model", config)  # here: writing it starts JAX
    r = run_with_devices([__file__, "process-worker", str(tmp_path)])
    assert r["backend_started"] is False
    assert r["bad_lines"] == [4, 7] and r["n"] == 20
    assert r["mismatches"] == [], r["mismatches"][:3]
    assert "in 2 replica processes" in r["summary"]
    # Both replicas worked, and their generated tokens add up to the run's.
    each = re.search(r"replicas: steps (\d+)/(\d+) .* generated (\d+)/(\d+) ", r["summary"])
    total = re.search(r"tokens (\d+) ", r["summary"])
    assert each and total, r["summary"]
    assert all(int(x) > 0 for x in each.groups())
    assert int(each[3]) + int(each[4]) == int(total[1])


def _process_worker(tmp: Path) -> None:
    import contextlib
    import io

    from jax._src import xla_bridge  # no public query of "has a backend started"

    inp = tmp / "in.jsonl"
    lines = write_input(inp, 20)
    model_dir = tmp / "model"
    out = tmp / "out.jsonl"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = _load_script().main([
            "--model", str(model_dir), "--input", str(inp), "--output", str(out), "--dtype",
            "float32", "--backend", "reference", "--max-new-tokens", "8", "--tp", "2", "--dp",
            "2", "--replicas", "processes", "--batch-size", "4", "--no-progress",
            "--compile-cache", ""])
    assert rc == 0
    started = xla_bridge.backends_are_initialized()

    import jaxinfer

    recs = [json.loads(x) if i not in (3, 6) else None for i, x in enumerate(lines)]
    good = [(i, r) for i, r in enumerate(recs) if r is not None]
    single = jaxinfer.load_model(model_dir, dtype="float32", backend="reference")
    want = jaxinfer.generate(single, [r.get("prompt", r.get("messages")) for _, r in good],
                             max_new_tokens=8)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    print(json.dumps({
        "backend_started": started, "summary": printed.getvalue(), "n": len(rows),
        "bad_lines": [r["line"] for r in rows if "error" in r],
        "mismatches": [(i, rows[i]["token_ids"], c.token_ids)
                       for (i, _), c in zip(good, want, strict=True)
                       if rows[i]["token_ids"] != c.token_ids or rows[i]["text"] != c.text]}))


def test_replica_devices_count_among_the_gpus_already_visible():
    """A replica process sees its GPUs through ``CUDA_VISIBLE_DEVICES``, numbered among those
    the caller's value shows (so ``CUDA_VISIBLE_DEVICES=4,5,6,7 batch_eval --dp 2 --tp 2``
    pins GPUs 6,7 to the second replica); an index past them is the user's error."""
    from jaxinfer.engine_process import cuda_visible_devices
    from jaxinfer.errors import InputError

    assert cuda_visible_devices((2, 3), None) == "2,3"
    assert cuda_visible_devices((2, 3), "4,5,6,7") == "6,7"
    assert cuda_visible_devices((0,), "GPU-ab12, GPU-cd34") == "GPU-ab12"
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES=4,5 shows 2"):
        cuda_visible_devices((1, 2), "4,5")
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES= shows 0"):  # no GPUs at all
        cuda_visible_devices((0,), "")


def test_replica_processes_route_by_work_left():
    """A ticket goes to the replica with the fewest prompt + new tokens outstanding (the next
    one when that queue is full); done, failed or rejected jobs give their tokens back, also
    when the answer comes before ``submit`` returns; ids for ``cancel`` name the replica."""
    from jaxinfer.engine_process import EngineSpec, QueueFull, ReplicaProcesses
    from jaxinfer.requests import Request
    from jaxinfer.sampling import SamplingParams

    seen: list[list] = []
    pool = ReplicaProcesses(EngineSpec("m", dp=3, replica_processes=True), seen.append,
                            max_queue=0)
    assert [e.spec.devices for e in pool.engines] == [(0,), (1,), (2,)]
    sent: list[tuple[int, str]] = []
    cancelled: list[tuple[int, int]] = []
    full: set[int] = set()
    instant: set[str] = set()  # tickets answered (done) before submit returns

    def fake_submit(ticket, jobs, stream, i):  # no processes: record what each is sent
        if i in full:
            raise QueueFull
        sent.append((i, ticket))
        if ticket in instant:
            pool.engines[i]._on_messages([(ticket, "done", k, "R") for k, _ in jobs])
        return 10 + len(sent)

    for i, engine in enumerate(pool.engines):
        engine.submit = lambda t, j, s, i=i: fake_submit(t, j, s, i)
        engine.cancel = lambda tid, i=i: cancelled.append((i, tid))

    def req(prompt: int, new: int) -> Request:  # new=0: a scoring request (prompt only)
        return Request(tuple(range(prompt)), SamplingParams(max_new_tokens=max(new, 1)), (),
                       num_scored=0 if new else 3)

    ids = {}
    for key, (prompt, new) in zip("abcde", [(10, 90), (5, 5), (40, 10), (1, 1), (30, 0)],
                                  strict=True):
        ids[key] = pool.submit(key, [(0, req(prompt, new))], stream=False)
        # after a, b, c: 100 | 10 | 50; d to 1 (12); e to 1 (42)
    assert sent == [(0, "a"), (1, "b"), (2, "c"), (1, "d"), (1, "e")]
    assert pool._load == [100, 42, 50]
    pool.cancel(ids["d"])
    assert cancelled == [(1, 14)]  # replica 1's own id for d
    msgs = [("a", "done", 0, "A"), ("c", "failed", 0, "why"), ("e", "rejected", None, "no")]
    pool.engines[0]._on_messages(msgs)  # as replica 0's receiver thread would
    assert seen == [msgs] and pool._load == [0, 12, 0]
    instant.add("f")
    pool.submit("f", [(0, req(20, 20)), (1, req(5, 5))], stream=False)
    assert sent[-1] == (0, "f") and pool._load == [0, 12, 0]  # answered within submit
    full.add(0)
    pool.submit("g", [(0, req(20, 20))], stream=False)  # replica 0 is full: the next, 2
    assert sent[-1] == (2, "g") and pool._load == [0, 12, 40]
    full.update({1, 2})
    with pytest.raises(QueueFull):
        pool.submit("h", [(0, req(1, 1))], stream=False)
    assert pool._load == [0, 12, 40]  # nothing held for the refused ticket


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_batch_eval_writes_the_plain_greedy_tokens(tiny_dir, tmp_path, method):
    """``batch_eval --speculative ngram|draft`` (the model as its own draft) writes plain
    greedy's tokens for every record, and each record its proposed and accepted tokens."""
    be = _load_script()
    inp = tmp_path / "in.jsonl"
    # Repetitive prompts, so n-gram lookup has something to propose.
    inp.write_text("".join(json.dumps({"prompt": "ab cd ab cd ab cd " * (1 + i % 3)}) + "\n"
                           for i in range(6)))
    plain, spec = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    assert be.main(_args(tiny_dir, inp, plain, "--max-new-tokens", "12")) == 0
    extra = ["--draft-model", str(tiny_dir)] if method == "draft" else []
    assert be.main(_args(tiny_dir, inp, spec, "--max-new-tokens", "12", "--speculative",
                         method, *extra)) == 0
    want = [json.loads(x) for x in plain.read_text().splitlines()]
    got = [json.loads(x) for x in spec.read_text().splitlines()]
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert all("draft_tokens" not in r for r in want)
    assert all(0 <= r["accepted_tokens"] <= r["draft_tokens"] for r in got)
    assert sum(r["accepted_tokens"] for r in got) > 0
    if method == "draft":  # its own draft: greedy proposals are all accepted
        assert all(r["accepted_tokens"] == r["draft_tokens"] for r in got)


def test_in_process_runner_keeps_the_draft_in_its_own_options(tiny_dir, tmp_path):
    """With ``--draft-model`` the in-process runner's options carry the loaded draft, and
    the options it was given stay as they were (the caller may reuse them)."""
    be = _load_script()
    args = be._parser().parse_args(_args(tiny_dir, tmp_path / "in.jsonl",
                                         tmp_path / "out.jsonl", "--speculative", "draft",
                                         "--draft-model", str(tiny_dir)))
    options = be.sampling_kwargs(args)
    options.pop("seed")
    given = dict(options)
    runner = be._InProcess(args, options)
    assert options == given and options["speculative"] is None  # no draft loaded yet
    assert runner.options["speculative"].draft is not None
    assert {k: v for k, v in runner.options.items() if k != "speculative"} == {
        k: v for k, v in given.items() if k != "speculative"}


@pytest.mark.parametrize("flags, multihost, draft, gpus, want", [
    (("--dp", "4"), False, False, True, True),  # auto on one host of GPUs: processes
    (("--dp", "4"), False, False, False, False),  # CPU or TPU: threads
    (("--dp", "1"), False, False, True, False),  # nothing to split
    (("--dp", "4"), True, False, True, False),  # across hosts: one engine over the mesh
    (("--dp", "4"), False, True, True, False),  # the draft model lives in this process
    (("--dp", "4", "--replicas", "threads"), False, False, True, False),
    (("--dp", "4", "--replicas", "processes"), True, False, False, True),  # refused later
])
def test_replicas_auto_picks_processes_where_they_run(flags, multihost, draft, gpus, want):
    """``--replicas auto`` (the default) runs ``--dp`` replicas as engine processes on one
    host of CUDA GPUs without a draft model, as threads otherwise; an explicit choice is
    kept."""
    import argparse

    from jaxinfer.cli import add_mesh_args, add_replicas_arg, replica_processes

    p = argparse.ArgumentParser()
    add_mesh_args(p)
    add_replicas_arg(p)
    args = p.parse_args(list(flags))
    assert replica_processes(args, multihost=multihost, draft=draft, gpus=gpus) is want


def test_targets_cuda_reads_platforms_and_plugins():
    """CUDA is the target when ``jax_platforms`` allows it (unset, or naming cuda/gpu) and a
    CUDA plugin is installed; this CPU test process (``JAX_PLATFORMS=cpu``) is not one."""
    from jaxinfer.cli import cuda_host, targets_cuda

    cuda13 = ["xla_cuda13"]
    assert targets_cuda(None, cuda13) and targets_cuda("", cuda13)
    assert targets_cuda("cuda,cpu", cuda13) and targets_cuda("gpu", ["xla_cuda12"])
    assert not targets_cuda("cpu", cuda13) and not targets_cuda("tpu", cuda13)
    assert not targets_cuda(None, []) and not targets_cuda(None, ["xla_tpu"])
    assert cuda_host() is False


@pytest.mark.parametrize("extra, message", [
    ((), "--replicas processes runs one process per --dp replica; give --dp 2 or more"),
    (("--dp", "2", "--num-processes", "2", "--coordinator", "h:1", "--process-id", "0"),
     "--replicas processes runs on one host"),
    (("--dp", "2", "--speculative", "draft", "--draft-model", "x"),
     "--speculative draft cannot run with --replicas processes"),
    (("--dp", "2", "--dtype", "int3"), "dtype 'int3' is not supported"),
])
def test_replica_processes_bad_flags(tiny_dir, tmp_path, capsys, extra, message):
    be = _load_script()
    inp = tmp_path / "in.jsonl"
    write_input(inp, 2, bad=False)
    out = tmp_path / "out.jsonl"
    assert be.main(_args(tiny_dir, inp, out, "--replicas", "processes", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"batch_eval: error: {message}"), err
    assert not out.exists()


def test_replica_processes_fail_fast_when_one_replica_fails_to_start():
    """A replica that fails to start (a user's mistake) ends the start at once: replicas still
    loading are killed rather than awaited, started ones are stopped, and its error (not a
    killed replica's) is raised."""
    import threading
    import time

    from jaxinfer.engine_process import EngineInfo, EngineSpec, ReplicaProcesses
    from jaxinfer.errors import InputError

    pool = ReplicaProcesses(EngineSpec("m", dp=3, replica_processes=True), lambda m: None,
                            max_queue=0)
    loading, ready, failing = pool.engines
    killed = threading.Event()
    calls: list[str] = []

    def slow_start():  # a replica loading for a minute unless killed
        if not killed.wait(60):
            raise AssertionError("never killed")
        raise RuntimeError("the engine process exited (code -9) before it was ready")

    def ready_start():
        ready.info = EngineInfo.__new__(EngineInfo)
        return ready.info

    def fail_start():
        time.sleep(0.2)  # after the ready one
        raise InputError("no such model: m")

    loading.start, loading.kill = slow_start, lambda: (calls.append("kill 0"), killed.set())
    ready.start, ready.kill = ready_start, lambda: calls.append("kill 1")
    ready.stop = lambda grace: calls.append(f"stop 1 {grace}")
    failing.start, failing.kill = fail_start, lambda: calls.append("kill 2")
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="no such model"):
        pool.start()
    assert time.perf_counter() - t0 < 30
    assert calls == ["kill 0", "kill 2", "stop 1 0.0"]


def test_replica_processes_results_end_the_run_when_an_engine_fails():
    """An engine's refusal (a reason) is the record's error; a failed or cancelled request
    ends the run (the written records stay a prefix to resume from)."""
    import queue

    be = _load_script()
    runner = be._Processes.__new__(be._Processes)  # its message handling, no processes
    runner._done = queue.SimpleQueue()
    runner._done.put([(1, "accepted", None, None), (1, "done", 1, "C"),
                      (2, "rejected", None, "too long")])
    assert runner.results() == [(1, "C", None), (2, None, "too long")]
    for kind, payload in (("failed", "the engine step raised X"), ("done", None),
                          ("rejected", None)):
        runner._done.put([(3, kind, 3, payload)])
        with pytest.raises(RuntimeError, match=f"could not finish line 3 \\({kind}"):
            runner.results()


@pytest.mark.slow
def test_dp_scaling_runs_each_mode(tiny_dir, tmp_path):
    """``scripts/dp_scaling.py`` runs batch_eval as one replica, 2 threads and 2 processes
    (float32 on 2 forced CPU devices: every mode writes the first run's tokens), and records
    each run's parsed summary and each mode's median over ``one``'s."""
    import os
    import subprocess

    inp = tmp_path / "in.jsonl"
    write_input(inp, 10)
    rec_path = tmp_path / "rec.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dp_scaling.py"), "--dp", "2", "--json",
         str(rec_path), "--", "--model", str(tiny_dir), "--input", str(inp), "--dtype",
         "float32", "--backend", "reference", "--max-new-tokens", "5", "--batch-size", "4",
         "--compile-cache", ""],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(rec_path.read_text())
    runs = rec["runs"]
    assert [r["mode"] for r in runs] == ["one", "threads", "processes"]
    assert all(r["requests"] == 8 and r["identical_records"] == 10 for r in runs), runs
    assert len({r["tokens"] for r in runs}) == 1 and runs[0]["tokens"] == 8 * 5
    assert "--dp 2 --tp 1 --replicas processes" in runs[2]["command"]
    assert "--dp 2 --tp 1 --replicas threads" in runs[1]["command"]
    assert [r["replicas"] is None for r in runs] == [True, False, False]  # one per replica
    one = runs[0]["tok_per_s"]
    for r in runs:
        assert rec["summary"][r["mode"]] == {"median": r["tok_per_s"],
                                             "vs_one": round(r["tok_per_s"] / one, 3)}


def test_dp_scaling_modes_use_the_callers_gpus(monkeypatch):
    """The one-replica baseline runs on the first ``--tp`` GPUs the caller shows, as the
    replica processes count them; the other modes pass ``--replicas``."""
    ds = _load_script("dp_scaling")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert ds.mode_args("one", 2, 2) == (["--tp", "2"], {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert ds.mode_args("processes", 2, 2) == (
        ["--dp", "2", "--tp", "2", "--replicas", "processes"], {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert ds.mode_args("one", 4, 1)[1] == {"CUDA_VISIBLE_DEVICES": "0"}


def test_dp_scaling_parses_the_summary_and_refuses_its_own_flags(capsys):
    ds = _load_script("dp_scaling")
    line = ("requests 2000 generated (+0 resumed, 0 bad)  tokens 256000  wall 4.27 s  "
            "throughput 59906.6 tok/s  468.02 req/s  prefix-cache hits 0 tokens  (after 59.9 s "
            "compiling/loading step programs)  (engine: 93 steps, 4.15 s in steps, 3.88 s "
            "waiting on the device)\nTPOT  p50 3.8 ms\nfloor 2.167 s on 1 device(s) (...): "
            "the run reached 50.7% of it\n")
    assert ds.parse_summary(line) == {
        "requests": 2000, "tokens": 256000, "wall_s": 4.27, "tok_per_s": 59906.6,
        "req_per_s": 468.02, "warm_s": 59.9, "floor_share": 0.507, "replicas": None}
    replicas = "steps 40/41  s in steps 1.10/1.15  s on the device 1.0/1.1  generated 1/2"
    assert ds.parse_summary(line + f"replicas: {replicas}\n")["replicas"] == replicas
    with pytest.raises(ValueError, match="no batch_eval summary line"):
        ds.parse_summary("batch_eval: error: something\n")
    with pytest.raises(SystemExit):
        ds.main(["--dp", "2", "--", "--model", "m", "--dp", "4"])
    assert "['--dp'] are set by this script" in capsys.readouterr().err


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
elif __name__ == "__main__" and sys.argv[1:2] == ["process-worker"]:
    _process_worker(Path(sys.argv[2]))
