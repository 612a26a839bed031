"""The custom-op layer over the kernels: torch.library.opcheck of every op with both
implementations, the dispatch rule (VSKIPPER_IMPL), T = 0, argument errors, the per-GPU config
tables, torch.compile of a small routed body, and CUDA-graph capture of it where a GPU is present.

Legend: T = rows, H = hidden, I = MLP width, B = decode rows.
"""
from __future__ import annotations

import json

import pytest
import torch

from vskipper import kernel_configs, ops
from vskipper.triton_kernels import gather_rows as GR
from vskipper.triton_kernels import grouped_linear as GL
from vskipper.triton_kernels import grouped_swiglu as GS
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import route_maps as RM
from vskipper.triton_kernels import scatter_combine as SC
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from conftest import assert_close

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
    rows, _, counts = RM.reference(run, valid)
    x, h = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    wg, wu, wd = torch.randn(I, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    B, nh, kvh, d, C, P = 3, 4, 2, 16, 12, 40
    attn = (torch.randn(B, nh, d, generator=g), torch.randn(P, kvh, d, generator=g), torch.randn(P, kvh, d, generator=g),
            torch.randint(0, P, (B, C), generator=g, dtype=torch.int32), torch.arange(B), torch.tensor([1, 12, 5]),
            torch.tensor([True, False, True]), 0.25)
    n = counts[0:1]
    return {
        "route_maps": (torch.ops.vskipper.route_maps.default, (run, valid)),
        "route_maps_no_valid": (torch.ops.vskipper.route_maps.default, (run, None)),
        "gather_rows": (torch.ops.vskipper.gather_rows.default, (x, rows, n)),
        "scatter_combine_": (torch.ops.vskipper.scatter_combine_.default, (h.clone(), x, h, rows, n, torch.rand(T))),
        "grouped_linear": (torch.ops.vskipper.grouped_linear.default, (x, rows, n, wg)),
        "grouped_swiglu_": (torch.ops.vskipper.grouped_swiglu_.default, (h.clone(), h, x, rows, n, wg, wu, wd, None)),
        "masked_decode_attention": (torch.ops.vskipper.masked_decode_attention.default, attn),
    }


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("case", list(opcheck_cases()))
def test_opcheck(case, impl, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", impl)
    op, args = opcheck_cases()[case]
    args = tuple(a.to(DEVICE) if torch.is_tensor(a) else a for a in args)
    torch.library.opcheck(op, args)


def test_public_ops_are_fx_call_function_targets():
    """The passes insert ops as call_function nodes: the public names must be plain functions."""
    from torch import fx

    case = opcheck_cases()
    g = fx.Graph()
    outs = []
    for name in ("route_maps", "gather_rows", "grouped_linear", "masked_decode_attention"):
        args = [g.placeholder(f"{name}_{i}") if torch.is_tensor(a) else a for i, a in enumerate(case[name][1])]
        outs.append(g.call_function(getattr(ops, name), tuple(args)))
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    flat = [a for name in ("route_maps", "gather_rows", "grouped_linear", "masked_decode_attention")
            for a in case[name][1] if torch.is_tensor(a)]
    got = gm(*flat)
    assert torch.equal(got[1], ops.gather_rows(*case["gather_rows"][1]))
    assert "route_maps(" in gm.code and "masked_decode_attention(" in gm.code


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dispatch_reaches_the_chosen_implementation(impl, monkeypatch):
    calls = []
    for name in ("launch", "reference", "reference_dynamic"):
        fn = getattr(GR, name)
        monkeypatch.setattr(GR, name, lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    monkeypatch.setenv("VSKIPPER_IMPL", impl)
    x = torch.randn(4, 8, device=DEVICE)
    ops.gather_rows(x, torch.arange(4, device=DEVICE), torch.tensor([2], device=DEVICE))
    want = "launch" if impl == "triton" else "reference_dynamic" if DEVICE.type == "cpu" else "reference"
    assert calls == [want]


def test_dispatch_default_and_bad_value(monkeypatch):
    monkeypatch.delenv("VSKIPPER_IMPL", raising=False)
    assert ops.implementation(torch.device("cpu")) == "torch"
    assert ops.implementation(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv("VSKIPPER_IMPL", "cuda")
    with pytest.raises(ValueError, match=r"VSKIPPER_IMPL='cuda' is not one of \['torch', 'triton'\]"):
        ops.gather_rows(torch.randn(2, 2), torch.arange(2), torch.tensor([1]))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_zero_rows(impl, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", impl)
    z = dict(device=DEVICE)
    run_rows, proj_rows, counts = ops.route_maps(torch.zeros(0, dtype=torch.bool, **z))
    assert run_rows.shape == proj_rows.shape == (0,) and counts.tolist() == [0, 0]
    x, n = torch.zeros(0, 16, **z), counts[0:1]
    assert ops.gather_rows(x, run_rows, n).shape == (0, 16)
    assert ops.grouped_linear(x, run_rows, n, torch.randn(8, 16, **z)).shape == (0, 8)
    ops.scatter_combine_(x, x, x, run_rows, n, None)
    ops.grouped_swiglu_(x, x, x, run_rows, n, torch.randn(8, 16, **z), torch.randn(8, 16, **z), torch.randn(16, 8, **z))
    o = ops.masked_decode_attention(torch.zeros(0, 4, 8, **z), torch.randn(5, 2, 8, **z), torch.randn(5, 2, 8, **z),
                                    torch.zeros(1, 3, dtype=torch.int32, **z), torch.zeros(0, dtype=torch.long, **z),
                                    torch.zeros(0, dtype=torch.long, **z), torch.zeros(0, dtype=torch.bool, **z), 1.0)
    assert o.shape == (0, 4, 8)


def _bad_arguments():
    D = dict(device=DEVICE)
    i32 = dict(dtype=torch.int32, **D)
    one, ones2 = torch.ones(2, dtype=torch.bool, **D), torch.ones(2, dtype=torch.long, **D)
    return [
        (GR.launch, (torch.randn(4, 8, **D).long(), torch.arange(4, **D), torch.tensor([1], **D)),
         r"gather_rows: x has dtype torch.int64"),
        (GR.reference, (torch.randn(4, 8, **D), torch.arange(4.0, **D), torch.tensor([1], **D)),
         r"gather_rows: rows has dtype torch.float32"),
        (GR.reference, (torch.randn(4, 8, **D), torch.arange(4, **D), torch.tensor([1, 2], **D)), r"count must hold one element"),
        (GR.reference, (torch.randn(4, 8, **D), torch.arange(4, **D), torch.tensor([1])) if DEVICE.type == "cuda" else
         (torch.randn(4, 8, **D), torch.arange(4, **D), torch.tensor([1], dtype=torch.long, device="meta")), r"count is on"),
        (GR.launch, (torch.randn(4, 8, **D), torch.arange(8, **D)[::2], torch.tensor([1], **D)), r"rows must be contiguous"),
        (GR.launch, (torch.randn(8, 4, **D).T, torch.arange(4, **D), torch.tensor([1], **D)),
         r"x must have a contiguous last dimension"),
        (GL.reference, (torch.randn(4, 8, **D), torch.arange(4, **D), torch.tensor([1], **D), torch.randn(5, 7, **D)),
         r"weight is \[5, 7\]"),
        (GL.reference, (torch.randn(4, 8, **D), torch.arange(4, **D), torch.tensor([1], **D), torch.randn(5, 8, **D).half()),
         r"weight has dtype"),
        (RM.reference, (torch.ones(4, dtype=torch.bool, **D), torch.ones(3, dtype=torch.bool, **D)), r"valid has shape \[3\]"),
        (RM.reference, (torch.ones(4, **D),), r"run_mask has dtype torch.float32"),
        (SC.reference, (torch.randn(4, 8, **D), torch.randn(4, 8, **D), torch.randn(3, 8, **D), torch.arange(4, **D),
                        torch.tensor([1], **D), None), r"y has 3 rows but rows has 4"),
        (GS.reference, (torch.randn(4, 8, **D), torch.randn(4, 8, **D), torch.randn(4, 8, **D), torch.arange(4, **D),
                        torch.tensor([1], **D), torch.randn(6, 8, **D), torch.randn(6, 8, **D), torch.randn(6, 8, **D), None),
         r"w_down is \[6, 8\], expected \[H, I\]"),
        (MA.reference, (torch.randn(2, 3, 8, **D), torch.randn(5, 2, 8, **D), torch.randn(5, 2, 8, **D),
                        torch.zeros(2, 3, **i32), torch.arange(2, **D), ones2, one, 1.0),
         r"nh = 3 must be a multiple of KV heads kvh = 2"),
        (MA.reference, (torch.randn(2, 2, 8, **D), torch.randn(5, 2, 8, **D), torch.randn(5, 2, 8, **D),
                        torch.zeros(2, 3, dtype=torch.int64, **D), torch.arange(2, **D), ones2, one, 1.0),
         r"req_to_token has dtype torch.int64"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_arguments())))
def test_bad_arguments_raise_value_errors(i):
    fn, args, match = _bad_arguments()[i]
    with pytest.raises(ValueError, match=match):
        fn(*args)


# --- per-GPU configs ---------------------------------------------------------------------------
def test_bucket_is_next_power_of_two():
    assert [kernel_configs.bucket(t) for t in (0, 1, 2, 3, 16, 17, 1000, 1024, 1025)] == [1, 1, 2, 4, 16, 32, 1024, 1024, 2048]


def test_tuned_tables_strictly_keyed(tmp_path, monkeypatch):
    gpu = "Fake GPU 9000"
    good, foreign, stale = tmp_path / "good", tmp_path / "foreign", tmp_path / "stale"
    table = {"grouped_linear": {"16": {"BLOCK_N": 32}, "256": {"BLOCK_N": 256}}}
    kernel_configs.save(table, gpu, good)
    for d, change in ((foreign, {"gpu": "Other GPU"}), (stale, {"triton": "0.0.1"})):
        d.mkdir()
        (d / f"{kernel_configs.slug(gpu)}.json").write_text(
            json.dumps({"meta": {**kernel_configs.stamp(gpu), **change}, "configs": {"grouped_linear": {"16": {"BLOCK_N": 1}}}}))
    kernel_configs.tuned_table.cache_clear()
    assert kernel_configs.tuned_table(gpu, (good,)) == table
    with pytest.warns(UserWarning, match="foreign kernel-config table"):
        assert kernel_configs.tuned_table(gpu, (foreign, good)) == table
    with pytest.warns(UserWarning, match=r"stale kernel-config table .*triton '0.0.1'"):
        assert kernel_configs.tuned_table(gpu, (stale,)) == {}

    # lookup on a (pretend) CUDA device: the tuned bucket, else the largest below, else the default
    monkeypatch.setattr(kernel_configs, "_gpu_name", lambda index: gpu)
    monkeypatch.setattr(kernel_configs, "search_dirs", lambda: [good])
    kernel_configs.tuned_table.cache_clear()
    cuda = torch.device("cuda", 0)
    assert kernel_configs.lookup("grouped_linear", 12, cuda, GL.default_config)["BLOCK_N"] == 32
    assert kernel_configs.lookup("grouped_linear", 100, cuda, GL.default_config)["BLOCK_N"] == 32
    assert kernel_configs.lookup("grouped_linear", 1000, cuda, GL.default_config)["BLOCK_N"] == 256
    assert kernel_configs.lookup("grouped_linear", 1000, cuda, GL.default_config)["BLOCK_K"] == GL.default_config(1024)["BLOCK_K"]
    assert kernel_configs.lookup("grouped_linear", 8, cuda, GL.default_config) == GL.default_config(8)
    monkeypatch.setenv("VSKIPPER_AUTOTUNE", "0")
    assert kernel_configs.lookup("grouped_linear", 12, cuda, GL.default_config) == GL.default_config(16)
    monkeypatch.setenv("VSKIPPER_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match=r"VSKIPPER_AUTOTUNE='yes' is not one of \['0', '1'\]"):
        kernel_configs.lookup("grouped_linear", 12, cuda, GL.default_config)
    kernel_configs.tuned_table.cache_clear()


# --- a small routed body, compiled and captured ------------------------------------------------
def routed_body(h, x, logits, valid, wg, wu, wd, wp, attn):
    """RUN rows: h + g * MLP(x) (+ attention of the RUN rows, added in for coverage); PROJECT rows:
    h + (1 - g) * (x @ wp.T). h, x [T, H]; logits [T] (the router output); valid [T]."""
    g = torch.sigmoid(logits)
    run = g > 0.5
    run_rows, proj_rows, counts = ops.route_maps(run, valid)
    out = h.clone()
    ops.grouped_swiglu_(out, h, x, run_rows, counts[0:1], wg, wu, wd, g)
    y = ops.gather_rows(x, proj_rows, counts[1:2])  # [T, H] compact PROJECT rows
    z = ops.grouped_linear(y, torch.arange(y.shape[0], device=y.device), counts[1:2], wp)
    ops.scatter_combine_(out, h, z, proj_rows, counts[1:2], 1 - g)
    q, k, v, r2t, rpi, lens = attn
    o = ops.masked_decode_attention(q, k, v, r2t, rpi, lens, run & valid, q.shape[-1] ** -0.5)  # [T, nh, d]
    return out + o.reshape(out.shape[0], -1)[:, :1]


def routed_inputs(T, H, I, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype).to(device)

    nh, kvh, d, C, P = 4, 2, 16, 24, 64
    attn = (r(T, nh, d), r(P, kvh, d), r(P, kvh, d), torch.randint(0, P, (T, C), generator=g, dtype=torch.int32).to(device),
            torch.arange(T, device=device), torch.randint(1, C + 1, (T,), generator=g).to(device))
    return (r(T, H), r(T, H), torch.randn(T, generator=g).to(device) * 3, (torch.arange(T) < T - 2).to(device),
            r(I, H, scale=H ** -0.5), r(I, H, scale=H ** -0.5), r(H, I, scale=I ** -0.5), r(H, H, scale=H ** -0.5), attn)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_torch_compile_routed_body_matches_eager(device, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", "torch" if device == "cpu" else "triton")
    torch._dynamo.reset()
    args = routed_inputs(12, 24, 40, torch.float32, device)
    compiled = torch.compile(routed_body, fullgraph=True)
    for flip in (False, True):  # the same graph serves other route decisions
        a = args if not flip else (*args[:2], -args[2], *args[3:])
        assert_close(compiled(*a), routed_body(*a), f"compiled vs eager (flip={flip})")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_routed_body(dtype, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", "triton")
    T, H, I = 64, 256, 512
    static = routed_inputs(T, H, I, dtype, DEVICE)
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
        monkeypatch.setenv("VSKIPPER_IMPL", "torch")
        assert_close(out, routed_body(*static), f"replay vs eager torch reference ({trial})")
        monkeypatch.setenv("VSKIPPER_IMPL", "triton")
