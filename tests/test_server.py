"""The front ends over the engine: the OpenAI-compatible server (``jaxinfer.server``, through
real clients on loopback sockets) and the lm-evaluation-harness model
(``jaxinfer.lm_eval_adapter``, on tiny local tasks, offline).

One tiny random model with a byte-level tokenizer and a chat template (float32, reference
attention, so outputs are batch-invariant and equal ``jaxinfer.generate``'s). The servers'
engines run in processes of their own (``jaxinfer.engine_process``), each compiling its
step programs; tests share one server per module where they can, and every process shares
JAX's persistent compilation cache (``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import jaxinfer
from jaxinfer.engine import Engine
from jaxinfer.engine_process import EngineSpec
from jaxinfer.server import create_app

REPO = Path(__file__).resolve().parents[1]
# One token bucket and two decode row buckets: few step programs to compile.
SIZES = dict(num_pages=96, page_size=8, max_batch=8, max_tokens_per_step=16, verbose=False)
PROMPTS = ["Hello there", "The sea is", "Once upon a time", "1, 2, 3,", "abc", "Why?",
           "Tell me more", "x y z"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, graceful_s: float | None = None) -> Iterator[tuple[str, object]]:
    """Run ``app`` under uvicorn in a thread on a free loopback port; yield (url, server)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           timeout_graceful_shutdown=graceful_s))
    thread = threading.Thread(target=server.run)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny model, saved; engine processes load it from here."""
    from sharding.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("server") / "model")


def spec_of(folder: Path, kind: type[EngineSpec] = EngineSpec) -> EngineSpec:
    """The tiny model with this module's engine sizes (a float32, reference-attention
    engine: its outputs equal the ``model`` fixture's)."""
    return kind(str(folder), dtype="float32", backend="reference", engine=SIZES)


@pytest.fixture(scope="module")
def model(folder):
    """The tiny model in this process: the oracle."""
    m = jaxinfer.load_model(folder, dtype="float32", backend="reference")
    m.engine = Engine(m, **SIZES)  # generate()'s engine: the server's sizes
    return m


