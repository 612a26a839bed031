"""One routed layer's decode step: dense-masked vs routed vs routed-mlp vs auto, T in 1..512, RUN
fraction 0.5 and 0.75; time ratios against dense beside the ideal (the executed fraction: what routed
would cost if PROJECT rows were free), and auto against the best of the other bodies in the same
rounds. The step is the one `vskipper calibrate` times (calibrate.LayerBench, side_by_side).

    python -m benchmarks.step.layer [--shape 576,1536,9,3] [--repeats 15]
"""
from __future__ import annotations

import argparse
import random

import torch

from benchmarks import results as R
from benchmarks.results import log
from vskipper import cost
from vskipper.calibrate import LayerBench, lower_quartile, paired_ratio, repeats_at, side_by_side

TS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def parse(argv, name: str, doc: str) -> tuple[argparse.Namespace, tuple[int, int, int, int], str]:
    """The one-layer benchmarks' flags (layer.py, cost_regret.py): (args, the layer's shape, the device)."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.step.{name.replace('-', '_')}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="576,1536,9,3", help="hidden,intermediate,heads,kv_heads (SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=15)
    R.add_arguments(ap, name)
    args = ap.parse_args(argv)
    try:
        H, I, nh, kvh = (int(v) for v in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape {args.shape!r}: expected hidden,intermediate,heads,kv_heads")
    return args, (H, I, nh, kvh), "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> None:
    args, (H, I, nh, kvh), device = parse(argv, "layer", __doc__)
    cal = cost.load(device, H, I)
    bench = LayerBench(H, I, nh, kvh, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bodies = ["dense", "routed", "routed-mlp"] + (["auto"] if cal else [])
    rng = random.Random(0)
    head = (f"{cost.device_name(device)}, hidden={H} intermediate={I}, {torch.get_num_threads()} thread(s), "
            f"{args.repeats} rounds in random order ({repeats_at(1, args.repeats)} at T=1); dense: lower quartile; "
            f"ratios: paired medians"
            + ("" if cal else "; no calibration, so no auto column (run `vskipper calibrate`)"))
    rows, times = [], {}
    for T in TS:
        for f in (0.5, 0.75):
            a = bench.inputs(T, f)
            if cal:
                bench.add_auto(cal)
            s = side_by_side(bench, bodies, a, sync, repeats_at(T, args.repeats), rng)
            cols = [f"{paired_ratio(s, b, 'dense'):.2f}" for b in bodies[1:]]
            if cal:  # auto against the cheapest other body, round by round
                s["best"] = [min(s[b][i] for b in bodies[:-1]) for i in range(len(s["dense"]))]
                cols.append(f"{paired_ratio(s, 'auto', 'best'):.2f}")
            rows.append([T, f, f"{lower_quartile(s['dense']):.3f}"] + cols[:len(bodies) - 1] + [f"{f:.2f}"]
                        + cols[len(bodies) - 1:])
            times[f"T={T} f={f}"] = s
            log(f"T={T} RUN fraction {f}: " + ", ".join(map(str, rows[-1][2:])))
    head_row = (["T", "RUN fraction", "dense ms"] + [f"{b} / dense" for b in bodies[1:]] + ["ideal"]
                + (["auto / best"] if cal else []))
    text = f"{head}\n\n{R.table(head_row, rows)}\n"
    print(text)
    R.write_results("layer", {"args": vars(args), "step_ms": times}, text, args.out, R.docs_dir(args))


if __name__ == "__main__":
    main()
