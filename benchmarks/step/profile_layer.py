"""Where a routed layer's decode step spends its time: torch.profiler's operator table for each
body (dense-masked, routed, routed-mlp) of the step `vskipper calibrate` and benchmarks/step/layer.py
time (calibrate.LayerBench: a SmolLM2-sized layer, 128 tokens of context, a FlexiDepth adapter).

    OMP_NUM_THREADS=1 python -m benchmarks.step.profile_layer          # T = 32 and 256, 75% RUN
    python -m benchmarks.step.profile_layer --ts 32 --fraction 0.5 --rows 20
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import results as R
from vskipper.calibrate import LayerBench, lower_quartile

BODIES = ("dense", "routed", "routed-mlp")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step.profile_layer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="576,1536,9,3", help="hidden,intermediate,heads,kv_heads (SmolLM2-135M)")
    ap.add_argument("--ts", default="32,256", help="batch sizes (rows)")
    ap.add_argument("--fraction", type=float, default=0.75, help="RUN fraction")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per body")
    ap.add_argument("--rows", type=int, default=12, help="operators listed per table")
    R.add_arguments(ap, "profile-layer")
    args = ap.parse_args(argv)
    if not 0.0 <= args.fraction <= 1.0 or args.steps < 1:
        ap.error("--fraction must be in [0, 1] and --steps >= 1")
    bench = LayerBench(*(int(v) for v in args.shape.split(",")), torch.device("cpu"))
    parts = [f"{torch.get_num_threads()} thread(s), RUN fraction {args.fraction}; each table covers {2 * args.steps} "
             f"steps (LayerBench.time runs an untimed step before each timed one); ms: lower quartile of 30 "
             f"unprofiled steps"]
    step_ms = {}
    for T in (int(t) for t in args.ts.split(",")):
        a = bench.inputs(T, args.fraction)
        for body in BODIES:
            ms = lower_quartile([bench.time(body, a, lambda: None) for _ in range(30)])
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(args.steps):
                    bench.time(body, a, lambda: None, inner=1)
            step_ms[f"T={T} {body}"] = ms
            ops = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=44)
            parts.append(f"T={T} {body}: {ms:.3f} ms per step\n\n```\n{ops.rstrip()}\n```")
            print(parts[-1], flush=True)
    R.write_results("profile-layer", {"args": vars(args), "step_ms": step_ms}, "\n\n".join(parts) + "\n", args.out,
                    R.docs_dir(args))


if __name__ == "__main__":
    main()
