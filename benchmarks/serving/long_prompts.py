"""Time to first token of long prompts, through SGLang's own client: upstream SGLang against SGLang +
vskipper (rate 0: the same engine path with nothing skipped; RandomSkip 0.5 over the second half of
the layers; on the bundled SmolLM2-135M, the shipped trained FlexiDepth skipper).

Requests are SGLang's random-ids dataset (`sample_random_requests` with integer token ids, no
download), `--input-len` tokens each (1024 by default, lengths pinned), `--output-len` new tokens,
sent and timed by `sglang.benchmark.serving`'s request function (client.py),
every call from an empty radix cache. Paired rounds: each round draws fresh prompts and runs every
system, in a fresh random order, at two loads: all `--requests` at once, and Poisson arrivals at
`--open-load` x upstream's capacity (measured in the warm-up round: requests / duration). Per load
and system: mean TTFT (median over rounds) and its ratio to upstream's in the same round (median,
bootstrap 95% CI; benchmarks/stats.py). Servers: one CPU thread each (servers.SERVER_THREADS).

    python -m benchmarks.serving.long_prompts         # 8 requests x 1024 tokens, 4 rounds: ~12 min on 2 CPUs
    python -m benchmarks.serving.long_prompts --requests 16 --rounds 6 --chunked-prefill-size 512
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import random
import statistics

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.serving.servers import SERVER_THREADS, System, default_systems, start_all, stop
from benchmarks.stats import paired_delta, round_orders


def prompts(client, n: int, input_len: int, output_len: int, seed: int) -> list:
    """n random-ids prompts of exactly input_len tokens (SGLang's sampler, seeded)."""
    import numpy as np
    from sglang.benchmark.datasets.random import sample_random_requests

    random.seed(seed)
    np.random.seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):
        return sample_random_requests(input_len, output_len, n, 1.0, client.tokenizer, "", random_sample=False,
                                      return_text=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="base model (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--skipper", help="skipper spec under test (default: random:rate=0.5 over the second half)")
    ap.add_argument("--requests", type=int, default=8, help="requests per call")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds after the warm-up round")
    ap.add_argument("--open-load", type=float, default=0.75, help="open-loop arrival rate, x upstream's capacity")
    ap.add_argument("--chunked-prefill-size", type=int, help="SGLang's --chunked-prefill-size for every server")
    R.add_arguments(ap, "long-prompts")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.input_len < 1 or args.output_len < 4 or args.rounds < 3 or not 0 < args.open_load:
        ap.error("--requests and --input-len must be >= 1, --output-len >= 4 (SGLang's client minimum), "
                 "--rounds >= 3, --open-load > 0")
    try:
        systems = default_systems(args.model_path, args.skipper)
    except ValueError as e:
        ap.error(str(e))
    if args.chunked_prefill_size:
        flag = ("--chunked-prefill-size", str(args.chunked_prefill_size))
        systems = [dataclasses.replace(s, args=s.args + flag) for s in systems]
    run(systems, args)


def run(systems: list[System], args) -> None:
    from benchmarks.serving.client import Client

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in systems]
    threads = SERVER_THREADS
    pool = args.requests * (args.input_len + args.output_len) + 1024
    log(f"starting {len(systems)} SGLang servers ({', '.join(names)}), {threads} CPU thread(s) each, "
        f"KV pool {pool} tokens")
    servers = start_all(systems, out, pool, threads=threads)
    try:
        client = Client(systems[0].model_path, out)
        warm = prompts(client, args.requests, args.input_len, args.output_len, seed=10_000)
        capacity = None
        for n in names:  # warm-up round (not counted); upstream's gives the capacity
            r = client.run(servers[n].url, warm, None)
            if n == names[0]:
                capacity = r.completed / r.duration
        rate = args.open_load * capacity
        log(f"upstream's capacity {capacity:.3f} req/s; open loop at {rate:.3f} req/s")
        loads = {"all at once": float("inf"), f"open loop {args.open_load}x capacity": rate}  # arrival rates
        ttft = {load: {n: [] for n in names} for load in loads}
        failed = {load: {n: 0 for n in names} for load in loads}
        for r_i, order in enumerate(round_orders(names, args.rounds, seed=0)):
            rows = prompts(client, args.requests, args.input_len, args.output_len, seed=r_i)
            for n in order:
                for load in loads:
                    res = client.run(servers[n].url, rows, None, rate=loads[load], seed=r_i)
                    ttft[load][n].append(res.mean_ttft_ms)
                    failed[load][n] += res.requests - res.completed
            log(f"round {r_i + 1}/{args.rounds} done")
    finally:
        for srv in servers.values():
            stop(srv)
    header = (f"SGLang's client, {args.requests} random-ids prompts of {args.input_len} tokens, {args.output_len} "
              f"output tokens, {args.rounds} paired rounds in random order, {threads} CPU thread(s) per server"
              + (f", --chunked-prefill-size {args.chunked_prefill_size}" if args.chunked_prefill_size else "")
              + "; TTFT: median over rounds of each call's mean; ratio: median [95% CI] of per-round ratios to "
                "upstream")
    rows = []
    for load in loads:
        for n in names:
            ratio = "-" if n == names[0] else paired_delta(ttft[load][n], ttft[load][names[0]]).ratio_text()
            rows.append([load, n, f"{statistics.median(ttft[load][n]):.0f}", ratio, failed[load][n]])
    text = f"{header}\n\n" + R.table(["load", "system", "mean TTFT ms", "TTFT / upstream", "failed"], rows) + "\n"
    R.write_results("long-prompts", {"systems": [dataclasses.asdict(x) for x in systems], "args": vars(args),
                                     "open_rate": rate, "ttft_ms": ttft, "failed": failed}, text, out, R.docs_dir(args))
    print(text)


if __name__ == "__main__":
    main()
