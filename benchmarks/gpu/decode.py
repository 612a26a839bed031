"""Decode tokens/s of the base model and of vskipper's bodies, every one compiled (torch.compile,
regional: benchmarks/gpu/harness.py compile_regions) and captured in a CUDA graph, side by side in one
run, beside what a bytes/FLOPs model says skipping can save at best.

    python -m benchmarks.gpu.decode                   # Llama-3-8B shape, random bf16 weights, on CUDA
    python -m benchmarks.gpu.decode --batches 1 16 --contexts 1024
    python -m benchmarks.gpu.decode --smoke           # tiny shapes on CPU: checks the script runs

Systems (one set of weights, shared): the base model; RandomSkip(rate) over the routed layers (16-31 of
32) transformed with Config(execution="dense" | "routed" | "auto", static_shapes=True); "routed0", the
routed body at RandomSkip(0) (every row runs: the routed path's fixed cost, tau = routed0 - base per
step); "base-eager", the base captured without compilation (what the first GPU run compared against).
"auto" uses the cost calibration of this device if one is cached (`vskipper calibrate`; the GPU check
runs it first), else it is the dense body (said in the header). With a calibration auto captures both
forms per cell, every routed layer forced dense and forced routed (vskipper/replay.py), and picks the
graph to replay on the host before each replay from the resident K/V (B x C) and the EMA of the route
counts, as SGLang's graph runner does through the plugin; the cell says which form it replayed, and
the header gives the calibration's V*, the resident K/V from which routing pays.

Per (batch B, context C): the KV cache holds C tokens per sequence (random values: the cost of a step
does not depend on them), each system's decode step at position C - 1 is captured once, then
`--rounds` rounds in random order each time `--iters` replays (CUDA events, median). tok/s = B / step
time. The grid is capped by memory (--max-kv-tokens, default what 70% of the free memory holds); the
results file is rewritten after every cell, so a run cut short keeps the cells it finished.

The ideal (a model, not a measurement): per layer part, time = max(bytes / BW, FLOPs / peak), summed
over the step. Weights stream if any row of the batch runs the part (for RandomSkip at rate s, with
probability 1 - s^B); skipped rows save their KV reads and FLOPs. "ideal" skips q/o projections,
attention and the MLP for skipped rows (K/V projected for every row); "ideal, MLP only" keeps
attention for every row. The last column is the compiled base's modelled time against its measured one.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import traceback

from benchmarks import results as R

SYSTEMS = ("base", "dense", "routed", "auto", "routed0", "base-eager")
TAU_B = 64  # the batch size tau is reported at (the cell)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, tiny, or hidden,intermediate,heads,kv_heads,layers,vocab")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--max-kv-tokens", type=int, default=None,
                   help="largest B * C kept (8B shape: 128 KiB of KV per token; default: what 70%% of the "
                        "device's free memory holds once the weights are loaded)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="capture every system eagerly (no torch.compile)")
    p.add_argument("--rate", type=float, default=0.5, help="RandomSkip rate")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="replays timed per round (median)")
    p.add_argument("--bw", type=float, default=4.8e12, help="memory bandwidth of the ideal model, B/s (H200)")
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the ideal model (H200)")
    R.add_arguments(p, "gpu-decode")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.batches, a.contexts, a.rounds, a.iters = "tiny", [1, 4], [16, 32], 1, 1
        a.max_kv_tokens = a.max_kv_tokens or 1 << 12
    return a


# --- the ideal: a bytes/FLOPs model of one decode step -----------------------------------------
@dataclasses.dataclass(frozen=True)
class Machine:
    bw: float  # bytes/s
    peak: float  # FLOP/s
    elem: int = 2  # bytes per weight / KV element (bf16)


def step_time(shape, B: int, C: int, m: Machine, rate: float = 0.0, skip_attention: bool = True) -> float:
    """Modelled seconds of one decode step (B sequences, C cached tokens each) when each token skips
    each routed layer with probability `rate`. Per part: max(bytes / bw, flops / peak), summed."""
    H, I, nh, kvh, d, V = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab
    routed = set(shape.routed)
    parts = []  # (bytes, flops)
    for layer in range(shape.layers):
        r = 1.0 - rate if layer in routed else 1.0  # RUN fraction of the rows
        a = 1.0 - rate ** B if layer in routed else 1.0  # probability that any row runs: weights stream
        ra, aa = (r, a) if skip_attention else (1.0, 1.0)
        w_kv, w_qo, w_mlp = 2 * H * kvh * d, 2 * H * nh * d, 3 * H * I
        parts.append((w_kv * m.elem, 2 * B * w_kv))  # K/V projections: every row, always
        parts.append((aa * w_qo * m.elem, 2 * ra * B * w_qo))
        parts.append((ra * B * C * 2 * kvh * d * m.elem, ra * B * 4 * C * nh * d))  # attention over the cache
        parts.append((a * w_mlp * m.elem, 2 * r * B * w_mlp))
    parts.append((V * H * m.elem, 2 * B * V * H))  # lm_head
    return sum(max(b / m.bw, f / m.peak) for b, f in parts)


def ideal_speedups(shape, B: int, C: int, m: Machine, rate: float) -> tuple[float, float]:
    """(ideal, ideal with attention for every row): base step time over the skipping step's."""
    base = step_time(shape, B, C, m)
    return base / step_time(shape, B, C, m, rate), base / step_time(shape, B, C, m, rate, skip_attention=False)


