"""A step in transformers (CPU, f32), systems side by side in paired rounds: decode, prefill, or both.

Decode: tokens/s (prefill subtracted) at batch 1, 8, 32, 64 with transformers' generate:
  (a) the base model;
  (b) the skipper's own kind of eager loop: every row computes attention, MLP and adapter,
      per-token masks select (vskipper's dense-masked body, which is how FlexiDepth's reference
      code runs it);
  (c) vskipper.transform (default: execution="auto", the calibrated cost model; --execution);
  (d) the same with the skipper at rate 0 (nothing skipped: what vskipper's own path costs, so
      skipping gains and engine effects are reported apart).
Prefill: the forward of the prompt(s) (generate's prefill), --input-len tokens each, with the dense
body, the routed body with attention for all rows (as before routed prefill) and the routed body,
paired against dense.

Paired rounds: each round runs every system once on the same batch, in a fresh random order; a
system's speed against the baseline is the median of its per-round ratios with a bootstrap 95% CI
(benchmarks/stats.py). The clock is this process's CPU time when torch runs one thread (the work
done: a neighbour's load on a shared machine stretches wall time, not that), wall time otherwise
(--clock).

    python -m benchmarks.step.hf_step                                    # decode, batch 1 8 32 64
    python -m benchmarks.step.hf_step --phase prefill --batches 1 --input-len 256 \\
        --skipper random:rate=0.25,layers=15-29,seed=0                  # 75% of rows RUN
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

import vskipper
from benchmarks import results as R
from benchmarks.results import log
from benchmarks.stats import paired_delta, timed_rounds

DEFAULT_BATCHES = {"decode": [1, 8, 32, 64], "prefill": [1]}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step.hf_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["decode", "prefill", "both"], default="decode")
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--skipper", default="random:rate=0.5,layers=15-29,seed=0")
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: decode 1 8 32 64, prefill 1)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode: tokens generated per sequence")
    ap.add_argument("--input-len", type=int, default=1024, help="prefill: prompt tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execution", default="auto", choices=list(vskipper.config.EXECUTIONS), help="decode: (c)'s")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--clock", choices=["cpu", "wall"], help="default: cpu with one torch thread, wall otherwise")
    R.add_arguments(ap, None)
    a = ap.parse_args(argv)
    if a.rounds < 2 or a.new_tokens < 2 or a.input_len < 1 or min(a.batches or [1]) < 1 or (a.threads or 1) < 1:
        ap.error("--rounds and --new-tokens must be >= 2, --input-len, --batches and --threads >= 1")
    a.phases = ["decode", "prefill"] if a.phase == "both" else [a.phase]
    a.out = a.out or Path("out") / f"hf-step-{a.phase}"
    return a


def ratio_table(speeds: dict[int, dict[str, list[float]]], names: list[str], what: str, digits: int) -> str:
    """Per batch size: the baseline's (names[0]) median and every other system's paired ratio to it."""
    rows = []
    for B, v in speeds.items():
        base = sorted(v[names[0]])[len(v[names[0]]) // 2]
        rows.append([B, f"{base:.{digits}f}"] + [paired_delta(v[n], v[names[0]]).ratio_text(2) for n in names[1:]])
    return R.table(["batch", f"{names[0]} {what}"] + [f"{n.split()[0]} / {names[0].split()[0]}" for n in names[1:]],
                   rows)


def decode(args, base, tok, clock) -> tuple[str, dict]:
    from vskipper.data import load

    skipper = vskipper.parse_skipper(args.skipper)
    config = vskipper.Config(execution=args.execution)
    systems = {
        "(a) base": copy.deepcopy(base),  # every system a copy, made alike (a copy's step runs a little slower)
        "(b) eager masked skipper": vskipper.transform(copy.deepcopy(base), skipper,
                                                       vskipper.Config(execution="dense")),
        "(c) vskipper": vskipper.transform(copy.deepcopy(base), vskipper.parse_skipper(args.skipper), config),
        "(d) rate 0": vskipper.transform(copy.deepcopy(base), vskipper.RandomSkip(0.0, list(skipper.layers)), config),
    }
    prompts = [r["prompt"] for r in load("prompts")]
    speeds = {}
    for B in args.batches or DEFAULT_BATCHES["decode"]:
        enc = tok(prompts[:B], return_tensors="pt", padding=True)

        def run(m, new):
            t0 = clock()
            with torch.no_grad():
                m.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=tok.pad_token_id)
            return clock() - t0

        def step(n: str) -> float:  # decode tok/s: the prefill (and first token) subtracted
            return B * (args.new_tokens - 1) / max(run(systems[n], args.new_tokens) - run(systems[n], 1), 1e-9)

        speeds[B] = timed_rounds(list(systems), args.rounds, B, step)
        log(f"decode, batch {B} done")
    head = (f"transformers decode, skipper {args.skipper}, execution {args.execution!r}, {args.new_tokens} new tokens, "
            f"{args.rounds} paired rounds; ratios: median [95% CI] of per-round ratios to (a)")
    return f"{head}\n\n{ratio_table(speeds, list(systems), 'tok/s', 1)}", speeds


def prefill(args, base, clock) -> tuple[str, dict]:
    import vskipper.engines.hf as hf

    sk = vskipper.parse_skipper(args.skipper)
    models = {b: vskipper.transform(copy.deepcopy(base), copy.deepcopy(sk), vskipper.Config(execution=b))
              for b in ("dense", "routed")}
    every_row = lambda mask, B, S, Skv: 0  # noqa: E731  (n < 0 never: attention for all rows, as before)
    systems = {"dense": (models["dense"], hf._query_rows), "routed-mlp-only": (models["routed"], every_row),
               "routed": (models["routed"], hf._query_rows)}
    times = {}
    for B in args.batches or DEFAULT_BATCHES["prefill"]:
        ids = torch.randint(1, 10000, (B, args.input_len), generator=torch.Generator().manual_seed(0))

        def step(n: str) -> float:
            m, hf._query_rows = systems[n]
            t0 = clock()
            with torch.no_grad():
                m(ids)
            return clock() - t0

        try:
            times[B] = timed_rounds(list(systems), args.rounds, B, step)
        finally:
            hf._query_rows = systems["dense"][1]
        log(f"prefill, batch {B} done")
    ms = {B: {n: [1e3 * x for x in v] for n, v in t.items()} for B, t in times.items()}
    head = (f"transformers forward, prompts of {args.input_len} tokens, skipper {args.skipper}, {args.rounds} paired "
            f"rounds; ratios: median [95% CI] of per-round time ratios to dense")
    return f"{head}\n\n{ratio_table(ms, list(systems), 'ms', 0)}", times


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vskipper.models.smollm2 import smollm2_dir

    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock_name = args.clock or ("cpu" if torch.get_num_threads() == 1 else "wall")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    path = args.model or str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sections, values = [f"{type(base).__name__}, {torch.get_num_threads()} thread(s), {clock_name} clock"], {}
    for phase in args.phases:
        text, values[phase] = decode(args, base, tok, clock) if phase == "decode" else prefill(args, base, clock)
        sections.append(text)
        print(text, flush=True)
    R.write_results(f"hf-step-{args.phase}", {"args": vars(args), "decode_tok_s": values.get("decode"),
                                              "prefill_s": values.get("prefill")},
                    "\n\n".join(sections) + "\n", args.out, R.docs_dir(args))


if __name__ == "__main__":
    main()
