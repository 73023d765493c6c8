"""The one engine on a tiny random model (float32): every request's output equals the same
request run alone, whatever the batch, arrival order, pool size, chunking, multi-step decode or
prefix sharing; and greedy outputs equal an independent argmax loop over ``compute_logits``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import runner
from jaxinfer.engine import Engine
from jaxinfer.errors import InputError
from jaxinfer.model import init_params
from jaxinfer.requests import Model, make_score_requests
from tests.conftest import LetterTokenizer, tiny_engine_model

PAGE = 4
SLOTS = 8
BUDGET = 32
MAX_SEQ = 32


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_engine_model(context=256, max_batch=SLOTS)


def _engine(model: Model, num_pages: int = 64, **kw) -> Engine:
    kw = {"page_size": PAGE, "max_tokens_per_step": BUDGET, "max_seq_len": MAX_SEQ,
          "verbose": False, **kw}
    return Engine(model, num_pages=num_pages, **kw)


def _workload(seed: int, n: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_new_tokens, arrival step) triples."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 128, size=int(rng.integers(1, 17))).tolist(),
             int(rng.integers(9, 17)), int(rng.integers(0, 60))) for _ in range(n)]


def _serve(engine: Engine, work: list[tuple[list[int], int, int]], **sampling):
    """Submit each request at its arrival step; return results and the streamed tokens."""
    ids: dict[int, int] = {}
    streamed: dict[int, list[int]] = {}
    finished: set[int] = set()
    step = 0
    while len(ids) < len(work) or engine.has_unfinished():
        for i, (prompt, max_new, arrival) in enumerate(work):
            if arrival == step:
                ids[i] = engine.submit(prompt, max_new_tokens=max_new, **sampling)
        for rid, new, done in engine.step():
            assert rid not in finished
            streamed.setdefault(rid, []).extend(new)
            if done:
                finished.add(rid)
        step += 1
    results = [engine.result(ids[i]) for i in range(len(work))]
    return results, [streamed.get(ids[i], []) for i in range(len(work))]


@pytest.fixture(scope="module")
def work200() -> list[tuple[list[int], int, int]]:
    return _workload(0, 200)


@pytest.fixture(scope="module")
def alone200(model, work200) -> list[jaxinfer.Completion]:
    return [jaxinfer.generate(model, [p], max_new_tokens=m)[0] for p, m, _ in work200]


def greedy_oracle(model: Model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens from full recomputation (``compute_logits`` + argmax), no engine."""
    out: list[int] = []
    for _ in range(max_new):
        tok = int(np.argmax(jaxinfer.compute_logits(model, prompt + out)[-1]))
        if tok in model.config.eos_token_ids:
            break
        out.append(tok)
    return out


def test_alone_equals_recomputation_oracle(model, work200, alone200):
    for (p, m, _), got in list(zip(work200, alone200, strict=True))[:6]:
        assert got.token_ids == greedy_oracle(model, p, m)


def _assert_same(got: list[jaxinfer.Completion], want: list[jaxinfer.Completion]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), f"request {i}"
        assert g.prompt_token_ids == w.prompt_token_ids


def test_200_requests_equal_each_alone(model, work200, alone200):
    engine = _engine(model)
    got, streamed = _serve(engine, work200)
    _assert_same(got, alone200)
    assert streamed == [c.token_ids for c in got]  # the events carry exactly the outputs
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.pages_used == 0
    engine.blocks.check_all_free()
    assert stats.generated_tokens >= sum(len(c.token_ids) for c in got)
    # One program per token bucket and decode row bucket at most.
    assert stats.num_programs <= len(engine.token_buckets) + len(engine.row_buckets)
    assert stats.decode_calls < stats.generated_tokens / 2  # several tokens per round trip


