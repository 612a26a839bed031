"""Decode tokens/s (prefill subtracted) at batch 1, 8, 32, 64 with transformers' generate (CPU, f32):
  (a) the base model;
  (b) the skipper's own kind of eager loop: every row computes attention, MLP and adapter,
      per-token masks select (vskipper's dense-masked body, which is how FlexiDepth's reference
      code runs it);
  (c) vskipper.transform (default: execution="auto", the calibrated cost model; --execution).
Interleaved repeats, median; one markdown table."""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import vskipper


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vskipper.data import load
    from vskipper.models.smollm2 import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skipper", default="random:rate=0.5,layers=15-29,seed=0")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--execution", default="auto", choices=["auto", "dense", "routed"])
    args = ap.parse_args(argv)
    path = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    systems = {
        "(a) base": base,
        "(b) eager masked skipper": vskipper.transform(copy.deepcopy(base), vskipper.parse_skipper(args.skipper),
                                                       vskipper.Config(execution="dense")),
        "(c) vskipper": vskipper.transform(copy.deepcopy(base), vskipper.parse_skipper(args.skipper),
                                           vskipper.Config(execution=args.execution)),
    }
    prompts = [r["prompt"] for r in load("prompts")]
    print(f"SmolLM2-135M-Instruct, skipper {args.skipper}, {args.new_tokens} new tokens, {torch.get_num_threads()} "
          f"threads, median of {args.repeats}\n")
    print("| batch | " + " | ".join(f"{n} tok/s" for n in systems) + " | (c) / (a) | (b) / (a) |")
    print("|---|" + "---|" * (len(systems) + 2))
    for B in (int(b) for b in args.batches.split(",")):
        enc = tok(prompts[:B], return_tensors="pt", padding=True)
        speeds = {n: [] for n in systems}
        for m in systems.values():  # warm-up: first calls allocate and pick kernels
            with torch.no_grad():
                m.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
        for r in range(args.repeats):
            for n, m in list(systems.items())[r % 3:] + list(systems.items())[:r % 3]:
                t = []
                for new in (1, args.new_tokens):  # decode only: the prefill (and first token) subtracted
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        m.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
                    t.append(time.perf_counter() - t0)
                speeds[n].append(B * (args.new_tokens - 1) / (t[1] - t[0]))
        med = {n: statistics.median(v) for n, v in speeds.items()}
        a, b, c = med.values()
        print(f"| {B} | " + " | ".join(f"{v:.1f}" for v in med.values()) + f" | {c / a:.2f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
