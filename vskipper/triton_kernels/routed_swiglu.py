"""routed_swiglu_: a routed layer's whole MLP side at fixed shapes, both cohorts in one pair of launches.

T = rows, H = hidden, I = MLP width, Ia = adapter width. For every row r of out [T, H]:
    RUN r (r = run_rows[j], j < counts[0]):     h1 = h[r] + a[r]
        out[r] = h1 + w[r] * mlp(rmsnorm(h1))                     w = g (soft gate) or 1
    PROJECT r (project_rows[j], j < counts[1]), with an adapter:
        out[r] = h[r] + w'[r] * adapter(rmsnorm(h[r]))            w' = 1 - g (soft gate) or 1
    any other row (PROJECT without an adapter; padding, valid False):   out[r] = h[r]
mlp(y) = (silu(y @ w_gate.T) * (y @ w_up.T)) @ w_down.T (w_gate, w_up [I, H], w_down [H, I]); the adapter is
the same form over its own weights ([Ia, H], [Ia, H], [H, Ia]; FlexiDepth's up_proj(silu(gate_proj(y)) *
down_proj(y)) is a_gate=gate_proj, a_up=down_proj, a_down=up_proj). rmsnorm(x) = norm_w * (x / rms(x))
in the model's order (transformers' LlamaRMSNorm: f32 statistics, cast back, then the weight).

It stands for what the fixed-shape routed body otherwise launches apart: the residual add h + a, the
post-attention norm of the RUN rows and of the PROJECT rows, the MLP's and the adapter's grouped
SwiGLU (grouped_swiglu_, twice), and the copy of out. Two kernels, each over both cohorts (a program
knows its cohort from its id): gate/up with the gather, the residual add and the norm in the A load
and silu * up in the epilogue, into compact [T, I] / [T, Ia] buffers; then down with the weighted
scatter-combine epilogue, and the programs that copy the rows no cohort writes. Tiles past a cohort's
device-side count exit at once.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels import grouped_swiglu as GS
from vskipper.triton_kernels._common import (
    FLOATS,
    INDEXES,
    check_contiguous,
    check_devices,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    dot_flags,
    eager_only,
    expect,
    grouped_tile,
    stages_for,
    tl,
    triton,
)

OP = "routed_swiglu_"


def default_config(bucket: int) -> dict:
    """Untuned defaults: grouped_swiglu_'s (the same GEMM tiles), and a copy tile for the rows no cohort writes."""
    cfg = GS.default_config(bucket)
    cfg["copy"] = {"BLOCK_M": 16, "BLOCK_N": 128}
    return cfg


@triton.jit
def _residual(h_ptr, a_ptr, rows, cols, mask, stride_h, stride_a, ADD: tl.constexpr):
    # h[rows, cols] (+ a[rows, cols] when ADD, rounded to h's dtype as torch's h + a is) in f32; the arithmetic
    # in f32 (the interpreter's bf16 arithmetic is not to be trusted), rounding where torch rounds
    x = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    if ADD:
        y = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
        return (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _rstd(h_ptr, a_ptr, rows, live, stride_h, stride_a, H, eps, ADD: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr):
    # 1 / rms of x = h[rows] (+ a[rows] when ADD, rounded to h's dtype as torch rounds h + a): [BLOCK_M] f32
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        m = live[:, None] & ((k0 + offs_k) < H)[None, :]
        x = _residual(h_ptr, a_ptr, rows, k0 + offs_k, m, stride_h, stride_a, ADD)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / H + eps)


