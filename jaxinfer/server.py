"""An OpenAI-compatible HTTP server over the one engine (``jaxinfer serve``).

Two processes, as in vLLM v1 (its API server and ``EngineCore``): this one runs the ASGI
server (FastAPI on uvicorn) and the engine runs in a process of its own
(``jaxinfer.engine_process``), which owns the devices and the model and steps the engine.
Each has its own interpreter lock, so the HTTP work of many open streams (parsing, SSE
encoding, detokenizing) runs beside the engine's host work instead of taking turns with it.

The handlers run on the asyncio loop: they validate the body, turn it into engine
``Request`` objects (``requests.make_requests``, the library's validation; prompt token ids,
``SamplingParams`` and compiled grammars are plain data) and submit them as one ticket over
a pipe; then they wait on an ``asyncio.Queue`` that ``Server.deliver`` fills with each
engine step's new tokens and results (one pipe message per step for all requests). So
requests of every HTTP client share the engine's continuous batch. Text is detokenized
here, one SSE event per choice per engine step.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed over SSE
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text). Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad request, 429 with ``Retry-After`` when the queue is full, 503 while shutting down or
once the engine process is gone (requests it was running fail with a 500 body, or an error
chunk when streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine import EngineStats
from jaxinfer.engine_process import EngineSpec, Message, QueueFull, ShuttingDown, open_engine
from jaxinfer.errors import InputError
from jaxinfer.generate import TextStream
from jaxinfer.requests import (
    Completion,
    Model,
    ScoreResult,
    encode,
    make_requests,
    make_score_requests,
)
from jaxinfer.requests import (
    Request as EngineRequest,
)
from jaxinfer.sampling import SamplingParams, offset_seed

DEFAULT_MAX_QUEUE = 1024
"""Requests that may wait for a slot (beyond those the engine runs) before new ones get 429."""

RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 answer, in seconds."""

MAX_CHOICES = 128
"""Largest ``n`` (choices per prompt) a request may ask for."""

# SamplingParams field -> the OpenAI parameter it comes from, to name it in 400 answers.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop", "seed": "seed",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "top_logprobs": "top_logprobs",
                 "response_format": "response_format"}


# ---------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def input_error(e: InputError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 for the library's one-line ``InputError``, naming the OpenAI parameter when the
    message starts with or names a sampling option (``max_new_tokens=-1 must be ...``,
    ``response_format type 'xml' is unknown``); ``renames`` maps options an endpoint spells
    differently (``/v1/completions``: ``top_logprobs`` is ``logprobs``)."""
    names = {**_OPENAI_NAMES, **(renames or {})}
    message = str(e)
    first = re.match(r"(\w+)", message)
    found = [first.group(1)] if first else []
    found += re.findall(r"\b(\w+)=", message)
    param = next((names[m] for m in found if m in names), None)
    # The client's names in the text too (max_tokens, not the library's max_new_tokens).
    message = re.sub(r"\b(\w+)\b", lambda m: names.get(m.group(1), m.group(1)), message)
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # Strict: "5" is no integer and 1.5 no token id; unknown fields are refused, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class _Sampling(_Body):
    """Parameters both endpoints share (OpenAI's, plus vLLM's ``top_k``, ``min_p``,
    ``repetition_penalty`` and ``ignore_eos``)."""

    model: str
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # json_object / json_schema / regex / grammar (jaxinfer.structured; OpenAI's on chat,
    # accepted on completions too, as vLLM does)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's logs; it changes nothing here

    # SamplingParams options this endpoint names otherwise (for 400 answers).
    renames: ClassVar[dict[str, str]] = {}

    # echo (completions) and logprobs (chat: a bool) are the endpoints' own fields.
    @field_validator("n", "stream", "ignore_eos", "presence_penalty", "frequency_penalty",
                     "echo", "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        """``null`` means the default, as OpenAI's API takes it."""
        return cls.model_fields[info.field_name].default if value is None else value

    def wants_logprobs(self) -> bool:
        """Whether the chosen tokens' log-probabilities are asked for."""
        raise NotImplementedError

    def num_top_logprobs(self) -> int:
        """How many most likely alternatives to report per token."""
        raise NotImplementedError

    def unsupported(self) -> list[tuple[str, str]]:
        """``(parameter, why)`` for values this server does not implement."""
        out = []
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported; leave it out"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream=true"))
        return out


