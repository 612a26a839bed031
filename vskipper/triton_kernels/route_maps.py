"""route_maps: RUN / PROJECT row maps by a stable partition with prefix sums (no atomics, no sync).

T = rows. For each class (RUN = run & valid, PROJECT = ~run & valid) the map is a stable partition
of 0..T-1: the class's rows ascending in [0, count), every other row ascending after them. So the
maps are deterministic, and every entry, past the count too, is a valid row index: a gather past
the count never reads out of bounds. Two launches when T spans several blocks (per-block counts,
then compaction with each block's offset summed from the counts before it); one launch otherwise.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels._common import (
    check_contiguous,
    check_devices,
    check_dim,
    check_dtype,
    check_launchable,
    expect,
    tl,
    triton,
)

# Rows per program: the bucket itself up to 1024, so every decode batch SGLang captures (<= 1024
# rows) is one program and one launch; untuned (no GPU measured yet). 1024 int1 lanes scan in one
# tl.cumsum on 4 warps, the tutorial's size for one-block scans.
MAX_BLOCK = 1024
# Partial counts summed per loop step by each compaction program (T / MAX_BLOCK blocks in all).
PARTIALS_BLOCK = 1024


def default_config(bucket: int) -> dict:
    block = max(16, min(bucket, MAX_BLOCK))
    return {"BLOCK": block, "num_warps": 4 if block >= 512 else 1 if block <= 64 else 2}


@triton.jit
def _classes(run_ptr, valid_ptr, offs, T, HAS_VALID: tl.constexpr):
    # -> (is_run, is_project) as [BLOCK] int32 0/1; rows past T are in neither class
    inb = offs < T
    run = tl.load(run_ptr + offs, mask=inb, other=0)
    if HAS_VALID:
        valid = (tl.load(valid_ptr + offs, mask=inb, other=0) != 0) & inb
    else:
        valid = inb
    return ((run != 0) & valid).to(tl.int32), ((run == 0) & valid).to(tl.int32)


@triton.jit
def _block_counts_kernel(run_ptr, valid_ptr, partial_ptr, T, BLOCK: tl.constexpr, HAS_VALID: tl.constexpr):
    # run_ptr, valid_ptr: [T] uint8; partial_ptr: [num_blocks, 2] int32 (RUN, PROJECT rows per block)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    is_run, is_proj = _classes(run_ptr, valid_ptr, offs, T, HAS_VALID)
    tl.store(partial_ptr + pid * 2, tl.sum(is_run, axis=0))
    tl.store(partial_ptr + pid * 2 + 1, tl.sum(is_proj, axis=0))


@triton.jit
def _compact_kernel(run_ptr, valid_ptr, partial_ptr, run_rows_ptr, proj_rows_ptr, counts_ptr, T, num_blocks,
                    BLOCK: tl.constexpr, PARTIALS: tl.constexpr, HAS_VALID: tl.constexpr, MULTI: tl.constexpr):
    # run_ptr, valid_ptr: [T] uint8; partial_ptr: [num_blocks, 2] int32 (if MULTI);
    # run_rows_ptr, proj_rows_ptr: [T] int32; counts_ptr: [2] int32
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    is_run, is_proj = _classes(run_ptr, valid_ptr, offs, T, HAS_VALID)
    if MULTI:  # this block's offset = members of the blocks before it; totals over all blocks
        run_before = tl.sum(is_run * 0, axis=0)  # an int32 zero scalar (loop-carried: must be a tensor)
        proj_before = run_before
        run_total = run_before
        proj_total = run_before
        for start in range(0, num_blocks, PARTIALS):
            b = start + tl.arange(0, PARTIALS)
            mb = b < num_blocks
            pr = tl.load(partial_ptr + b.to(tl.int64) * 2, mask=mb, other=0)
            pp = tl.load(partial_ptr + b.to(tl.int64) * 2 + 1, mask=mb, other=0)
            run_before += tl.sum(tl.where(b < pid, pr, 0), axis=0)
            proj_before += tl.sum(tl.where(b < pid, pp, 0), axis=0)
            run_total += tl.sum(pr, axis=0)
            proj_total += tl.sum(pp, axis=0)
    else:
        run_before = tl.sum(is_run * 0, axis=0)
        proj_before = run_before
        run_total = tl.sum(is_run, axis=0)
        proj_total = tl.sum(is_proj, axis=0)
    # members before each row (exclusive prefix); a non-member at row i goes to total + (i - that)
    run_excl = (run_before + tl.cumsum(is_run, axis=0) - is_run).to(tl.int64)
    proj_excl = (proj_before + tl.cumsum(is_proj, axis=0) - is_proj).to(tl.int64)
    run_pos = tl.where(is_run != 0, run_excl, run_total + offs - run_excl)
    proj_pos = tl.where(is_proj != 0, proj_excl, proj_total + offs - proj_excl)
    tl.store(run_rows_ptr + run_pos, offs.to(tl.int32), mask=inb)
    tl.store(proj_rows_ptr + proj_pos, offs.to(tl.int32), mask=inb)
    if pid == 0:
        tl.store(counts_ptr, run_total)
        tl.store(counts_ptr + 1, proj_total)


def check(run_mask: torch.Tensor, valid: torch.Tensor | None) -> None:
    check_dim("route_maps", "run_mask", run_mask, 1, "[T]")
    check_dtype("route_maps", "run_mask", run_mask, (torch.bool,))
    if valid is not None:
        check_dtype("route_maps", "valid", valid, (torch.bool,))
        expect(valid.shape == run_mask.shape, "route_maps",
               f"valid has shape {list(valid.shape)} but run_mask has {list(run_mask.shape)}")
    check_devices("route_maps", run_mask=run_mask, valid=valid)
    expect(run_mask.shape[0] < 2**31, "route_maps", f"T = {run_mask.shape[0]} rows do not fit int32 maps")


def launch(run_mask: torch.Tensor, valid: torch.Tensor | None = None, tuned: bool = True):
    """run_mask [T] bool, valid [T] bool | None -> (run_rows [T] int32, project_rows [T] int32, counts [2] int32)."""
    check(run_mask, valid)
    check_launchable("route_maps", _compact_kernel, run_mask.device)
    check_contiguous("route_maps", "run_mask", run_mask)
    if valid is not None:
        check_contiguous("route_maps", "valid", valid)
    T = run_mask.shape[0]
    new = dict(dtype=torch.int32, device=run_mask.device)
    run_rows, project_rows = torch.empty(T, **new), torch.empty(T, **new)
    if T == 0:
        return run_rows, project_rows, torch.zeros(2, **new)
    counts = torch.empty(2, **new)
    cfg = kernel_configs.lookup("route_maps", T, run_mask.device, default_config, tuned)
    block, warps = cfg["BLOCK"], cfg["num_warps"]
    num_blocks = triton.cdiv(T, block)
    run_u8 = run_mask.view(torch.uint8)
    valid_u8 = run_u8 if valid is None else valid.view(torch.uint8)  # not read when HAS_VALID is False
    multi = num_blocks > 1
    partial = torch.empty(num_blocks if multi else 1, 2, **new)
    if multi:
        _block_counts_kernel[(num_blocks,)](run_u8, valid_u8, partial, T, BLOCK=block,
                                            HAS_VALID=valid is not None, num_warps=warps)
    _compact_kernel[(num_blocks,)](run_u8, valid_u8, partial, run_rows, project_rows, counts, T, num_blocks,
                                   BLOCK=block, PARTIALS=PARTIALS_BLOCK, HAS_VALID=valid is not None,
                                   MULTI=multi, num_warps=warps)
    return run_rows, project_rows, counts


def torch_op(run_mask: torch.Tensor, valid: torch.Tensor | None = None):
    """The same maps in plain torch: fixed shapes, no host sync, deterministic (a stable sort puts
    each map's members first, both in ascending order)."""
    check(run_mask, valid)
    run = run_mask if valid is None else run_mask & valid
    proj = ~run_mask if valid is None else ~run_mask & valid
    counts = torch.stack([run, proj]).sum(1, dtype=torch.int32)
    return (torch.argsort(~run, stable=True).to(torch.int32), torch.argsort(~proj, stable=True).to(torch.int32),
            counts)
