"""Where a decode step's device time goes, per part, for the base model and vskipper's routed body:
torch.profiler's kernel times (and kernel counts) grouped into router and maps, attention, MLP, adapter,
grouped MLP side (vskipper's routed_swiglu_: MLP, adapter and the combine in one pair of kernels) and
other (embedding, norms, residual adds, lm_head), at a few (batch, context) cells.

    python -m benchmarks.gpu.profile                     # Llama-3-8B shape, bf16, on CUDA
    python -m benchmarks.gpu.profile --cells 64x4096 1x1024
    python -m benchmarks.gpu.profile --smoke             # tiny shapes on CPU (CPU time per part)

A part is the innermost labelled region a kernel's launching op runs in: forward hooks label the
modules (each attention's q/k/v/o projections and the attention module itself, each MLP, adapter and
router), and vskipper's custom ops are labelled by name (route, the attention ops, routed_swiglu_).
The step runs eagerly under the profiler (the kernels a CUDA graph replays are the same; the graph
removes the gaps between them, which these sums do not count).
"""
from __future__ import annotations

import argparse
import contextlib
import sys

from benchmarks import results as R

PARTS = ("router and maps", "attention", "MLP", "adapter", "grouped MLP side", "other")
BY_OP = (("vskipper::route", "router and maps"), ("cache_decode_attention", "attention"),
         ("masked_decode_attention", "attention"), ("routed_swiglu", "grouped MLP side"),
         ("grouped_swiglu", "grouped MLP side"))
LABEL = "vskipper-part:"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, tiny, or hidden,intermediate,heads,kv_heads,layers,vocab")
    p.add_argument("--cells", nargs="+", default=["64x4096", "1x1024"], help="BxC: batch x context")
    p.add_argument("--rate", type=float, default=0.5, help="RandomSkip rate")
    p.add_argument("--skipper", default="random", choices=["random", "flexidepth-soft", "flexidepth-hard"])
    R.add_arguments(p, "gpu-profile")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.cells = "tiny", ["4x16", "1x8"]
    try:
        a.cells = [tuple(int(v) for v in c.lower().split("x")) for c in a.cells]
    except ValueError:
        raise SystemExit(f"--cells {a.cells}: expected BxC pairs such as 64x4096")
    return a


def part_of_module(name: str) -> str | None:
    """The part a module's qualified name labels, or None."""
    last = name.rsplit(".", 1)[-1]
    if last in ("q_proj", "k_proj", "v_proj", "o_proj", "self_attn"):
        return "attention"
    if last == "mlp":
        return "MLP"
    if last in ("router_proj", "adapter") or ".adapters." in f".{name}.":
        return "adapter"
    if name.startswith("routers.") or ".routers." in f".{name}." or last == "router":
        return "router and maps"
    return None


@contextlib.contextmanager
def labelled(model):
    """Forward hooks that open a profiler region named after the module's part for its call."""
    import torch

    modules = dict(model.named_modules())
    state = getattr(model, "vskipper", None)
    for i, gm in enumerate(state.graphs if state is not None else ()):
        modules.update({f"stack{i}.{n}": m for n, m in gm.named_modules()})
    for l in (state.skipper.layers if state is not None else ()):
        modules[f"routers.{l}"] = state.skipper.router(l)
        adapter = getattr(state.skipper, "adapter", None)
        if callable(adapter) and adapter(l) is not None:
            modules[f"adapters.{l}"] = adapter(l)
    handles, open_ = [], {}
    for name, m in modules.items():
        part = part_of_module(name)
        if part is None:
            continue

        def pre(mod, args, _part=part):
            rf = torch.profiler.record_function(LABEL + _part)
            rf.__enter__()
            open_.setdefault(id(mod), []).append(rf)

        def post(mod, args, out):
            stack = open_.get(id(mod))
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def parts(prof, on_gpu: bool) -> dict[str, list[float]]:
    """{part: [ms, kernels]} from a profile: each op's own kernels (GPU) or own CPU time (CPU), under its
    innermost labelled region, else its name's part (BY_OP), else "other"."""
    out = {p: [0.0, 0] for p in PARTS}
    events = prof.events()

    def walk(e, label):
        if e.name.startswith(LABEL):
            label = e.name[len(LABEL):]
        part = label or next((p for key, p in BY_OP if key in e.name), None) or "other"
        if label is None and any(key in e.name for key, _ in BY_OP):
            label = part  # what a custom op launches belongs to it
        if on_gpu:
            for k in getattr(e, "kernels", []):
                out[part][0] += k.duration / 1e3
                out[part][1] += 1
        elif not e.name.startswith(LABEL):
            out[part][0] += e.self_cpu_time_total / 1e3
            out[part][1] += 1
        for c in e.cpu_children:
            walk(c, label)

    for e in events:
        if e.cpu_parent is None:
            walk(e, None)
    return out


def profile_step(G, model, kv, B: int, C: int) -> dict[str, list[float]]:
    import torch

    step = G.Step(model, kv, B, C, full=True)
    step.positions.fill_(C - 1)
    for _ in range(2):
        step()
    G.sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if G.cuda() else [])
    with labelled(model), torch.profiler.profile(activities=acts) as prof:
        step()
        G.sync()
    return parts(prof, G.cuda())


def main(args) -> int:
    from benchmarks.gpu import open_base

    opened = open_base(args, "profile")
    if opened is None:
        return 2
    G, device, dtype, shape, base = opened
    sk = (G.skipper_for(args.skipper, shape, device, dtype) if args.skipper != "random"
          else __import__("vskipper").RandomSkip(args.rate, shape.routed, seed=0))
    systems = {"base": base, "routed": G.transformed(base, sk, "routed")}
    kv = G.PoolKV(shape, max(B * C for B, C in args.cells), device, dtype)
    unit = "kernel ms" if G.cuda() else "CPU ms (smoke: meaningless)"
    blocks, record = [], []
    for B, C in args.cells:
        kv.view(B, C, None)
        kv.randomize()
        got = {n: profile_step(G, m, kv, B, C) for n, m in systems.items()}
        record.append({"B": B, "C": C, "parts": got})
        rows = [[p] + [f"{got[n][p][0]:.3f}" for n in systems] + [got[n][p][1] for n in systems] for p in PARTS]
        rows.append(["total"] + [f"{sum(v[0] for v in got[n].values()):.3f}" for n in systems]
                    + [sum(v[1] for v in got[n].values()) for n in systems])
        blocks.append(f"B={B}, C={C}\n\n" + R.table(["part"] + [f"{n} {unit}" for n in systems]
                                                     + [f"{n} kernels" for n in systems], rows))
        print(blocks[-1], file=sys.stderr, flush=True)
    header = (f"Decode step per part, eager under torch.profiler; {G.device_line()}\n{shape}, {dtype}, "
              f"{type(sk).__name__}({sk.extra_repr()}), routed body, fixed shapes")
    text = header + "\n\n" + "\n\n".join(blocks) + "\n"
    print(text)
    R.write_results("gpu-profile", {"args": vars(args), "cells": record}, text, args.out, R.docs_dir(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(parse()))
