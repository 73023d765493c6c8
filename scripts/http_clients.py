"""Concurrent streaming clients of an OpenAI-compatible ``/v1/completions`` endpoint.

``scripts/bench_server.py`` runs this in a process of its own, so the clients' work (HTTP,
SSE parsing) does not share the server's interpreter. It reads a workload from stdin,
``{"prompts": [[token ids], ...], "output_lens": [...]}``, posts each prompt with
``max_tokens`` its output length, greedy, ``"stream": true`` and usage reporting, from
``CLIENTS`` concurrent clients (0: one per request, all at once), and writes to stdout
``{"elapsed_s", "cpu_s", "requests": [{"tokens", "chunks", "ttft_s", "tpot_s"}, ...]}`` in
workload order: every SSE event is read and parsed as JSON; tokens come from the usage
chunk, ``chunks`` counts the text chunks (a chunk carries every token of its request that
one engine step made), TTFT is from sending the request to its first text chunk, TPOT
(last chunk - first chunk) / (tokens - 1); ``cpu_s`` is this process's CPU time over the run.

aiohttp (as vLLM's serving benchmark uses): httpx's connection pool scans all its
connections for each request it places, so 1,000 concurrent streams took one core for
~10 s of a run (``bench/NOTES.md``, issue 14) and the clients, not the server, set the
measured rate.

Usage: python scripts/http_clients.py URL MODEL CLIENTS < workload.json > result.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


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
                      clients: int) -> dict[str, Any]:
    """``clients`` concurrent clients (0: one per request) taking requests in order."""
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

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client() for _ in range(n)))
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return {"elapsed_s": elapsed, "cpu_s": cpu_s, "requests": out}


def main(argv: list[str]) -> None:
    """Read the workload from stdin, run the clients, write the result to stdout."""
    url, model, clients = argv[0], argv[1], int(argv[2])
    w = json.load(sys.stdin)
    result = asyncio.run(run_clients(url, model, w["prompts"], w["output_lens"], clients))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
