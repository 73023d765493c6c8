"""Soak: 1,000 random requests through one engine on CPU, with random sampling options, stop
strings, stop ids, arrivals and cancellations, in a pool small enough to preempt. Nothing is
lost, every result equals the same request run alone, and no page leaks."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import jaxinfer
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from tests.conftest import LetterTokenizer, tiny_engine_model

N = 1000
pytestmark = pytest.mark.slow


@dataclasses.dataclass
class _Job:
    prompt: list[int]
    options: dict[str, Any]
    arrival: int  # engine step at which it is submitted
    cancel_after: int | None  # steps after arrival at which it is cancelled, if any


def _jobs(seed: int) -> list[_Job]:
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    jobs = []
    for _ in range(N):
        options: dict[str, Any] = dict(
            max_new_tokens=int(rng.integers(1, 13)), seed=int(rng.integers(0, 2**31)),
            temperature=float(rng.choice([0.0, 0.0, 0.7, 1.3])),
            top_k=int(rng.choice([0, 5, 50])), top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.0, 1.3])),
            ignore_eos=bool(rng.random() < 0.3), logprobs=bool(rng.random() < 0.2))
        if rng.random() < 0.3:
            options["stop"] = ["".join(rng.choice(list(letters), int(rng.integers(1, 3))))
                               for _ in range(int(rng.integers(1, 3)))]
        if rng.random() < 0.2:
            options["stop_token_ids"] = rng.integers(3, 128, int(rng.integers(1, 3))).tolist()
        jobs.append(_Job(prompt=rng.integers(3, 128, int(rng.integers(1, 25))).tolist(),
                         options=options, arrival=int(rng.integers(0, 300)),
                         cancel_after=int(rng.integers(0, 8)) if rng.random() < 0.08 else None))
    return jobs


def _serve(engine: Engine, jobs: list[_Job], cancels: bool) -> dict[int, jaxinfer.Completion]:
    """Submit each job at its arrival step, cancel some; return the results by job index and
    check that the streamed tokens of each equal its result's."""
    ids: dict[int, int] = {}
    job_of: dict[int, int] = {}
    streamed: dict[int, list[int]] = {}
    cancelled: set[int] = set()
    by_step: dict[int, list[int]] = {}
    for k, j in enumerate(jobs):
        by_step.setdefault(j.arrival, []).append(k)
        if cancels and j.cancel_after is not None:
            by_step.setdefault(j.arrival + j.cancel_after, []).append(~k)
    step = 0
    while len(ids) < len(jobs) or engine.has_unfinished():
        for k in by_step.get(step, []):
            if k >= 0:
                ids[k] = engine.submit(jobs[k].prompt, **jobs[k].options)
                job_of[ids[k]] = k
            else:
                engine.cancel(ids[~k])  # running, waiting or already finished: all cancelled
                cancelled.add(~k)
        for rid, new, _ in engine.step():
            streamed.setdefault(rid, []).extend(new)
        step += 1
    results = {}
    for k, rid in ids.items():
        if k in cancelled:
            with pytest.raises(InputError, match="cancelled"):
                engine.result(rid)
            engine.forget(rid)
            continue
        r = engine.result(rid)
        assert r.error is None and r.token_ids == streamed.get(rid, []), k
        results[k] = r
    return results


@pytest.fixture(scope="module")
def model():
    return dataclasses.replace(tiny_engine_model(context=64), tokenizer=LetterTokenizer())


def test_soak_1000_random_requests(model):
    jobs = _jobs(0)
    engine = Engine(model, num_pages=40, page_size=4, max_batch=16, max_tokens_per_step=32,
                    max_seq_len=40, decode_steps=4, verbose=False)
    got = _serve(engine, jobs, cancels=True)
    n_cancelled = sum(j.cancel_after is not None for j in jobs)
    assert len(got) == N - n_cancelled and n_cancelled > 50
    s = engine.stats()
    assert s.num_preemptions > 0 and s.running == s.waiting == 0 and s.pages_used == 0
    engine.blocks.check_all_free()

    # Each request alone: one slot, so requests run one after another (another page size
    # and decode call length too).
    alone_engine = Engine(model, num_pages=40, page_size=8, max_batch=1, max_tokens_per_step=32,
                          max_seq_len=40, decode_steps=7, verbose=False)
    kept = sorted(got)
    alone = _serve(alone_engine, [dataclasses.replace(jobs[k], arrival=0) for k in kept],
                   cancels=False)
    for pos, k in enumerate(kept):
        a, b = got[k], alone[pos]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text,
                                                           b.finish_reason), k
        if a.logprobs is not None:
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)

    # A sample through generate(), the other entry point.
    rng = np.random.default_rng(1)
    for k in rng.choice(kept, 6, replace=False):
        (alone,) = jaxinfer.generate(model, [jobs[k].prompt], **jobs[k].options)
        assert (alone.token_ids, alone.finish_reason) == (got[k].token_ids,
                                                          got[k].finish_reason), k
