"""Open-loop load: seeded Poisson arrivals, pinned output lengths, per-request TTFT / TPOT /
end-to-end latency, through SGLang's native streaming /generate endpoint.

The serving benchmarks (quick and full) send their requests with SGLang's own client
(vskipper/bench/sglang_client.py); this client of ours remains only for the soak run
(vskipper/bench/soak.py), and `Result` / `throughput` serve both."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt: str
    arrival: float  # seconds after the start of the run
    max_new_tokens: int


@dataclass(frozen=True)
class Result:
    ok: bool
    ttft: float  # s
    tpot: float  # s per output token after the first
    e2e: float  # s
    output_tokens: int
    start: float
    end: float
    error: str = ""


def poisson_schedule(prompts: list[str], rate: float, n: int, max_new_tokens: int, seed: int) -> list[Request]:
    """n requests cycling over prompts; exponential inter-arrival gaps at `rate` req/s
    (rate = inf: all at t = 0, i.e. saturation)."""
    r = random.Random(seed)
    order = [prompts[i % len(prompts)] for i in range(n)]
    r.shuffle(order)
    t, out = 0.0, []
    for p in order:
        out.append(Request(p, t, max_new_tokens))
        if math.isfinite(rate):
            t += r.expovariate(rate)
    return out


async def _one(session, url: str, req: Request, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    start = time.perf_counter()
    first = None
    n = 0
    payload = {"text": req.prompt, "stream": True,
               "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0, "ignore_eos": True}}
    try:
        async with session.post(url + "/generate", json=payload) as resp:
            if resp.status != 200:
                return Result(False, 0, 0, 0, 0, start, time.perf_counter(), f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if first is None and n > 0:
                    first = time.perf_counter()
    except Exception as e:  # a benchmark records failures; it does not hide them
        return Result(False, 0, 0, 0, n, start, time.perf_counter(), repr(e))
    end = time.perf_counter()
    ttft = (first or end) - start
    tpot = (end - (first or end)) / max(1, n - 1)
    return Result(n == req.max_new_tokens, ttft, tpot, end - start, n, start, end,
                  "" if n == req.max_new_tokens else f"{n} of {req.max_new_tokens} tokens")


async def _run(url: str, reqs: list[Request]) -> list[Result]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        return await asyncio.gather(*[_one(session, url, r, t0) for r in reqs])


def run_load(url: str, reqs: list[Request]) -> list[Result]:
    return asyncio.run(_run(url, reqs))


def throughput(results: list[Result]) -> float:
    """Output tokens per second over the span of the run."""
    ok = [r for r in results if r.ok]
    if not ok:
        return 0.0
    span = max(r.end for r in ok) - min(r.start for r in results)
    return sum(r.output_tokens for r in ok) / span