def test_small_pool_preempts_and_gives_same_outputs(model, work200, alone200):
    engine = _engine(model, num_pages=MAX_SEQ // PAGE + 4)  # one long request + a little
    got, _ = _serve(engine, work200)
    _assert_same(got, alone200)
    assert engine.stats().num_preemptions > 0
    engine.blocks.check_all_free()


def test_preemption_without_chunked_prefill(model, work200, alone200):
    # Budget 16 fits any prompt (<= 16) but not a preempted request's prompt + output, whose
    # recompute must then be chunked anyway.
    engine = _engine(model, num_pages=MAX_SEQ // PAGE + 2, max_tokens_per_step=16,
                     chunked_prefill=False)
    got, _ = _serve(engine, work200[:60])
    _assert_same(got, alone200[:60])
    assert engine.stats().num_preemptions > 0
    engine.blocks.check_all_free()


def test_sampling_options_equal_generate(model):
    work = _workload(1, 12)
    opts = dict(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3, logprobs=True,
                presence_penalty=0.4, frequency_penalty=0.7)
    # Small: preempted requests must resume identically (their token counts reloaded).
    engine = _engine(model, num_pages=24)
    ids = [engine.submit(p, max_new_tokens=m, seed=i, **opts) for i, (p, m, _) in enumerate(work)]
    engine.run_until_done()
    for i, (p, m, _) in enumerate(work):
        got = engine.result(ids[i])
        (want,) = jaxinfer.generate(model, [p], max_new_tokens=m, seed=i, **opts)
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert engine.stats().num_preemptions > 0


def test_prefix_sharing_uses_fewer_pages_same_outputs(model):
    rng = np.random.default_rng(2)
    system = rng.integers(3, 128, size=20).tolist()  # five full pages
    prompt = rng.integers(3, 128, size=10).tolist()
    requests = [(prompt, dict(temperature=1.0, seed=s)) for s in range(4)]  # n=4 samples
    requests += [(system + rng.integers(3, 128, size=3).tolist(), {}) for _ in range(10)]

    def run(prefix_caching: bool):
        engine = _engine(model, prefix_caching=prefix_caching, max_seq_len=48)
        ids = [engine.submit(p, max_new_tokens=10, **o) for p, o in requests]
        engine.run_until_done()
        return [engine.result(i).token_ids for i in ids], engine.stats()

    shared, s_on = run(True)
    plain, s_off = run(False)
    assert shared == plain
    assert s_on.prefix_cache_hit_rate > 0.3 and s_off.prefix_cache_hit_rate == 0
    assert s_on.peak_pages_used < s_off.peak_pages_used
    assert s_on.computed_tokens < s_off.computed_tokens  # the shared prefix was read once


def test_fully_cached_prompt_maps_pages_before_its_last_token(model):
    prompt = np.random.default_rng(3).integers(3, 128, size=12).tolist()  # 3 full pages
    engine = _engine(model)
    first = engine.submit(prompt, max_new_tokens=9)
    engine.run_until_done()
    again = engine.submit(prompt, max_new_tokens=9)  # cached; token 11 must be recomputed
    engine.run_until_done()
    # Pages before the one holding the first output position (11) are mapped: 2 x 4 tokens.
    assert engine.request_metrics(again).cached_prompt_tokens == 8
    (want,) = jaxinfer.generate(model, [prompt], max_new_tokens=9)
    assert engine.result(first).token_ids == engine.result(again).token_ids == want.token_ids
    engine.blocks.check_all_free()


def test_multi_step_decode_equals_single_step(model, work200, alone200):
    calls = {}
    work = [(p, m, 0) for p, m, _ in work200[:40]]  # all at once: long decode-only stretches
    for steps in (1, 5):
        engine = _engine(model, decode_steps=steps)
        got, _ = _serve(engine, work)
        _assert_same(got, alone200[:40])
        calls[steps] = engine.stats().decode_calls
    assert calls[1] > 2 * calls[5]  # five tokens per round trip where nothing intervenes


def test_run_decodes_whole_calls_and_step_follows_decode_call_seconds(model, work200):
    # run() (generate, score) and run_until_done(): nobody can submit while they wait, so
    # each decode call runs up to decode_steps; step() keeps decode_call_seconds (tiny here:
    # calls of the 4-iteration minimum), which bounds how long a request submitted meanwhile
    # waits for a slot.
    prompt = work200[0][0]
    calls = {}
    for how in ("run", "run_until_done", "step"):
        engine = _engine(model, decode_steps=8, decode_call_seconds=1e-9)
        engine.warmup()  # compiled here: every call below is timed, so the 4-minimum holds
        rid = engine.submit(prompt, max_new_tokens=17, ignore_eos=True)
        if how == "run":
            (got,) = engine.run([rid])
        else:
            if how == "run_until_done":
                engine.run_until_done()
            else:
                while engine.has_unfinished():
                    engine.step()
            got = engine.result(rid)
        assert len(got.token_ids) == 17
        calls[how] = engine.stats().decode_calls
    # 16 decoded tokens after the prefill's first, 8 per call
    assert calls["run"] == calls["run_until_done"] == 2
    assert calls["step"] == 3  # 8 before a time is measured, then the minimum of 4 twice


def test_greedy_batches_run_the_greedy_sampler_program(model, work200, alone200):
    # The host picks the sampler statically: greedy-only steps must never compile (or run)
    # the sampled variant, whose vocabulary sort costs device time on every step.
    engine = _engine(model)
    greedy, _ = _serve(engine, [(p, m, 0) for p, m, _ in work200[:6]])
    _assert_same(greedy, alone200[:6])
    programs = engine.stats().num_programs
    engine.submit(work200[0][0], max_new_tokens=6, temperature=0.8, seed=3)
    engine.run_until_done()
    assert engine.stats().num_programs == programs + 2  # its mixed step and decode loop


def test_call_lengths_ignore_a_calls_compile_time(model):
    # The first decode call of a shape compiles; its seconds must not count as device time
    # per iteration, or every later call would be cut to the minimum length.
    engine = _engine(model, num_pages=61, decode_steps=4)  # a pool size no other test uses
    engine.submit([5, 6, 7], max_new_tokens=12, ignore_eos=True)
    engine.step()  # prefill
    engine.step()  # first decode call: compiles
    assert engine._iteration_s == {}
    engine.run_until_done()
    assert list(engine._iteration_s) == [engine.row_buckets[0]]  # measured by later calls


def test_longest_first_admits_long_generations_first(model, work200, alone200):
    work = work200[:10]
    engine = _engine(model, max_batch=4, schedule="longest_first")
    ids = [engine.submit(p, max_new_tokens=m) for p, m, _ in work]
    engine.step()
    admitted = {i for i in ids if engine.request_metrics(i).queue_time is not None}
    by_length = sorted(range(10), key=lambda i: -work[i][1])  # stable, like the engine
    assert admitted == {ids[i] for i in by_length[:4]}
    engine.run_until_done()
    _assert_same([engine.result(i) for i in ids], alone200[:10])
    with pytest.raises(InputError, match="schedule='lifo' must be one of fcfs, longest_first"):
        _engine(model, schedule="lifo")


def test_no_token_after_a_stop_token(model, work200, alone200):
    # Stops that fire inside a multi-step decode call: the device keeps no token past them.
    cases = [(p, m, a) for (p, m, _), a in zip(work200, alone200, strict=True)
             if len(a.token_ids) >= 8][:8]
    engine = _engine(model, decode_steps=16)
    ids = []
    for p, m, a in cases:
        stop = a.token_ids[5]
        ids.append((engine.submit(p, max_new_tokens=m, stop_token_ids=[stop]), stop, a))
    engine.run_until_done()
    for rid, stop, a in ids:
        got = engine.result(rid)
        assert got.finish_reason == "stop" and stop not in got.token_ids
        assert got.token_ids == a.token_ids[: a.token_ids.index(stop)]


def test_ignore_eos_runs_to_length(model, work200, alone200):
    import dataclasses

    # Make a token the model emits early its eos, then ask to ignore it.
    p, m, _ = work200[0]
    eos = alone200[0].token_ids[2]
    cfg = dataclasses.replace(model.config, eos_token_ids=(eos,))
    eos_model = dataclasses.replace(model, config=cfg)
    (stopped,) = jaxinfer.generate(eos_model, [p], max_new_tokens=m)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == alone200[0].token_ids[: alone200[0].token_ids.index(eos)]
    (full,) = jaxinfer.generate(eos_model, [p], max_new_tokens=m, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.token_ids) == m


def test_chunked_prefill_equals_unchunked(model):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 128, size=int(n)).tolist() for n in (40, 3, 27, 55, 9)]

    def run(**kw):
        engine = _engine(model, max_seq_len=72, **kw)
        ids = [engine.submit(p, max_new_tokens=12) for p in prompts]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return [engine.result(i).token_ids for i in ids], steps

    chunked, chunked_steps = run(max_tokens_per_step=SLOTS, prefix_caching=False)
    whole, _ = run(max_tokens_per_step=64, chunked_prefill=False, prefix_caching=False)
    assert chunked == whole
    assert chunked_steps > 55 // SLOTS  # the long prompts really were split


