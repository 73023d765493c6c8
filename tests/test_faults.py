"""Faults while requests run: a request whose output handling raises, and a device
out-of-memory error in a step, end only the requests involved, with an error result naming
the cause; the pages are freed and every other request gives the tokens it gives alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import engine as engine_module
from jaxinfer.engine import Engine
from jaxinfer.requests import Model, make_score_requests
from tests.conftest import tiny_engine_model


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_engine_model(context=128, max_batch=4)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 128, size=int(rng.integers(2, 12))).tolist() for _ in range(n)]


def _engine(model: Model) -> Engine:
    return Engine(model, num_pages=48, page_size=4, max_tokens_per_step=16, max_seq_len=64,
                  decode_steps=4, verbose=False)


def _alone(model: Model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    return [jaxinfer.generate(model, [p], max_new_tokens=max_new, ignore_eos=True)[0].token_ids
            for p in prompts]


def test_a_request_whose_output_handling_raises_ends_alone(model, monkeypatch):
    prompts = _prompts(5)
    poison = prompts[2]
    real = engine_module.add_tokens
    calls = {"poisoned": 0}

    def add_tokens(model_, req, progress, tokens, logprobs, *rest):
        if list(req.prompt_ids) == poison:
            calls["poisoned"] += 1
            if calls["poisoned"] == 2:  # after its first token: a failure mid-generation
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(model_, req, progress, tokens, logprobs, *rest)

    monkeypatch.setattr(engine_module, "add_tokens", add_tokens)
    engine = _engine(model)
    ids = [engine.submit(p, max_new_tokens=9, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    results = [engine.result(i) for i in ids]
    bad = results[2]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 1
    assert f"request {ids[2]} failed" in bad.error and "UnicodeDecodeError" in bad.error
    monkeypatch.undo()
    want = _alone(model, prompts, 9)
    for i in (0, 1, 3, 4):
        assert results[i].error is None and results[i].token_ids == want[i]
    engine.blocks.check_all_free()


def test_generate_returns_and_stream_raises_a_failed_request(model, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("stop check exploded")

    monkeypatch.setattr(engine_module, "add_tokens", fail)
    (c,) = jaxinfer.generate(model, [[5, 6, 7]], max_new_tokens=4)
    assert c.finish_reason == "error" and "RuntimeError: stop check exploded" in c.error
    with pytest.raises(jaxinfer.RequestError, match="stop check exploded"):
        list(jaxinfer.stream_tokens(model, [5, 6, 7], max_new_tokens=4))
    monkeypatch.undo()
    (ok,) = jaxinfer.generate(model, [[5, 6, 7]], max_new_tokens=4)  # the engine still works
    assert ok.error is None and len(ok.token_ids) >= 1


def _out_of_memory_once(monkeypatch, name: str, on_call: int, lose_pool: bool) -> dict:
    """Make the engine's ``name`` step program fail like a device OOM on call ``on_call``;
    with ``lose_pool`` it first deletes the (donated) pool, as a failed execution may."""
    real = getattr(engine_module, name)
    seen = {"calls": 0}

    def step(params, pool, *args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == on_call:
            if lose_pool:
                for x in jax.tree.leaves(pool):
                    x.delete()
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50GiB.")
        return real(params, pool, *args, **kwargs)

    monkeypatch.setattr(engine_module, name, step)
    return seen


@pytest.mark.parametrize("name, on_call, lose_pool", [
    ("mixed_step", 2, False), ("mixed_step", 2, True), ("decode_steps", 2, True)])
def test_out_of_memory_ends_the_steps_requests_and_frees_their_pages(model, monkeypatch, capsys,
                                                                      name, on_call, lose_pool):
    prompts = _prompts(7)
    want = _alone(model, prompts, 10)
    _out_of_memory_once(monkeypatch, name, on_call, lose_pool)
    engine = _engine(model)
    ids = [engine.submit(p, max_new_tokens=10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    results = [engine.result(i) for i in ids]
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed, "the failing step's requests end with an error"
    shape = "mixed step of" if name == "mixed_step" else "decode call of"
    for r in failed:
        assert "ran out of memory" in r.error and shape in r.error
        assert "RESOURCE_EXHAUSTED" in r.error
    for r, w in zip(results, want, strict=True):
        if r.error is None:  # the others (recomputed when the pool was lost) are unaffected
            assert r.token_ids == w
    assert "ran out of memory" in capsys.readouterr().err
    engine.blocks.check_all_free()
    assert engine.stats().pages_used == 0


def test_a_scoring_request_in_a_failed_step_reports_the_error(model, monkeypatch):
    _out_of_memory_once(monkeypatch, "mixed_step", 1, False)
    engine = _engine(model)
    (rid,) = [engine.add_request(r) for r in make_score_requests(model, [([3, 4, 5], [6, 7])])]
    (res,) = engine.run([rid])
    assert "ran out of memory" in res.error and np.isnan(res.logprob) and not res.greedy


def test_batch_eval_writes_a_failed_request_as_an_error_record(model, monkeypatch):
    from tests.test_batch_eval import _load_script

    monkeypatch.setattr(engine_module, "add_tokens", lambda *a: 1 / 0)
    (c,) = jaxinfer.generate(model, [[5, 6, 7]], max_new_tokens=4)
    assert _load_script()._record(c, speculative=False) == {"error": c.error}
    assert "ZeroDivisionError" in c.error
