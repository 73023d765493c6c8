"""Issue 15: every bad input is a one-line ``InputError`` raised before any device work, and
writes (``convert``, ``batch_eval``) that cannot destroy or tear what is there."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxinfer
from jaxinfer.errors import InputError
from jaxinfer.requests import Model, make_requests, make_score_requests
from jaxinfer.sampling import SamplingParams
from tests.conftest import tiny_engine_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_engine_model(context=96, seed=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from sharding.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok_model(tiny_dir) -> Model:
    """The tiny converted model with its byte tokenizer (for chat messages)."""
    return jaxinfer.load_model(str(tiny_dir), dtype="float32", backend="reference")


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# --- sampling -------------------------------------------------------------------------------

def test_single_stop_string_and_id_are_one_item():
    assert SamplingParams(stop="was").stop == ("was",)
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=np.int64(5)).stop_token_ids == (5,)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")  # lists become tuples
    assert SamplingParams.from_kwargs(stop="was").stop == ("was",)
    assert SamplingParams.from_kwargs(stop_token_ids=5, stop=None).stop_token_ids == (5,)
    hash(SamplingParams(stop=["a"]))  # frozen params stay hashable


@pytest.mark.parametrize("kwargs, option", [
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"temperature": None}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"top_p": None}, "top_p"),
    ({"min_p": "0"}, "min_p"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty"),
    ({"max_new_tokens": None}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 2**31}, "max_new_tokens"),
    ({"top_k": True}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": True}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": 1.5}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_sampling_values_are_one_line_input_errors(kwargs, option):
    for make in (SamplingParams, SamplingParams.from_kwargs):
        with pytest.raises(InputError) as e:
            make(**kwargs)
        assert one_line(e).startswith(f"{option}=")


def test_good_sampling_values_pass():
    SamplingParams(temperature=np.float32(0.5), top_k=np.int32(4), top_p=1, min_p=0.0,
                   repetition_penalty=1, seed=2**63 - 1, logprobs=np.bool_(True))


# --- prompts --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, where", [
    ([True, False], "token id True"),
    (5, "not int"),
    (None, "not NoneType"),
    ({"role": "user", "content": "hi"}, "not one dict"),
    ([[1, 2], [3, True]], "prompt 1: prompt token id True"),
    ([[1, 2], 7], "prompt 1: a prompt is"),
    ([[1, 2], None], "prompt 1: a prompt is"),
    ([[1, 2], {"a": 1}], "prompt 1: a chat is a list"),
    ([[1, 2], [3, 500]], "prompt 1: prompt token id 500"),
    ([[1, 2], [3, -1]], "prompt 1: prompt token id -1"),
    ([[1, 2], []], "prompt 1: prompt is empty"),
    ([[1, 2], [3, 1.0]], "prompt 1: prompt token id 1.0"),
    ([], "no prompts"),
])
def test_bad_prompts_name_the_prompt(model, prompts, where):
    with pytest.raises(InputError) as e:
        make_requests(model, prompts, False, None, {"max_new_tokens": 2})
    assert where in one_line(e)
    with pytest.raises(InputError):
        jaxinfer.generate(model, prompts, max_new_tokens=2)


def test_bad_score_pairs_name_the_pair(model):
    with pytest.raises(InputError) as e:
        make_score_requests(model, [([1, 2], [3]), ([1, 2], None)])
    assert one_line(e).startswith("score request 1 continuation:")
    with pytest.raises(InputError) as e:
        make_score_requests(model, [([1, 2], [3]), ([False], [3])])
    assert one_line(e).startswith("score request 1 context: prompt token id False")
    with pytest.raises(InputError) as e:
        make_score_requests(model, [([1, 2], [3]), 5])
    assert "score request 1" in one_line(e)


def test_token_ids_still_accepted(model):
    (r,) = make_requests(model, np.array([1, 2, 3]), False, None, {"max_new_tokens": 2})
    assert r.prompt_ids == (1, 2, 3)
    rs = make_requests(model, [[1, 2], (np.int32(3),)], False, None, {"max_new_tokens": 2})
    assert [r.prompt_ids for r in rs] == [(1, 2), (3,)]


@pytest.mark.parametrize("messages, where", [
    ([{"role": "robot", "content": "hi"}], "chat message 0 has role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": None}],
     "chat message 1 has content None"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}],
     "chat message 1 has content 5"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "chat message 1 has role None"),
    ([{"role": "user", "content": "hi"}, "hello"], "chat message 1 is a str"),
    ([{"role": "user", "content": "hi"}, None], "chat message 1 is a NoneType"),
])
def test_bad_chat_messages_name_the_message(tok_model, messages, where):
    with pytest.raises(InputError) as e:
        make_requests(tok_model, messages, False, None, {"max_new_tokens": 2})
    assert where in one_line(e)
    with pytest.raises(InputError) as e:  # in a batch, the prompt index leads
        make_requests(tok_model, ["fine", messages], False, None, {"max_new_tokens": 2})
    assert one_line(e).startswith("prompt 1: ") and where in str(e.value)


def test_good_chat_roles_pass(tok_model):
    msgs = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool")]
    msgs.append({"role": "user", "content": "y"})
    (r,) = make_requests(tok_model, msgs, False, None, {"max_new_tokens": 2})
    assert r.prompt_ids


# --- Engine and CLI -------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["max_batch", "max_seq_len", "max_tokens_per_step",
                                    "num_pages", "kv_cache_bytes", "page_size", "decode_steps"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_engine_rejects_sizes_below_one(model, option, value):
    with pytest.raises(InputError) as e:
        jaxinfer.Engine(model, **{option: value}, verbose=False)
    assert one_line(e).startswith(f"{option}=")


@pytest.mark.parametrize("kwargs, why", [
    ({"page_size": 12}, "page_size=12 must be a power of two"),
    ({"num_pages": 64, "kv_cache_bytes": 2**20}, "pass num_pages or kv_cache_bytes, not both"),
    ({"decode_call_seconds": None}, "decode_call_seconds=None must be a finite"),
    ({"decode_call_seconds": float("nan")}, "decode_call_seconds=nan must be a finite"),
    ({"decode_call_seconds": 0}, "decode_call_seconds=0 must be a finite"),
    ({"decode_call_seconds": "0.2"}, "decode_call_seconds='0.2' must be a finite"),
])
def test_engine_rejects_bad_settings(model, kwargs, why):
    with pytest.raises(InputError) as e:
        jaxinfer.Engine(model, **kwargs, verbose=False)
    assert why in one_line(e)


def test_engine_step_and_cancel_refuse_bad_arguments(model):
    """``step(max_decode_steps=0)`` is refused before it plans anything (it used to preempt
    every running sequence); cancelling an id the engine never issued is refused, while an
    issued, finished one still answers False."""
    engine = jaxinfer.Engine(model, verbose=False)
    (req,) = make_requests(model, [[5, 6, 7]], False, None, {"max_new_tokens": 4})
    rid = engine.add_request(req)
    engine.step(max_decode_steps=1)
    running = engine.stats().num_preemptions
    for bad in (0, -3, 1.5, True):
        with pytest.raises(InputError, match="max_decode_steps=.* must be an integer >= 1"):
            engine.step(max_decode_steps=bad)
    assert engine.stats().num_preemptions == running and engine.has_unfinished()
    while engine.has_unfinished():
        engine.step()
    for bad in (rid + 1, -1, "0", 0.0):
        with pytest.raises(InputError, match="unknown request id"):
            engine.cancel(bad)
    assert len(engine.result(rid).token_ids) == 4 and engine.cancel(rid) is False


def test_load_model_checks_backend_and_mesh_before_loading():
    """A backend typo, a mesh that is not ``make_mesh``'s, and a mesh with shardings are
    one-line errors before anything is read (the model named does not even exist)."""
    from sharding import make_mesh

    for kwargs, why in (({"backend": "palas"}, "unknown attention backend 'palas'"),
                        ({"mesh": 2}, "mesh=2 must be a mesh of axes ('data', 'model')"),
                        ({"mesh": make_mesh(), "shardings": object()},
                         "pass mesh or shardings, not both")):
        with pytest.raises(InputError) as e:
            jaxinfer.load_model("/no/such/model", **kwargs)
        assert why in one_line(e)


def test_stop_ids_outside_the_vocabulary_and_non_pairs_are_refused(model):
    vocab = model.config.vocab_size
    with pytest.raises(InputError, match=f"stop_token_ids \\[{vocab + 5}\\] are outside"):
        make_requests(model, [[5, 6]], False, None, {"max_new_tokens": 2,
                                                     "stop_token_ids": [3, vocab + 5]})
    for bad in (5, None, "text"):
        with pytest.raises(InputError, match="score takes .context, continuation. pairs"):
            make_score_requests(model, bad)


@pytest.mark.parametrize("flags, option", [
    (["--bandwidth", "0"], "--bandwidth"),
    (["--bandwidth", "-1"], "--bandwidth"),
    (["--memory", "nan"], "--memory"),
    (["--flops", "inf"], "--flops"),
    (["--context", "0"], "--context"),
    (["--batch", "0,4"], "--batch"),
    (["--quantize", "int3"], "quantize"),
    (["--quantize", "native"], "quantize"),
    (["--kv-cache-dtype", "int4"], "kv_cache_dtype"),
])
def test_plan_rejects_bad_device_numbers(flags, option, capsys):
    from jaxinfer.cli import main

    assert main(["plan", "--model", "llama-3.1-8b", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and option in err


def test_generate_rejects_an_empty_prompt_before_loading(capsys, monkeypatch):
    from jaxinfer import loading
    from jaxinfer.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    assert main(["generate", "--prompt", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--prompt is empty" in err


# --- convert --------------------------------------------------------------------------------

def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_convert_never_overwrites_a_foreign_folder(tiny_dir, tmp_path, capsys):
    from jaxinfer.cli import main
    from jaxinfer.loading import convert

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"\0weights" * 100)
    (hf / "tokenizer.json").write_text("{}")
    before = _snapshot(hf)
    for overwrite in (False, True):
        with pytest.raises(InputError) as e:
            convert(tiny_dir, hf, overwrite=overwrite)
        assert "not a jaxinfer conversion" in one_line(e)
        assert main(["convert", str(tiny_dir), str(hf), "--overwrite"]) == 2
        assert "not a jaxinfer conversion" in capsys.readouterr().err
    assert _snapshot(hf) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
    afile = tmp_path / "afile"
    afile.write_text("keep")
    with pytest.raises(InputError, match="is a file"):
        convert(tiny_dir, afile)
    assert afile.read_text() == "keep"


def test_convert_overwrites_only_a_previous_conversion(tiny_dir, tmp_path):
    from checkpoints.orbax_io import MARKER
    from jaxinfer.loading import convert

    dst = tmp_path / "out"
    assert convert(tiny_dir, dst) == dst.resolve()
    assert (dst / MARKER).is_file()
    with pytest.raises(InputError) as e:
        convert(tiny_dir, dst)
    assert "--overwrite" in one_line(e)
    (dst / "stale.txt").write_text("from before")
    convert(tiny_dir, dst, overwrite=True)
    assert not (dst / "stale.txt").exists() and (dst / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(tiny_dir, empty)  # an empty folder is fine
    m = jaxinfer.load_model(str(dst), dtype="float32", backend="reference")
    assert m.config.vocab_size > 0


def test_interrupted_convert_leaves_dst_alone(tiny_dir, tmp_path, monkeypatch):
    import checkpoints.orbax_io as orbax_io
    from jaxinfer.loading import convert

    dst = tmp_path / "out"
    convert(tiny_dir, dst)
    before = _snapshot(dst)

    def boom(directory, *args, **kwargs):
        (Path(directory) / "config.json").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(orbax_io, "save_converted", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_dir, dst, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_dir, tmp_path / "new")
    assert _snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- batch_eval -----------------------------------------------------------------------------

def _load_batch_eval():
    spec = importlib.util.spec_from_file_location("batch_eval", REPO / "scripts" / "batch_eval.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["batch_eval"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_batch_eval_bad_output_reported_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    be = _load_batch_eval()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(jaxinfer, "load_model", no_load)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, why in ((tmp_path, "is a directory"), (afile / "out.jsonl", "cannot be written")):
        assert be.main(["--model", str(tiny_dir), "--input", str(inp), "--output", str(out),
                        "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--output" in err and why in err
    assert afile.read_text() == "x"
    # A seed out of range is refused as given, before loading (each record's seed is
    # ``offset_seed(seed, line)``, so the largest valid seed stays valid on every line).
    out = tmp_path / "out.jsonl"
    assert be.main(["--model", str(tiny_dir), "--input", str(inp), "--output", str(out),
                    "--seed", "-5", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "seed=-5 must be an integer in [0, 2**63)" in err


def test_offset_seed_wraps_valid_seeds_and_keeps_invalid_ones_for_refusal():
    """``offset_seed``: a record's / turn's / choice's seed, ``seed + offset`` modulo 2**63,
    so the largest seed plus an offset is still a seed; an invalid base comes back as it is,
    and ``SamplingParams`` refuses it."""
    from jaxinfer.sampling import SEEDS, offset_seed

    assert offset_seed(7, 3) == 10 and offset_seed(SEEDS - 1, 2) == 1
    SamplingParams(seed=offset_seed(SEEDS - 1, 5))
    for bad in (-5, SEEDS):
        assert offset_seed(bad, 1) == bad
        with pytest.raises(InputError, match="must be an integer in"):
            SamplingParams(seed=offset_seed(bad, 1))


def test_batch_eval_keeps_unicode_line_separators_in_records(tmp_path):
    be = _load_batch_eval()
    inp = tmp_path / "in.jsonl"
    prompts = ["one\u2028two", "three\u2029four\u0085five", "plain"]
    # ensure_ascii=False writes U+2028 raw, as many JSONL writers do; one record uses \r\n.
    lines = [json.dumps({"id": i, "prompt": p}, ensure_ascii=False) for i, p in enumerate(prompts)]
    inp.write_text(lines[0] + "\n" + lines[1] + "\r\n" + lines[2] + "\n", encoding="utf-8",
                   newline="")
    records = be.parse_records(inp, score=False)
    assert [r.error for r in records] == [None, None, None]
    assert [r.prompt for r in records] == prompts
    assert [r.line for r in records] == [1, 2, 3]


def test_stream_takes_one_prompt(model):
    with pytest.raises(InputError, match="stream takes one prompt, got 2"):
        next(jaxinfer.stream_tokens(model, [[3, 4], [5, 6]]))