def test_compile_count_fixed_after_warmup(model):
    engine = _engine(model)
    engine.warmup(score=True, sampled=True)
    sizes = (runner.mixed_step._cache_size(), runner.decode_steps._cache_size())
    warm = engine.stats().num_programs
    # greedy and sampled generation, greedy and sampled scoring per token bucket; greedy and
    # sampled decode loops per row bucket
    assert warm == 4 * len(engine.token_buckets) + 2 * len(engine.row_buckets)
    for prompt, max_new, _ in _workload(5, 30):  # new lengths, batch sizes, page counts
        engine.submit(prompt, max_new_tokens=max_new, temperature=0.5, seed=1)
    engine.run_until_done()
    (rid,) = [engine.add_request(r) for r in make_score_requests(model, [([3, 4, 5], [6, 7])])]
    engine.run([rid])
    assert engine.stats().num_programs == warm
    assert (runner.mixed_step._cache_size(), runner.decode_steps._cache_size()) == sizes


def test_metrics(model):
    engine = _engine(model)
    ids = [engine.submit(p, max_new_tokens=m) for p, m, _ in _workload(6, 6)]
    engine.run_until_done()
    rid = max(ids, key=lambda i: engine.request_metrics(i).num_generated)  # avoid early eos
    m = engine.request_metrics(rid)
    assert m.num_generated > 1 and m.queue_time >= 0 and m.num_preemptions == 0
    assert m.time_to_first_token >= m.queue_time and m.time_per_output_token > 0
    completion = engine.result(rid)
    assert len(completion.token_ids) == m.num_generated
    assert completion.time_to_first_token == pytest.approx(m.time_to_first_token)
    s = engine.stats()
    assert s.tokens_per_second > 0 and s.decode_calls < m.num_generated
    assert 0 < s.decode_seconds < s.device_seconds <= s.step_seconds  # mixed steps ran too
    assert s.tokens_capacity == 64 * PAGE and s.pages_used == 0 and s.pages_cached > 0