class CompletionBody(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    renames: ClassVar[dict[str, str]] = {"top_logprobs": "logprobs"}

    def wants_logprobs(self) -> bool:
        """``logprobs=k``: the chosen tokens' log-probabilities (and k alternatives)."""
        return self.logprobs is not None

    def num_top_logprobs(self) -> int:
        """``logprobs`` (OpenAI's legacy layout: k alternatives per token)."""
        return self.logprobs or 0

    def unsupported(self) -> list[tuple[str, str]]:
        """``_Sampling.unsupported`` plus the completion-only parameters."""
        out = super().unsupported()
        if self.best_of not in (None, 1, self.n):
            out.append(("best_of", "best_of must equal n (or 1); ranking choices is not "
                        "supported"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        if self.echo and self.stream:
            out.append(("echo", "echo is not supported with stream=true"))
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens=0 needs echo=true (prompt scoring)"))
        return out


class ChatMessage(_Body):
    """One chat message; ``content`` a string or a list of ``{"type": "text"}`` parts."""

    role: str
    content: str | list[dict[str, Any]]


class ChatBody(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def wants_logprobs(self) -> bool:
        """``logprobs=true``."""
        return self.logprobs

    def num_top_logprobs(self) -> int:
        """``top_logprobs`` (with ``logprobs=true``)."""
        return self.top_logprobs or 0

    def unsupported(self) -> list[tuple[str, str]]:
        """``_Sampling.unsupported`` plus the chat-only parameters."""
        out = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.tools or self.tool_choice not in (None, "none"):
            out.append(("tools", "tool calls are not supported"))
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            out.append(("max_tokens", "give max_tokens or max_completion_tokens, not both"))
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) == 0:
                out.append((name, f"{name} must be at least 1 (a chat reply has tokens)"))
        return out

    def texts(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts with string content."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if not isinstance(content, str):
                if not all(p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"message {i}: only text content parts "
                                   "({'type': 'text', 'text': ...}) are supported",
                                   param="messages")
                content = "".join(p["text"] for p in content)
            out.append({"role": m.role, "content": content})
        return out


def parse_body(raw: bytes, kind: type[_Body]) -> Any:
    """The JSON body as ``kind``, or a 400 naming the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"])  # messages.0.name: the element itself
        if err["type"] == "extra_forbidden":
            message = f"unrecognized request argument {where!r}"
        elif err["type"] == "missing":
            message = f"missing required argument {where!r}"
        else:
            message = f"invalid value for {where}: {err['msg']} (got {err['input']!r:.60})"
        raise APIError(400, message, param=param) from None
    for param, why in body.unsupported():
        raise APIError(400, why, param=param)
    return body


# ---------------------------------------------------------------------------- engine replies
Reply = tuple[str, Any, Any]  # (kind, key, payload): engine_process.Message without its ticket


@dataclasses.dataclass(eq=False)  # hashed by identity
class Ticket:
    """One HTTP request's engine requests, each under the key its handler chose, and where
    their replies go: lists of them on ``queue``, through ``loop``."""

    jobs: list[tuple[Any, EngineRequest]]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[Reply]]
    stream: bool  # send each step's new tokens (else only results)
    id: int = -1  # EngineProcess.submit's, for cancel


def _put_all(items: list[tuple[asyncio.Queue[list[Reply]], list[Reply]]]) -> None:
    for q, replies in items:
        q.put_nowait(replies)


class ServerMetrics:
    """Prometheus metrics of one server (their own registry, so servers in one process do
    not mix)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("jaxinfer_requests_running", "Requests in the engine's batch",
                             registry=r)
        self.waiting = Gauge("jaxinfer_requests_waiting", "Requests waiting for a slot",
                             registry=r)
        self.pages = Gauge("jaxinfer_kv_pages", "KV cache pages by state: used (by running "
                           "requests), cached (prefix cache, evictable), free", ["state"],
                           registry=r)
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Time to first token "
                              "from the request's arrival in the engine", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("jaxinfer_time_per_output_token_seconds", "Mean time between a "
                              "request's later tokens", registry=r,
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generated_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated for "
                                        "finished requests", registry=r)
        self.finished = Counter("jaxinfer_requests_finished", "Engine requests finished, by "
                                "finish reason (cancelled: the client went away)",
                                ["finish_reason"], registry=r)
        self.draft_tokens = Counter("jaxinfer_spec_decode_draft_tokens", "Tokens proposed by "
                                    "speculative decoding for finished requests", registry=r)
        self.accepted_tokens = Counter("jaxinfer_spec_decode_accepted_tokens", "Of those, "
                                       "accepted", registry=r)
        self.rejected = Counter("jaxinfer_requests_rejected", "HTTP requests answered 429 "
                                "(queue full) or 503 (shutting down)", ["status"], registry=r)

    def publish(self, s: EngineStats) -> None:
        """Set the gauges from the engine's counters."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.pages.labels("used").set(s.pages_used)
        self.pages.labels("cached").set(s.pages_cached)
        self.pages.labels("free").set(s.pages_free)

    def observe(self, result: Completion | ScoreResult) -> None:
        """Count a finished engine request."""
        if isinstance(result, ScoreResult):
            self.finished.labels("error" if result.error else "score").inc()
            self.prompt_tokens.inc(len(result.context_token_ids)
                                   + len(result.continuation_token_ids))
            return
        self.finished.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(len(result.prompt_token_ids))
        self.generated_tokens.inc(len(result.token_ids))
        self.draft_tokens.inc(result.draft_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        if result.token_ids:
            self.ttft.observe(result.time_to_first_token)
        if len(result.token_ids) > 1:
            self.tpot.observe(result.time_per_output_token)


# ---------------------------------------------------------------------------- one HTTP request
class Submission:
    """The asyncio side of a ticket: the engine's replies, in order, through ``messages``."""

    def __init__(self, server: Server, jobs: list[tuple[Any, EngineRequest]], stream: bool
                 ) -> None:
        self.server = server
        self.ticket = Ticket(jobs, asyncio.get_running_loop(), asyncio.Queue(), stream)
        self._held: list[Reply] = []  # what came with the acceptance
        self.done = False

    async def messages(self) -> list[Reply]:
        """The replies that arrived since the last call (waits for at least one)."""
        if self._held:
            out, self._held = self._held, []
            return out
        q = self.ticket.queue
        out = await q.get()
        while not q.empty():
            out += q.get_nowait()
        return out

    async def start(self) -> None:
        """Submit; return once the engine took the requests (raise ``APIError`` otherwise).
        No jobs (an echo-only completion without logprobs): nothing to submit."""
        if not self.ticket.jobs:
            self.done = True
            return
        try:
            self.ticket.id = self.server.engine.submit(self.ticket, self.ticket.jobs,
                                                       self.ticket.stream)
        except InputError as e:
            raise APIError(400, str(e), param="n") from None
        except QueueFull:
            self.server.metrics.rejected.labels("429").inc()
            raise APIError(429, "the server's queue is full; retry later",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            self.server.metrics.rejected.labels("503").inc()
            raise APIError(503, str(e), kind="server_error",
                           code="engine_down" if self.server.engine.dead else "shutting_down"
                           ) from None
        first, *self._held = await self.messages()
        kind, _, why = first
        if kind == "rejected":
            self.done = True
            if why is None:
                raise APIError(503, "the server is shutting down", kind="server_error",
                               code="shutting_down")
            raise APIError(400, why)

    def cancel(self) -> None:
        """Cancel what is still running (the client went away)."""
        if not self.done:
            self.done = True
            self.server.engine.cancel(self.ticket.id)


@dataclasses.dataclass
class Choice:
    """One generated choice while it runs: its request, streamed text, final result."""

    index: int
    request: EngineRequest
    text: TextStream
    result: Completion | None = None


async def collect(sub: Submission, request: Request) -> dict[Any, Any] | None:
    """Wait for every job's result (``key -> result``); a client that disconnects first
    cancels them (None). A job that failed raises a 500."""
    results: dict[Any, Any] = {}
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while len(results) < len(sub.ticket.jobs):
            getter = asyncio.ensure_future(sub.messages())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return None  # nobody is left to answer; finally cancels the jobs
            for kind, key, payload in getter.result():
                if kind == "failed":
                    raise APIError(500, f"the request failed: {payload}", kind="server_error")
                if kind == "done":
                    if payload is None:
                        raise APIError(503, "the server is shutting down", kind="server_error",
                                       code="shutting_down")
                    if payload.error is not None:
                        raise APIError(500, f"the request failed: {payload.error}",
                                       kind="server_error")
                    results[key] = payload
    finally:
        watcher.cancel()
        sub.done = len(results) == len(sub.ticket.jobs) or sub.done
        sub.cancel()
    return results


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body was read, so ``receive`` waits)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------- the server
class Server:
    """The engine process, the model's config and tokenizer, and the metrics behind one
    FastAPI app.

    Starting it starts the engine process (``EngineProcess.start``: the model loads there;
    ``ReplicaProcesses`` with ``spec.replica_processes``: one per data replica)
    and waits until it is ready; ``model`` is the served model without its weights.
    """

    def __init__(self, spec: EngineSpec, name: str | None, max_queue: int,
                 max_decode_steps: int | None) -> None:
        self.metrics = ServerMetrics()
        self.speculative = spec.speculative  # every generation request's
        self.engine = open_engine(spec, self.deliver, max_queue, max_decode_steps)
        info = self.engine.start()
        self.model: Model = info.model()
        self.name = name or info.name
        self.max_seq_len = info.max_seq_len  # longest prompt + output the engine holds
        self.metrics.publish(info.stats)
        self.created = int(time.time())

    def deliver(self, messages: list[Message]) -> None:
        """One engine iteration's messages (on ``EngineProcess``'s receiver thread): count
        finished requests, set the gauges, and hand each ticket its replies, with one
        wake-up per event loop."""
        by_ticket: dict[Ticket, list[Reply]] = {}
        for ticket, kind, key, payload in messages:
            if kind == "done":
                if payload is None:
                    self.metrics.finished.labels("cancelled").inc()
                else:
                    self.metrics.observe(payload)
            elif kind == "failed":
                self.metrics.finished.labels("error").inc()
            by_ticket.setdefault(ticket, []).append((kind, key, payload))
        if self.engine.stats is not None:
            self.metrics.publish(self.engine.stats)
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for ticket, replies in by_ticket.items():
            by_loop.setdefault(ticket.loop, []).append((ticket.queue, replies))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(_put_all, items)

    # ------------------------------------------------------------------ helpers
    def check_model(self, name: str) -> None:
        """400 unless ``name`` is the served model's."""
        if name != self.name:
            raise APIError(400, f"the model {name!r} is not served here; this server serves "
                           f"{self.name!r}", param="model", code="model_not_found")

    def sampling(self, body: _Sampling, max_tokens: int, index: int) -> SamplingParams:
        """The ``SamplingParams`` of choice ``index`` (its seed is ``seed + index``, modulo
        2**63: ``offset_seed``)."""
        # None: make_requests draws one
        seed = None if body.seed is None else offset_seed(body.seed, index)
        options = dict(max_new_tokens=max_tokens, seed=seed,
                       stop=() if body.stop is None else body.stop,
                       ignore_eos=body.ignore_eos,
                       temperature=1.0 if body.temperature is None else body.temperature,
                       top_p=1.0 if body.top_p is None else body.top_p,
                       top_k=body.top_k or 0, min_p=body.min_p or 0.0,
                       repetition_penalty=(1.0 if body.repetition_penalty is None
                                           else body.repetition_penalty),
                       logprobs=body.wants_logprobs(), top_logprobs=body.num_top_logprobs(),
                       presence_penalty=body.presence_penalty,
                       frequency_penalty=body.frequency_penalty,
                       response_format=body.response_format, speculative=self.speculative)
        return SamplingParams(**options)

    def generation_jobs(self, body: _Sampling, prompts: Sequence[Any], chat: bool,
                        max_tokens: int | None) -> tuple[list[list[int]], list[Choice]]:
        """Prompt ids and the ``n`` choices per prompt, validated by the library
        (``InputError`` -> 400). ``max_tokens`` None: up to the context's end."""
        ids_list, choices = [], []
        for i, prompt in enumerate(prompts):
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            try:
                if max_tokens == 0:  # echo only: the prompt is scored, nothing generated
                    ids_list.append(encode(self.model, prompt, chat=chat))
                    continue
                ids = None  # encoded (and checked) once, by the first choice's request
                if max_tokens is None:  # up to the context's end: the length comes first
                    ids = encode(self.model, prompt, chat=chat)
                for j in range(body.n):
                    limit = max_tokens or max(1, self.max_seq_len - len(ids))
                    sp = self.sampling(body, limit, j)
                    (req,) = make_requests(self.model, prompt if ids is None else ids,
                                           chat and ids is None, sp, {})
                    ids = list(req.prompt_ids)
                    choices.append(Choice(len(choices), req, TextStream(self.model, sp.stop)))
                ids_list.append(ids)
            except InputError as e:
                err = input_error(e, body.renames)
                err.message = where + err.message
                raise err from None
        return ids_list, choices

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        body: CompletionBody = parse_body(await request.body(), CompletionBody)
        self.check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        ids_list, choices = self.generation_jobs(body, prompts, False, body.max_tokens)
        jobs: list[tuple[Any, EngineRequest]] = [(c.index, c.request) for c in choices]
        if body.echo and body.wants_logprobs():
            for i, ids in enumerate(ids_list):
                if len(ids) > 1:  # the first token has no context to be scored with
                    (req,) = make_score_requests(self.model, [(ids[:1], ids[1:])])
                    jobs.append((("echo", i), req))
        sub = Submission(self, jobs, body.stream)
        await sub.start()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(sub, choices, body, rid, created, False,
                                sum(len(ids) for ids in ids_list))
        results = await collect(sub, request)
        if results is None:
            return Response(status_code=499)  # client gone: never sent
        out = []
        for i, ids in enumerate(ids_list):
            prompt_text = self.model.tokenizer.decode(ids) if body.echo else ""
            echo = results.get(("echo", i))
            echo_lps = [None] + (echo.token_logprobs if echo is not None else [])
            if body.max_tokens == 0:  # the prompt alone, once per choice asked for
                for _ in range(body.n):
                    out.append(self._text_choice(len(out), prompt_text, ids, echo_lps, None,
                                                 "length", body.wants_logprobs()))
                continue
            for j in range(body.n):
                c = results[i * body.n + j]
                text = prompt_text + c.text
                out.append(self._text_choice(
                    len(out), text, ids if body.echo else [], echo_lps if body.echo else [], c,
                    c.finish_reason, body.wants_logprobs()))
        generated = sum(len(c.token_ids) for c in results.values()
                        if isinstance(c, Completion))
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": self.name,
            "choices": out, "usage": _usage(sum(len(ids) for ids in ids_list), generated)})

    def _text_choice(self, index: int, text: str, prompt_ids: list[int],
                     prompt_lps: list[float | None], result: Completion | None,
                     finish_reason: str, with_logprobs: bool) -> dict[str, Any]:
        """One ``/v1/completions`` choice (echoed prompt tokens, then ``result``'s), its
        ``logprobs`` in OpenAI's legacy layout: ``top_logprobs`` maps each generated token's
        most likely tokens (as text) to their log-probabilities (None for prompt tokens, or
        when no alternatives were asked for)."""
        lp = None
        if with_logprobs:
            tok = self.model.tokenizer  # offsets count characters from the choice's start
            ids = list(prompt_ids) + (result.token_ids if result is not None else [])
            values = list(prompt_lps) + (result.logprobs or [] if result is not None else [])
            top = None
            if result is not None and result.top_logprobs is not None:
                top = [None] * len(prompt_ids) + [self._by_text(d) for d in result.top_logprobs]
            lp = {"tokens": [tok.decode([t]) for t in ids], "token_logprobs": values,
                  "top_logprobs": top,
                  "text_offset": [len(tok.decode(ids[:k])) for k in range(len(ids))]}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        body: ChatBody = parse_body(await request.body(), ChatBody)
        self.check_model(body.model)
        if self.model.tokenizer is None or not self.model.tokenizer.chat_template:
            raise APIError(400, f"the model {self.name!r} has no chat template; use "
                           "/v1/completions", param="messages")
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        (ids,), choices = self.generation_jobs(body, [body.texts()], True, max_tokens)
        sub = Submission(self, [(c.index, c.request) for c in choices], body.stream)
        await sub.start()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(sub, choices, body, rid, created, True, len(ids))
        results = await collect(sub, request)
        if results is None:
            return Response(status_code=499)  # client gone: never sent
        out = []
        for c in choices:
            r = results[c.index]
            out.append({"index": c.index, "message": {"role": "assistant", "content": r.text},
                        "logprobs": self._chat_logprobs(r) if body.logprobs else None,
                        "finish_reason": r.finish_reason})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.name,
            "choices": out,
            "usage": _usage(len(ids), sum(len(r.token_ids) for r in results.values()))})

    def _by_text(self, top: dict[int, float]) -> dict[str, float]:
        """Alternatives keyed by their text (the legacy layout); tokens of the same text
        (e.g. bytes of an incomplete character, all "\ufffd") keep the most likely one."""
        out: dict[str, float] = {}
        for t, v in top.items():  # most likely first
            out.setdefault(self.model.tokenizer.decode([t]), v)
        return out

    def _chat_logprobs(self, r: Completion) -> dict[str, Any]:
        """``choices[i].logprobs`` of a chat completion: per token its text, bytes,
        log-probability and ``top_logprobs`` alternatives (most likely first)."""
        tok = self.model.tokenizer

        def entry(t: int, lp: float) -> dict[str, Any]:
            piece = tok.decode([t])
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

        tops = r.top_logprobs or [{} for _ in r.token_ids]
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in d.items()]}
                            for t, lp, d in zip(r.token_ids, r.logprobs or [], tops,
                                                strict=True)]}

    def _stream(self, sub: Submission, choices: list[Choice], body: _Sampling, rid: str,
                created: int, chat: bool, prompt_tokens: int) -> StreamingResponse:
        return StreamingResponse(self._events(sub, choices, body, rid, created, chat,
                                              prompt_tokens),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, sub: Submission, choices: list[Choice], body: _Sampling, rid: str,
                      created: int, chat: bool, prompt_tokens: int) -> AsyncIterator[str]:
        """SSE ``data:`` chunks of a streamed response, then ``data: [DONE]``.

        Text arrives in final pieces (``TextStream``); per-token log-probabilities come with
        each choice's last chunk. A choice that fails or is cancelled by shutdown ends with an
        ``{"error": ...}`` chunk.
        """
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(c: Choice, text: str, finish: str | None, lps: Any = None) -> str:
            if chat:
                delta = {"content": text} if text else {}
                piece: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": lps,
                                         "finish_reason": finish}
            else:
                piece = {"index": c.index, "text": text, "logprobs": lps,
                         "finish_reason": finish}
            return _sse({"id": rid, "object": obj, "created": created, "model": self.name,
                         "choices": [piece]})

        try:
            # Each round's events are written at once (one send for all of a stream's
            # chunks of one engine step, its last chunk, usage and [DONE]).
            out: list[str] = []
            if chat:  # OpenAI opens each choice with the assistant role
                out += [_sse({"id": rid, "object": obj, "created": created, "model": self.name,
                              "choices": [{"index": c.index,
                                           "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
                        for c in choices]
            left = len(choices)
            while left:
                if out:
                    yield "".join(out)
                    out = []
                # Everything queued so far becomes one chunk per choice: a client (or a
                # server) that falls behind the engine gets fewer, larger chunks, and each
                # choice's new tokens of all those engine steps are detokenized at once.
                batch = await sub.messages()
                pending: dict[int, list[int]] = {}  # choice -> token ids not yet sent
                for kind, key, payload in batch:
                    c = choices[key]
                    if kind == "tokens":
                        pending.setdefault(key, []).extend(payload)
                        continue
                    left -= 1
                    text = c.text.add(pending.pop(key, []))
                    if kind == "failed" or payload is None or payload.error is not None:
                        why = ("the server is shutting down" if kind == "done" and payload is None
                               else payload if kind == "failed" else payload.error)
                        if text:
                            out.append(chunk(c, text, None))
                        out.append(_sse(APIError(500, f"choice {c.index} failed: {why}",
                                                 kind="server_error").body()))
                        continue
                    c.result = payload
                    lps = None
                    if body.wants_logprobs():
                        lps = (self._chat_logprobs(payload) if chat else self._text_choice(
                            c.index, payload.text, [], [], payload, "", True)["logprobs"])
                    out.append(chunk(c, text + c.text.add(None), payload.finish_reason, lps))
                for key, ids in pending.items():
                    text = choices[key].text.add(ids)
                    if text:
                        out.append(chunk(choices[key], text, None))
            sub.done = True
            if body.stream_options is not None and body.stream_options.include_usage:
                gen = sum(len(c.result.token_ids) for c in choices if c.result is not None)
                out.append(_sse({"id": rid, "object": obj, "created": created,
                                 "model": self.name, "choices": [],
                                 "usage": _usage(prompt_tokens, gen)}))
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:  # the client went away (cancelled) or the response ended
            sub.cancel()

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "created": self.created, "owned_by": "jaxinfer",
                                            "max_model_len": self.max_seq_len}]}

    async def health(self) -> Response:
        """``GET /health``: 200 while serving, 503 while shutting down or when the engine
        process is gone."""
        if self.engine.dead:
            return JSONResponse({"status": "engine down", "message": self.engine.dead},
                                status_code=503)
        if self.engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        """``GET /metrics``: Prometheus text exposition."""
        return Response(generate_latest(self.metrics.registry),
                        media_type=PROMETHEUS_CONTENT_TYPE)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(prompt: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}


def create_app(spec: EngineSpec, *, name: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_decode_steps: int | None = None,
               shutdown_grace_s: float = 30.0) -> FastAPI:
    """The FastAPI app serving the model ``spec`` names (``uvicorn.run(create_app(spec))``).

    Starts the engine process (the model loads and warms up there; ``InputError`` if it
    cannot be loaded) and returns once it is ready. The app's shutdown (lifespan end) drains
    and stops it.

    Args:
      spec: what the engine process loads (``EngineSpec("path/to/model", dtype=...)``).
      name: the model id clients pass as ``"model"`` (default: the loaded model's name).
      max_queue: requests that may wait for a slot before new ones get 429.
      max_decode_steps: tokens per sequence per decode call; None keeps the engine's own
        (about ``decode_call_seconds`` of device time), for throughput; smaller values
        stream in smaller pieces and admit new requests sooner.
      shutdown_grace_s: at shutdown, running requests get this long to finish before they
        are cancelled.
    """
    server = Server(spec, name, max_queue, max_decode_steps)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(server.engine.stop, shutdown_grace_s)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind: Literal["invalid_request_error", "server_error"] = (
            "invalid_request_error" if e.status_code < 500 else "server_error")
        return APIError(e.status_code, str(e.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}: {e}",
                        kind="server_error").response()

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    return app
