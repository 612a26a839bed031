"""Regret of Config(execution="auto"): for each batch size T and RUN fraction f, one routed
layer's decode step timed with the dense-masked body, the routed body and auto, side by side
(interleaved repeats, medians); regret = auto / min(dense, routed) - 1.

Uses this device's calibration (`vskipper calibrate`), measuring it first if there is none.
Prints a markdown table and a last line `max_regret=<x> median_regret=<y>`."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from vskipper import cost
from vskipper.calibrate import LayerBench, measure

TS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FS = (0.1, 0.3, 0.5, 0.7, 0.9)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="576,1536,9,3", help="hidden,intermediate,heads,kv_heads (SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    H, I, nh, kvh = (int(v) for v in args.shape.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cal = cost.load(device, H, I)
    if cal is None or (cal.hidden, cal.intermediate) != (H, I):
        print("no calibration for this shape: measuring it first", file=sys.stderr)
        cal, _ = measure(H, I, nh, kvh, device=device)
        cost.save(cal)
    bench = LayerBench(H, I, nh, kvh, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows, regrets, choice = [], [], []
    t0 = time.perf_counter()
    for T in TS:
        for f in FS:
            args_ = bench.inputs(T, f)
            auto = cost.AutoBody(cal)
            bench.body.chooser = auto
            for b in ("dense", "routed", "auto"):
                bench.time(b, args_, sync)
            samples = {b: [] for b in ("dense", "routed", "auto")}
            order = ["dense", "routed", "auto"]
            for r in range(args.repeats):
                for b in order[r % 3:] + order[:r % 3]:
                    samples[b].append(bench.time(b, args_, sync))
            med = {b: statistics.median(v) for b, v in samples.items()}
            regret = med["auto"] / min(med["dense"], med["routed"]) - 1
            regrets.append(regret)
            choice.append(med[auto.current] / min(med["dense"], med["routed"]) - 1)  # the choice alone
            rows.append(f"| {T} | {f} | {med['dense']:.3f} | {med['routed']:.3f} | {med['auto']:.3f} | {auto.current} | "
                        f"{choice[-1]:+.3f} | {regret:+.3f} |")
        print(f"T={T} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"{cost.device_name(device)}, hidden={H} intermediate={I}, median of {args.repeats} interleaved repeats\n")
    print("| T | RUN fraction | dense ms | routed ms | auto ms | auto chose | choice regret | regret |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    # choice regret: the time of the body auto chose (its own column) over the faster one; regret
    # (the target's measure) also carries the noise between the auto column and that body's column
    print(f"\nmax_choice_regret={max(choice):.3f} median_choice_regret={statistics.median(choice):.3f}")
    print(f"max_regret={max(regrets):.3f} median_regret={statistics.median(regrets):.3f}")


if __name__ == "__main__":
    main()