def test_bad_input_is_one_line_error(model):
    engine = _engine(model, num_pages=8)
    with pytest.raises(InputError, match="max_seq_len"):
        engine.submit(list(range(3, 30)), max_new_tokens=16)  # can never fit
    with pytest.raises(InputError, match="one prompt"):
        engine.submit([[3, 4], [5, 6]])
    with pytest.raises(InputError, match="max_new_tokens"):
        engine.submit([3, 4], max_new_tokens=0)
    rid = engine.submit([3, 4], max_new_tokens=9)
    with pytest.raises(InputError, match="not finished"):
        engine.result(rid)
    engine.run_until_done()
    engine.result(rid)
    with pytest.raises(InputError, match="already taken"):
        engine.result(rid)
    with pytest.raises(InputError, match="unknown request id 999"):
        engine.result(999)
    (done,) = engine.run([engine.submit([3, 4], max_new_tokens=9)])  # run() forgets its ids
    assert done.finish_reason in ("stop", "length")
    with pytest.raises(InputError, match="unknown request id"):
        engine.request_metrics(rid + 1)
    with pytest.raises(InputError, match="max_tokens_per_step"):
        Engine(model, num_pages=8, max_batch=8, max_tokens_per_step=4, verbose=False)
    with pytest.raises(InputError, match="without chunked prefill"):
        _engine(model, chunked_prefill=False, max_tokens_per_step=8).submit(list(range(3, 20)),
                                                                       max_new_tokens=9)


