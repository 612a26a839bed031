"""Decode tokens/s (prefill subtracted) at batch 1, 8, 32, 64 with transformers' generate (CPU, f32):
  (a) the base model;
  (b) the skipper's own kind of eager loop: every row computes attention, MLP and adapter,
      per-token masks select (vskipper's dense-masked body, which is how FlexiDepth's reference
      code runs it);
  (c) vskipper.transform (default: execution="auto", the calibrated cost model; --execution);
  (d) the same with the skipper at rate 0 (nothing skipped: what vskipper's own path costs, so
      skipping gains and engine effects are reported apart).
Paired rounds: each round runs every system once on the same batch, in a fresh random order; a
system's speed against (a) is the median of its per-round ratios with a bootstrap 95% CI
(vskipper/bench/paired.py). The clock is this process's CPU time when torch runs one thread (the
work done: a neighbour's load on a shared machine stretches wall time, not that), wall time
otherwise (--clock). One markdown table."""
from __future__ import annotations

import argparse
import copy
import time

import torch

import vskipper


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vskipper.bench.paired import paired_delta, round_orders
    from vskipper.data import load
    from vskipper.models.smollm2 import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skipper", default="random:rate=0.5,layers=15-29,seed=0")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execution", default="auto", choices=list(vskipper.config.EXECUTIONS))
    ap.add_argument("--clock", choices=["cpu", "wall"], help="default: cpu with one torch thread, wall otherwise")
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.new_tokens < 2:
        ap.error("--rounds and --new-tokens must be >= 2")
    clock_name = args.clock or ("cpu" if torch.get_num_threads() == 1 else "wall")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    path = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    skipper = vskipper.parse_skipper(args.skipper)
    config = vskipper.Config(execution=args.execution)
    systems = {
        "(a) base": copy.deepcopy(base),  # every system a copy, made alike (a copy's step measured 1-2% slower)
        "(b) eager masked skipper": vskipper.transform(copy.deepcopy(base), skipper,
                                                       vskipper.Config(execution="dense")),
        "(c) vskipper": vskipper.transform(copy.deepcopy(base), vskipper.parse_skipper(args.skipper), config),
        "(d) rate 0": vskipper.transform(copy.deepcopy(base), rate0(skipper), config),
    }
    prompts = [r["prompt"] for r in load("prompts")]
    print(f"SmolLM2-135M-Instruct, skipper {args.skipper}, execution {args.execution!r}, {args.new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads, {args.rounds} paired rounds, {clock_name} clock; "
          f"ratios: median [95% CI] of per-round ratios to (a)\n")
    names = list(systems)
    print("| batch | (a) base tok/s | " + " | ".join(f"{n[:3]} / (a)" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (len(names) - 1))
    for B in (int(b) for b in args.batches.split(",")):
        enc = tok(prompts[:B], return_tensors="pt", padding=True)

        def run(m, new):
            t0 = clock()
            with torch.no_grad():
                m.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=tok.pad_token_id)
            return clock() - t0

        for m in systems.values():  # warm-up: first calls allocate and pick kernels
            run(m, 2)
        speeds = {n: [] for n in names}
        for order in round_orders(names, args.rounds, seed=B):
            for n in order:  # decode only: the prefill (and first token) subtracted
                speeds[n].append(B * (args.new_tokens - 1) / max(run(systems[n], args.new_tokens) -
                                                                 run(systems[n], 1), 1e-9))
        base_speed = sorted(speeds[names[0]])[len(speeds[names[0]]) // 2]
        cols = []
        for n in names[1:]:
            d = paired_delta(speeds[n], speeds[names[0]])
            cols.append(f"{1 + d.median:.2f} [{1 + d.lo:.2f}, {1 + d.hi:.2f}]")
        print(f"| {B} | {base_speed:.1f} | " + " | ".join(cols) + " |", flush=True)


def rate0(skipper):
    """The same skipper's layers with nothing skipped (a RandomSkip at rate 0)."""
    return vskipper.RandomSkip(0.0, list(skipper.layers))


if __name__ == "__main__":
    main()
