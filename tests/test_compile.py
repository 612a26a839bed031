"""torch.compile of a transformed model, as the GPU harness compiles base and vskipper alike
(benchmarks/gpu/harness.py: compile_regions, one region per decoder layer, input norm, router and routed
layer, fullgraph): every fixed-shape body's routed layers trace without a graph break (vskipper's ops
are custom ops with fake kernels, opaque to the compiler), the compiled decode step equals the eager
one, and a second batch size and context reuse the compiled regions (dynamic shapes, no recompile per
layer or per size)."""
from __future__ import annotations

import os

import pytest
import torch

import vskipper
from benchmarks.gpu import harness as G

from helpers import assert_close

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    cfg = torch._dynamo.config
    saved = (cfg.allow_unspec_int_on_nn_module, cfg.cache_size_limit)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    cfg.allow_unspec_int_on_nn_module, cfg.cache_size_limit = saved


def _steps(model, kv, cells):
    out = []
    for B, C in cells:
        kv.view(B, C, None)
        kv.randomize(seed=B + C)
        step = G.Step(model, kv, B, C, full=True)
        step.positions.fill_(C - 1)
        step.ids.copy_(torch.arange(B, device=DEVICE)[:, None] * 7 % kv.shape.vocab)
        out.append(step().clone())
    return out


CASES = [("random", "routed", "torch"), ("flexidepth-soft", "routed", "torch"), ("flexidepth-hard", "dense", "torch"),
         ("random", "routed-mlp", "torch"),
         pytest.param("random", "routed", "triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton")),
         pytest.param("flexidepth-soft", "routed", "triton",
                      marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton"))]


@pytest.mark.parametrize("skipper, execution, impl", CASES)
def test_routed_layers_compile_without_graph_breaks(skipper, execution, impl):
    """fullgraph regions (a graph break would raise), traced by dynamo and AOT autograd (aot_eager: the
    compiler's tracing without inductor's code generation); the compiled steps equal the eager ones."""
    shape = G.TINY
    base = G.build_llama(shape, DEVICE, torch.float32)
    sk = G.skipper_for(skipper, shape, DEVICE, torch.float32)
    model = G.transformed(base, sk, execution, impl=impl)
    cells = [(4, 16), (3, 24), (5, 8)]
    kv = G.PoolKV(shape, 5 * 24, DEVICE, torch.float32)
    eager = _steps(model, kv, cells)
    n = G.compile_regions(model, backend="aot_eager")
    assert n >= len(sk.layers) * 3  # each routed layer's input norm, router and routed layer at least
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = _steps(model, kv, cells)
    for (B, C), a, b in zip(cells, compiled, eager):
        assert_close(a, b, f"{skipper} {execution} {impl}: compiled vs eager step, B={B} C={C}")
    frames = counters["stats"]["unique_graphs"]
    # a region compiles once, once more when the layer index and then the sizes become values: never
    # once per layer (6 decoder layers) and per cell (3 cells)
    kinds = len({type(m).forward for m in G.regions(model)})
    assert 0 < frames <= 3 * kinds, (frames, kinds)


@pytest.mark.slow
def test_inductor_compiles_the_triton_routed_body():
    """Inductor's code (C++ on CPU) around vskipper's Triton ops: the compiled step within fp32 tolerance."""
    if not TRITON_RUNS:
        pytest.skip("needs Triton")
    shape = G.TINY
    base = G.build_llama(shape, DEVICE, torch.float32)
    model = G.transformed(base, G.skipper_for("flexidepth-soft", shape, DEVICE, torch.float32), "routed",
                          impl="triton")
    kv = G.PoolKV(shape, 4 * 16, DEVICE, torch.float32)
    eager = _steps(model, kv, [(4, 16)])
    G.compile_regions(model)
    assert_close(_steps(model, kv, [(4, 16)])[0], eager[0], "inductor vs eager")
    assert vskipper.stats(model)[shape.routed[0]]["tokens"] > 0