def test_generate_and_stream_share_the_models_engine(model, work200, alone200):
    from jaxinfer.replicas import engine_for

    work = work200[:20]
    sampling = [jaxinfer.SamplingParams(max_new_tokens=m) for _, m, _ in work]
    got = jaxinfer.generate(model, [p for p, _, _ in work], sampling=sampling)
    _assert_same(got, alone200[:20])
    engine = engine_for(model)
    assert model.engine is engine and engine.max_batch == SLOTS  # model.max_batch slots
    before = engine.stats().generated_tokens
    streamed = [t for piece in jaxinfer.stream_tokens(model, work[0][0], chunk_steps=3,
                                                      max_new_tokens=work[0][1]) for t in piece]
    assert streamed == alone200[0].token_ids
    assert engine.stats().generated_tokens == before + len(streamed)
    assert not engine.has_unfinished() and engine.stats().pages_used == 0


def test_cancel_waiting_running_and_finished(model, work200, alone200):
    engine = _engine(model)
    work = work200[:12]  # 12 requests, 8 slots: some wait
    ids = [engine.submit(p, max_new_tokens=m) for p, m, _ in work]
    finished: list[int] = []
    while len(finished) < 1:
        finished += [i for i, _, done in engine.step() if done]
    running = next(i for i in ids if i not in finished and engine.request_metrics(i).num_generated)
    waiting = ids[-1]
    assert engine.request_metrics(waiting).queue_time is None  # not admitted yet
    assert engine.cancel(running) and engine.cancel(waiting)
    assert not engine.cancel(finished[0])  # finished: its result is dropped
    assert not engine.cancel(running)  # once only
    engine.run_until_done()
    for k, rid in enumerate(ids):
        if rid in (running, waiting, finished[0]):
            with pytest.raises(InputError, match="cancelled"):
                engine.result(rid)
            assert engine.forget(rid)
        else:
            got = engine.result(rid)
            assert got.token_ids == alone200[k].token_ids, k
    engine.blocks.check_all_free()


def test_interrupted_generate_and_closed_stream_leave_the_engine_usable(model, work200,
                                                                         alone200):
    from jaxinfer.replicas import engine_for

    work = work200[:10]
    prompts = [p for p, _, _ in work]
    sampling = [jaxinfer.SamplingParams(max_new_tokens=m) for _, m, _ in work]
    engine = engine_for(model)
    calls = {"n": 0}
    real_step = engine.step

    def interrupted(*a, **kw):  # Ctrl-C in the middle of a run
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(*a, **kw)

    engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            jaxinfer.generate(model, prompts, sampling=sampling)
    finally:
        del engine.step
    assert not engine.has_unfinished() and engine.stats().pages_used == 0
    pieces = jaxinfer.stream_tokens(model, prompts[0], chunk_steps=2,
                                    max_new_tokens=work[0][1])
    assert next(pieces) == alone200[0].token_ids[:1]
    pieces.close()  # the caller stops reading: the request is cancelled
    assert not engine.has_unfinished() and engine.stats().pages_used == 0
    _assert_same(jaxinfer.generate(model, prompts, sampling=sampling), alone200[:10])


def test_engine_needs_no_sizing_arguments(model):
    from jaxinfer.engine import CPU_KV_CACHE_BYTES
    from jaxinfer.paged_cache import PagePool

    engine = Engine(model, verbose=False)
    per_page = PagePool.bytes_per_page(model.config, engine.page_size, model.dtype)
    assert engine.blocks.num_pages == CPU_KV_CACHE_BYTES // per_page
    assert engine.max_seq_len == model.config.max_position_embeddings
    rid = engine.submit([3, 4, 5], max_new_tokens=9)
    engine.run_until_done()
    assert engine.result(rid).token_ids == greedy_oracle(model, [3, 4, 5], 9)