# --- the measurement ---------------------------------------------------------------------------
def build_systems(args, G, base, shape):
    """{name: model}; the base-eager copy is made before anything is compiled, and every other system
    is compiled (unless --no-compile): inductor on CUDA, aot_eager on CPU (a smoke run: no C++ toolchain
    relied on, and the compiler still traces every region without a graph break)."""
    import vskipper

    systems = {}
    for name in args.systems:
        if name == "base-eager":
            systems[name] = G.sharing_copy(base)
        elif name == "base":
            systems[name] = base
        else:
            rate = 0.0 if name == "routed0" else args.rate
            execution = "routed" if name == "routed0" else name
            systems[name] = G.transformed(base, vskipper.RandomSkip(rate, shape.routed, seed=0), execution)
    if args.compile:
        backend = "inductor" if G.cuda() else "aot_eager"
        for name, model in systems.items():
            if name != "base-eager":
                G.compile_regions(model, backend=backend)
    return {n: systems[n] for n in args.systems}


class BothForms:
    """auto captured in both forms, the one to replay chosen on the host per replay (vskipper/replay.py):
    ReplayChooser.choose from the resident K/V and the RUN-fraction EMA, then observe's non-blocking copy
    of the route counts. Without a calibration auto has one form: `chooser` is None and it is captured once."""

    def __init__(self, G, step, model, B: int, C: int, guard: bool = True) -> None:
        from vskipper.replay import FORMS, ReplayChooser, forced

        self.chooser = ReplayChooser.for_model(model)
        self.B, self.resident = B, B * C
        if self.chooser is None:
            self.caps = {"one": G.Captured(step, guard=False)}  # (CPU: auto reads its counts on the host)
            return

        def form_step(form):
            def run():
                with forced(model, form):  # at capture (CUDA) or at every eager replay (the smoke run)
                    return step()
            return run

        self.caps = {form: G.Captured(form_step(form), guard=guard) for form in FORMS}

    def replay(self):
        if self.chooser is None:
            return self.caps["one"].replay()
        form = self.chooser.choose(self.B, self.resident)
        out = self.caps[form].replay()
        self.chooser.ran(form)
        self.chooser.observe()
        return out

    def forms(self) -> str:
        if self.chooser is None:
            return "one form (no calibration)"
        return ", ".join(f"{f} {n}" for f, n in self.chooser.replays.items() if n) or "-"

    def close(self) -> None:
        for c in self.caps.values():
            c.close()