@pytest.fixture(scope="module")
def served(folder):
    app = create_app(spec_of(folder), name="tiny", max_decode_steps=8)
    with serving(app) as (url, _):
        yield url, app.state.server


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed with prometheus_client: ``(sample name, labels) -> value``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_idle(url: str) -> dict:
    """Poll /metrics until no request runs or waits and no page is in use."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(url)
        idle = (m[("jaxinfer_requests_running", ())] == m[("jaxinfer_requests_waiting", ())]
                == m[("jaxinfer_kv_pages", (("state", "used"),))] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_openai_client_completions_and_chat(model, client):
    want = jaxinfer.generate(model, PROMPTS[:2], max_new_tokens=12, temperature=0.0,
                             logprobs=True)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=12,
                                  temperature=0, logprobs=0)
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert [c.finish_reason for c in r.choices] == [w.finish_reason for w in want]
    for c, w in zip(r.choices, want, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for i, w in enumerate(want):
        assert "".join(c.choices[0].text for c in chunks
                       if c.choices and c.choices[0].index == i) == w.text
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()

    # Chat: the template renders the messages; streamed and not give the same text.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (chat_want,) = jaxinfer.generate(model, [messages], max_new_tokens=10, temperature=0.0)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, logprobs=True)
    assert r.choices[0].message.content == chat_want.text
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(chat_want.token_ids)
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == chat_want.text
    assert chunks[-1].usage.completion_tokens == len(chat_want.token_ids)
    assert chunks[-2].choices[0].finish_reason == chat_want.finish_reason


def test_a_steps_tokens_stream_as_one_chunk(served):
    """The tokens one engine step makes for a stream reach the client as one SSE chunk (their
    text joined), not one chunk per token; the pieces, logprobs and usage equal the
    non-streamed answer's."""
    url, server = served
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    before = server.engine.stats.steps
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    steps = server.engine.stats.steps - before  # the stats came with the last step's tokens
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) <= steps < 24  # a mixed step's token, then decode calls of up to 8
    assert "".join(texts) == whole["choices"][0]["text"]
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    assert last["logprobs"]["token_logprobs"] == pytest.approx(
        whole["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    assert chunks[-1]["usage"] == whole["usage"]


def test_n_seed_and_stop(model, client):
    # One sampled token per choice (the sampled mixed step alone: one program to compile),
    # 3 prompts x n=2: six draws whose seeds must be seed + choice index.
    prompts = PROMPTS[:3]
    kwargs = dict(model="tiny", prompt=prompts, max_tokens=1, temperature=1.0, seed=7, n=2)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == list(range(6))  # prompt-major, then choice
    want = jaxinfer.generate(model, [p for p in prompts for _ in (7, 8)], sampling=[
        jaxinfer.SamplingParams(max_new_tokens=1, temperature=1.0, seed=s)
        for _ in prompts for s in (7, 8)])
    assert [c.text for c in a.choices] == [w.text for w in want]
    assert len({w.token_ids[0] for w in want}) > 2  # the seeds draw different tokens
    # The largest seed: choice 1 wraps to seed 0 (offset_seed) rather than being refused.
    top = client.completions.create(**{**kwargs, "prompt": prompts[0], "seed": 2**63 - 1})
    want = jaxinfer.generate(model, [prompts[0]] * 2, sampling=[
        jaxinfer.SamplingParams(max_new_tokens=1, temperature=1.0, seed=s)
        for s in (2**63 - 1, 0)])
    assert [c.text for c in top.choices] == [w.text for w in want]

    # A stop string cuts the text before it, streamed or not.
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0)
    stop = full.choices[0].text[3:5]
    assert len(stop) == 2
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_top_logprobs_penalties_and_json_schema(model, client):
    # Completions: logprobs=k gives k alternatives per token, as generate's top_logprobs.
    (want,) = jaxinfer.generate(model, "The sea is", max_new_tokens=6, temperature=0.0,
                                logprobs=True, top_logprobs=2)
    r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=6,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    tok = model.tokenizer
    # Keyed by text: byte tokens that are not whole characters all read "\ufffd"; the most
    # likely of them stays.
    expected = [{} for _ in want.top_logprobs]
    for e, d in zip(expected, want.top_logprobs, strict=True):
        for t, v in d.items():
            e.setdefault(tok.decode([t]), pytest.approx(v, abs=1e-5))
    assert lp.top_logprobs == expected
    # Greedy: the chosen token is the most likely one.
    for d, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert max(d.values()) == pytest.approx(chosen, abs=1e-6)
    # Chat: top_logprobs alternatives beside each chosen token (greedy: the chosen is first).
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)

    # Presence and frequency penalties: the text generate gives with them.
    (want,) = jaxinfer.generate(model, "abc", max_new_tokens=12, temperature=0.0,
                                presence_penalty=1.5, frequency_penalty=0.5)
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5)
    assert r.choices[0].text == want.text

    # A JSON schema constrains the chat output: it parses and validates, streamed or not.
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32,
                                       temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32,
                                            temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) \
        == r.choices[0].message.content


def test_echo_logprobs_score_the_prompt(model, served):
    url, _ = served
    ids = model.tokenizer.encode("The sea is blue")
    r = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0},
        timeout=60).json()
    (choice,) = r["choices"]
    assert choice["text"] == model.tokenizer.decode(ids)
    lps = choice["logprobs"]["token_logprobs"]
    (want,) = jaxinfer.score(model, [(ids[:1], ids[1:])])
    assert lps[0] is None and lps[1:] == pytest.approx(want.token_logprobs, abs=1e-5)
    assert r["usage"]["completion_tokens"] == 0


def test_64_concurrent_streaming_clients_equal_generate(model, served):
    url, _ = served
    n = 64
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]
    lengths = [4 + (i * 7) % 13 for i in range(n)]

    async def one(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True}
        text, done = [], False
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert done
        return "".join(text)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, p, k)
                                          for p, k in zip(prompts, lengths, strict=True)))

    got = asyncio.run(run())
    want = [jaxinfer.generate(model, p, max_new_tokens=k, temperature=0.0)[0].text
            for p, k in zip(prompts, lengths, strict=True)]
    assert got == want
    wait_idle(url)


