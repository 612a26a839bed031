"""The grouped-execution kernels: each Triton kernel against its torch reference (under
TRITON_INTERPRET=1 on CPU, at tiny shapes), each reference against a plain loop that states the
op's contract, the fused epilogue against the gate arithmetic (skippers/base.py), the dynamic
(CPU) attention against the fixed-shape one, and the torch path at larger shapes. The custom-op
layer (opcheck, dispatch, configs, compile, CUDA graphs) is tested in test_ops_compile.py.

Legend: T = rows, H = hidden, I = MLP width, R = map length, B = decode rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vskipper import ops
from vskipper.skippers.base import project_value, run_value
from vskipper.triton_kernels import cache_decode_attention as CA
from vskipper.triton_kernels import grouped_swiglu as GS
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import route_maps as RM
from vskipper.triton_kernels import routed_swiglu as RS
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from helpers import assert_close, assert_close_terms, assert_equal

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = HAS_TRITON and (DEVICE.type == "cuda" or interpreted(RM._compact_kernel))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")

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
    maps = RM.torch_op(run, valid)
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


def spec_cache_attention(q, k_cache, v_cache, attended, run_mask, sm_scale):
    """Row b, head h attends the positions p of its own cache [b, h // G] where attended[b or 0, p]."""
    B, nh, d = q.shape
    G, L = nh // k_cache.shape[1], k_cache.shape[2]
    o = torch.zeros(B, nh, d, dtype=torch.float32)
    for b in range(B):
        keep = torch.ones(L, dtype=torch.bool) if attended is None else attended[b if attended.shape[0] > 1 else 0]
        if not run_mask[b] or not keep.any():
            continue
        for h in range(nh):
            k, v = k_cache[b, h // G][keep].float(), v_cache[b, h // G][keep].float()  # [n, d]
            o[b, h] = torch.softmax((q[b, h].float() @ k.T) * sm_scale, dim=0) @ v
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
    check_maps(RM.torch_op(run.to(DEVICE), None if valid is None else valid.to(DEVICE)), run, valid)


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
    ref = RM.torch_op(run, valid)
    assert_equal(maps[0].cpu(), ref[0], "kernel and reference partition alike")


# --- route: decisions, maps and counts in one op ------------------------------------------------
@st.composite
def router_outputs(draw, max_t: int = 40):
    """(mode, x, token_ids, valid, threshold, hash_params): a router's bool decisions, its gates (some
    non-finite, some at the threshold) in a float dtype, or RandomSkip's inputs (positions, token ids)."""
    from vskipper.skippers.random_skip import RandomSkipRouter

    run, valid = draw(routings(max_t))
    T = run.shape[0]
    mode = draw(st.sampled_from(["decisions", "gate", "hash"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    thr = draw(st.sampled_from([0.5, 0.45, 0.3]))
    if mode == "decisions":
        return mode, run, None, valid, thr, None
    if mode == "gate":
        x = torch.rand(T, generator=g)
        x[torch.rand(T, generator=g) < 0.15] = thr
        x[torch.rand(T, generator=g) < 0.1] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        return mode, x.to(draw(st.sampled_from(DTYPES))), None, valid, thr, None
    dt = draw(st.sampled_from([torch.int32, torch.int64]))
    router = RandomSkipRouter(draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])), draw(st.integers(0, 40)),
                              draw(st.integers(0, 2**20)))
    pos, ids = torch.randint(0, 2**15, (T,), generator=g).to(dt), torch.randint(0, 2**17, (T,), generator=g).to(dt)
    return mode, pos, ids, valid, router, router.hash_params


def route_by_parts(mode, x, ids, valid, thr, counter):
    """What the unfused graph computes: the router's decisions (RandomSkip: its own forward), sanitize_gate,
    the maps, RouteCounter's counts (in the phase `counter` reads)."""
    from vskipper.skippers.base import sanitize_gate

    if mode == "hash":  # thr is the router here
        x = thr(None, x, ids)
        thr = 0.5
    g, run, bad = sanitize_gate(x, thr)
    counter(run, torch.ones_like(run) if valid is None else valid, bad)
    return g, run, RM.torch_op(run, valid)


@given(router_outputs(), st.sampled_from([0, 1]))
@example(("gate", torch.tensor([float("nan"), 0.5, 0.7]), None, None, 0.5, None), 1)
def test_route_is_its_parts_bit_for_bit(case, phase):
    """ops.route (torch form, and the Triton kernel) against the parts it fuses: the same gates,
    decisions, maps and counts, whatever the mode, dtype, padding and phase."""
    from vskipper.counters import Phase, RouteCounter

    mode, x, ids, valid, thr, hp = case
    ph = Phase()
    ph.set(phase)
    want_counter = RouteCounter(ph)
    want = route_by_parts(mode, x, ids, valid, thr, want_counter)
    impls = ["torch"] + (["triton"] if TRITON_RUNS else [])
    for impl in impls:
        counter = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
        for step in range(2):  # counts accumulate over steps
            got = ops.route(x.to(DEVICE), cpu(valid) if valid is None else valid.to(DEVICE), counter,
                            ph.onehot.to(DEVICE), thr if mode != "hash" else 0.5,
                            token_ids=None if ids is None else ids.to(DEVICE), hash_params=hp, impl=impl)
        assert_equal(got[1].cpu(), want[1], f"{impl}: decisions")
        if mode == "gate":
            assert_equal(got[0].cpu(), want[0], f"{impl}: sanitized gates")
        for a, b, what in zip(got[2], want[2], ("run_rows", "project_rows", "counts")):
            assert_equal(a.cpu(), b, f"{impl}: {what}")
        assert_equal(counter.cpu(), 2 * want_counter.counts, f"{impl}: the counter, two steps")


@needs_triton
@pytest.mark.parametrize("mode", ["gate", "hash"])
def test_route_kernel_multi_block(mode):
    from vskipper.skippers.random_skip import RandomSkipRouter

    T = 3000
    g = torch.Generator().manual_seed(1)
    valid = torch.rand(T, generator=g) < 0.9
    router = RandomSkipRouter(0.5, 7, 3)
    x = torch.rand(T, generator=g) if mode == "gate" else torch.arange(T)
    ids = torch.randint(0, 1000, (T,), generator=g) if mode == "hash" else None
    hp = router.hash_params if mode == "hash" else None
    outs = []
    for impl in ("torch", "triton"):
        counter = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
        got = ops.route(x.to(DEVICE), valid.to(DEVICE), counter, torch.tensor([0, 1], device=DEVICE),
                        token_ids=None if ids is None else ids.to(DEVICE), hash_params=hp, impl=impl)
        outs.append([got[1].cpu(), *(m.cpu() for m in got[2]), counter.cpu()])
    for a, b in zip(*outs):
        assert_equal(a, b, f"{mode}: kernel vs torch form over {T} rows")
    assert outs[1][-1][0].tolist() == [0, 0, 0] and outs[1][-1][1, 0] == int(valid.sum())


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_route_maps_flattens_any_shape(impl):
    g = torch.Generator().manual_seed(0)
    run = (torch.rand(3, 5, generator=g) < 0.5).to(DEVICE)
    valid = (torch.rand(3, 5, generator=g) < 0.8).to(DEVICE)
    check_maps(ops.route_maps(run, valid, impl=impl), run.reshape(-1).cpu(), valid.reshape(-1).cpu())
    check_maps(ops.route_maps(run.T, impl=impl), run.T.reshape(-1).cpu(), None)  # non-contiguous input, no valid
    check_maps(ops.route_maps(run[:0], impl=impl), run[:0].reshape(-1).cpu(), None)


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

    ref = run_impl(GS.torch_op)
    n = n_of(count)
    r = rows.cpu()[:n].long()
    ys = torch.zeros(T, H, dtype=dtype)
    ys[:n] = spec_swiglu_rows(x.cpu()[r], wg.cpu(), wu.cpu(), wd.cpu())
    res = out0.cpu() if mode == "alias" else residual.cpu()
    spec = spec_scatter(out0.cpu(), res, ys, rows.cpu(), count.cpu(), cpu(weight))
    terms = res.float().abs() + (spec.float() - res.float()).abs()  # |residual| + |w * y|: the sum may cancel
    assert_close_terms(ref.cpu(), spec, terms, "torch_op vs spec")
    if TRITON_RUNS:
        got = run_impl(GS.launch)
        assert_close_terms(got.cpu(), ref.cpu(), terms, "kernel vs reference")
        untouched = torch.ones(T, dtype=torch.bool)
        untouched[r] = False
        assert_equal(got.cpu()[untouched], out0.cpu()[untouched], "rows outside the map are untouched")


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("soft", [True, False])
def test_grouped_swiglu_epilogue_is_the_gate_arithmetic(impl, soft):
    """The fixed-shape body's two calls (RUN rows: residual h1, weight g; PROJECT rows: residual h,
    weight 1 - g; hard gate: no weight) give run_value / project_value of the rows they name."""
    T, H, I = 11, 24, 40
    g = torch.Generator().manual_seed(7)
    h, h1, x = (randn(T, H, dtype=torch.float32, g=g) for _ in range(3))
    wg, wu = (randn(I, H, dtype=torch.float32, g=g, scale=H ** -0.5) for _ in range(2))
    wd = randn(H, I, dtype=torch.float32, g=g, scale=I ** -0.5)
    gate = torch.rand(T, generator=g).to(DEVICE)
    run = (gate > 0.5).cpu()
    run_rows, proj_rows, counts = (m.to(DEVICE) for m in RM.torch_op(run, None))
    y = spec_swiglu_rows(x, wg, wu, wd)  # [T, H]
    out = h.clone()
    ops.grouped_swiglu_(out, h1, x, run_rows, counts[0:1], wg, wu, wd, gate if soft else None, impl=impl)
    ops.grouped_swiglu_(out, h, x, proj_rows, counts[1:2], wg, wu, wd, 1 - gate if soft else None, impl=impl)
    r = run.to(DEVICE)
    assert_close(out[r], run_value(h1, y, gate, soft)[r], "RUN rows vs run_value")
    assert_close(out[~r], project_value(h, y, gate, soft)[~r], "PROJECT rows vs project_value")


# --- routed_swiglu_: the MLP side of a fixed-shape routed layer -----------------------------------
def spec_rmsnorm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def spec_routed_swiglu(h, a, run, valid, mlp, adapter, nw, eps, g):
    """Row by row, as skippers/base.py states it: RUN h1 + g * mlp(norm(h1)), PROJECT h + (1 - g) *
    adapter(norm(h)) (h itself without an adapter), padding h; in f32."""
    out = h.float().clone()
    v = torch.ones_like(run) if valid is None else valid
    for r in range(h.shape[0]):
        if not v[r]:
            continue
        if run[r]:
            h1 = (h[r] + a[r])[None]
            m = spec_swiglu_rows(spec_rmsnorm(h1, nw, eps).float(), *(w.float() for w in mlp))[0]
            out[r] = h1[0].float() + (1.0 if g is None else float(g[r])) * m
        elif adapter is not None:
            p = spec_swiglu_rows(spec_rmsnorm(h[r][None], nw, eps).float(), *(w.float() for w in adapter))[0]
            out[r] = h[r].float() + (1.0 if g is None else 1.0 - float(g[r])) * p
    return out.to(h.dtype)


@FEW
@given(routings(), st.sampled_from([1, 16, 33, 64]), st.sampled_from([1, 24, 40]), st.sampled_from([None, 1, 5]),
       st.sampled_from(DTYPES), st.booleans(), st.integers(0, 2**16))
def test_routed_swiglu(rv, H, I, Ia, dtype, soft, seed):
    """Every row written: the torch form against the row-by-row spec, the kernel against the torch form
    (and its rows outside both cohorts: h exactly)."""
    run, valid = rv
    T = run.shape[0]
    g = torch.Generator().manual_seed(seed)
    h, a = randn(T, H, dtype=dtype, g=g), randn(T, H, dtype=dtype, g=g)
    mlp = (randn(I, H, dtype=dtype, g=g, scale=H ** -0.5), randn(I, H, dtype=dtype, g=g, scale=H ** -0.5),
           randn(H, I, dtype=dtype, g=g, scale=I ** -0.5))
    adapter = None if Ia is None else (randn(Ia, H, dtype=dtype, g=g, scale=H ** -0.5),
                                       randn(Ia, H, dtype=dtype, g=g, scale=H ** -0.5),
                                       randn(H, Ia, dtype=dtype, g=g, scale=Ia ** -0.5))
    nw = (torch.rand(H, generator=g) + 0.5).to(dtype).to(DEVICE)
    gate = torch.rand(T, generator=g).to(dtype).to(DEVICE) if soft else None
    v = None if valid is None else valid.to(DEVICE)
    maps = ops.route_maps(run.to(DEVICE), v, impl="torch")

    def run_impl(impl):
        out = torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)  # every row must be written
        ops.routed_swiglu_(out, h, a, maps, mlp, adapter, nw, 1e-5, gate, v, impl=impl)
        return out

    ref = run_impl("torch")
    spec = spec_routed_swiglu(h.cpu(), a.cpu(), run, valid, [w.cpu() for w in mlp],
                              None if adapter is None else [w.cpu() for w in adapter], nw.cpu(), 1e-5, cpu(gate))
    terms = h.cpu().float().abs() + a.cpu().float().abs() + (spec.float() - h.cpu().float()).abs()  # >= |each term|
    assert_close_terms(ref.cpu(), spec, terms, "torch form vs spec")
    if TRITON_RUNS:
        got = run_impl("triton")
        assert_close_terms(got.cpu(), ref.cpu(), terms, "kernel vs torch form")
        vv = torch.ones_like(run) if valid is None else valid
        keep = ~vv | (~run if Ia is None else torch.zeros_like(run))  # padding; PROJECT rows without an adapter
        assert_equal(got.cpu()[keep], h.cpu()[keep], "rows no cohort writes are h")


def test_routed_swiglu_refuses_bad_arguments():
    T, H = 4, 8
    h = torch.randn(T, H)
    maps = RM.torch_op(torch.ones(T, dtype=torch.bool), None)
    mlp = (torch.randn(6, H), torch.randn(6, H), torch.randn(H, 6))
    with pytest.raises(ValueError, match=r"norm_w is \[7\] torch.float32, expected \[H\] = \[8\]"):
        RS.torch_op(h.clone(), h, h, *maps, mlp, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match=r"adapter w_down is \[8, 2\] torch.float32, expected \[8, 3\]"):
        RS.torch_op(h.clone(), h, h, *maps, mlp, (torch.randn(3, H), torch.randn(3, H), torch.randn(H, 2)),
                    torch.ones(H), 1e-5)
    with pytest.raises(ValueError, match=r"counts is \[1\], expected \[2\]"):
        RS.torch_op(h.clone(), h, h, maps[0], maps[1], maps[2][:1], mlp, None, torch.ones(H), 1e-5)


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
    ref = MA.torch_op(*args)
    assert_close(ref.cpu(), spec_attention(*(a.cpu() if torch.is_tensor(a) else a for a in args)), "reference vs spec")
    assert_close(MA.torch_op_dynamic(*args), ref, "dynamic vs fixed reference")
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
    for fn in (MA.torch_op, MA.torch_op_dynamic) + ((MA.launch,) if TRITON_RUNS and DEVICE.type == "cpu" else ()):
        o = fn(*args)
        assert_equal(o[0], torch.zeros_like(o[0]), fn.__qualname__)
        assert torch.isfinite(o).all()


# --- cache_decode_attention --------------------------------------------------------------------
@st.composite
def cache_batches(draw):
    """Decode rows over a contiguous cache [B, kvh, L, d]: masks with holes, left padding, a row that
    attends nothing, a mask broadcast over the batch, or none; strided query and run mask."""
    B = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, 5)))
    kvh = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 4, 5]))
    d = draw(st.sampled_from([1, 10, 16, 64]))
    L = draw(st.sampled_from([1, 7, 40, 130, 200]))
    mask = draw(st.sampled_from(["none", "holes", "left_pad", "broadcast", "empty_row"]))
    kind = draw(st.sampled_from(["all", "none", "mixed"]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = randn(B, G * kvh, d + 3, dtype=dtype, g=g)[..., :d] if draw(st.booleans()) else \
        randn(B, G * kvh, d, dtype=dtype, g=g)
    k, v = randn(B, kvh, L, d, dtype=dtype, g=g), randn(B, kvh, L, d, dtype=dtype, g=g)
    attended = {"none": None, "holes": torch.rand(B, L, generator=g) < 0.6,
                "left_pad": torch.arange(L)[None, :] >= torch.randint(0, L, (B, 1), generator=g),
                "broadcast": torch.rand(1, L, generator=g) < 0.5 if L > 1 else torch.ones(1, 1, dtype=torch.bool),
                "empty_row": torch.arange(B)[:, None].expand(B, L) > 0}[mask]
    run = {"all": torch.ones(2 * B, dtype=torch.bool), "none": torch.zeros(2 * B, dtype=torch.bool),
           "mixed": torch.rand(2 * B, generator=g) < 0.6}[kind][::2]  # strided, as a sublayer's column
    return q, k, v, None if attended is None else attended.to(DEVICE), run.to(DEVICE), d ** -0.5


@FEW
@given(cache_batches())
def test_cache_decode_attention(args):
    ref = CA.torch_op(*args)
    assert_close(ref.cpu(), spec_cache_attention(*(cpu(a) if torch.is_tensor(a) else a for a in args)),
                 "reference vs spec")
    assert_equal(ops.cache_decode_attention(*args, impl="torch"), ref, "public op, torch")
    if TRITON_RUNS:
        got = CA.launch(*args)
        assert_close(got, ref, "kernel vs reference")
        skipped = ~args[4]
        assert_equal(got[skipped], torch.zeros_like(got[skipped]), "zeros for skipped rows")
        assert torch.isfinite(got.float()).all()


# --- the torch path at larger shapes -----------------------------------------------------------
@pytest.mark.parametrize("T,H,I", [(512, 512, 1024), (300, 111, 257)])
def test_torch_path_larger_shapes(T, H, I):
    g = torch.Generator().manual_seed(T)
    gate = torch.rand(T, generator=g)
    run, valid = gate > 0.4, torch.arange(T) < T - 7
    maps = ops.route_maps(run, valid, impl="torch")
    check_maps(maps, run, valid)
    run_rows, _, counts = maps
    x, h = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    wg, wu = torch.randn(I, H, generator=g) * H ** -0.5, torch.randn(I, H, generator=g) * H ** -0.5
    wd = torch.randn(H, I, generator=g) * I ** -0.5
    n = counts[0:1]
    a, b = h.clone(), h.clone()
    ops.grouped_swiglu_(a, h, x, run_rows, n, wg, wu, wd, gate, impl="torch")
    GS.torch_op(b, h, x, run_rows, n, wg, wu, wd, gate)
    assert_equal(a, b, "grouped_swiglu_ is its reference")
    # the same as the dense MLP on the RUN rows, the rest untouched
    m = run & valid
    dense = torch.where(m[:, None], h + gate[:, None] * spec_swiglu_rows(x, wg, wu, wd), h)
    assert_close(a, dense, "grouped_swiglu_ vs dense MLP")
