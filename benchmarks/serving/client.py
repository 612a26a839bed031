"""The one load client of the benchmarks: SGLang's own (`sglang.benchmark.serving`), called in-process.

SGLang's, unchanged: the requests (its custom-dataset sampler over vskipper's shipped prompts,
chat template applied, output length pinned), the arrivals (`get_request`: all at once, or
Poisson at a rate), the sending and timing of every request (`async_request_sglang_generate`,
streaming /generate: TTFT, per-token gaps, e2e) and the metrics (`calculate_metrics`: output
tok/s, mean TTFT / TPOT / e2e).

Ours, and only this: `_drive`, the loop that hands those requests to SGLang's request function
under a concurrency limit. It is the core of SGLang's `benchmark()` (same semaphore, same
generator, same gather) without what that function adds around it on every call: a warm-up
request, a fixed 1 s sleep, two /server_info requests, a printed report and an appended result
file, about 1 s per call (a quick run makes ~70 calls; a subprocess call of the CLI costs ~20 s).
And the open loop's arrival times: SGLang's `get_request` draws each Poisson gap from numpy's
global generator as it goes, so two calls running at once (the quick run measures two servers
side by side, each call in its own thread) would take each other's draws. `_arrivals` draws the
same exponential gaps up front from a generator of the call's own seed, and `_drive` sends each
request at its time, as `get_request` replays a trace.

The soak (soak_traffic.py) sends its own streaming, non-streaming and disconnecting requests: the
traffic it checks the server under, not a measurement.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Client", "LoadResult", "opt_out"]

_GLOBAL = threading.Lock()  # SGLang's module-global args and our stdout redirect: one call at a time


@dataclass(frozen=True)
class LoadResult:
    """One call: what SGLang's calculate_metrics reports, plus the texts (for quality)."""

    requests: int
    completed: int
    duration: float  # s, first request sent to last one done
    output_throughput: float  # output tok/s over the duration
    mean_ttft_ms: float
    mean_tpot_ms: float
    mean_e2e_ms: float
    texts: tuple[str, ...]
    errors: tuple[str, ...]
    per_request: tuple[tuple[bool, float, float, int, float], ...] = ()  # (success, ttft, e2e, tokens, start) s


def _args(ignore_eos: bool) -> argparse.Namespace:
    """The fields of SGLang's CLI namespace that its request function and metrics read."""
    return argparse.Namespace(
        backend="sglang", temperature=0.0, top_p=1.0, disable_ignore_eos=not ignore_eos, disable_stream=False,
        return_logprob=False, return_routed_experts=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, header=None, cache_report=False, plot_throughput=False, goodput=None)


def opt_out(rows: list, share: float, ignore_eos: bool = True) -> list:
    """Copies of `rows` where every 1/share-th row (row i when floor((i + 1) * share) > floor(i * share))
    carries {"vskipper": {"skip": false}} in its /generate sampling params. SGLang's request function
    puts a row's extra_request_body over its own payload, so those rows give the whole sampling_params
    it would send (greedy, the pinned output length, ignore_eos), plus custom_params."""
    import dataclasses
    import math

    if not 0 <= share <= 1:
        raise ValueError(f"opt_out: share={share} must be in [0, 1]")
    out = []
    for i, row in enumerate(rows):
        if math.floor((i + 1) * share) > math.floor(i * share):
            sp = {"temperature": 0.0, "max_new_tokens": row.output_len, "ignore_eos": ignore_eos,
                  "custom_params": {"vskipper": {"skip": False}}}
            row = dataclasses.replace(row, extra_request_body={**(row.extra_request_body or {}), "sampling_params": sp})
        out.append(row)
    return out


