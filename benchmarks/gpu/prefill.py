"""Time to first token: one prefill forward of B prompts of P tokens, the base model against vskipper's
bodies, side by side in one run, beside what a FLOPs model says skipping can save at best.

    python -m benchmarks.gpu.prefill                    # Llama-3-8B shape, random bf16 weights, on CUDA
    python -m benchmarks.gpu.prefill --prompts 4096 --batches 1
    python -m benchmarks.gpu.prefill --smoke            # tiny shapes on CPU: checks the script runs

Systems (one set of weights, shared): the base model; RandomSkip(--rate) over the routed layers
transformed with Config(execution="dense" | "routed" | "auto", static_shapes=True). A prefill is never
captured (as in a serving engine, whose extend batches run eagerly), so every system runs eagerly: the
routed bodies gather their rows and run torch's GEMMs (cuBLAS), attention for the RUN queries only. Per
(P, B): the prompts write a fresh KV cache (the harness's PoolKV) and only the last position's logits
are computed (what a server samples from); `--rounds` rounds in random order of `--iters` timed
forwards each (CUDA events, median). The ideal (a model, not a measurement): prefill is compute-bound,
so per layer a skipped row saves its q/o projections, its MLP and its queries' attention FLOPs (K/V
are projected for every row); ideal = base FLOPs / skipping FLOPs.
"""
from __future__ import annotations

import argparse
import random
import sys
import traceback

from benchmarks import results as R

SYSTEMS = ("base", "dense", "routed", "auto")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, tiny, or hidden,intermediate,heads,kv_heads,layers,vocab")
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 8192], help="prompt lengths P")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=32768, help="largest B * P run")
    p.add_argument("--rate", type=float, default=0.5, help="RandomSkip rate")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=2, help="forwards timed per round (median)")
    R.add_arguments(p, "gpu-prefill")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.prompts, a.batches, a.rounds, a.iters = "tiny", [16, 40], [1, 2], 1, 1
    return a


def prefill_flops(shape, B: int, P: int, rate: float = 0.0) -> float:
    """FLOPs of a prefill of B prompts of P tokens when each token skips each routed layer with
    probability `rate` (its K/V still projected)."""
    H, I, nh, kvh, d, V = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab
    T, total = B * P, 0.0
    for layer in range(shape.layers):
        r = 1.0 - rate if layer in shape.routed else 1.0
        total += 2 * T * 2 * H * kvh * d  # K, V: every row
        total += r * (2 * T * 2 * H * nh * d + 2 * T * 3 * H * I)  # q, o and the MLP: RUN rows
        total += r * B * 2 * P * P * nh * d  # causal attention (QK^T and PV, half the square) of RUN queries
    return total + 2 * B * H * V  # lm_head at the last position


def build_systems(args, G, base, shape):
    import vskipper

    sk = vskipper.RandomSkip(args.rate, shape.routed, seed=0)
    return {name: base if name == "base" else G.transformed(base, sk, name) for name in args.systems}


def forward(model, kv, ids, positions):
    """One prefill of ids [B, P] at positions [B, P] into kv; the last position's logits."""
    import torch

    B, P = ids.shape
    kv.view(B, P, positions)
    cols = torch.arange(P, device=ids.device)
    mask = cols[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, P, P] causal
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=kv, use_cache=True,
                     logits_to_keep=1).logits


def measure_cell(args, G, systems, kv, B: int, P: int, rng: random.Random) -> dict:
    import torch

    g = torch.Generator().manual_seed(B * 31 + P)
    ids = torch.randint(0, kv.shape.vocab, (B, P), generator=g).to(kv.device)
    positions = torch.arange(P, device=kv.device)[None, :].expand(B, P).contiguous()
    out, times, logits = {}, {}, {}
    for name, model in systems.items():
        try:
            logits[name] = forward(model, kv, ids, positions).float()  # also the warm-up
            times[name] = []
        except Exception as e:
            traceback.print_exc()
            out[name] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    order = list(times)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for n in order:
            times[n].append(G.time_ms(lambda m=systems[n]: forward(m, kv, ids, positions), args.iters, warmup=0))
    for n, t in times.items():
        out[n] = sorted(t)[len(t) // 2]
    skipping = [n for n in ("dense", "routed", "auto") if n in logits]
    if len(skipping) > 1:  # every body computes the skipper's function: the same last-position logits
        ref = logits[skipping[0]]
        out["max logit diff"] = max(float((logits[n] - ref).abs().max()) for n in skipping[1:])
    return out


def table(args, shape, rows, header) -> str:
    names = list(args.systems)
    others = [n for n in names if n != "base"]
    head = (["P", "B"] + [f"{n} ms" for n in names] + [f"base / {n}" for n in others]
            + ["ideal", "bodies' max logit diff"])
    lines = []
    for (P, B), r in rows:
        if isinstance(r, str):
            lines.append([P, B, r])
            continue
        ms = [f"{r[n]:.1f}" if isinstance(r.get(n), float) else r.get(n, "-") for n in names]
        ratio = [f"{r['base'] / r[n]:.3f}" if isinstance(r.get(n), float) and isinstance(r.get("base"), float)
                 else "-" for n in others]
        ideal = prefill_flops(shape, B, P) / prefill_flops(shape, B, P, args.rate)
        diff = f"{r['max logit diff']:.3g}" if "max logit diff" in r else "-"
        lines.append([P, B] + ms + ratio + [f"{ideal:.3f}", diff])
    return header + "\n\n" + R.table(head, lines)


def main(args) -> int:
    from benchmarks.gpu import open_base

    opened = open_base(args, "prefill")
    if opened is None:
        return 2
    G, device, dtype, shape, base = opened
    systems = build_systems(args, G, base, shape)
    cells = [(P, B) for P in args.prompts for B in args.batches]
    fits = [c for c in cells if c[0] * c[1] <= args.max_tokens]
    kv = G.PoolKV(shape, max(P * B for P, B in fits), device, dtype)
    rng, rows, ok = random.Random(0), [], True
    for P, B in cells:
        if (P, B) not in fits:
            rows.append(((P, B), f"skipped: {P * B} tokens > --max-tokens"))
            continue
        r = measure_cell(args, G, systems, kv, B, P, rng)
        ok &= not any(isinstance(v, str) for v in r.values())
        rows.append(((P, B), r))
        print(f"  P={P} B={B}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in r.items()), file=sys.stderr, flush=True)
    header = (f"Prefill (time to first token), eager; {G.device_line()}\n{shape}, {dtype}, "
              f"RandomSkip({args.rate}) over layers {shape.routed[0]}-{shape.routed[-1]}, "
              f"median of {args.rounds} rounds x {args.iters} forwards.\n"
              f"Ideal: FLOPs model (docstring of benchmarks/gpu/prefill.py); ratios over base (> 1 is faster).")
    text = table(args, shape, rows, header) + "\n"
    print(text)
    R.write_results("gpu-prefill", {"passed": ok, "args": vars(args), "cells": [[P, B, r] for (P, B), r in rows]},
                    text, args.out, R.docs_dir(args))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(parse()))
