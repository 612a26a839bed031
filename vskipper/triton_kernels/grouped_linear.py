"""grouped_linear: y[j] = x[rows[j]] @ weight.T for j < count, zeros after.

x [T, K], rows [R], count [1], weight [N, K] -> y [R, N]. Count-adaptive: the gather is fused into
the A load, the grid is sized by R, and row tiles past the device-side count store zeros and exit
without touching x or the weight. Accumulates in f32.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels import gather_rows
from vskipper.triton_kernels._common import (
    FLOATS, INDEXES, check_count, check_devices, check_dim, check_dtype, check_inner_contiguous,
    check_launchable, check_contiguous, dot_flags, expect, grouped_tile, stages_for, tl, triton)


def default_config(bucket: int) -> dict:
    """Untuned defaults (no GPU measured yet), after the Triton matmul tutorial's configs: the row
    tile follows the token bucket (16 rows at decode, where the weight read dominates), wide N and K
    tiles to stream the weight; bf16 tiles of 128 x 64 x 64 fit 4 stages in sm90's shared memory."""
    bm = min(max(bucket, 16), 128)
    if bm <= 32:
        return {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8 if bm >= 128 else 4,
            "num_stages": 3 if bm >= 128 else 4}


@triton.jit
def _grouped_linear_kernel(x_ptr, rows_ptr, count_ptr, w_ptr, y_ptr, R, N, K, stride_x, stride_w, stride_y,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                           PRECISION: tl.constexpr):
    # x_ptr: [T, K] (row stride stride_x); rows_ptr: [R] int; count_ptr: [1] int;
    # w_ptr: [N, K] (row stride stride_w); y_ptr: [R, N] (row stride stride_y)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
    y_mask = (offs_m < R)[:, None] & (offs_n < N)[None, :]
    count = tl.load(count_ptr)
    if pid_m.to(tl.int64) * BLOCK_M >= count:  # a tile past the count: zeros, no loads, no math
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=y_mask)
        return
    live = (offs_m < R) & (offs_m < count)
    rows = tl.load(rows_ptr + offs_m, mask=live, other=0).to(tl.int64)
    in_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K], gathered rows
    b_ptrs = w_ptr + offs_n[None, :] * stride_w + offs_k[:, None]  # [BLOCK_K, BLOCK_N] = weight.T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=in_n[None, :], other=0.0)
        else:
            in_k = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def check(x, rows, count, weight) -> None:
    op = "grouped_linear"
    check_dim(op, "x", x, 2, "[T, K]")
    check_dim(op, "rows", rows, 1, "[R]")
    check_dim(op, "weight", weight, 2, "[N, K]")
    check_dtype(op, "x", x, FLOATS)
    check_dtype(op, "rows", rows, INDEXES)
    check_count(op, count)
    expect(weight.dtype == x.dtype, op, f"weight has dtype {weight.dtype} but x has {x.dtype}")
    expect(weight.shape[1] == x.shape[1], op, f"weight is {list(weight.shape)} ([N, K]) but x has K = {x.shape[1]}")
    check_devices(op, x=x, rows=rows, count=count, weight=weight)


def launch(x, rows, count, weight) -> torch.Tensor:
    check(x, rows, count, weight)
    op = "grouped_linear"
    check_launchable(op, _grouped_linear_kernel, x.device)
    check_inner_contiguous(op, "x", x)
    check_inner_contiguous(op, "weight", weight)
    check_contiguous(op, "rows", rows)
    R, (N, K) = rows.shape[0], weight.shape
    if R == 0 or N == 0:
        return x.new_empty(R, N)
    if K == 0 or x.shape[0] == 0:
        return x.new_zeros(R, N)
    y = x.new_empty(R, N)
    cfg = kernel_configs.lookup(op, R, x.device, default_config)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(K)))
    upcast, precision = dot_flags(x.dtype, _grouped_linear_kernel)
    grid = (triton.cdiv(R, bm) * triton.cdiv(N, bn),)
    _grouped_linear_kernel[grid](x, rows, count, weight, y, R, N, K, x.stride(0), weight.stride(0), y.stride(0),
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], EVEN_K=K % bk == 0,
                                 UPCAST=upcast, PRECISION=precision, num_warps=cfg["num_warps"],
                                 num_stages=stages_for(x.dtype, cfg["num_stages"]))
    return y


def reference(x, rows, count, weight) -> torch.Tensor:
    """Fixed shapes, no host sync: every row multiplied, rows past the count gathered as zeros."""
    check(x, rows, count, weight)
    return gather_rows.reference(x, rows, count) @ weight.T


def reference_dynamic(x, rows, count, weight) -> torch.Tensor:
    """CPU path: only the rows below the count are multiplied."""
    check(x, rows, count, weight)
    n = int(count.reshape(()).clamp(0, rows.shape[0]))
    y = x.new_zeros(rows.shape[0], weight.shape[0])
    y[:n] = x.index_select(0, rows[:n].long()) @ weight.T
    return y
