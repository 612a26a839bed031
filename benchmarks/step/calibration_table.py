"""Print the cost calibration `vskipper calibrate` cached for this device and shape as one markdown
table: per batch size T, the dense-masked step (ms) and routed / dense at each RUN fraction f, and
the body the cost model picks there.

    python -m benchmarks.step.calibration_table --shape 4096,14336 --device cuda [--out DIR]
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import results as R
from vskipper import cost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step.calibration_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="hidden,intermediate[,...] (the rest is ignored)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="the calibration's dtype (default: bfloat16 on cuda, float32 on cpu, "
                                    "as vskipper calibrate)")
    R.add_arguments(ap, "calibration")
    a = ap.parse_args(argv)
    H, I = (int(v) for v in a.shape.split(",")[:2])
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    cal = cost.load(a.device, H, I, dtype)
    if cal is None or (cal.hidden, cal.intermediate) != (H, I):
        print(f"calibration_table: no calibration cached for {cost.device_name(a.device)!r} at {H}x{I} {dtype} "
              f"(cache: {cost.cache_dir()}); run `vskipper calibrate --shape {H},{I}` first", file=sys.stderr)
        return 1
    rows = [[T, f"{sorted(d_row)[len(d_row) // 2]:.3f}"] + [f"{r / d:.2f}" for d, r in zip(d_row, r_row)]
            + [cal.choose(T, 0.5)] for T, d_row, r_row in zip(cal.ts, cal.dense, cal.routed)]
    text = (f"Cost calibration of one routed layer on {cal.device}, hidden={H} intermediate={I}, {cal.dtype}, "
            f"{cal.versions}\n\n"
            + R.table(["T", "dense ms"] + [f"routed / dense at f={f}" for f in cal.fs] + ["picked at f=0.5"], rows)
            + "\n")
    print(text)
    R.write_results("calibration", {"device": cal.device, "dtype": cal.dtype, "ts": list(cal.ts), "fs": list(cal.fs),
                                    "dense_ms": cal.dense, "routed_ms": cal.routed}, text, a.out, R.docs_dir(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
