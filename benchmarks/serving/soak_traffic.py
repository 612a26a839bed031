"""The soak's traffic (see soak.py): the seeded request mix, probes, the client that runs it
(streaming, non-streaming, disconnecting) and the server's memory, sampled."""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
import time
from dataclasses import dataclass

NEW_TOKENS = (16, 32, 64)  # output lengths of the load, drawn uniformly
KINDS = {"stream": 0.5, "full": 0.35, "disconnect": 0.15}  # full = non-streaming
LONG_FRACTION = 0.3  # share of prompts made by joining LONG_PARTS shipped prompts
LONG_PARTS = (4, 12)
PROBE_NEW = 32


@dataclass(frozen=True)
class Job:
    arrival: float  # s after the start of the load
    prompt: str
    max_new_tokens: int
    kind: str  # stream | full | disconnect | probe
    cancel_after: int = 0  # disconnect: close the stream once this many tokens arrived
    probe: int = -1  # probe: index in the probe set
    round: int = -1  # probe: which round
    skip: bool = True  # False: sent with {"vskipper": {"skip": false}} (the base model's function)


@dataclass
class Outcome:
    job: Job
    status: str  # completed | cancelled | failed
    tokens: int = 0
    finish: str = ""
    output_ids: list[int] | None = None
    ttft: float = math.nan
    e2e: float = math.nan
    error: str = ""
    span: tuple[float, float] = (math.nan, math.nan)  # (sent, answered), s after the start of the load

    @property
    def exact(self) -> bool:
        return self.tokens == self.job.max_new_tokens and self.finish == "length"


# --- what is sent ----------------------------------------------------------------------------
def shipped_prompts() -> list[str]:
    from vskipper.data import load

    return [r["prompt"] for r in load("prompts")]


def long_prompt(r: random.Random, prompts: list[str]) -> str:
    return "\n\n".join(r.sample(prompts, r.randint(*LONG_PARTS)))


