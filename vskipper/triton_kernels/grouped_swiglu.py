"""grouped_swiglu_: the fused SwiGLU body of the routed MLP and of the FlexiDepth adapter, in place.

For j < count, r = rows[j]:
    out[r] = residual[r] + w[r] * (silu(x[r] @ w_gate.T) * (x[r] @ w_up.T)) @ w_down.T     (w = 1 if None)
x, out, residual [T, H]; rows [R]; count [1]; w_gate, w_up [I, H]; w_down [H, I]; weight [T] | None.
(FlexiDepth's adapter up_proj(silu(gate_proj(y)) * down_proj(y)) is w_gate=gate_proj,
w_up=down_proj, w_down=up_proj.) Two kernels: gate/up GEMM with the gather in the A load and
silu * mul in the epilogue, into a compact [R, I] buffer; then the down GEMM with the weighted
scatter-combine epilogue. Tiles past the device-side count exit at once; other rows of `out` are
untouched. `residual` may be `out` itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vskipper import kernel_configs
from vskipper.triton_kernels._common import (
    FLOATS,
    INDEXES,
    check_contiguous,
    check_count,
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


def default_config(bucket: int) -> dict:
    """Untuned defaults (no GPU measured yet): the row tile follows the token bucket (16..128, the
    count-adaptive part); the gate/up kernel holds two accumulators, so its N tile is half as wide
    at large row tiles."""
    bm = min(max(bucket, 16), 128)
    small = bm <= 32
    return {
        "gate_up": {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128 if small else 64, "GROUP_M": 8,
                    "num_warps": 4 if bm < 128 else 8, "num_stages": 4 if bm < 128 else 3},
        "down": {"BLOCK_M": bm, "BLOCK_N": 64 if small else 128, "BLOCK_K": 128 if small else 64, "GROUP_M": 8,
                 "num_warps": 4 if bm < 128 else 8, "num_stages": 4 if bm < 128 else 3},
    }


@triton.jit
def _gate_up_kernel(x_ptr, rows_ptr, count_ptr, wg_ptr, wu_ptr, h_ptr, R, I, H, stride_x, stride_wg, stride_wu,
                    stride_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # x_ptr: [T, H]; rows_ptr: [R] int; count_ptr: [1] int; wg_ptr, wu_ptr: [I, H]; h_ptr: [R, I] (compact)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    count = tl.load(count_ptr)
    if pid_m.to(tl.int64) * BLOCK_M >= count:  # the down kernel never reads these rows of h
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (offs_m < R) & (offs_m < count)
    in_n = offs_n < I
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K], gathered rows
    g_ptrs = wg_ptr + offs_n[None, :] * stride_wg + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = wu_ptr + offs_n[None, :] * stride_wu + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=in_n[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=in_n[None, :], other=0.0)
        else:
            in_k = (k0 + offs_k) < H
            a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up, in f32
    tl.store(h_ptr + offs_m[:, None] * stride_h + offs_n[None, :], act.to(h_ptr.dtype.element_ty),
             mask=live[:, None] & in_n[None, :])


@triton.jit
def _down_combine_kernel(h_ptr, wd_ptr, out_ptr, res_ptr, rows_ptr, count_ptr, w_ptr, R, H, I,
                         stride_h, stride_wd, stride_out, stride_res,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr):
    # h_ptr: [R, I] (compact); wd_ptr: [H, I]; out_ptr, res_ptr: [T, H]; rows_ptr: [R] int;
    # count_ptr: [1] int; w_ptr: [T]
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    count = tl.load(count_ptr)
    if pid_m.to(tl.int64) * BLOCK_M >= count:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (offs_m < R) & (offs_m < count)
    in_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None] * stride_h + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = wd_ptr + offs_n[None, :] * stride_wd + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=in_n[None, :], other=0.0)
        else:
            in_k = (k0 + offs_k) < I
            a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # epilogue: weighted scatter-combine into the rows the compact rows came from
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & in_n[None, :]
    res = tl.load(res_ptr + rows[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        acc = acc * tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], (res + acc).to(out_ptr.dtype.element_ty),
             mask=mask)


@eager_only
def check(out, residual, x, rows, count, w_gate, w_up, w_down, weight) -> None:
    op = "grouped_swiglu_"
    for name, t, legend in (("out", out, "[T, H]"), ("residual", residual, "[T, H]"), ("x", x, "[T, H]"),
                            ("w_gate", w_gate, "[I, H]"), ("w_up", w_up, "[I, H]"), ("w_down", w_down, "[H, I]")):
        check_dim(op, name, t, 2, legend)
        check_dtype(op, name, t, FLOATS)
        expect(t.dtype == x.dtype, op, f"{name} has dtype {t.dtype} but x has {x.dtype}")
    check_dim(op, "rows", rows, 1, "[R]")
    check_dtype(op, "rows", rows, INDEXES)
    check_count(op, count)
    T, H = x.shape
    I = w_gate.shape[0]
    expect(out.shape == x.shape and residual.shape == x.shape, op,
           f"out {list(out.shape)}, residual {list(residual.shape)} and x {list(x.shape)} must have one shape [T, H]")
    expect(w_gate.shape == (I, H) and w_up.shape == (I, H), op,
           f"w_gate {list(w_gate.shape)} and w_up {list(w_up.shape)} must be [I, H] with H = {H}")
    expect(w_down.shape == (H, I), op, f"w_down is {list(w_down.shape)}, expected [H, I] = {[H, I]}")
    if weight is not None:
        check_dim(op, "weight", weight, 1, "[T]")
        check_dtype(op, "weight", weight, FLOATS)
        expect(weight.shape[0] == T, op, f"weight has {weight.shape[0]} entries but x has {T} rows")
    check_devices(op, out=out, residual=residual, x=x, rows=rows, count=count, w_gate=w_gate, w_up=w_up,
                  w_down=w_down, weight=weight)


def launch(out, residual, x, rows, count, w_gate, w_up, w_down, weight=None, tuned: bool = True) -> None:
    check(out, residual, x, rows, count, w_gate, w_up, w_down, weight)
    op = "grouped_swiglu_"
    check_launchable(op, _gate_up_kernel, x.device)
    for name, t in (("out", out), ("residual", residual), ("x", x), ("w_gate", w_gate), ("w_up", w_up),
                    ("w_down", w_down)):
        check_inner_contiguous(op, name, t)
    check_contiguous(op, "rows", rows)
    if weight is not None:
        check_contiguous(op, "weight", weight)
    R, (T, H), I = rows.shape[0], x.shape, w_gate.shape[0]
    if R == 0 or T == 0 or H == 0:
        return
    if I == 0:  # an empty MLP adds zero: the rows named become their residual, as in torch_op
        return torch_op(out, residual, x, rows, count, w_gate, w_up, w_down, weight)
    cfg = kernel_configs.lookup(op, R, x.device, default_config, tuned)
    upcast, precision = dot_flags(x.dtype, _gate_up_kernel)
    h = x.new_empty(R, I)  # silu(gate) * up of the compact rows; rows past the count stay unwritten
    c = cfg["gate_up"]
    bk = min(c["BLOCK_K"], max(16, triton.next_power_of_2(H)))
    grid = (triton.cdiv(R, c["BLOCK_M"]) * triton.cdiv(I, c["BLOCK_N"]),)
    _gate_up_kernel[grid](x, rows, count, w_gate, w_up, h, R, I, H, x.stride(0), w_gate.stride(0), w_up.stride(0),
                          h.stride(0), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, GROUP_M=c["GROUP_M"],
                          EVEN_K=H % bk == 0, UPCAST=upcast, PRECISION=precision, num_warps=c["num_warps"],
                          num_stages=stages_for(x.dtype, c["num_stages"]))
    c = cfg["down"]
    bk = min(c["BLOCK_K"], max(16, triton.next_power_of_2(I)))
    grid = (triton.cdiv(R, c["BLOCK_M"]) * triton.cdiv(H, c["BLOCK_N"]),)
    _down_combine_kernel[grid](h, w_down, out, residual, rows, count, out if weight is None else weight, R, H, I,
                               h.stride(0), w_down.stride(0), out.stride(0), residual.stride(0),
                               BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, GROUP_M=c["GROUP_M"],
                               EVEN_K=I % bk == 0, UPCAST=upcast, PRECISION=precision, HAS_WEIGHT=weight is not None,
                               num_warps=c["num_warps"], num_stages=stages_for(x.dtype, c["num_stages"]))


def _swiglu(x, w_gate, w_up, w_down):
    """The model's own arithmetic (HF LlamaMLP): each op in the input dtype."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def torch_op(out, residual, x, rows, count, w_gate, w_up, w_down, weight=None) -> None:
    """Fixed shapes, no host sync: every entry of the map through the MLP (entries past the count
    read row 0 and are discarded), then each out row finds the j < count that names it
    (scatter_reduce amax: deterministic, entries past the count cannot win) and one dense where()
    writes."""
    check(out, residual, x, rows, count, w_gate, w_up, w_down, weight)
    T, R = x.shape[0], rows.shape[0]
    if T == 0 or R == 0:
        return
    j = torch.arange(R, device=x.device)
    live = j < count.reshape(())  # [R]
    idx = torch.where(live, rows.long(), 0)
    y = _swiglu(x.index_select(0, idx), w_gate, w_up, w_down)  # [R, H]
    src = torch.full((T,), -1, dtype=torch.int64, device=x.device)
    src.scatter_reduce_(0, idx, torch.where(live, j, -1), reduce="amax")
    hit = src >= 0  # [T]
    yr = y.index_select(0, src.clamp(min=0))  # [T, H]: y of the entry that names each row
    w = yr.new_ones(()) if weight is None else weight.to(out.dtype)[:, None]
    out.copy_(torch.where(hit[:, None], residual + w * yr, out))