def test_bad_requests_get_400(served):
    url, _ = served
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/completions", "{not json", None),
        ("/v1/completions", "[1, 2]", None),
        ("/v1/completions", {**ok, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {**ok, "temperature": -1}, "temperature"),
        ("/v1/completions", {**ok, "top_p": 2.0}, "top_p"),
        ("/v1/completions", {**ok, "stop": [""]}, "stop"),
        ("/v1/completions", {**ok, "n": 0}, "n"),
        ("/v1/completions", {**ok, "n": 129}, "n"),
        ("/v1/completions", {**ok, "model": "gpt-4"}, "model"),
        ("/v1/completions", {**ok, "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {**ok, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {**ok, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**ok, "echo": True, "stream": True}, "echo"),
        ("/v1/completions", {**ok, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**ok, "prompt": ""}, None),
        ("/v1/completions", {**ok, "prompt": []}, "prompt"),
        ("/v1/completions", {**ok, "prompt": [1, 99999]}, None),
        ("/v1/completions", {**ok, "prompt": [1, 2.5]}, "prompt"),
        ("/v1/completions", {**ok, "prompt": "x" * 600}, None),  # over the 512 context
        ("/v1/completions", {**ok, "max_tokens": 500, "prompt": "x" * 100}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/chat/completions", {**chat, "messages": []}, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]},
         None),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user"}]}, "messages"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}},
         "response_format"),
        ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
         "response_format"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": None, "max_completion_tokens": 0},
         "max_completion_tokens"),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/chat/completions", {**chat, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages"),
    ]
    for path, body, param in cases:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(url + path, content=content, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert "\n" not in err["message"]
        if param is not None:
            assert err["param"] == param, (body, err)
    # An error inside a list names the element, not just the field.
    for body, says in (
            ({**chat, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
             "unrecognized request argument 'messages.0.name'"),
            ({**chat, "messages": [{"role": "user"}]},
             "missing required argument 'messages.0.content'")):
        err = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["error"]
        assert err["message"] == says and err["param"] == "messages", err
    # The messages use the API's parameter names, not the library's.
    for body, says in (({**ok, "max_tokens": -1}, "max_tokens=-1"),
                       ({**ok, "logprobs": 21}, "logprobs=21"),
                       ({**ok, "max_tokens": 500, "prompt": "x" * 100}, "lower max_tokens")):
        message = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["error"][
            "message"]
        assert says in message and "max_new_tokens" not in message, message
        assert "top_logprobs" not in message, message
    assert httpx.get(url + "/v1/nothing").status_code == 404
    assert httpx.get(url + "/v1/completions").status_code == 405
    # The server still serves after all that.
    assert httpx.post(url + "/v1/completions", json=ok, timeout=60).status_code == 200
    # null takes the default where OpenAI's API allows it.
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None}
    r = httpx.post(url + "/v1/completions", json={**ok, **nulls, "echo": None}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(url + "/v1/chat/completions", json={**chat, **nulls, "logprobs": None},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    # Echo alone (no tokens generated, no logprobs: nothing for the engine to run) gives one
    # choice per n, and leaves nothing behind in the engine.
    r = httpx.post(url + "/v1/completions", json={**ok, "max_tokens": 0, "echo": True, "n": 3},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["hi"] * 3
    wait_idle(url)


def test_models_health_and_metrics_move(served):
    url, _ = served
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    (entry,) = httpx.get(url + "/v1/models").json()["data"]
    assert entry["id"] == "tiny" and entry["max_model_len"] == 512
    before = wait_idle(url)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ["a b", "c d"],
                                                  "max_tokens": 6, "temperature": 0},
                   timeout=60).json()
    after = wait_idle(url)

    def moved(name: str, labels: tuple = ()) -> float:  # a label appears when first counted
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("jaxinfer_generation_tokens_total") == r["usage"]["completion_tokens"]
    assert moved("jaxinfer_prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert moved("jaxinfer_time_to_first_token_seconds_count") == 2
    assert moved("jaxinfer_time_per_output_token_seconds_count") == sum(
        c["finish_reason"] == "length" for c in r["choices"])
    done = sum(moved("jaxinfer_requests_finished_total", (("finish_reason", k),))
               for k in ("stop", "length"))
    assert done == 2
    total = sum(after[("jaxinfer_kv_pages", (("state", s),))] for s in ("used", "cached", "free"))
    assert total == SIZES["num_pages"]


def test_server_wide_ngram_speculation_gives_the_plain_tokens(folder, model):
    """``jaxinfer serve --speculative ngram``: every request speculates (forced here), the
    texts are the plain greedy ones, and /metrics counts the proposals."""
    spec = dataclasses.replace(spec_of(folder), speculative=jaxinfer.Speculative(
        num_tokens=3, adaptive=False))
    prompts = ["a b a b a b a b", "1, 2, 1, 2, 1, 2,", *PROMPTS[:2]]
    want = jaxinfer.generate(model, prompts, max_new_tokens=12, temperature=0.0)
    with serving(create_app(spec, name="tiny", max_decode_steps=8)) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts,
                                                      "max_tokens": 12, "temperature": 0},
                       timeout=120).json()
        m = wait_idle(url)
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [w.text for w in want]
    proposed = m[("jaxinfer_spec_decode_draft_tokens_total", ())]
    assert proposed > 0 and 0 <= m[("jaxinfer_spec_decode_accepted_tokens_total", ())] <= proposed


def test_replica_processes_serve_the_plain_tokens(folder, model, monkeypatch):
    """``jaxinfer serve --dp 2`` (replicas as processes): an engine process per replica (each
    with its own CPU device here) serves concurrent requests with ``generate``'s texts; both
    replicas take work, and the server's counters add theirs up."""
    import concurrent.futures

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the engine processes inherit it
    spec = dataclasses.replace(spec_of(folder), dp=2, replica_processes=True)
    want = jaxinfer.generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
    app = create_app(spec, name="tiny", max_decode_steps=4)
    with serving(app) as (url, _):
        def ask(prompt: str) -> str:
            r = httpx.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0},
                timeout=300)
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(ask, PROMPTS))
        wait_idle(url)
        engine = app.state.server.engine
        per_replica = [e.stats.generated_tokens for e in engine.engines]
        total = engine.stats.generated_tokens
    assert texts == [w.text for w in want]
    assert all(n > 0 for n in per_replica) and sum(per_replica) == total, per_replica
    assert total == sum(len(w.token_ids) for w in want)