def test_stop_strings_and_text_equal_generate(model, work200, alone200):
    import dataclasses

    lettered = dataclasses.replace(model, tokenizer=LetterTokenizer())
    work = [(p, m) for (p, m, _), a in zip(work200, alone200, strict=True)
            if len(a.token_ids) >= 4][:6]
    engine = _engine(lettered)
    stops = []
    for p, m in work:
        (full,) = jaxinfer.generate(lettered, [p], max_new_tokens=m)
        stops.append(full.text[2:4])  # a stop string that completes mid-output
    ids = [engine.submit(p, max_new_tokens=m, stop=s)
           for (p, m), s in zip(work, stops, strict=True)]
    engine.run_until_done()
    for (p, m), s, rid in zip(work, stops, ids, strict=True):
        got = engine.result(rid)
        (want,) = jaxinfer.generate(lettered, [p], max_new_tokens=m, stop=s)
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text, want.token_ids, want.finish_reason)
        assert got.finish_reason == "stop" and s not in got.text


def test_pallas_kernels_give_the_reference_tokens():
    # Interpret mode on CPU: mixed steps run the ragged kernel, decode calls the paged one.
    cfg = jaxinfer.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128,
                               num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                               max_position_embeddings=64)
    params = init_params(cfg, jax.random.PRNGKey(2), jnp.float32)
    prompts = [[5, 6, 7], list(range(10, 30)), [40]]
    outs = {}
    for backend in ("reference", "pallas"):
        m = Model(config=cfg, params=params, tokenizer=None, dtype=jnp.float32,
                  backend=backend, max_batch=4)
        outs[backend] = [c.token_ids for c in jaxinfer.generate(
            m, prompts, max_new_tokens=6, ignore_eos=True)]
    assert outs["pallas"] == outs["reference"]


def test_step_shape_buckets():
    assert runner.token_buckets(4096, 128) == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                                                3072, 4096)
    assert runner.token_buckets(300, 16, fine=False) == (16, 32, 64, 128, 256, 300)
    assert runner.row_buckets(256) == (2, 8, 16, 32, 64, 128, 256)
    assert runner.row_buckets(1) == (1,)
    assert runner.row_buckets(64, few=(1, 2, 4)) == (1, 2, 4, 8, 16, 32, 64)
    # verify steps: every row's last token and proposals, in 16-token tiles, within the budget
    assert [runner.verify_tokens(b, 4, 256) for b in (2, 8, 64)] == [16, 48, 256]
    assert [runner.bucket(n, (1, 8, 16)) for n in (1, 2, 8, 9, 16)] == [1, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.bucket(17, (1, 8, 16))


def _long_prompts(n: int, seed: int = 9) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=int(rng.integers(10, 21))).tolist() for _ in range(n)]


def test_mixed_steps_launched_ahead_equal_each_alone(model):
    # A token budget of 8 chunks the prompts, so prompt work lasts many steps and each mixed
    # step is launched before the one before it is read. Requests stop on a stop token, on
    # max_new_tokens (1 to 4: some end in the step that reads their prompt's end), sample
    # with seeds, use penalties, and one asks for top log-probabilities.
    prompts = _long_prompts(12)
    params = [jaxinfer.SamplingParams(max_new_tokens=1 + i % 4, temperature=0.8 * (i % 2),
                                      seed=i, repetition_penalty=1.0 + 0.2 * (i % 3 == 0),
                                      logprobs=True, top_logprobs=2 * (i == 5))
              for i in range(len(prompts))]
    alone = [jaxinfer.generate(model, [p], sampling=sp)[0]
             for p, sp in zip(prompts, params, strict=True)]
    stops = {3: alone[3].token_ids[1] if len(alone[3].token_ids) > 1 else None}
    engine = _engine(model, max_tokens_per_step=8, max_batch=8)
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        if stops.get(i) is not None:
            sp = dataclasses.replace(sp, stop_token_ids=[stops[i]])
        ids.append(engine.submit(p, sampling=sp))
    engine.run_until_done()
    got = [engine.result(i) for i in ids]
    assert engine.stats().ahead_steps > 5
    for i, (g, a) in enumerate(zip(got, alone, strict=True)):
        want = a.token_ids
        if stops.get(i) is not None:
            want = want[: want.index(stops[i])]
        assert g.token_ids == want, i
        assert g.logprobs == pytest.approx(a.logprobs[: len(want)], abs=1e-5)
    assert [d.keys() for d in got[5].top_logprobs] == [d.keys() for d in alone[5].top_logprobs]
    engine.blocks.check_all_free()


