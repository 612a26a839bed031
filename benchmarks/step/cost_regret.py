"""Regret of Config(execution="auto"): for each batch size T and RUN fraction f, one routed
layer's decode step timed with the dense-masked, routed and routed-mlp bodies and auto, side by side
in rounds of random order (calibrate.side_by_side); regret = auto / min(the other bodies) - 1, each
ratio the median over rounds of the two bodies' times in the same round. The ms columns are lower
quartiles.

Uses this device's calibration (`vskipper calibrate`), measuring it first if there is none.
Prints a markdown table and a last line `max_regret=<x> median_regret=<y>`.

    python -m benchmarks.step.cost_regret [--shape 576,1536,9,3] [--repeats 15]
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from benchmarks import results as R
from benchmarks.results import log
from benchmarks.step.layer import parse
from vskipper import cost
from vskipper.calibrate import LayerBench, lower_quartile, measure, paired_ratio, repeats_at, side_by_side

TS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FS = (0.1, 0.3, 0.5, 0.7, 0.9)
BODIES = ("dense", "routed", "routed-mlp", "auto")
FIXED = BODIES[:-1]
# more rounds up to T=64 than the calibration takes: one round's auto/routed ratio moves by ~10%
# at small T on a shared CPU, and the max over 50 cells would be that noise, not auto's regret
SHORT = 64


def main(argv=None) -> None:
    args, (H, I, nh, kvh), device = parse(argv, "cost-regret", __doc__)
    cal = cost.load(device, H, I)
    if cal is None or (cal.hidden, cal.intermediate) != (H, I):
        log("no calibration for this shape: measuring it first")
        cal, _ = measure(H, I, nh, kvh, device=device)
        cost.save(cal)
    bench = LayerBench(H, I, nh, kvh, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows, regrets, choice = [], [], []
    rng = random.Random(0)
    t0 = time.perf_counter()
    for T in TS:
        for f in FS:
            auto = bench.add_auto(cal).chooser
            s = side_by_side(bench, BODIES, bench.inputs(T, f), sync, repeats_at(T, args.repeats, SHORT), rng)
            ms = {b: lower_quartile(v) for b, v in s.items()}
            # auto / the cheapest other body, each ratio paired round by round (slow spells cancel)
            regrets.append(max(paired_ratio(s, "auto", b) for b in FIXED) - 1)
            chose = auto.current[(True, T)]  # decode steps of T rows
            choice.append(max([paired_ratio(s, chose, b) for b in FIXED if b != chose] + [1.0]) - 1)  # the choice alone
            rows.append([T, f] + [f"{ms[b]:.3f}" for b in BODIES]
                        + [chose, f"{choice[-1]:+.3f}", f"{regrets[-1]:+.3f}"])
        log(f"T={T} done ({time.perf_counter() - t0:.0f} s)")
    # choice regret: the body auto chose over the cheapest other one (0 if it is the cheapest); regret (the
    # target's measure) is the auto column itself, so it also carries auto's own cost and noise
    text = (f"{cost.device_name(device)}, hidden={H} intermediate={I}, {args.repeats} rounds in random order "
            f"({repeats_at(1, args.repeats, SHORT)} at T=1: repeats_at); ms: lower quartiles; "
            f"regrets: paired medians\n\n"
            + R.table(["T", "RUN fraction"] + [f"{b} ms" for b in BODIES] + ["auto chose", "choice regret", "regret"],
                      rows)
            + f"\n\nmax_choice_regret={max(choice):.3f} median_choice_regret={statistics.median(choice):.3f}\n"
            f"max_regret={max(regrets):.3f} median_regret={statistics.median(regrets):.3f}\n")
    print(text)
    R.write_results("cost-regret", {"args": vars(args), "regret": regrets, "choice_regret": choice}, text, args.out,
                    R.docs_dir(args))


if __name__ == "__main__":
    main()
