"""Print the cost calibration `vskipper calibrate` cached for this device and shape as one markdown
table: per batch size T, the dense-masked step (ms) and routed / dense at each RUN fraction f, and
the body the cost model picks there.

    python bench/calibration_table.py --shape 4096,14336 --device cuda [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vskipper import cost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="hidden,intermediate[,...] (the rest is ignored)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="the calibration's dtype (default: bfloat16 on cuda, float32 on cpu, "
                                    "as vskipper calibrate)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    H, I = (int(v) for v in a.shape.split(",")[:2])
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    cal = cost.load(a.device, H, I, dtype)
    if cal is None or (cal.hidden, cal.intermediate) != (H, I):
        print(f"calibration_table: no calibration cached for {cost.device_name(a.device)!r} at {H}x{I} {dtype} "
              f"(cache: {cost.cache_dir()}); run `vskipper calibrate --shape {H},{I}` first", file=sys.stderr)
        return 1
    head = "| T | dense ms | " + " | ".join(f"routed / dense at f={f}" for f in cal.fs) + " | picked at f=0.5 |"
    lines = [f"Cost calibration of one routed layer on {cal.device}, hidden={H} intermediate={I}, {cal.dtype}, "
             f"{cal.versions}", "", head, "|" + "---|" * (head.count("|") - 1)]
    for T, d_row, r_row in zip(cal.ts, cal.dense, cal.routed):
        ratios = " | ".join(f"{r / d:.2f}" for d, r in zip(d_row, r_row))
        lines.append(f"| {T} | {sorted(d_row)[len(d_row) // 2]:.3f} | {ratios} | {cal.choose(T, 0.5)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