def measure_cell(args, G, systems, kv, B: int, C: int, rng: random.Random) -> dict[str, float | str]:
    """{system: ms per decode step} (or an error string) at batch B, context C; "auto_forms": the forms
    auto replayed; "run_fraction": the routed system's share of routed-layer rows that ran."""
    import torch

    import vskipper

    kv.view(B, C, None)
    kv.randomize(seed=B * 7 + C)
    ids = torch.randint(0, kv.shape.vocab, (B, 1), generator=torch.Generator().manual_seed(B + C))
    caps, out = {}, {}
    for name, model in systems.items():
        try:
            step = G.Step(model, kv, B, C, full=True)
            step.ids.copy_(ids)
            step.positions.fill_(C - 1)
            # the CPU stand-in's host-sync guard is a torch function mode, which torch.compile refuses: compiled
            # systems run unguarded there (tests/test_compile.py traces them; the eager ones keep the guard)
            guard = not args.compile or name == "base-eager"
            caps[name] = BothForms(G, step, model, B, C, guard) if name == "auto" else G.Captured(step, guard=guard)
        except Exception as e:
            traceback.print_exc()
            out[name] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    if "routed" in systems:
        vskipper.stats(systems["routed"], reset=True)
    times = {n: [] for n in caps}
    order = list(caps)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for n in order:
            times[n].append(G.time_ms(caps[n].replay, args.iters, warmup=1))
    for n, t in times.items():
        out[n] = sorted(t)[len(t) // 2]
    if "auto" in caps:
        out["auto_forms"] = caps["auto"].forms()
    for c in caps.values():
        c.close()
    if "routed" in systems:
        s = vskipper.stats(systems["routed"])
        out["run_fraction"] = sum(v["run"] for v in s.values()) / max(1, sum(v["tokens"] for v in s.values()))
    return out


def vstar_line(systems, batches) -> str:
    """The calibration's V* (benchmarks' auto reads the same table), or why there is none."""
    from vskipper.calibrate import break_even_line
    from vskipper.replay import ReplayChooser

    auto = systems.get("auto")
    chooser = ReplayChooser.for_model(auto) if auto is not None else None
    if chooser is None:
        return "V*: no calibration cached for this device (run `vskipper calibrate --device cuda`)"
    return break_even_line(chooser.cal, chooser.f(), [B for B in chooser.cal.ts if B <= max(batches)])


def tau_line(rows) -> str:
    """tau, the routed path's fixed cost per step: routed at rate 0 less the base, per cell."""
    cells = [(B, C, r["routed0"] - r["base"]) for (B, C), r in rows
             if isinstance(r, dict) and isinstance(r.get("routed0"), float) and isinstance(r.get("base"), float)]
    if not cells:
        return "tau: not measured (needs the base and routed0 systems)"
    at = [f"{t:.3f} ms (B={B}, C={C})" for B, C, t in cells if B == TAU_B] or [f"{t:.3f} ms (B={B}, C={C})"
                                                                             for B, C, t in cells]
    return f"tau (routed at RandomSkip 0 less base, per step): {'; '.join(at)}"


def table(args, G, shape, rows, header) -> str:
    m = Machine(args.bw, args.peak)
    names = [n for n in args.systems]
    others = [n for n in names if n != "base"]
    head = (["B", "context"] + [f"{n} tok/s" for n in names] + [f"{n} / base" for n in others]
            + ["ideal", "ideal, MLP only", "RUN fraction", "auto replayed", "base: model ms / measured ms"])
    lines = []
    for (B, C), r in rows:
        if isinstance(r, str):
            lines.append([B, C, r])
            continue
        tok = {n: (f"{B / r[n] * 1e3:.0f}" if isinstance(r.get(n), float) else r.get(n, "-")) for n in names}
        ratio = {n: (f"{r['base'] / r[n]:.3f}" if isinstance(r.get(n), float) and isinstance(r.get("base"), float)
                     else "-") for n in others}
        ideal, ideal_mlp = ideal_speedups(shape, B, C, m, args.rate)
        model_ms = step_time(shape, B, C, m) * 1e3
        base_eff = f"{model_ms:.3g} / {r['base']:.3g}" if isinstance(r.get("base"), float) else "-"
        frac = f"{r['run_fraction']:.2f}" if "run_fraction" in r else "-"
        lines.append([B, C] + [tok[n] for n in names] + [ratio[n] for n in others]
                     + [f"{ideal:.3f}", f"{ideal_mlp:.3f}", frac, r.get("auto_forms", "-"), base_eff])
    return header + "\n\n" + R.table(head, lines)


def kv_budget(args, G, shape, dtype) -> int:
    """--max-kv-tokens, or what 70% of the device's free memory holds (weights loaded)."""
    import torch

    if args.max_kv_tokens is not None:
        return args.max_kv_tokens
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype.itemsize
    free = torch.cuda.mem_get_info()[0] if G.cuda() else 1 << 30
    return int(0.7 * free // per_token)


def main(args) -> int:
    from benchmarks.gpu import open_base

    opened = open_base(args, "decode")
    if opened is None:
        return 2
    G, device, dtype, shape, base = opened
    systems = build_systems(args, G, base, shape)
    cells = [(B, C) for C in args.contexts for B in args.batches]
    budget = kv_budget(args, G, shape, dtype)
    fits = [c for c in cells if c[0] * c[1] <= budget]
    if not fits:
        print(f"gpu decode: no cell of the grid fits {budget} KV tokens (--max-kv-tokens)", file=sys.stderr)
        return 2
    kv = G.PoolKV(shape, max(B * C for B, C in fits), device, dtype)
    rng = random.Random(0)
    rows, ok = [], True
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype.itemsize
    auto = systems.get("auto")
    why = "; ".join(l.strip() for l in auto.vskipper.explain().splitlines()[2:]) if auto is not None else "-"
    compiled = (f"compiled (torch.compile {'inductor' if G.cuda() else 'aot_eager'}, regional) and "
                if args.compile else "")
    vstar = vstar_line(systems, args.batches)

    def write() -> str:
        header = (f"Decode, every system {compiled}captured in a CUDA graph "
                  f"({'replayed' if G.cuda() else 'CPU: eager stand-in'}) but base-eager (captured, not compiled); "
                  f"{G.device_line()}\n{shape}, {dtype}, RandomSkip({args.rate}) over layers {shape.routed[0]}-"
                  f"{shape.routed[-1]}, median of {args.rounds} rounds x {args.iters} replays.\nauto: {why}\n"
                  f"{vstar}\n{tau_line(rows)}\n"
                  f"Ideal model: bandwidth {args.bw / 1e12:.1f} TB/s, peak {args.peak / 1e12:.0f} TFLOP/s, "
                  f"per-part roofline (docstring of benchmarks/gpu/decode.py); speed-ups over the compiled base "
                  f"(> 1 is faster).")
        text = table(args, G, shape, rows, header) + "\n"
        R.write_results("gpu-decode", {"passed": ok, "args": vars(args), "vstar": vstar, "tau": tau_line(rows),
                                       "cells": [[B, C, r] for (B, C), r in rows]},
                        text, args.out, R.docs_dir(args))
        return text

    for B, C in cells:
        if (B, C) not in fits:
            rows.append(((B, C), f"skipped: KV {B * C * per_token / 1e9:.0f} GB > {budget} tokens (--max-kv-tokens)"))
            continue
        r = measure_cell(args, G, systems, kv, B, C, rng)
        failed = [n for n, v in r.items() if isinstance(v, str) and v.startswith("FAILED")]
        ok &= not failed
        for n in failed:  # a capture that failed once is not retried (nor allowed to disturb the others)
            systems.pop(n, None)
            print(f"  {n}: dropped from the remaining cells after: {r[n]}", file=sys.stderr, flush=True)
        rows.append(((B, C), r))
        print(f"  B={B} C={C}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in r.items()), file=sys.stderr, flush=True)
        write()  # after every cell: a run cut short keeps what it measured
    print(write())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(parse()))
