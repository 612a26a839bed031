"""The grouped-execution ops: each Triton kernel against its torch reference (under
TRITON_INTERPRET=1 on CPU, at tiny shapes), each reference against a plain loop that states the
op's contract, the fixed-shape references against the dynamic (CPU) ones, the torch path at larger
shapes, torch.library.opcheck on every custom op, the dispatch and config rules, torch.compile of a
small routed body on CPU, and CUDA-graph capture of it where a GPU is present.

Legend: T = rows, H = hidden, I = MLP width, R = map length, B = decode rows.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vskipper import kernel_configs, ops
from vskipper.triton_kernels import gather_rows as GR
from vskipper.triton_kernels import grouped_linear as GL
from vskipper.triton_kernels import grouped_swiglu as GS
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import route_maps as RM
from vskipper.triton_kernels import scatter_combine as SC
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from conftest import assert_close, assert_equal

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = HAS_TRITON and (DEVICE.type == "cuda" or interpreted(RM._compact_kernel))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")

# GEMMs and attention compile a kernel for most new shape/dtype combinations on a GPU (about a
# second each): fewer examples for those there (40 on "gpu"); on "cpu" the interpreter at these
# tiny shapes takes about 50 ms an example, so they keep the profile's number.
FEW = settings(max_examples=min(settings.default.max_examples, max(25, settings.default.max_examples // 5)))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HIDDEN = st.sampled_from([1, 7, 16, 33, 111, 128, 256])


# --- inputs ------------------------------------------------------------------------------------
@st.composite
def routings(draw, max_t: int = 40):
    """(run [T] bool, valid [T] bool | None): all-RUN, none-RUN or mixed; no, full or padded validity."""
    T = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_t)))
    kind = draw(st.sampled_from(["all", "none", "mixed"]))
    pad = draw(st.sampled_from(["none", "all_valid", "trailing", "holes"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ratio = draw(st.floats(0.0, 1.0))
    run = {"all": torch.ones(T, dtype=torch.bool), "none": torch.zeros(T, dtype=torch.bool),
           "mixed": torch.rand(T, generator=g) < ratio}[kind]
    if pad == "none":
        valid = None
    elif pad == "all_valid":
        valid = torch.ones(T, dtype=torch.bool)
    elif pad == "trailing":  # a padded batch: the last rows are not tokens
        valid = torch.arange(T) < T - draw(st.integers(0, T))
    else:
        valid = torch.rand(T, generator=g) < 0.7
    return run, valid


def maps_for(run, valid, rows_dtype=torch.int32, which=0, scalar_count=False):
    """rows [T] and count ([1] or []) of RUN (which=0) or PROJECT (1) rows, from the torch reference."""
    maps = RM.reference(run, valid)
    rows = maps[which].to(rows_dtype)
    count = maps[2][which] if scalar_count else maps[2][which:which + 1]
    return rows.to(DEVICE), count.to(DEVICE)


def randn(*shape, dtype, g, scale=1.0, strided=False):
    """A random tensor on DEVICE; strided: a row slice of a wider buffer (row stride > last dim)."""
    if strided and len(shape) == 2:
        buf = torch.randn(shape[0], shape[1] + 3, generator=g) * scale
        return buf.to(dtype).to(DEVICE)[:, :shape[1]]
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def n_of(count) -> int:
    return int(count.reshape(()))


# --- specs: the contract written as plain loops (the references' oracle) ---------------------
def spec_gather(x, rows, count):
    y = torch.zeros(rows.shape[0], x.shape[1], dtype=x.dtype)
    for j in range(n_of(count)):
        y[j] = x[int(rows[j])]
    return y


def spec_scatter(out, residual, y, rows, count, weight):
    out = out.clone()
    for j in range(n_of(count)):
        r = int(rows[j])
        w = 1.0 if weight is None else weight[r].to(out.dtype)
        out[r] = residual[r] + w * y[j]
    return out


def spec_swiglu_rows(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def spec_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale):
    B, nh, d = q.shape
    G = nh // k_buffer.shape[1]
    o = torch.zeros(B, nh, d, dtype=torch.float32)
    for b in range(B):
        L = int(seq_lens[b])
        if not run_mask[b] or L == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :L].long()
        for h in range(nh):
            k, v = k_buffer[slots, h // G].float(), v_buffer[slots, h // G].float()  # [L, d]
            p = torch.softmax((q[b, h].float() @ k.T) * sm_scale, dim=0)
            o[b, h] = p @ v
    return o.to(q.dtype)


def cpu(t):
    return None if t is None else t.cpu()


# --- route_maps --------------------------------------------------------------------------------
def check_maps(maps, run, valid):
    run_rows, project_rows, counts = (m.cpu() for m in maps)
    T = run.shape[0]
    v = torch.ones(T, dtype=torch.bool) if valid is None else valid
    want_run, want_proj = (run & v).nonzero().squeeze(1), (~run & v).nonzero().squeeze(1)
    assert_equal(counts, torch.tensor([want_run.numel(), want_proj.numel()], dtype=torch.int32), "counts")
    assert run_rows.dtype == project_rows.dtype == torch.int32
    assert_equal(run_rows[:want_run.numel()].long(), want_run, "run_rows[:count]")
    assert_equal(project_rows[:want_proj.numel()].long(), want_proj, "project_rows[:count]")
    for name, m in (("run_rows", run_rows), ("project_rows", project_rows)):
        # past the count: still row indices; and (the documented construction) each map is a permutation
        assert_equal(m.sort().values, torch.arange(T, dtype=torch.int32), f"{name} is a permutation of 0..T-1")


@given(routings())
@example((torch.ones(0, dtype=torch.bool), None))
@example((torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)))
def test_route_maps_reference(rv):
    run, valid = rv
    check_maps(RM.reference(run.to(DEVICE), None if valid is None else valid.to(DEVICE)), run, valid)


@needs_triton
@given(routings())
@example((torch.ones(0, dtype=torch.bool), None))
@example((torch.ones(1, dtype=torch.bool), None))
@example((torch.zeros(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool)))
def test_route_maps_kernel(rv):
    run, valid = rv
    check_maps(RM.launch(run.to(DEVICE), None if valid is None else valid.to(DEVICE)), run, valid)


@needs_triton
@pytest.mark.parametrize("T", [1023, 1024, 1025, 4097, 65536])
@pytest.mark.parametrize("with_valid", [False, True])
def test_route_maps_kernel_multi_block(T, with_valid):
    g = torch.Generator().manual_seed(T)
    run = torch.rand(T, generator=g) < 0.6
    valid = (torch.rand(T, generator=g) < 0.9) if with_valid else None
    maps = RM.launch(run.to(DEVICE), None if valid is None else valid.to(DEVICE))
    check_maps(maps, run, valid)
    ref = RM.reference(run, valid)
    assert_equal(maps[0].cpu(), ref[0], "kernel and reference partition alike")


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_route_maps_flattens_any_shape(impl, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", impl)
    g = torch.Generator().manual_seed(0)
    run = (torch.rand(3, 5, generator=g) < 0.5).to(DEVICE)
    valid = (torch.rand(3, 5, generator=g) < 0.8).to(DEVICE)
    check_maps(ops.route_maps(run, valid), run.reshape(-1).cpu(), valid.reshape(-1).cpu())
    check_maps(ops.route_maps(run.T), run.T.reshape(-1).cpu(), None)  # non-contiguous input, no valid
    check_maps(ops.route_maps(run[:0]), run[:0].reshape(-1).cpu(), None)


# --- gather_rows -------------------------------------------------------------------------------
@given(routings(), HIDDEN, st.sampled_from(DTYPES), st.integers(0, 2**16), st.booleans(), st.booleans(),
       st.sampled_from([0, 1]))
@example((torch.zeros(0, dtype=torch.bool), None), 111, torch.float32, 0, False, False, 0)
@example((torch.ones(1, dtype=torch.bool), None), 111, torch.bfloat16, 0, True, True, 1)
def test_gather_rows(rv, H, dtype, seed, strided, int64_rows, which):
    run, valid = rv
    g = torch.Generator().manual_seed(seed)
    x = randn(run.shape[0], H, dtype=dtype, g=g, strided=strided)
    rows, count = maps_for(run, valid, torch.int64 if int64_rows else torch.int32, which, scalar_count=int64_rows)
    ref = GR.reference(x, rows, count)
    assert_equal(ref.cpu(), spec_gather(x.cpu(), rows.cpu(), count.cpu()), "reference vs spec")
    assert_equal(GR.reference_dynamic(x, rows, count), ref, "dynamic vs fixed reference")
    if TRITON_RUNS:
        assert_equal(GR.launch(x, rows, count), ref, "kernel vs reference")


# --- scatter_combine_ --------------------------------------------------------------------------
@given(routings(), HIDDEN, st.sampled_from(DTYPES), st.integers(0, 2**16), st.booleans(), st.booleans(),
       st.sampled_from(["none", "weight", "alias"]))
@example((torch.zeros(0, dtype=torch.bool), None), 111, torch.float32, 0, False, False, "weight")
@example((torch.ones(1, dtype=torch.bool), None), 111, torch.bfloat16, 0, True, True, "alias")
def test_scatter_combine(rv, H, dtype, seed, strided, int64_rows, mode):
    run, valid = rv
    T = run.shape[0]
    g = torch.Generator().manual_seed(seed)
    out0 = randn(T, H, dtype=dtype, g=g, strided=strided)
    residual = out0 if mode == "alias" else randn(T, H, dtype=dtype, g=g)
    y = randn(T, H, dtype=dtype, g=g)
    weight = None if mode == "none" else torch.rand(T, generator=g).to(DEVICE)
    rows, count = maps_for(run, valid, torch.int64 if int64_rows else torch.int32)

    def run_impl(fn):
        out = out0.clone()
        fn(out, out if mode == "alias" else residual, y, rows, count, weight)
        return out

    ref = run_impl(SC.reference)
    assert_close(ref.cpu(), spec_scatter(out0.cpu(), cpu(residual), y.cpu(), rows.cpu(), count.cpu(), cpu(weight)),
                 "reference vs spec")
    assert_close(run_impl(SC.reference_dynamic), ref, "dynamic vs fixed reference")
    if TRITON_RUNS:
        got = run_impl(SC.launch)
        assert_close(got, ref, "kernel vs reference")
        untouched = torch.ones(T, dtype=torch.bool)
        untouched[rows[:n_of(count)].long().cpu()] = False
        assert_equal(got.cpu()[untouched], out0.cpu()[untouched], "rows outside the map are untouched")


# --- grouped_linear ----------------------------------------------------------------------------
@FEW
@given(routings(), HIDDEN, st.sampled_from([1, 16, 40, 130]), st.sampled_from(DTYPES), st.integers(0, 2**16),
       st.booleans())
@example((torch.zeros(0, dtype=torch.bool), None), 111, 40, torch.float32, 0, False)
@example((torch.ones(1, dtype=torch.bool), None), 111, 40, torch.bfloat16, 0, True)
def test_grouped_linear(rv, K, N, dtype, seed, strided):
    run, valid = rv
    g = torch.Generator().manual_seed(seed)
    x = randn(run.shape[0], K, dtype=dtype, g=g, strided=strided)
    w = randn(N, K, dtype=dtype, g=g, scale=K ** -0.5, strided=strided)
    rows, count = maps_for(run, valid)
    ref = GL.reference(x, rows, count, w)
    xs, ws = x.cpu().float(), w.cpu().float()
    spec = torch.zeros(rows.shape[0], N)
    for j in range(n_of(count)):
        spec[j] = xs[int(rows[j])] @ ws.T
    assert_close(ref.cpu(), spec.to(dtype), "reference vs spec")
    assert_close(GL.reference_dynamic(x, rows, count, w), ref, "dynamic vs fixed reference")
    if TRITON_RUNS:
        got = GL.launch(x, rows, count, w)
        assert_close(got, ref, "kernel vs reference")
        assert_equal(got[n_of(count):], torch.zeros_like(got[n_of(count):]), "zeros past the count")


# --- grouped_swiglu_ ---------------------------------------------------------------------------
@FEW
@given(routings(), HIDDEN, st.sampled_from([1, 16, 50, 200]), st.sampled_from(DTYPES), st.integers(0, 2**16),
       st.booleans(), st.sampled_from(["none", "weight", "alias"]), st.sampled_from([0, 1]))
@example((torch.zeros(0, dtype=torch.bool), None), 111, 50, torch.float32, 0, False, "weight", 0)
@example((torch.ones(1, dtype=torch.bool), None), 111, 50, torch.bfloat16, 0, True, "alias", 0)
@example((torch.ones(17, dtype=torch.bool), None), 256, 200, torch.float16, 1, False, "weight", 0)
def test_grouped_swiglu(rv, H, I, dtype, seed, strided, mode, which):
    run, valid = rv
    T = run.shape[0]
    g = torch.Generator().manual_seed(seed)
    x = randn(T, H, dtype=dtype, g=g, strided=strided)
    out0 = randn(T, H, dtype=dtype, g=g)
    residual = randn(T, H, dtype=dtype, g=g)
    wg, wu = randn(I, H, dtype=dtype, g=g, scale=H ** -0.5), randn(I, H, dtype=dtype, g=g, scale=H ** -0.5)
    wd = randn(H, I, dtype=dtype, g=g, scale=I ** -0.5, strided=strided)
    weight = None if mode == "none" else torch.rand(T, generator=g).to(DEVICE)
    rows, count = maps_for(run, valid, which=which)

    def run_impl(fn):
        out = out0.clone()
        fn(out, out if mode == "alias" else residual, x, rows, count, wg, wu, wd, weight)
        return out

    ref = run_impl(GS.reference)
    n = n_of(count)
    r = rows.cpu()[:n].long()
    ys = torch.zeros(T, H, dtype=dtype)
    ys[:n] = spec_swiglu_rows(x.cpu()[r], wg.cpu(), wu.cpu(), wd.cpu())
    res = out0.cpu() if mode == "alias" else residual.cpu()
    assert_close(ref.cpu(), spec_scatter(out0.cpu(), res, ys, rows.cpu(), count.cpu(), cpu(weight)), "reference vs spec")
    assert_close(run_impl(GS.reference_dynamic), ref, "dynamic vs fixed reference")
    if TRITON_RUNS:
        got = run_impl(GS.launch)
        assert_close(got, ref, "kernel vs reference")
        untouched = torch.ones(T, dtype=torch.bool)
        untouched[r] = False
        assert_equal(got.cpu()[untouched], out0.cpu()[untouched], "rows outside the map are untouched")


# --- masked_decode_attention -------------------------------------------------------------------
@st.composite
def decode_batches(draw):
    B = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, 6)))
    kvh = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 4, 5]))
    d = draw(st.sampled_from([1, 10, 16, 64, 100]))
    C = draw(st.sampled_from([1, 7, 40, 130]))
    kind = draw(st.sampled_from(["all", "none", "mixed"]))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from(DTYPES))
    strided_q = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    P, R = 3 * C + 5, B + 3
    if strided_q:  # q as a view of a fused qkv projection
        qkv = torch.randn(B, (G * kvh + 2 * kvh) * d, generator=g).to(dtype).to(DEVICE)
        q = qkv[:, :G * kvh * d].view(B, G * kvh, d)
    else:
        q = randn(B, G * kvh, d, dtype=dtype, g=g)
    k, v = randn(P, kvh, d, dtype=dtype, g=g), randn(P, kvh, d, dtype=dtype, g=g)
    req_to_token = torch.randint(0, P, (R, C), generator=g, dtype=torch.int32).to(DEVICE)
    req_pool_indices = torch.randperm(R, generator=g)[:B].to(draw(st.sampled_from([torch.int32, torch.int64])))
    seq_lens = torch.randint(1, C + 1, (B,), generator=g)
    run = {"all": torch.ones(B, dtype=torch.bool), "none": torch.zeros(B, dtype=torch.bool),
           "mixed": torch.rand(B, generator=g) < 0.6}[kind]
    return (q, k, v, req_to_token, req_pool_indices.to(DEVICE), seq_lens.to(DEVICE), run.to(DEVICE), d ** -0.5)


@FEW
@given(decode_batches())
def test_masked_decode_attention(args):
    ref = MA.reference(*args)
    assert_close(ref.cpu(), spec_attention(*(a.cpu() if torch.is_tensor(a) else a for a in args)), "reference vs spec")
    assert_close(MA.reference_dynamic(*args), ref, "dynamic vs fixed reference")
    assert_close(ops.masked_decode_attention_dynamic(*args), ref, "public dynamic helper")
    if TRITON_RUNS:
        got = MA.launch(*args)
        assert_close(got, ref, "kernel vs reference")
        skipped = ~args[6]
        assert_equal(got[skipped], torch.zeros_like(got[skipped]), "zeros for skipped rows")


def test_masked_decode_attention_zero_length_row_is_zero():
    q, k, v = torch.randn(2, 2, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    args = (q, k, v, torch.zeros(2, 4, dtype=torch.int32), torch.arange(2), torch.tensor([0, 3]),
            torch.ones(2, dtype=torch.bool), 0.3)
    for fn in (MA.reference, MA.reference_dynamic) + ((MA.launch,) if TRITON_RUNS and DEVICE.type == "cpu" else ()):
        o = fn(*args)
        assert_equal(o[0], torch.zeros_like(o[0]), fn.__qualname__)
        assert torch.isfinite(o).all()


# --- the torch path at larger shapes -----------------------------------------------------------
@pytest.mark.parametrize("T,H,I", [(512, 512, 1024), (300, 111, 257)])
def test_torch_path_larger_shapes(T, H, I, monkeypatch):
    monkeypatch.setenv("VSKIPPER_IMPL", "torch")
    g = torch.Generator().manual_seed(T)
    gate = torch.rand(T, generator=g)
    run, valid = gate > 0.4, torch.arange(T) < T - 7
    run_rows, proj_rows, counts = ops.route_maps(run, valid)
    check_maps((run_rows, proj_rows, counts), run, valid)
    x, h = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    wg, wu = torch.randn(I, H, generator=g) * H ** -0.5, torch.randn(I, H, generator=g) * H ** -0.5
    wd = torch.randn(H, I, generator=g) * I ** -0.5
    n = counts[0:1]
    assert_equal(ops.gather_rows(x, run_rows, n), GR.reference(x, run_rows, n), "gather_rows")
    assert_close(ops.grouped_linear(x, run_rows, n, wg), GL.reference(x, run_rows, n, wg), "grouped_linear")
    a, b = h.clone(), h.clone()
    ops.grouped_swiglu_(a, h, x, run_rows, n, wg, wu, wd, gate)
    GS.reference(b, h, x, run_rows, n, wg, wu, wd, gate)
    assert_close(a, b, "grouped_swiglu_")
    # the same as the dense MLP on the RUN rows, the rest untouched
    m = run & valid
    dense = torch.where(m[:, None], h + gate[:, None] * spec_swiglu_rows(x, wg, wu, wd), h)
    assert_close(a, dense, "grouped_swiglu_ vs dense MLP")
    a, b = h.clone(), h.clone()
    ops.scatter_combine_(a, h, x, proj_rows, counts[1:2], None)
    SC.reference(b, h, x, proj_rows, counts[1:2], None)
    assert_close(a, b, "scatter_combine_")


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
