"""The op layer over the kernels: torch.library.opcheck of every Triton custom op, the dispatch rule
(the `impl` every op is given, resolved once from Config.impl), T = 0, argument errors, the per-GPU
config tables, torch.compile of a small routed body, and CUDA-graph capture of it and of the layer
`vskipper calibrate` times where a GPU is present.

Legend: T = rows, H = hidden, I = MLP width, B = decode rows.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from vskipper import kernel_configs, ops
from vskipper.calibrate import LayerBench
from vskipper.triton_kernels import cache_decode_attention as CA
from vskipper.triton_kernels import grouped_swiglu as GS
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import route_maps as RM
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from helpers import assert_close, assert_equal
from tiny import synthetic_calibration

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = HAS_TRITON and (DEVICE.type == "cuda" or interpreted(RM._compact_kernel))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")


# --- custom ops: opcheck, dispatch, T = 0 ------------------------------------------------------
def opcheck_cases():
    g = torch.Generator().manual_seed(0)
    T, H, I = 9, 24, 40
    run = torch.rand(T, generator=g) < 0.5
    valid = torch.arange(T) < T - 2
    rows, _, counts = RM.torch_op(run, valid)
    x, h = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    wg, wu, wd = torch.randn(I, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    B, nh, kvh, d, C, P = 3, 4, 2, 16, 12, 40
    attn = (torch.randn(B, nh, d, generator=g), torch.randn(P, kvh, d, generator=g),
            torch.randn(P, kvh, d, generator=g), torch.randint(0, P, (B, C), generator=g, dtype=torch.int32),
            torch.arange(B), torch.tensor([1, 12, 5]), torch.tensor([True, False, True]), 0.25)
    n = counts[0:1]
    cache = (torch.randn(B, nh, d, generator=g), torch.randn(B, kvh, C, d, generator=g),
             torch.randn(B, kvh, C, d, generator=g), torch.rand(B, C, generator=g) < 0.7,
             torch.tensor([True, False, True]), 0.25)
    from vskipper.skippers.random_skip import RandomSkipRouter

    counter, phase = torch.zeros(2, 3, dtype=torch.int64), torch.tensor([0, 1])
    gates = torch.rand(T, generator=g)
    return {
        "route_gate": (torch.ops.vskipper.route.default, (gates, None, valid, counter, phase, RM.GATE, 0.5, [])),
        "route_decisions": (torch.ops.vskipper.route.default, (run, None, None, counter, phase, RM.DECISIONS, 0.5, [])),
        "route_hash": (torch.ops.vskipper.route.default, (torch.arange(T), torch.arange(T) * 3, valid, counter, phase,
                                                          RM.HASH, 0.5, list(RandomSkipRouter(0.5, 2, 0).hash_params))),
        "routed_swiglu_": (torch.ops.vskipper.routed_swiglu_.default,
                           (torch.empty(T, H), h, x, *RM.torch_op(run, valid), wg, wu, wd, wg[:8], wu[:8], wd[:, :8],
                            torch.rand(H, generator=g) + 0.5, 1e-5, torch.rand(T, generator=g), valid)),
        "routed_swiglu_hard_no_adapter": (torch.ops.vskipper.routed_swiglu_.default,
                                          (torch.empty(T, H), h, x, *RM.torch_op(run, None), wg, wu, wd, None, None,
                                           None, torch.ones(H), 1e-6, None, None)),
        "cache_decode_attention": (torch.ops.vskipper.cache_decode_attention.default, cache),
        "cache_decode_attention_no_mask": (torch.ops.vskipper.cache_decode_attention.default,
                                           (*cache[:3], None, *cache[4:])),
        "route_maps": (torch.ops.vskipper.route_maps.default, (run, valid)),
        "route_maps_no_valid": (torch.ops.vskipper.route_maps.default, (run, None)),
        "grouped_swiglu_": (torch.ops.vskipper.grouped_swiglu_.default, (h.clone(), h, x, rows, n, wg, wu, wd, None)),
        "grouped_swiglu_weighted": (torch.ops.vskipper.grouped_swiglu_.default,
                                    (h.clone(), h, x, rows, n, wg, wu, wd, torch.rand(T, generator=g))),
        "masked_decode_attention": (torch.ops.vskipper.masked_decode_attention.default, attn),
    }


@needs_triton
@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_opcheck(case):
    op, args = opcheck_cases()[case]
    args = tuple(a.to(DEVICE) if torch.is_tensor(a) else a for a in args)
    torch.library.opcheck(op, args)


def test_public_ops_are_fx_call_function_targets():
    """The passes insert ops as call_function nodes: the public names must be plain functions,
    their implementation a constant of the node."""
    from torch import fx

    case = opcheck_cases()
    g = fx.Graph()
    outs = []
    for name in ("route_maps", "masked_decode_attention"):
        args = [g.placeholder(f"{name}_{i}") if torch.is_tensor(a) else a for i, a in enumerate(case[name][1])]
        outs.append(g.call_function(getattr(ops, name), tuple(args), {"impl": "torch"}))
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    flat = [a for name in ("route_maps", "masked_decode_attention") for a in case[name][1] if torch.is_tensor(a)]
    got = gm(*flat)
    assert torch.equal(got[1], MA.torch_op(*case["masked_decode_attention"][1]))
    assert "route_maps(" in gm.code and "impl = 'torch'" in gm.code


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dispatch_reaches_the_chosen_implementation(impl):
    """impl="triton" runs the kernel through its custom op (seen by the profiler as vskipper::route_maps);
    impl="torch" calls torch_op directly, with no custom-op dispatch. Both give the same maps."""
    run = torch.tensor([True, False, True, True], device=DEVICE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = ops.route_maps(run, impl=impl)
    names = {e.key for e in prof.key_averages()}
    assert ("vskipper::route_maps" in names) == (impl == "triton"), sorted(n for n in names if "vskipper" in n)
    for a, b in zip(got, RM.torch_op(run, None)):
        assert_equal(a.cpu(), b.cpu(), f"route_maps, impl={impl}")


def test_impl_resolved_once_and_bad_values():
    assert ops.resolve_impl("auto", torch.device("cpu")) == "torch"
    assert ops.resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert ops.resolve_impl("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match=r"impl='cuda' is not one of 'auto', 'torch', 'triton'"):
        ops.resolve_impl("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"impl='auto' is not one of \['torch', 'triton'\]"):
        ops.route_maps(torch.ones(2, dtype=torch.bool), impl="auto")  # an op takes a resolved one
    with pytest.raises(ValueError, match=r"Config.impl='cuda' is not one of"):
        __import__("vskipper").Config(impl="cuda")


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_zero_rows(impl):
    z = dict(device=DEVICE)
    run_rows, proj_rows, counts = ops.route_maps(torch.zeros(0, dtype=torch.bool, **z), impl=impl)
    assert run_rows.shape == proj_rows.shape == (0,) and counts.tolist() == [0, 0]
    x, n = torch.zeros(0, 16, **z), counts[0:1]
    ops.grouped_swiglu_(x, x, x, run_rows, n, torch.randn(8, 16, **z), torch.randn(8, 16, **z), torch.randn(16, 8, **z),
                        impl=impl)
    o = ops.masked_decode_attention(torch.zeros(0, 4, 8, **z), torch.randn(5, 2, 8, **z), torch.randn(5, 2, 8, **z),
                                    torch.zeros(1, 3, dtype=torch.int32, **z), torch.zeros(0, dtype=torch.long, **z),
                                    torch.zeros(0, dtype=torch.long, **z), torch.zeros(0, dtype=torch.bool, **z), 1.0,
                                    impl=impl)
    assert o.shape == (0, 4, 8)


def _bad_arguments():
    D = dict(device=DEVICE)
    i32 = dict(dtype=torch.int32, **D)
    one, ones2 = torch.ones(2, dtype=torch.bool, **D), torch.ones(2, dtype=torch.long, **D)

    def swiglu(x=None, rows=None, count=None, w_down=None):  # grouped_swiglu_ arguments, one of them bad
        x = torch.randn(4, 8, **D) if x is None else x
        return (torch.randn(4, 8, **D), torch.randn(4, 8, **D), x, torch.arange(4, **D) if rows is None else rows,
                torch.tensor([1], **D) if count is None else count, torch.randn(6, 8, **D), torch.randn(6, 8, **D),
                torch.randn(8, 6, **D) if w_down is None else w_down, None)

    meta_count = torch.tensor([1]) if DEVICE.type == "cuda" else torch.tensor([1], dtype=torch.long, device="meta")
    return [
        (GS.torch_op, swiglu(x=torch.randn(4, 8, **D).long()), r"grouped_swiglu_: out has dtype torch.float32 but x"),
        (GS.torch_op, swiglu(rows=torch.arange(4.0, **D)), r"grouped_swiglu_: rows has dtype torch.float32"),
        (GS.torch_op, swiglu(count=torch.tensor([1, 2], **D)), r"count must hold one element"),
        (GS.torch_op, swiglu(count=meta_count), r"count is on"),
        (GS.launch, swiglu(rows=torch.arange(8, **D)[::2]), r"rows must be contiguous"),
        (GS.launch, swiglu(x=torch.randn(8, 4, **D).T), r"x must have a contiguous last dimension"),
        (GS.torch_op, swiglu(w_down=torch.randn(6, 8, **D)), r"w_down is \[6, 8\], expected \[H, I\]"),
        (RM.torch_op, (torch.ones(4, dtype=torch.bool, **D), torch.ones(3, dtype=torch.bool, **D)),
         r"valid has shape \[3\]"),
        (RM.torch_op, (torch.ones(4, **D),), r"run_mask has dtype torch.float32"),
        (MA.torch_op, (torch.randn(2, 3, 8, **D), torch.randn(5, 2, 8, **D), torch.randn(5, 2, 8, **D),
                        torch.zeros(2, 3, **i32), torch.arange(2, **D), ones2, one, 1.0),
         r"nh = 3 must be a multiple of KV heads kvh = 2"),
        (MA.torch_op, (torch.randn(2, 2, 8, **D), torch.randn(5, 2, 8, **D), torch.randn(5, 2, 8, **D),
                        torch.zeros(2, 3, dtype=torch.int64, **D), torch.arange(2, **D), ones2, one, 1.0),
         r"req_to_token has dtype torch.int64"),
        (CA.torch_op, (torch.randn(2, 4, 8, **D), torch.randn(2, 2, 5, 8, **D), torch.randn(2, 2, 5, 8, **D),
                       torch.ones(2, 4, dtype=torch.bool, **D), one, 1.0),
         r"attended is \[2, 4\], expected \[B or 1, L\] = \[2 or 1, 5\]"),
        (CA.torch_op, (torch.randn(3, 4, 8, **D), torch.randn(2, 2, 5, 8, **D), torch.randn(2, 2, 5, 8, **D),
                       None, torch.ones(3, dtype=torch.bool, **D), 1.0),
         r"k_cache holds 2 sequences but q has B = 3 rows"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_arguments())))
def test_bad_arguments_raise_value_errors(i):
    fn, args, match = _bad_arguments()[i]
    with pytest.raises(ValueError, match=match):
        fn(*args)


# --- per-GPU configs ---------------------------------------------------------------------------
def test_bucket_is_next_power_of_two():
    tokens = (0, 1, 2, 3, 16, 17, 1000, 1024, 1025)
    assert [kernel_configs.bucket(t) for t in tokens] == [1, 1, 2, 4, 16, 32, 1024, 1024, 2048]


def test_tuned_tables_strictly_keyed(tmp_path, monkeypatch):
    from vskipper import cache

    gpu = "Fake GPU 9000"
    good, foreign, stale = tmp_path / "good", tmp_path / "foreign", tmp_path / "stale"
    table = {"grouped_swiglu_": {"16": {"BLOCK_N": 32}, "256": {"BLOCK_N": 256}}}
    kernel_configs.save(table, gpu, good)
    for d, change in ((foreign, {"device": "Other GPU"}), (stale, {"triton": "0.0.1"})):
        d.mkdir()
        (d / f"{cache.slug(gpu)}.json").write_text(
            json.dumps({"meta": {**cache.stamp(gpu), **change},
                        "configs": {"grouped_swiglu_": {"16": {"BLOCK_N": 1}}}}))
    kernel_configs.tuned_table.cache_clear()
    assert kernel_configs.tuned_table(gpu, (good,)) == table
    with pytest.warns(UserWarning, match=r"ignoring kernel-config table .*device 'Other GPU' \(now 'Fake GPU 9000'\)"):
        assert kernel_configs.tuned_table(gpu, (foreign, good)) == table
    with pytest.warns(UserWarning, match=r"ignoring kernel-config table .*triton '0.0.1'"):
        assert kernel_configs.tuned_table(gpu, (stale,)) == {}

    # lookup on a (pretend) CUDA device: the tuned bucket, else the one half its size, else the default
    monkeypatch.setattr(kernel_configs, "_gpu_name", lambda index: gpu)
    monkeypatch.setattr(kernel_configs, "search_dirs", lambda: [good])
    kernel_configs.tuned_table.cache_clear()
    cuda = torch.device("cuda", 0)

    def default(b):
        return {"BLOCK_N": 64, "BLOCK_K": b}

    assert kernel_configs.lookup("grouped_swiglu_", 12, cuda, default)["BLOCK_N"] == 32
    assert kernel_configs.lookup("grouped_swiglu_", 30, cuda, default)["BLOCK_N"] == 32
    assert kernel_configs.lookup("grouped_swiglu_", 100, cuda, default) == default(128)
    assert kernel_configs.lookup("grouped_swiglu_", 400, cuda, default) == {"BLOCK_N": 256, "BLOCK_K": 512}
    assert kernel_configs.lookup("grouped_swiglu_", 1000, cuda, default) == default(1024)
    assert kernel_configs.lookup("grouped_swiglu_", 8, cuda, default) == default(8)
    assert kernel_configs.lookup("grouped_swiglu_", 12, cuda, default, tuned=False) == default(16)
    kernel_configs.tuned_table.cache_clear()


# --- a small routed body, compiled and captured ------------------------------------------------
def routed_body(h, x, logits, valid, wg, wu, wd, wp, attn, impl):
    """RUN rows: h + g * MLP(x) (+ attention of the RUN rows, added in for coverage); PROJECT rows:
    h + (1 - g) * adapter(x), the adapter a SwiGLU with the same weights (wp unused for shape).
    h, x [T, H]; logits [T] (the router output); valid [T]."""
    g = torch.sigmoid(logits)
    run = g > 0.5
    run_rows, proj_rows, counts = ops.route_maps(run, valid, impl=impl)
    out = h.clone()
    ops.grouped_swiglu_(out, h, x, run_rows, counts[0:1], wg, wu, wd, g, impl=impl)
    ops.grouped_swiglu_(out, h, x @ wp.T, proj_rows, counts[1:2], wu, wg, wd, 1 - g, impl=impl)
    q, k, v, r2t, rpi, lens = attn
    o = ops.masked_decode_attention(q, k, v, r2t, rpi, lens, run & valid, q.shape[-1] ** -0.5, impl=impl)  # [T, nh, d]
    return out + o.reshape(out.shape[0], -1)[:, :1]


def routed_inputs(T, H, I, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype).to(device)

    nh, kvh, d, C, P = 4, 2, 16, 24, 64
    attn = (r(T, nh, d), r(P, kvh, d), r(P, kvh, d),
            torch.randint(0, P, (T, C), generator=g, dtype=torch.int32).to(device), torch.arange(T, device=device),
            torch.randint(1, C + 1, (T,), generator=g).to(device))
    return (r(T, H), r(T, H), torch.randn(T, generator=g).to(device) * 3, (torch.arange(T) < T - 2).to(device),
            r(I, H, scale=H ** -0.5), r(I, H, scale=H ** -0.5), r(H, I, scale=I ** -0.5), r(H, H, scale=H ** -0.5),
            attn)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_torch_compile_routed_body_matches_eager(device):
    torch._dynamo.reset()
    args = (*routed_inputs(12, 24, 40, torch.float32, device), "torch" if device == "cpu" else "triton")
    compiled = torch.compile(routed_body, fullgraph=True)
    for flip in (False, True):  # the same graph serves other route decisions
        a = args if not flip else (*args[:2], -args[2], *args[3:])
        assert_close(compiled(*a), routed_body(*a), f"compiled vs eager (flip={flip})")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_routed_body(dtype):
    T, H, I = 64, 256, 512
    static = (*routed_inputs(T, H, I, dtype, DEVICE), "triton")
    logits = static[2]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile the kernels before capture
            routed_body(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_body(*static)
    g = torch.Generator().manual_seed(1)
    for trial in ["mixed", "all", "none", "mixed", "mixed"]:  # route decisions change between replays
        new = torch.randn(T, generator=g) * 3
        new = {"mixed": new, "all": new.abs() + 1, "none": -new.abs() - 1}[trial]
        logits.copy_(new.to(DEVICE))
        static[0].copy_(torch.randn(T, H, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, routed_body(*static), f"replay vs eager Triton ({trial})")
        assert_close(out, routed_body(*static[:-1], "torch"), f"replay vs eager torch reference ({trial})")


@needs_cuda
def test_calibration_times_decode_steps_as_replayed_cuda_graphs():
    bench = LayerBench(64, 128, 4, 2, DEVICE, context=16)
    chooser = bench.add_auto(synthetic_calibration(64, 128, DEVICE)).chooser
    args = bench.inputs(4, 0.5)
    h, x, g, run, valid, maps, ctx = args
    gen = torch.Generator().manual_seed(1)
    for body in ("dense", "routed", "routed-mlp", "auto"):
        ms = bench.time(body, args, torch.cuda.synchronize)
        assert math.isfinite(ms) and ms > 0, f"{body}: {ms} ms"
        graph, out = bench.captured(body, args)  # the graph time() replayed, not a new one
        assert bench.captured(body, args)[0] is graph
        before = out.clone()
        h.copy_(torch.randn(h.shape, generator=gen).to(h))  # the replay reads the inputs in place
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, before), f"{body}: the replay did not rewrite its output"
        # captured, auto runs the body its chooser plans for T = 4 (it reads no counts inside a graph)
        bench.body.body = bench.bodies[chooser.planned(4) if body == "auto" else body]
        with torch.no_grad():
            eager = bench.body(h, x, g, run, valid, maps, **ctx)
        assert_close(out, eager, f"{body}: replay vs eager")
    bench.time("dense", bench.inputs(4, 0.5), torch.cuda.synchronize)
    assert list(bench._graphs) == ["dense"]  # new inputs drop the last cell's graphs
