"""Concurrent streaming clients of an OpenAI-compatible ``/v1/completions`` endpoint.

``scripts/bench_server.py`` runs this in processes of their own, so the clients' work (HTTP,
SSE parsing) does not share the server's interpreter. It reads a workload from stdin,
``{"prompts": [[token ids], ...], "output_lens": [...]}``, posts each prompt with
``max_tokens`` its output length, greedy, ``"stream": true`` and usage reporting, from
``CLIENTS`` concurrent clients (0: one per request, all at once) spread over ``PROCESSES``
processes (requests dealt round-robin, all starting together), and writes to stdout
``{"elapsed_s", "cpu_s", "processes", "requests": [{"tokens", "chunks", "ttft_s", "tpot_s"},
...]}`` in workload order: every SSE event is read and parsed as JSON; tokens come from the
usage chunk, ``chunks`` counts the text chunks (a chunk carries every token of its request
that the engine made since the server's last write to it), TTFT is from sending the request
to its first text chunk, TPOT (last chunk - first chunk) / (tokens - 1); ``cpu_s`` is the
client processes' CPU time over the run.

Why aiohttp and several processes (as real clients are many machines): httpx's connection
pool scans all its connections for each request it places, so 1,000 concurrent streams kept
one core busy for ~10 s of a ~15 s run, and the clients, not the server, set the measured
rate; aiohttp in one process still spends ~0.5 ms of CPU per request before its connection
opens, 0.5 s before the last of 1,000 requests is sent (``bench/NOTES.md``, issue 14).

Usage: python scripts/http_clients.py URL MODEL CLIENTS PROCESSES < workload.json > out.json
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import sys
import time
from collections.abc import Callable
from typing import Any

BARRIER_TIMEOUT_S = 120.0
"""How long a client process waits for the others to be ready (importing aiohttp) before it
gives up."""


async def stream_one(http: Any, url: str, model: str, prompt: list[int], max_tokens: int
                     ) -> dict[str, float | None]:
    """One streamed completion: its token count (``usage``), text chunks and client-side
    timings."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens = None
    chunks = 0
    done = False
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"the server answered {r.status}: {await r.read()!r}")
        tail = b""  # an event not yet complete
        async for data in r.content.iter_any():
            *events, tail = (tail + data).split(b"\n\n")
            for event in events:
                if event == b"data: [DONE]":
                    done = True
                    continue
                if not event.startswith(b"data: "):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    raise RuntimeError(f"benchmark request failed: {chunk['error']['message']}")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"][0]["text"]:
                    chunks += 1
                    last = time.perf_counter()
                    first = first or last
    if tokens is None or not done:
        raise RuntimeError("a stream ended without its usage chunk and [DONE]")
    return dict(tokens=tokens, chunks=chunks, ttft_s=(first or sent) - sent,
                tpot_s=(last - first) / (tokens - 1) if first and tokens > 1 else None)


async def run_clients(url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                      clients: int, start: Callable[[], object] = lambda: None
                      ) -> dict[str, Any]:
    """``clients`` concurrent clients (0: one per request) taking requests in order, once
    ``start`` returns; ``start``/``end`` are ``time.monotonic()`` (one clock for all
    processes)."""
    import aiohttp

    jobs: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        jobs.put_nowait(i)
    out: list[dict[str, float | None]] = [{} for _ in prompts]
    n = clients or len(prompts)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def client() -> None:
            while not jobs.empty():
                i = jobs.get_nowait()
                out[i] = await stream_one(http, url, model, prompts[i], output_lens[i])

        start()
        t0, cpu0 = time.monotonic(), time.process_time()
        await asyncio.gather(*(client() for _ in range(n)))
        end, cpu_s = time.monotonic(), time.process_time() - cpu0
    return {"start": t0, "end": end, "cpu_s": cpu_s, "requests": out}


def _client_process(url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                    clients: int, barrier: Any, results: Any, slot: int) -> None:
    try:
        result = asyncio.run(run_clients(url, model, prompts, output_lens, clients,
                                         lambda: barrier.wait(BARRIER_TIMEOUT_S)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, which raises it
        barrier.abort()  # the others stop waiting
        result = f"{type(e).__name__}: {e}"
    results.put((slot, result))


def run_processes(url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                  clients: int, processes: int) -> dict[str, Any]:
    """The requests dealt round-robin to ``processes`` client processes (each with its share
    of ``clients``; 0: one client per request), started together; their figures merged in
    workload order: ``elapsed_s`` from the first start to the last end, ``cpu_s`` summed."""
    processes = max(1, min(processes, clients or len(prompts), len(prompts)))
    ctx = multiprocessing.get_context("fork")  # no threads or devices here: safe, and fast
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    slices = [range(p, len(prompts), processes) for p in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(
        url, model, [prompts[i] for i in idx], [output_lens[i] for i in idx],
        clients // processes + (p < clients % processes), barrier, results, p))
        for p, idx in enumerate(slices)]
    for proc in procs:
        proc.start()
    parts: dict[int, Any] = {}
    while len(parts) < len(procs):
        try:
            slot, part = results.get(timeout=1.0)
            parts[slot] = part
        except queue.Empty:
            dead = [p for p, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"client process {dead[0]} exited with code "
                                   f"{procs[dead[0]].exitcode}") from None
    for proc in procs:
        proc.join()
    failed = [part for part in parts.values() if isinstance(part, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    out: list[dict[str, float | None]] = [{} for _ in prompts]
    for p, idx in enumerate(slices):
        for i, r in zip(idx, parts[p]["requests"], strict=True):
            out[i] = r
    return {"elapsed_s": max(r["end"] for r in parts.values())
            - min(r["start"] for r in parts.values()),
            "cpu_s": sum(r["cpu_s"] for r in parts.values()), "processes": processes,
            "requests": out}


def main(argv: list[str]) -> None:
    """Read the workload from stdin, run the clients, write the result to stdout."""
    url, model, clients, processes = argv[0], argv[1], int(argv[2]), int(argv[3])
    w = json.load(sys.stdin)
    json.dump(run_processes(url, model, w["prompts"], w["output_lens"], clients, processes),
              sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
