"""One routed layer's decode step: dense-masked vs routed vs auto, T in 1..512, RUN fraction
0.5 and 0.75; time ratios against dense beside the ideal (the executed fraction: what routed
would cost if PROJECT rows were free)."""
from __future__ import annotations

import argparse
import statistics

import torch

from vskipper import cost
from vskipper.calibrate import LayerBench

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
    bodies = ["dense", "routed"] + (["auto"] if cal else [])
    print(f"{cost.device_name(device)}, hidden={H} intermediate={I}, median of {args.repeats} interleaved repeats"
          + ("" if cal else "; no calibration, so no auto column (run `vskipper calibrate`)") + "\n")
    print("| T | RUN fraction | dense ms | routed / dense | " + ("auto / dense | " if cal else "") + "ideal |")
    print("|---|---|---|---|" + ("---|" if cal else "") + "---|")
    for T in TS:
        for f in (0.5, 0.75):
            a = bench.inputs(T, f)
            bench.body.chooser = cost.AutoBody(cal) if cal else None
            samples = {b: [] for b in bodies}
            for b in bodies:
                bench.time(b, a, sync)
            for r in range(args.repeats):
                for b in bodies[r % len(bodies):] + bodies[:r % len(bodies)]:
                    samples[b].append(bench.time(b, a, sync))
            m = {b: statistics.median(v) for b, v in samples.items()}
            cols = [f"{m['routed'] / m['dense']:.2f}"] + ([f"{m['auto'] / m['dense']:.2f}"] if cal else [])
            print(f"| {T} | {f} | {m['dense']:.3f} | " + " | ".join(cols) + f" | {f:.2f} |")


if __name__ == "__main__":
    main()
