"""scatter_combine_: out[rows[j]] = residual[rows[j]] + w[rows[j]] * y[j] for j < count, in place.

out, residual [T, H]; y [R, H] (compact, row j belongs to rows[j]); rows [R]; count [1];
weight [T] | None (w = 1). Other rows of `out` are untouched; `residual` may be `out` itself.
The sum is taken in f32 and rounded once to out's dtype.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels._common import (
    FLOATS, INDEXES, check_count, check_devices, check_dim, check_dtype, check_inner_contiguous,
    check_launchable, check_contiguous, expect, host_count, tl, triton)

# Untuned defaults (no GPU measured yet); same tile as gather_rows: it moves the same bytes.
BLOCK_M = 8
BLOCK_H = 1024


def default_config(bucket: int) -> dict:
    return {"BLOCK_M": BLOCK_M, "BLOCK_H": BLOCK_H, "num_warps": 4}


@triton.jit
def _scatter_combine_kernel(out_ptr, res_ptr, y_ptr, rows_ptr, count_ptr, w_ptr, R, H,
                            stride_out, stride_res, stride_y,
                            HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    # out_ptr, res_ptr: [T, H]; y_ptr: [R, H]; rows_ptr: [R] int; count_ptr: [1] int; w_ptr: [T]
    pid_m = tl.program_id(0).to(tl.int64)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:  # past the device-side count: nothing to write
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = (offs_m < R) & (offs_m < count)
    mask = live[:, None] & (offs_h < H)[None, :]
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    res = tl.load(res_ptr + rows[:, None] * stride_res + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs_m[:, None] * stride_y + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)
        y = y * w[:, None]
    val = res + y
    tl.store(out_ptr + rows[:, None] * stride_out + offs_h[None, :], val.to(out_ptr.dtype.element_ty), mask=mask)


def check(out, residual, y, rows, count, weight) -> None:
    op = "scatter_combine_"
    for name, t in (("out", out), ("residual", residual), ("y", y)):
        check_dim(op, name, t, 2, "[T, H]" if name != "y" else "[R, H]")
        check_dtype(op, name, t, FLOATS)
    check_dim(op, "rows", rows, 1, "[R]")
    check_dtype(op, "rows", rows, INDEXES)
    check_count(op, count)
    expect(residual.shape == out.shape, op, f"residual has shape {list(residual.shape)} but out has {list(out.shape)}")
    expect(y.shape[0] == rows.shape[0], op, f"y has {y.shape[0]} rows but rows has {rows.shape[0]} entries")
    expect(y.shape[1] == out.shape[1], op, f"y has hidden size {y.shape[1]} but out has {out.shape[1]}")
    expect(residual.dtype == out.dtype == y.dtype, op,
           f"out, residual and y must share a dtype, got {out.dtype}, {residual.dtype}, {y.dtype}")
    if weight is not None:
        check_dim(op, "weight", weight, 1, "[T]")
        check_dtype(op, "weight", weight, FLOATS)
        expect(weight.shape[0] == out.shape[0], op,
               f"weight has {weight.shape[0]} entries but out has {out.shape[0]} rows")
    check_devices(op, out=out, residual=residual, y=y, rows=rows, count=count, weight=weight)


def launch(out, residual, y, rows, count, weight=None) -> None:
    check(out, residual, y, rows, count, weight)
    op = "scatter_combine_"
    check_launchable(op, _scatter_combine_kernel, out.device)
    for name, t in (("out", out), ("residual", residual), ("y", y)):
        check_inner_contiguous(op, name, t)
    check_contiguous(op, "rows", rows)
    if weight is not None:
        check_contiguous(op, "weight", weight)
    R, H = rows.shape[0], out.shape[1]
    if R == 0 or H == 0 or out.shape[0] == 0:
        return
    cfg = kernel_configs.lookup("scatter_combine_", R, out.device, default_config)
    bm, bh = cfg["BLOCK_M"], min(cfg["BLOCK_H"], triton.next_power_of_2(H))
    grid = (triton.cdiv(R, bm), triton.cdiv(H, bh))
    _scatter_combine_kernel[grid](out, residual, y, rows, count, out if weight is None else weight, R, H,
                                  out.stride(0), residual.stride(0), y.stride(0), HAS_WEIGHT=weight is not None,
                                  BLOCK_M=bm, BLOCK_H=bh, num_warps=cfg["num_warps"])


def reference(out, residual, y, rows, count, weight=None) -> None:
    """Fixed shapes, no host sync. Each out row finds the j < count that names it (scatter_reduce
    amax: deterministic, and rows past the count cannot win), then one dense where() writes."""
    check(out, residual, y, rows, count, weight)
    T, R = out.shape[0], rows.shape[0]
    if T == 0 or R == 0:
        return
    j = torch.arange(R, device=out.device)
    live = j < count.reshape(())
    src = torch.full((T,), -1, dtype=torch.int64, device=out.device)
    src.scatter_reduce_(0, torch.where(live, rows.long(), 0), torch.where(live, j, -1), reduce="amax")
    hit = src >= 0  # [T]
    yr = y.index_select(0, src.clamp(min=0))  # [T, H]: y of the j that names each row
    w = yr.new_ones(()) if weight is None else weight.to(out.dtype)[:, None]
    out.copy_(torch.where(hit[:, None], residual + w * yr, out))


def reference_dynamic(out, residual, y, rows, count, weight=None) -> None:
    """CPU path: reads the count on the host and touches only the rows it names."""
    check(out, residual, y, rows, count, weight)
    n = host_count(count, rows.shape[0])
    r = rows[:n].long()
    w = y.new_ones(()) if weight is None else weight.to(out.dtype)[r][:, None]
    out[r] = residual[r] + w * y[:n]
