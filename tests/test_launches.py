"""The routed path's fixed cost, counted: the kernel launches a routed layer adds to a decode step in
its graph-safe form (fixed shapes, Triton ops; interpreted on CPU), against the stock layer, over the
GPU harness's captured step (benchmarks/gpu/launches.py). Each launch costs a few microseconds of a
captured step whatever it computes; the reference fork adds about 12 per routed layer."""
from __future__ import annotations

import os

import pytest

from benchmarks.gpu import harness as G
from benchmarks.gpu import launches as L

BUDGET = 6  # extra launches per routed layer, at most
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not G.cuda(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")


@pytest.mark.parametrize("skipper", ["random", "flexidepth-hard", "flexidepth-soft"])
def test_a_routed_layer_adds_at_most_the_budget_of_launches(skipper):
    shape = G.TINY
    sk = G.skipper_for(skipper, shape, "cpu", None)
    extra, base, model = L.routed_layer_launches(shape, sk, "routed", "triton")
    table = "\n".join(" | ".join(map(str, r)) for r in L.diff_table(base, model, len(sk.layers)))
    assert extra <= BUDGET, f"{skipper}: {extra:+.1f} launches per routed layer (budget {BUDGET}):\n{table}"
    # the graph-safe path's own kernels are there: one route op, the masked attention, the MLP side's pair
    n = len(sk.layers)
    for kernel in ("_compact_kernel", "_cache_decode_attention_kernel", "_gate_up_kernel", "_down_kernel"):
        assert model[f"triton:{kernel}"] == n, (kernel, table)
    assert L.total(base) > 0


def test_the_counter_sees_aten_ops_and_triton_launches():
    import torch

    from vskipper import ops

    run, y = torch.tensor([True, False, True]), torch.ones(3)
    with L.count_launches() as c:
        x = y.add(1).view(3, 1)  # one kernel; the view launches nothing
        ops.route_maps(run, impl="triton")
    assert c == {"aten.add": 1, "triton:_compact_kernel": 1}, c
    assert x.shape == (3, 1)
