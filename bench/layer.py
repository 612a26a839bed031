"""One routed layer's decode step: dense-masked vs routed vs routed-mlp vs auto, T in 1..512, RUN
fraction 0.5 and 0.75; time ratios against dense beside the ideal (the executed fraction: what routed
would cost if PROJECT rows were free), and auto against the best of the other bodies in the same
rounds. The step is the one `vskipper calibrate` times (calibrate.LayerBench, side_by_side)."""
from __future__ import annotations

import argparse
import random

import torch

from vskipper import cost
from vskipper.calibrate import LayerBench, lower_quartile, paired_ratio, repeats_at, side_by_side

TS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="576,1536,9,3", help="hidden,intermediate,heads,kv_heads (SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    H, I, nh, kvh = (int(v) for v in args.shape.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cal = cost.load(device, H, I)
    bench = LayerBench(H, I, nh, kvh, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bodies = ["dense", "routed", "routed-mlp"] + (["auto"] if cal else [])
    rng = random.Random(0)
    print(f"{cost.device_name(device)}, hidden={H} intermediate={I}, {args.repeats} rounds in random order "
          f"({repeats_at(1, args.repeats)} at T=1); dense: lower quartile; ratios: paired medians"
          + ("" if cal else "; no calibration, so no auto column (run `vskipper calibrate`)") + "\n")
    print(f"{torch.get_num_threads()} threads\n")
    print("| T | RUN fraction | dense ms | " + " | ".join(f"{b} / dense" for b in bodies[1:]) + " | ideal |"
          + (" auto / best |" if cal else ""))
    print("|---|---|---|" + "---|" * len(bodies) + ("---|" if cal else ""))
    for T in TS:
        for f in (0.5, 0.75):
            a = bench.inputs(T, f)
            if cal:
                bench.add_auto(cal)
            s = side_by_side(bench, bodies, a, sync, repeats_at(T, args.repeats), rng)
            cols = [f"{paired_ratio(s, b, 'dense'):.2f}" for b in bodies[1:]]
            best = ""
            if cal:  # auto against the cheapest other body, round by round
                s["best"] = [min(s[b][i] for b in bodies[:-1]) for i in range(len(s["dense"]))]
                best = f" {paired_ratio(s, 'auto', 'best'):.2f} |"
            print(f"| {T} | {f} | {lower_quartile(s['dense']):.3f} | " + " | ".join(cols) + f" | {f:.2f} |" + best,
                  flush=True)


if __name__ == "__main__":
    main()