def mixed_jobs(prompts: list[str], rate: float, duration: float, seed: int, opted_out: float = 0.0) -> list[Job]:
    """Seeded Poisson arrivals at `rate` req/s over [0, duration); every 1/opted_out-th of them (e.g.
    one in four at 0.25) sent with skip false."""
    r = random.Random(seed)
    jobs, t = [], r.expovariate(rate)
    kinds, weights = list(KINDS), list(KINDS.values())
    every = round(1 / opted_out) if opted_out > 0 else 0
    while t < duration:
        prompt = long_prompt(r, prompts) if r.random() < LONG_FRACTION else r.choice(prompts)
        n = r.choice(NEW_TOKENS)
        kind = r.choices(kinds, weights)[0]
        skip = not (every and len(jobs) % every == every - 1)
        jobs.append(Job(t, prompt, n, kind, cancel_after=r.randint(1, n // 2) if kind == "disconnect" else 0,
                        skip=skip))
        t += r.expovariate(rate)
    return jobs


def probe_set(prompts: list[str]) -> list[str]:
    """Four shipped prompts and two long ones, fixed."""
    r = random.Random(1234)
    return r.sample(prompts, 4) + [long_prompt(r, prompts) for _ in range(2)]


def probe_jobs(probes: list[str], duration: float, every: float, opted_out: bool = False) -> list[Job]:
    """The probe set every `every` s; with opted_out, each round also sends it with skip false."""
    times = [every / 2 + i * every for i in range(max(1, int(duration // every)))]
    return [Job(t, p, PROBE_NEW, "probe", probe=i, round=k, skip=skip) for k, t in enumerate(times)
            for skip in ((True, False) if opted_out else (True,)) for i, p in enumerate(probes)]


def mean_new_tokens() -> float:
    return statistics.fmean(NEW_TOKENS)


# --- the client --------------------------------------------------------------------------------
def _done(job: Job, body: dict, start: float, first: float | None) -> Outcome:
    end = time.perf_counter()
    meta = body["meta_info"]
    fr = meta.get("finish_reason") or {}
    return Outcome(job, "completed", meta["completion_tokens"], fr.get("type", "") if isinstance(fr, dict) else str(fr),
                   body.get("output_ids"), (first or end) - start, end - start)


async def send(session, url: str, job: Job, t0: float, live: dict) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + job.arrival - time.perf_counter()))
    live["sent"] += 1
    start = time.perf_counter()
    out = await _send(session, url, job, start)
    out.span = (start - t0, time.perf_counter() - t0)
    live["finished"] += 1
    return out


async def _send(session, url: str, job: Job, start: float) -> Outcome:
    first = None
    streaming = job.kind in ("stream", "disconnect")
    payload = {"text": job.prompt, "stream": streaming,
               "sampling_params": {"max_new_tokens": job.max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if not job.skip:
        payload["sampling_params"]["custom_params"] = {"vskipper": {"skip": False}}
    try:
        async with session.post(url + "/generate", json=payload) as resp:
            if resp.status != 200:
                return Outcome(job, "failed", error=f"HTTP {resp.status}: {(await resp.text())[:300]}")
            if not streaming:
                return _done(job, await resp.json(), start, None)
            last = None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                if "error" in msg:
                    return Outcome(job, "failed", error=f"error event: {msg['error']}")
                last = msg
                n = msg["meta_info"]["completion_tokens"]
                if first is None and n > 0:
                    first = time.perf_counter()
                if job.kind == "disconnect" and n >= job.cancel_after:
                    resp.close()  # drop the connection mid-stream; the server must abort the request
                    return Outcome(job, "cancelled", n, ttft=first - start, e2e=time.perf_counter() - start)
            if last is None:
                return Outcome(job, "failed", error="stream ended without a single event")
            return _done(job, last, start, first)
    except Exception as e:  # a soak counts failures; it does not hide them
        return Outcome(job, "failed", error=repr(e))


async def _run(url: str, jobs: list[Job], limit: float, progress=None) -> list[Outcome]:
    """Send every job at its arrival time; whatever is unfinished after `limit` s fails."""
    import aiohttp

    live = {"sent": 0, "finished": 0}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(send(session, url, j, t0, live)) for j in jobs]
        ticker = asyncio.ensure_future(_tick(live, t0, progress)) if progress else None
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        if ticker:
            ticker.cancel()
        out = []
        for j, t in zip(jobs, tasks):
            if t in done:
                out.append(t.result())
            else:
                out.append(Outcome(j, "failed", error=f"not finished {limit:.0f} s after the start of the load"))
        return out


async def _tick(live: dict, t0: float, progress) -> None:
    while True:
        await asyncio.sleep(15)
        progress(time.perf_counter() - t0, live["sent"], live["sent"] - live["finished"])


def run_jobs(url: str, jobs: list[Job], limit: float, progress=None) -> list[Outcome]:
    return asyncio.run(_run(url, jobs, limit, progress))


def idle_answers(url: str, probes: list[str], skip: bool = True) -> list[list[int] | None]:
    """Greedy answers of the probe set on an idle server: radix cache flushed, one at a time (skip
    False: sent with skip false)."""
    import requests

    r = requests.post(url + "/flush_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache on an idle server answered {r.status_code}: {r.text[:200]}")
    out = []
    for i, p in enumerate(probes):
        (o,) = run_jobs(url, [Job(0.0, p, PROBE_NEW, "probe", probe=i, skip=skip)], limit=600)
        if o.status != "completed" or not o.exact:
            raise RuntimeError(f"idle probe {i} did not complete: {o.status} {o.tokens} tokens {o.error}")
        out.append(o.output_ids)
    return out


# --- the server's memory -------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class RssSampler:
    def __init__(self, pid: int, every: float = 2.0) -> None:
        self.pid, self.every, self.samples = pid, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        t0 = time.time()
        while not self._stop.is_set():
            self.samples.append((time.time() - t0, tree_rss(self.pid)))
            self._stop.wait(self.every)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