@triton.jit
def _gate_up(h_ptr, a_ptr, nw_ptr, rows_ptr, count_ptr, wg_ptr, wu_ptr, act_ptr, pid, T, N, H, eps, stride_h, stride_a,
             stride_wg, stride_wu, stride_act, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # one cohort's program `pid`: act[j, n] = silu(y @ wg.T) * (y @ wu.T) for its tile, y = rmsnorm(x[rows[j]])
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    count = tl.load(count_ptr)
    if pid_m.to(tl.int64) * BLOCK_M >= count:  # the down kernel never reads these rows of act
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (offs_m < T) & (offs_m < count)
    in_n = offs_n < N
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    rstd = _rstd(h_ptr, a_ptr, rows, live, stride_h, stride_a, H, eps, ADD, BLOCK_M, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        in_k = (k0 + offs_k) < H
        m = live[:, None] & in_k[None, :]
        x = _residual(h_ptr, a_ptr, rows, k0 + offs_k, m, stride_h, stride_a, ADD)
        nw = tl.load(nw_ptr + k0 + offs_k, mask=in_k, other=0.0)
        dt = nw.dtype  # the norm in the model's order, rounded where it rounds (arithmetic in f32)
        y = (nw.to(tl.float32)[None, :] * (x * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
        wmask = in_k[:, None] & in_n[None, :]
        g = tl.load(wg_ptr + offs_n[None, :] * stride_wg + (k0 + offs_k)[:, None], mask=wmask, other=0.0)
        u = tl.load(wu_ptr + offs_n[None, :] * stride_wu + (k0 + offs_k)[:, None], mask=wmask, other=0.0)
        if UPCAST:
            y = y.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(y, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(y, u, acc_u, input_precision=PRECISION)
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up, in f32
    tl.store(act_ptr + offs_m[:, None] * stride_act + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=live[:, None] & in_n[None, :])


@triton.jit
def _gate_up_kernel(h_ptr, a_ptr, nw_ptr, run_rows_ptr, proj_rows_ptr, counts_ptr, wg_ptr, wu_ptr, ag_ptr, au_ptr,
                    act_ptr, aact_ptr, T, I, IA, H, eps, stride_h, stride_a, stride_wg, stride_wu, stride_ag,
                    stride_au, stride_act, stride_aact, HAS_ADAPTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr):
    # h_ptr, a_ptr: [T, H]; nw_ptr: [H]; run_rows_ptr, proj_rows_ptr: [T] int32; counts_ptr: [2] int32;
    # wg_ptr, wu_ptr: [I, H]; ag_ptr, au_ptr: [IA, H]; act_ptr: [T, I]; aact_ptr: [T, IA] (compact)
    pid = tl.program_id(0)
    run_programs = tl.cdiv(T, BLOCK_M) * tl.cdiv(I, BLOCK_N)
    if pid < run_programs:  # the RUN cohort: x = h + a, the MLP
        _gate_up(h_ptr, a_ptr, nw_ptr, run_rows_ptr, counts_ptr, wg_ptr, wu_ptr, act_ptr, pid, T, I, H, eps, stride_h,
                 stride_a, stride_wg, stride_wu, stride_act, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST,
                 PRECISION)
    elif HAS_ADAPTER:  # the PROJECT cohort: x = h, the adapter
        _gate_up(h_ptr, a_ptr, nw_ptr, proj_rows_ptr, counts_ptr + 1, ag_ptr, au_ptr, aact_ptr, pid - run_programs, T,
                 IA, H, eps, stride_h, stride_a, stride_ag, stride_au, stride_aact, False, BLOCK_M, BLOCK_N, BLOCK_K,
                 GROUP_M, UPCAST, PRECISION)


@triton.jit
def _down(act_ptr, wd_ptr, out_ptr, h_ptr, a_ptr, rows_ptr, count_ptr, g_ptr, pid, T, H, K, stride_act, stride_wd,
          stride_out, stride_h, stride_a, ADD: tl.constexpr, WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
          PRECISION: tl.constexpr):
    # one cohort's program: out[rows[j]] = residual + w * act[j] @ wd.T; residual = h (+ a, rounded, when ADD);
    # WEIGHT 0: none, 1: g, 2: 1 - g
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(T, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    count = tl.load(count_ptr)
    if pid_m.to(tl.int64) * BLOCK_M >= count:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (offs_m < T) & (offs_m < count)
    in_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = (k0 + offs_k) < K
        x = tl.load(act_ptr + offs_m[:, None] * stride_act + (k0 + offs_k)[None, :],
                    mask=live[:, None] & in_k[None, :], other=0.0)
        w = tl.load(wd_ptr + offs_n[None, :] * stride_wd + (k0 + offs_k)[:, None], mask=in_k[:, None] & in_n[None, :],
                    other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & in_n[None, :]
    res = _residual(h_ptr, a_ptr, rows, offs_n, mask, stride_h, stride_a, ADD)
    if WEIGHT == 1:
        acc = acc * tl.load(g_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    elif WEIGHT == 2:
        acc = acc * (1.0 - tl.load(g_ptr + rows, mask=live, other=0.0).to(tl.float32))[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], (res + acc).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _down_kernel(act_ptr, aact_ptr, wd_ptr, ad_ptr, out_ptr, h_ptr, a_ptr, run_rows_ptr, counts_ptr, proj_rows_ptr,
                 g_ptr, valid_ptr, T, I, IA, H, stride_act, stride_aact, stride_wd, stride_ad, stride_out, stride_h,
                 stride_a, HAS_ADAPTER: tl.constexpr, SOFT: tl.constexpr, HAS_VALID: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 COPY_M: tl.constexpr, COPY_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # act_ptr: [T, I], aact_ptr: [T, IA] (compact); wd_ptr: [H, I]; ad_ptr: [H, IA]; out_ptr, h_ptr, a_ptr: [T, H];
    # run_rows_ptr, proj_rows_ptr: [T] int32; counts_ptr: [2] int32; g_ptr: [T] (SOFT); valid_ptr: [T] uint8
    pid = tl.program_id(0)
    tiles = tl.cdiv(T, BLOCK_M) * tl.cdiv(H, BLOCK_N)
    if pid < tiles:
        _down(act_ptr, wd_ptr, out_ptr, h_ptr, a_ptr, run_rows_ptr, counts_ptr, g_ptr, pid, T, H, I, stride_act,
              stride_wd, stride_out, stride_h, stride_a, True, 1 if SOFT else 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
              UPCAST, PRECISION)
    elif HAS_ADAPTER and pid < 2 * tiles:
        _down(aact_ptr, ad_ptr, out_ptr, h_ptr, a_ptr, proj_rows_ptr, counts_ptr + 1, g_ptr, pid - tiles, T, H, IA,
              stride_aact, stride_ad, stride_out, stride_h, stride_a, False, 2 if SOFT else 0, BLOCK_M, BLOCK_N,
              BLOCK_K, GROUP_M, UPCAST, PRECISION)
    else:  # copy h into the rows no cohort writes: the non-RUN rows (run_rows past counts[0]), less PROJECT ones
        c = pid - (2 * tiles if HAS_ADAPTER else tiles)
        n_copy = tl.cdiv(H, COPY_N)
        first = tl.load(counts_ptr)
        offs_j = first + (c // n_copy).to(tl.int64) * COPY_M + tl.arange(0, COPY_M)
        if (c // n_copy) * COPY_M < T - first:
            live = offs_j < T
            rows = tl.load(run_rows_ptr + offs_j, mask=live, other=0).to(tl.int64)
            if HAS_ADAPTER:  # a non-RUN row that is valid is a PROJECT row, which its cohort writes
                if HAS_VALID:
                    live = live & (tl.load(valid_ptr + rows, mask=live, other=1) == 0)
                else:  # every row is valid: none to copy
                    live = live & (offs_j < 0)
            offs_n = (c % n_copy).to(tl.int64) * COPY_N + tl.arange(0, COPY_N)
            mask = live[:, None] & (offs_n < H)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :],
                     tl.load(h_ptr + rows[:, None] * stride_h + offs_n[None, :], mask=mask, other=0.0), mask=mask)


@eager_only
def check(out, h, a, run_rows, project_rows, counts, mlp, adapter, norm_w, g, valid) -> None:
    T, H = h.shape if h.dim() == 2 else (0, 0)
    for name, t in (("out", out), ("h", h), ("a", a)):
        check_dim(OP, name, t, 2, "[T, H]")
        check_dtype(OP, name, t, FLOATS)
        expect(t.shape == h.shape and t.dtype == h.dtype, OP,
               f"{name} is {list(t.shape)} {t.dtype}, expected h's [T, H] = {list(h.shape)} {h.dtype}")
    for name, t in (("run_rows", run_rows), ("project_rows", project_rows)):
        check_dim(OP, name, t, 1, "[T]")
        check_dtype(OP, name, t, INDEXES)
        expect(t.shape[0] == T, OP, f"{name} has {t.shape[0]} entries but h has T = {T} rows")
    check_dtype(OP, "counts", counts, INDEXES)
    expect(counts.shape == (2,), OP, f"counts is {list(counts.shape)}, expected [2] (RUN, PROJECT)")
    for what, ws in (("mlp", mlp), ("adapter", adapter)):
        if ws is None:
            continue
        expect(len(ws) == 3, OP, f"{what} must be (w_gate [N, H], w_up [N, H], w_down [H, N])")
        wg, wu, wd = ws
        N = wg.shape[0] if wg.dim() == 2 else -1
        for name, t, want in (("w_gate", wg, (N, H)), ("w_up", wu, (N, H)), ("w_down", wd, (H, N))):
            expect(t.dim() == 2 and tuple(t.shape) == want and t.dtype == h.dtype, OP,
                   f"{what} {name} is {list(t.shape)} {t.dtype}, expected {list(want)} {h.dtype}")
    expect(mlp is not None, OP, "mlp weights are required")
    expect(norm_w.dim() == 1 and norm_w.shape[0] == H and norm_w.dtype == h.dtype, OP,
           f"norm_w is {list(norm_w.shape)} {norm_w.dtype}, expected [H] = [{H}] {h.dtype}")
    if g is not None:
        check_dim(OP, "g", g, 1, "[T]")
        check_dtype(OP, "g", g, FLOATS)
        expect(g.shape[0] == T, OP, f"g has {g.shape[0]} entries but h has T = {T} rows")
    if valid is not None:
        check_dtype(OP, "valid", valid, (torch.bool,))
        expect(valid.shape == (T,), OP, f"valid is {list(valid.shape)}, expected [T] = [{T}]")
    check_devices(OP, out=out, h=h, a=a, run_rows=run_rows, project_rows=project_rows, counts=counts, norm_w=norm_w,
                  w_gate=mlp[0], adapter=None if adapter is None else adapter[0], g=g, valid=valid)


def launch(out, h, a, run_rows, project_rows, counts, mlp, adapter, norm_w, eps: float, g=None, valid=None,
           tuned: bool = True) -> None:
    check(out, h, a, run_rows, project_rows, counts, mlp, adapter, norm_w, g, valid)
    check_launchable(OP, _gate_up_kernel, h.device)
    for name, t in (("out", out), ("h", h), ("a", a), *(((f"mlp[{i}]", w) for i, w in enumerate(mlp))),
                    *(((f"adapter[{i}]", w) for i, w in enumerate(adapter or ())))):
        check_inner_contiguous(OP, name, t)
    for name, t in (("run_rows", run_rows), ("project_rows", project_rows), ("counts", counts), ("norm_w", norm_w),
                    ("g", g), ("valid", valid)):
        if t is not None:
            check_contiguous(OP, name, t)
    T, H = h.shape
    if T == 0 or H == 0:
        return
    wg, wu, wd = mlp
    ag, au, ad = adapter if adapter is not None else mlp  # not read without an adapter
    I, IA = wg.shape[0], (ag.shape[0] if adapter is not None else 1)
    cfg = kernel_configs.lookup(OP, T, h.device, default_config, tuned)
    upcast, precision = dot_flags(h.dtype, _gate_up_kernel)
    act = h.new_empty(T, I)
    aact = h.new_empty(T if adapter is not None else 1, IA)
    c = cfg["gate_up"]
    bk = min(c["BLOCK_K"], max(16, triton.next_power_of_2(H)))
    run_programs = triton.cdiv(T, c["BLOCK_M"]) * triton.cdiv(I, c["BLOCK_N"])
    proj_programs = triton.cdiv(T, c["BLOCK_M"]) * triton.cdiv(IA, c["BLOCK_N"]) if adapter is not None else 0
    _gate_up_kernel[(run_programs + proj_programs,)](
        h, a, norm_w, run_rows, project_rows, counts, wg, wu, ag, au, act, aact, T, I, IA, H, float(eps), h.stride(0),
        a.stride(0), wg.stride(0), wu.stride(0), ag.stride(0), au.stride(0), act.stride(0), aact.stride(0),
        HAS_ADAPTER=adapter is not None, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, GROUP_M=c["GROUP_M"],
        UPCAST=upcast, PRECISION=precision, num_warps=c["num_warps"], num_stages=stages_for(h.dtype, c["num_stages"]))
    c, cp = cfg["down"], cfg["copy"]
    bk = min(c["BLOCK_K"], max(16, triton.next_power_of_2(max(I, IA))))
    tiles = triton.cdiv(T, c["BLOCK_M"]) * triton.cdiv(H, c["BLOCK_N"])
    copies = triton.cdiv(T, cp["BLOCK_M"]) * triton.cdiv(H, cp["BLOCK_N"])
    _down_kernel[(tiles * (2 if adapter is not None else 1) + copies,)](
        act, aact, wd, ad, out, h, a, run_rows, counts, project_rows, h if g is None else g,
        counts if valid is None else valid.view(torch.uint8), T, I, IA, H, act.stride(0), aact.stride(0),
        wd.stride(0), ad.stride(0), out.stride(0), h.stride(0), a.stride(0), HAS_ADAPTER=adapter is not None,
        SOFT=g is not None, HAS_VALID=valid is not None, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=bk,
        GROUP_M=c["GROUP_M"], COPY_M=cp["BLOCK_M"], COPY_N=cp["BLOCK_N"], UPCAST=upcast, PRECISION=precision,
        num_warps=c["num_warps"], num_stages=stages_for(h.dtype, c["num_stages"]))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: f32 statistics, cast back to x's dtype, then the weight."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_op(out, h, a, run_rows, project_rows, counts, mlp, adapter, norm_w, eps: float, g=None, valid=None) -> None:
    """Fixed shapes, no host sync: out = h, then each cohort through grouped_swiglu_'s torch form on
    its normalized rows (h1 = h + a for the RUN rows, h for the PROJECT rows)."""
    check(out, h, a, run_rows, project_rows, counts, mlp, adapter, norm_w, g, valid)
    out.copy_(h)
    h1 = h + a
    GS.torch_op(out, h1, rmsnorm(h1, norm_w, eps), run_rows, counts[0:1], *mlp, g)
    if adapter is not None:
        GS.torch_op(out, h, rmsnorm(h, norm_w, eps), project_rows, counts[1:2], *adapter, None if g is None else 1 - g)