class Client:
    """SGLang's benchmark client for one model's tokenizer; `run` measures one load on one server."""

    def __init__(self, model_path: str, work_dir: Path) -> None:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGLang's quantization modules warn on import without a GPU
            import sglang.benchmark.serving as sb
            from sglang.benchmark.utils import get_tokenizer

            self.sb = sb
            self.tokenizer = get_tokenizer(model_path)
        work_dir.mkdir(parents=True, exist_ok=True)
        self.dataset = work_dir / "prompts-sglang-custom.jsonl"
        from vskipper.data import load

        # SGLang's custom dataset format: a user turn and an answer turn (unused here: lengths are pinned)
        self.dataset.write_text("".join(json.dumps({"conversations": [{"content": r["prompt"]}, {"content": "-"}]})
                                        + "\n" for r in load("prompts")))

    def prompt_rows(self, n: int, output_len: int, seed: int) -> list:
        """n shipped prompts, sampled by SGLang's custom-dataset reader (seeded), output length pinned."""
        from sglang.benchmark.datasets.custom import sample_custom_requests

        if n < 1 or output_len < 4:
            raise ValueError(f"prompt_rows: n={n} must be >= 1 and output_len={output_len} >= 4 (SGLang's minimum)")
        random.seed(seed)  # sample_custom_requests shuffles with the global generator
        with contextlib.redirect_stdout(io.StringIO()):
            rows = sample_custom_requests(str(self.dataset), n, self.tokenizer, fixed_output_len=output_len,
                                                         apply_chat_template=True)
        if len(rows) != n:
            raise ValueError(f"prompt_rows: asked for {n} prompts, the shipped set gave {len(rows)}")
        return rows

    def question_rows(self, prompts: list[str], max_new_tokens: int) -> list:
        """Chat-templated token ids of each prompt, in order (the answers are read back in that order)."""
        from sglang.benchmark.datasets.common import DatasetRow

        rows = []
        for p in prompts:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False)
            rows.append(DatasetRow(prompt=list(ids), prompt_len=len(ids), output_len=max_new_tokens))
        return rows

    def run(self, url: str, rows: list, concurrency: int | None, rate: float = float("inf"), seed: int = 0,
            ignore_eos: bool = True) -> LoadResult:
        """Send `rows` to the server at `url`: closed loop at `concurrency` (rate inf), or open loop
        with Poisson arrivals at `rate` req/s (seeded: the same seed, the same arrival times).
        Greedy; ignore_eos pins output lengths (False for quality: answers end where the model ends)."""
        import numpy as np

        if not rows:
            raise ValueError("run: no requests")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"run: concurrency={concurrency} must be >= 1 or None")
        if not rate > 0:
            raise ValueError(f"run: rate={rate} must be > 0 (inf: all at once)")
        sb = self.sb
        with _GLOBAL:  # the same args for every call of a run; calls may overlap (see the docstring)
            sb.set_global_args(_args(ignore_eos))  # SGLang's request function reads its module-global args
        sb.flush_server_cache(url, "sglang")  # every call starts from an empty radix cache
        at = None if rate == float("inf") else _arrivals(len(rows), rate, np.random.default_rng(seed))
        outputs, duration = asyncio.run(self._drive(url, rows, concurrency, at))
        with _GLOBAL, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            m, _ = sb.calculate_metrics(rows, outputs, duration, self.tokenizer, "sglang")
        return LoadResult(len(rows), m.completed, duration, m.output_throughput, m.mean_ttft_ms, m.mean_tpot_ms,
                          m.mean_e2e_latency_ms, tuple(o.generated_text for o in outputs),
                          tuple(o.error for o in outputs),
                          tuple((o.success, o.ttft, o.latency, o.output_len, o.start_time) for o in outputs))

    async def _drive(self, url: str, rows: list, concurrency: int | None, at: list[float] | None):
        """The core of sglang.benchmark.serving.benchmark(); see the module docstring for why ours.
        at: each request's send time, s after the first (None: all at once)."""
        sb = self.sb
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(row):
            inp = sb.RequestFuncInput(prompt=row.prompt, api_url=url + "/generate", prompt_len=row.prompt_len,
                                      output_len=row.output_len, model="default", lora_name=None, image_data=None,
                                      extra_request_body=dict(row.extra_request_body))
            if sem is None:
                return await sb.async_request_sglang_generate(inp)
            async with sem:
                return await sb.async_request_sglang_generate(inp)

        t0 = time.perf_counter()
        tasks = []
        if at is None:
            async for row in sb.get_request(list(rows), float("inf")):
                tasks.append(asyncio.create_task(one(row)))
        else:
            for row, t in zip(rows, at):
                if (wait := t0 + t - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        return outputs, time.perf_counter() - t0


def _arrivals(n: int, rate: float, rng) -> list[float]:
    """Poisson arrivals at `rate` req/s as SGLang's get_request draws them (the first at once, then
    an exponential gap of mean 1 / rate after each), as times from the first, s."""
    gaps = rng.exponential(1.0 / rate, n - 1)
    return [0.0] + [float(x) for x in gaps.cumsum()]
