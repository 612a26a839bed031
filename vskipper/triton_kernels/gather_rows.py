"""gather_rows: y[j] = x[rows[j]] for j < count, zeros after. x [T, H], rows [R], count [1] -> y [R, H].

The count lives on the device: the grid is sized by R, and lanes past the count store zeros
without loading, so the op is capturable in a CUDA graph and costs what the count needs.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels._common import (
    FLOATS, INDEXES, check_count, check_devices, check_dim, check_dtype, check_inner_contiguous,
    check_launchable, check_contiguous, count_scalar, expect, host_count, tl, triton)

# Untuned defaults (no GPU measured yet): a [BLOCK_M, BLOCK_H] tile per program, 16 KB of bf16 at
# 8 x 1024, the size a bandwidth-bound copy needs to keep loads in flight on 4 warps.
BLOCK_M = 8
BLOCK_H = 1024


def default_config(bucket: int) -> dict:
    return {"BLOCK_M": BLOCK_M, "BLOCK_H": BLOCK_H, "num_warps": 4}


@triton.jit
def _gather_rows_kernel(x_ptr, rows_ptr, count_ptr, y_ptr, R, H, stride_x, stride_y,
                        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    # x_ptr: [T, H] (row stride stride_x); rows_ptr: [R] int; count_ptr: [1] int; y_ptr: [R, H]
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    count = tl.load(count_ptr)
    in_m, in_h = offs_m < R, offs_h < H
    live = in_m & (offs_m < count)
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    vals = tl.load(x_ptr + rows[:, None] * stride_x + offs_h[None, :], mask=live[:, None] & in_h[None, :], other=0.0)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_h[None, :], vals, mask=in_m[:, None] & in_h[None, :])


def check(x: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> None:
    check_dim("gather_rows", "x", x, 2, "[T, H]")
    check_dim("gather_rows", "rows", rows, 1, "[R]")
    check_dtype("gather_rows", "x", x, FLOATS)
    check_dtype("gather_rows", "rows", rows, INDEXES)
    check_count("gather_rows", count)
    check_devices("gather_rows", x=x, rows=rows, count=count)


def launch(x: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    check(x, rows, count)
    check_launchable("gather_rows", _gather_rows_kernel, x.device)
    check_inner_contiguous("gather_rows", "x", x)
    check_contiguous("gather_rows", "rows", rows)
    R, H = rows.shape[0], x.shape[1]
    y = torch.empty(R, H, dtype=x.dtype, device=x.device)
    if R == 0 or H == 0:
        return y
    expect(x.shape[0] > 0, "gather_rows", "x has no rows to gather from but rows is not empty")
    cfg = kernel_configs.lookup("gather_rows", R, x.device, default_config)
    bm, bh = cfg["BLOCK_M"], min(cfg["BLOCK_H"], triton.next_power_of_2(H))
    grid = (triton.cdiv(R, bm), triton.cdiv(H, bh))
    _gather_rows_kernel[grid](x, rows, count, y, R, H, x.stride(0), y.stride(0),
                              BLOCK_M=bm, BLOCK_H=bh, num_warps=cfg["num_warps"])
    return y


def reference(x: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Fixed shapes, no host sync: gather every row (past the count at row 0), zero the tail."""
    check(x, rows, count)
    R = rows.shape[0]
    if R == 0 or x.shape[0] == 0:
        return x.new_zeros(R, x.shape[1])
    live = torch.arange(R, device=x.device) < count_scalar(count)  # [R]
    idx = torch.where(live, rows.long(), 0)
    return torch.where(live[:, None], x.index_select(0, idx), x.new_zeros(()))


def reference_dynamic(x: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """CPU path: reads the count on the host and touches only the rows it names."""
    check(x, rows, count)
    n = host_count(count, rows.shape[0])
    y = x.new_zeros(rows.shape[0], x.shape[1])
    y[:n] = x.index_select(0, rows[:n].long())
    return y
