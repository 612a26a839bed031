"""Kernel launches of a decode step, counted on any device (CPU included): every aten op that runs a
kernel (views, allocations and shape queries excluded) and every Triton launch (interpreted on CPU),
as a GPU would launch them eagerly; a CUDA graph replays the same launches. What a routed layer adds
to a step is the transformed model's count less the base model's, both over the harness's captured
decode step (benchmarks/gpu/harness.py: Step).

    python -m benchmarks.gpu.launches            # the table, tiny shapes on CPU (Triton interpreted)

A custom op (torch.ops.vskipper.*) counts as the Triton kernels it launches, the aten ops inside it not
at all (its torch allocations launch nothing). Under torch.compile the aten counts shrink (inductor
fuses elementwise chains, the base's as well); these counts are those of the eagerly captured step.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os

# Allocations, shape queries and copies that launch nothing; views are recognised by their schema.
NO_LAUNCH = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias", "unsafe_view",
             "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size"}


def _dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if not (name.startswith("vskipper::") or func.is_view
                    or func.overloadpacket.__name__.lstrip("_") in {n.lstrip("_") for n in NO_LAUNCH}):
                self.ops[f"aten.{func.overloadpacket.__name__}" if name.startswith("aten::") else name] += 1
            return func(*args, **(kwargs or {}))

    return Counter()


@contextlib.contextmanager
def count_launches():
    """Count what runs inside the block: yields a Counter {op name or "triton:<kernel>": launches}."""
    import triton.runtime.jit as jit

    mode = _dispatch_mode()
    counts = mode.ops
    launch = jit.KernelInterface.__getitem__

    def counted(self, grid):
        fn = launch(self, grid)
        name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "kernel")

        def run(*args, **kwargs):
            counts[f"triton:{name}"] += 1
            return fn(*args, **kwargs)
        return run

    jit.KernelInterface.__getitem__ = counted
    try:
        with mode:
            yield counts
    finally:
        jit.KernelInterface.__getitem__ = launch


def total(counts) -> int:
    return sum(counts.values())


def step_launches(model, kv, B: int, C: int) -> collections.Counter:
    """Launches of one decode step of `model` (the harness's Step: B sequences at position C - 1, every
    cached position attended), after one uncounted step (first-call work is not what a graph replays)."""
    import torch

    from benchmarks.gpu import harness as G

    step = G.Step(model, kv, B, C, full=True)
    step.positions.fill_(C - 1)
    step.ids.copy_(torch.arange(B).remainder(kv.shape.vocab)[:, None])
    step()
    with count_launches() as counts:
        step()
    return counts


def routed_layer_launches(shape, skipper, execution: str = "routed", impl: str = "triton", B: int = 4,
                          C: int = 16, dtype=None) -> tuple[int, collections.Counter, collections.Counter]:
    """(extra launches per routed layer, the base step's counts, the transformed step's counts): the
    transformed model (every layer of `skipper.layers` routed, fixed shapes) less the base model, over
    one decode step, divided by the number of routed layers."""
    import torch

    from benchmarks.gpu import harness as G

    dtype = dtype or torch.float32
    device = torch.device("cuda" if G.cuda() else "cpu")
    base = G.build_llama(shape, device, dtype)
    kv = G.PoolKV(shape, B * C, device, dtype)
    kv.view(B, C, None)
    kv.randomize()
    model = G.transformed(base, skipper, execution, impl=impl)
    b, m = step_launches(base, kv, B, C), step_launches(model, kv, B, C)
    extra = (total(m) - total(b)) / len(skipper.layers)
    return extra, b, m


def diff_table(b: collections.Counter, m: collections.Counter, n_routed: int) -> list[list]:
    """Per op: launches in the base step, in the transformed one, and the difference per routed layer."""
    rows = []
    for op in sorted(set(b) | set(m), key=lambda o: (-(m[o] - b[o]), o)):
        if m[op] != b[op]:
            rows.append([op, b[op], m[op], f"{(m[op] - b[op]) / n_routed:+.2f}"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.launches", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="triton", choices=["torch", "triton"])
    p.add_argument("--execution", default="routed", choices=["dense", "routed", "routed-mlp"])
    a = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before a kernel is decorated (no effect on a GPU box)
    import vskipper
    from benchmarks import results as R
    from benchmarks.gpu import harness as G

    shape = G.TINY
    for name, sk in (("RandomSkip 0.5", vskipper.RandomSkip(0.5, shape.routed)),
                     ("FlexiDepth hard", G.random_flexidepth(shape, "hard", "cpu", None)),
                     ("FlexiDepth soft", G.random_flexidepth(shape, "soft", "cpu", None))):
        extra, b, m = routed_layer_launches(shape, sk, a.execution, a.impl)
        print(f"\n{name}, {a.execution}, impl={a.impl}: {total(b)} launches in the base step, {total(m)} transformed, "
              f"{extra:+.1f} per routed layer\n")
        print(R.table(["op", "base", "transformed", "per routed layer"], diff_table(b, m, len(sk.layers))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