def test_the_engine_process_reports_what_a_step_reads_of_quantized_weights(folder):
    """``EngineInfo.weight_bytes`` (batch_eval's floor with replicas as processes): the
    engine process loading the model with ``quantize="int8"`` reports
    ``quantize.decode_weight_bytes`` of that model, as this process computes it."""
    from jaxinfer.quantize import decode_weight_bytes

    app = create_app(dataclasses.replace(spec_of(folder), quantize="int8"), name="tiny")
    with serving(app):
        info = app.state.server.engine.info
    here = jaxinfer.load_model(folder, dtype="float32", backend="reference", quantize="int8")
    want = decode_weight_bytes(here.params, here.config.tie_word_embeddings)
    assert want is not None and info.weight_bytes == want


def test_serve_speculative_flag_checks_before_loading(capsys):
    from jaxinfer.cli import main

    assert main(["serve", "--speculative", "ngram", "--num-speculative-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "num_tokens=0 must be an integer in [1, 16]" in err and err.count("\n") == 1


@dataclasses.dataclass(frozen=True)
class SlowSpec(EngineSpec):
    """An engine that sleeps 20 ms per step (pickled into the engine process, which imports
    this module)."""

    def build(self) -> Engine:
        """``EngineSpec.build``'s engine, its ``step`` slowed down."""
        engine = super().build()
        step = engine.step

        def slow_step(max_decode_steps=None):
            time.sleep(0.02)
            return step(max_decode_steps)

        engine.step = slow_step
        return engine


@pytest.fixture
def slow(folder):
    """A server whose engine sleeps 20 ms per step and decodes one token per step, with no
    room to queue beyond its 8 slots: requests stay in flight long enough to disconnect,
    overflow the queue and shut down under them."""
    return create_app(spec_of(folder, SlowSpec), name="tiny", max_queue=0, max_decode_steps=1,
                      shutdown_grace_s=0.0)


LONG = {"model": "tiny", "prompt": "go on", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


def test_full_queue_429_and_disconnects_free_pages(slow):
    app = slow
    with serving(app) as (url, _), httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", url + "/v1/completions", json={**LONG, "stream": True})
                   for _ in range(SIZES["max_batch"])]
        lines = []  # kept: a dropped line iterator closes its response
        for s in streams:
            r = s.__enter__()
            assert r.status_code == 200
            lines.append(r.iter_lines())
            next(lines[-1])  # the request runs
        too_many = http.post(url + "/v1/completions", json={**LONG, "n": 9})
        assert too_many.status_code == 400  # more than the server ever holds: not a 429
        assert too_many.json()["error"]["param"] == "n"
        full = http.post(url + "/v1/completions", json=LONG)
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert metrics(url)[("jaxinfer_requests_rejected_total", (("status", "429"),))] == 1
        assert metrics(url)[("jaxinfer_kv_pages", (("state", "used"),))] > 0
        for s in streams:  # the clients go away mid-stream
            s.__exit__(None, None, None)
        m = wait_idle(url)
        cancelled = ("jaxinfer_requests_finished_total", (("finish_reason", "cancelled"),))
        assert m[cancelled] == SIZES["max_batch"]

        # A non-streaming client that gives up (read timeout) cancels its request too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=LONG, timeout=0.5)
        m = wait_idle(url)
        assert m[cancelled] == SIZES["max_batch"] + 1
        assert app.state.server.engine.outstanding == 0
    s = app.state.server.engine.stats  # the engine's counters after its last step
    assert s.pages_used == s.running == s.waiting == 0


def test_shutdown_drains_short_requests_and_cancels_the_rest(slow):
    """At shutdown uvicorn's grace period lets a 5-token request finish and cuts a 400-token
    one (8 s of 20 ms steps). A first request compiles the engine's programs, so the grace
    period (3 s) times decoding only, never a compile: with a cold compilation cache on a
    busy CPU a 1 s grace had cut the short request too."""
    app = slow
    with serving(app, graceful_s=3.0) as (url, server), httpx.Client(timeout=60) as http:
        warm = http.post(url + "/v1/completions", json={**LONG, "max_tokens": 5})
        assert warm.status_code == 200
        short = http.stream("POST", url + "/v1/completions",
                            json={**LONG, "max_tokens": 5, "stream": True})
        long = http.stream("POST", url + "/v1/completions", json={**LONG, "stream": True})
        rs, rl = short.__enter__(), long.__enter__()
        lines_s, lines_l = rs.iter_lines(), rl.iter_lines()
        next(lines_s), next(lines_l)
        server.should_exit = True  # what SIGINT/SIGTERM do
        assert "data: [DONE]" in list(lines_s)  # drained: finished within the grace period
        with contextlib.suppress(httpx.HTTPError):
            assert "data: [DONE]" not in list(lines_l)  # cut at the grace period's end
        short.__exit__(None, None, None)
        long.__exit__(None, None, None)
    assert not app.state.server.engine.outstanding
    s = app.state.server.engine.stats
    assert s.pages_used == s.running == s.waiting == 0
    assert not app.state.server.engine.dead  # stopped, not crashed
    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        httpx.get(url + "/health")


def http_process_checks(folder: str) -> None:
    """Run by the test below in a process of its own (its JAX untouched by an oracle): the
    HTTP process serves without starting a JAX backend; when the engine process dies, the
    request it ran fails with an error chunk and new ones get 503, not a hang."""
    from jax._src import xla_bridge

    app = create_app(spec_of(Path(folder)), name="tiny", max_decode_steps=1)
    with serving(app) as (url, _), httpx.Client(timeout=60) as http:
        ok = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        assert http.post(url + "/v1/completions", json=ok).status_code == 200
        assert not xla_bridge.backends_are_initialized()

        with http.stream("POST", url + "/v1/completions",
                         json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # the request runs
            os.kill(app.state.server.engine.pid, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "engine process exited" in rest[-1]["error"]["message"], rest[-1]
        health = http.get(url + "/health")
        assert health.status_code == 503 and "exited" in health.json()["message"]
        r = http.post(url + "/v1/completions", json=ok)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
        assert app.state.server.engine.outstanding == 0


class FloodEngine:
    """An engine whose one request gets 100,000 tokens per step: each step's message is
    larger than a pipe's buffer."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def add_request(self, req) -> int:
        return 0

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self, max_decode_steps=None) -> list:
        self.left -= 1
        return [(0, list(range(100_000)), self.left == 0)]

    def result(self, rid: int) -> str:
        return "its result"

    def forget(self, rid: int) -> bool:
        return True

    def stats(self) -> None:
        return None


def test_engine_steps_on_while_its_messages_wait_to_be_read():
    """The engine loop does not wait for the HTTP process to read a step's message (its
    reader thread may be held up by HTTP work): five steps run with nothing read, then every
    message arrives, in order."""
    import multiprocessing

    from jaxinfer.engine_process import EngineLoop

    received, sent = multiprocessing.Pipe(duplex=False)
    engine = FloodEngine(5)
    loop = EngineLoop(engine, sent, None)
    loop.inbox.put(("add", 7, ([("key", None)], True)))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while engine.left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.left == 0  # nothing was read yet
    loop.inbox.put(("stop", None, 0.0))
    got = []
    while thread.is_alive() or received.poll():
        if received.poll(0.1):
            got += received.recv()[0]
    assert [m[1] for m in got] == ["accepted"] + ["tokens"] * 5 + ["done"]
    assert all(m[3] == list(range(100_000)) for m in got[1:6])
    assert got[-1] == (7, "done", "key", "its result")


def test_http_process_has_no_jax_backend_and_survives_engine_death(folder):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-c",
         f"import test_server; test_server.http_process_checks({str(folder)!r})"],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_serve_rejects_bad_flags_before_loading(capsys):
    from jaxinfer.cli import main

    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "--max-queue=-1 must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--port", "0"]) == 2
    capsys.readouterr()
    for grace in ("-1", "nan"):
        assert main(["serve", "--shutdown-grace", grace]) == 2
        assert f"--shutdown-grace={float(grace)} must be a number of seconds >= 0" in (
            capsys.readouterr().err)
    assert main(["serve", "--num-speculative-tokens", "3"]) == 2
    assert "--num-speculative-tokens needs --speculative" in capsys.readouterr().err
    assert main(["serve", "--replicas", "processes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "replica processes serve --dp replicas; give --dp 2" in err[0]


@pytest.mark.parametrize("flags, gpus, want", [
    ((), True, (1, False)), (("--dp", "2"), True, (2, True)), (("--dp", "2"), False, (2, False)),
    (("--dp", "2", "--replicas", "threads"), True, (2, False))])
def test_serve_runs_dp_replicas_as_processes_by_default(monkeypatch, flags, gpus, want):
    """``jaxinfer serve --dp N`` on a host of CUDA GPUs serves from N engine processes
    unless ``--replicas threads``, elsewhere from threads (the spec handed to the app says
    which; nothing is loaded here)."""
    import jaxinfer.cli
    import jaxinfer.server
    from jaxinfer.cli import main

    monkeypatch.setattr(jaxinfer.cli, "cuda_host", lambda: gpus)

    seen = []

    class Stop(Exception):
        """Raised in place of starting the engine and uvicorn."""

    def fake_create_app(spec, **_):
        seen.append((spec.dp, spec.replica_processes))
        raise Stop

    monkeypatch.setattr(jaxinfer.server, "create_app", fake_create_app)
    with pytest.raises(Stop):
        main(["serve", *flags])
    assert seen == [want]


@pytest.mark.slow
def test_jaxinfer_serve_default_model_end_to_end(default_gguf, tmp_path):
    """``jaxinfer serve`` in a process of its own: a chat answer, then SIGINT stops it."""
    import openai

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(default_gguf),
         "--served-model-name", "smollm2", "--port", str(port), "--no-warmup",
         "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=24, temperature=0)
        assert "4" in r.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


# ---------------------------------------------------------------- lm-evaluation-harness
DOCS = [{"question": "Is the sea wet?", "choices": ["yes", "no"], "answer": 0},
        {"question": "Two plus two?", "choices": ["four", "five", "six"], "answer": 0},
        {"question": "Colour of snow?", "choices": ["white", "black"], "answer": 1}]
TEXTS = [{"text": "The cat sat on the mat. " * 3}, {"text": "Hello world"}]


def write_tasks(folder: Path) -> None:
    """Three tasks over local JSONL files (no downloads)."""
    (folder / "qa.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "texts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXTS))
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'qa.jsonl'}\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\n"
        "doc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common
        + f"dataset_kwargs:\n  data_files: {folder / 'qa.jsonl'}\n"
        "output_type: generate_until\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: [\"\\n\", \"Q:\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def test_harness_results_equal_jaxinfer(model, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    import jaxinfer.lm_eval_adapter  # noqa: F401 - registers "jaxinfer"

    write_tasks(tmp_path)
    out = lm_eval.simple_evaluate(
        model="jaxinfer", model_args={"pretrained": model},
        tasks=["tiny_choice", "tiny_ppl", "tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True)
    samples = out["samples"]

    # Multiple choice: each choice's (log-likelihood, greedy) is jaxinfer.score's.
    for s in samples["tiny_choice"]:
        doc = s["doc"]
        context = f"Q: {doc['question']}\nA:"
        want = jaxinfer.score(model, [(context, " " + c) for c in doc["choices"]])
        got = [r[0] for r in s["resps"]]
        assert [g[0] for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
        assert [g[1] for g in got] == [w.greedy for w in want]
    assert len(samples["tiny_choice"]) == len(DOCS)

    # Rolling log-likelihood: score_rolling of BOS + the text.
    tok = model.tokenizer
    for s in samples["tiny_ppl"]:
        ids = [tok.bos_id, *tok.encode(s["doc"]["text"], add_bos=False)]
        assert s["resps"][0][0] == pytest.approx(jaxinfer.score_rolling(model, ids).logprob,
                                                 abs=1e-4)

    # Generation stops at the task's `until` strings, as generate with those stop strings.
    for s in samples["tiny_gen"]:
        context = f"Q: {s['doc']['question']}\nA:"
        (want,) = jaxinfer.generate(model, context, max_new_tokens=8, stop=["\n", "Q:"])
        assert s["resps"][0][0] == want.text
    assert "acc,none" in out["results"]["tiny_choice"]


def test_command_line_registers_the_model(model, tmp_path, monkeypatch):
    """``python -m jaxinfer.lm_eval_adapter --model jaxinfer --model_args pretrained=...``:
    lm_eval's CLI with the model registered (load_model replaced by the loaded model)."""
    lm_eval = pytest.importorskip("lm_eval")
    from jaxinfer import lm_eval_adapter

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    loaded = []

    def fake_load(path, **kwargs):
        loaded.append((path, kwargs))
        return model

    monkeypatch.setattr(lm_eval_adapter, "load_model", fake_load)

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        """The CLI's task index without lm_eval's ~26k built-in task files (~30 s)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)
    monkeypatch.setattr(sys, "argv", [
        "lm_eval", "--model", "jaxinfer", "--model_args",
        "pretrained=some/folder,dtype=float32,backend=reference", "--tasks", "tiny_choice",
        "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out")])
    lm_eval_adapter.main()
    assert loaded == [("some/folder", dict(dtype="float32", backend="reference",
                                           quantize=None, kv_cache_dtype=None, mesh=None))]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert "tiny_choice" in json.loads(result.read_text())["results"]


def test_unsupported_generation_options_are_refused(model):
    pytest.importorskip("lm_eval")
    from jaxinfer.errors import InputError
    from jaxinfer.lm_eval_adapter import JaxinferLM

    lm = JaxinferLM(pretrained=model)

    class Req:
        args = ("Q: x\nA:", {"until": ["\n"], "num_beams": 4})

    with pytest.raises(InputError, match="num_beams"):
        lm.generate_until([Req()])