def test_a_step_launched_ahead_drops_a_request_cancelled_meanwhile(model, work200, alone200):
    prompts = _long_prompts(6, seed=3)
    alone = [jaxinfer.generate(model, [p], max_new_tokens=6)[0] for p in prompts]
    engine = _engine(model, max_tokens_per_step=8)
    ids = [engine.submit(p, max_new_tokens=6) for p in prompts]
    while not engine.stats().ahead_steps:
        engine.step()
    victim = next(i for i in ids if not engine.finished(i))
    assert engine.cancel(victim)
    engine.run_until_done()
    for rid, a in zip(ids, alone, strict=True):
        if rid != victim:
            assert engine.result(rid).token_ids == a.token_ids
    engine.blocks.check_all_free()
    assert engine.stats().pages_used == 0


@pytest.mark.parametrize("no_arrivals", [False, True])
def test_a_decode_call_ends_when_waiting_requests_get_their_slots(model, no_arrivals):
    # 8 slots, a ninth request waiting: the decode call ends (at the chunk boundary) once
    # one row stops, however long decode_call_seconds allows, so the ninth is admitted then
    # (a call of decode_steps would have run the others to 40 tokens, one of 16 to ~21).
    # The same when the caller submits nothing more (run(): whole calls only when none
    # waits).
    prompts = _long_prompts(9, seed=5)
    lengths = [12] + [40] * 8
    alone = [jaxinfer.generate(model, [p], max_new_tokens=m, ignore_eos=True)[0]
             for p, m in zip(prompts, lengths, strict=True)]
    engine = _engine(model, num_pages=256, max_batch=8, decode_steps=64,
                     decode_call_seconds=100.0, max_seq_len=64)
    ids = [engine.submit(p, max_new_tokens=m, ignore_eos=True)
           for p, m in zip(prompts, lengths, strict=True)]
    seen = dict.fromkeys(ids, 0)
    seen_at_admission = None
    while engine.has_unfinished():
        for rid, new, _ in engine.step(no_arrivals=no_arrivals):
            if rid == ids[8] and seen_at_admission is None:
                seen_at_admission = seen[ids[1]]
            seen[rid] += len(new)
    assert seen_at_admission is not None and seen_at_admission <= 12 + runner.DECODE_CHUNK
    for rid, a in zip(ids, alone, strict=True):
        assert engine.result(rid).token_ids == a.token_ids


@pytest.mark.parametrize("where", ["to_host", "_dispatch_mixed"])
def test_an_interrupted_step_leaves_every_running_request_correct(model, monkeypatch, where):
    # Ctrl-C while a step's results are read (a step ahead already launched), or right
    # after a mixed step is dispatched (before the host marks its tokens): the engine
    # preempts the requests of the programs it abandons, and they recompute the same tokens.
    from jaxinfer import engine as engine_module

    prompts = _long_prompts(6)
    alone = [jaxinfer.generate(model, [p], max_new_tokens=8, ignore_eos=True)[0].token_ids
             for p in prompts]
    for at in (2, 4, 6):
        engine = _engine(model, max_tokens_per_step=8)
        ids = [engine.submit(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
        for _ in range(at):
            engine.step()
        target = engine_module if where == "to_host" else engine
        real = getattr(target, where)
        fired: list[int] = []

        def interrupt(*args, real=real, fired=fired, **kwargs):
            out = real(*args, **kwargs)
            if not fired:
                fired.append(1)
                raise KeyboardInterrupt
            return out

        monkeypatch.setattr(target, where, interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        monkeypatch.undo()
        engine.run_until_done()
        assert [engine.result(i).token_ids for i in ids] == alone, (where, at)
        engine.blocks.check_all_free()
