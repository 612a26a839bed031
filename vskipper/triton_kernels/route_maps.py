"""route_maps and route: RUN / PROJECT row maps by a stable partition with prefix sums (no atomics, no sync).

T = rows. For each class (RUN = run & valid, PROJECT = ~run & valid) the map is a stable partition
of 0..T-1: the class's rows ascending in [0, count), every other row ascending after them. So the
maps are deterministic, and every entry, past the count too, is a valid row index: a gather past
the count never reads out of bounds. Two launches when T spans several blocks (per-block counts,
then compaction with each block's offset summed from the counts before it); one launch otherwise.

`route` makes the decisions in the same launch and counts them: from the router's output as it is
(bool decisions), a gate sanitized and thresholded (the arithmetic of skippers/base.py:
sanitize_gate, restated), or RandomSkip's hash of position and token id (skippers/random_skip.py,
restated with its constants handed in); and it adds the layer's route counts (real rows, RUN rows,
non-finite gates) into the counter's row of the current phase (vskipper/counters.py: RouteCounter,
restated), so that router output to routed layer is one launch for T <= MAX_BLOCK. Each restatement
is tested bit for bit against the function it restates.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels._common import (
    FLOATS,
    INDEXES,
    check_contiguous,
    check_devices,
    check_dim,
    check_dtype,
    check_launchable,
    eager_only,
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
# How `route` reads the router's output (the MODE of the kernels; route_maps is DECISIONS without a counter).
DECISIONS, GATE, HASH = 0, 1, 2
MODES = {"decisions": DECISIONS, "gate": GATE, "hash": HASH}


def default_config(bucket: int) -> dict:
    block = max(16, min(bucket, MAX_BLOCK))
    return {"BLOCK": block, "num_warps": 4 if block >= 512 else 1 if block <= 64 else 2}


@triton.jit
def _classes(in_ptr, tok_ptr, valid_ptr, offs, T, threshold, hash_key, hash_cut, mul_pos, mul_tok, mix1,
             mix2, m32, MODE: tl.constexpr, HAS_VALID: tl.constexpr):
    # -> (is_run, is_project, is_nonfinite) as [BLOCK] int32 0/1 (rows past T in none), and the
    # sanitized gate [BLOCK] f32 (MODE GATE; zeros otherwise)
    inb = offs < T
    if HAS_VALID:
        valid = (tl.load(valid_ptr + offs, mask=inb, other=0) != 0) & inb
    else:
        valid = inb
    gate = offs.to(tl.float32) * 0.0
    bad = offs < 0
    if MODE == 0:  # decisions as the router gave them
        run = tl.load(in_ptr + offs, mask=inb, other=0) != 0
    elif MODE == 1:  # sanitize_gate: a non-finite gate RUNs with g = 1; RUN where g > threshold
        g = tl.load(in_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        finite = (g == g) & (tl.abs(g) < float("inf"))
        gate = tl.where(finite, g, 1.0)
        run = gate > threshold
        bad = ~finite & valid
    else:  # RandomSkip (in_ptr: the positions): lowbias32 of (A * position + B * token id + key) mod 2**32,
        x = tl.load(in_ptr + offs, mask=inb, other=0).to(tl.int64) * mul_pos  # RUN where >= cut
        x = (x + tl.load(tok_ptr + offs, mask=inb, other=0).to(tl.int64) * mul_tok + hash_key) & m32
        x = x ^ (x >> 16)
        x = (x * mix1) & m32
        x = x ^ (x >> 15)
        x = (x * mix2) & m32
        x = x ^ (x >> 16)
        run = x >= hash_cut
    return (run & valid).to(tl.int32), (~run & valid).to(tl.int32), bad.to(tl.int32), gate, run


@triton.jit
def _block_counts_kernel(in_ptr, tok_ptr, valid_ptr, partial_ptr, T, threshold, hash_key, hash_cut, mul_pos,
                         mul_tok, mix1, mix2, m32, BLOCK: tl.constexpr, MODE: tl.constexpr, HAS_VALID: tl.constexpr):
    # in_ptr: [T] uint8 decisions, float gates or int positions (MODE HASH); tok_ptr: [T] int (MODE HASH);
    # valid_ptr: [T] uint8;
    # partial_ptr: [num_blocks, 3] int32 (RUN, PROJECT, non-finite rows per block)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    is_run, is_proj, is_bad, _, _ = _classes(in_ptr, tok_ptr, valid_ptr, offs, T, threshold, hash_key,
                                             hash_cut, mul_pos, mul_tok, mix1, mix2, m32, MODE, HAS_VALID)
    tl.store(partial_ptr + pid * 3, tl.sum(is_run, axis=0))
    tl.store(partial_ptr + pid * 3 + 1, tl.sum(is_proj, axis=0))
    tl.store(partial_ptr + pid * 3 + 2, tl.sum(is_bad, axis=0))


@triton.jit
def _compact_kernel(in_ptr, tok_ptr, valid_ptr, partial_ptr, run_rows_ptr, proj_rows_ptr, counts_ptr,
                    gate_ptr, run_ptr, counter_ptr, phase_ptr, T, num_blocks, threshold, hash_key, hash_cut, mul_pos,
                    mul_tok, mix1, mix2, m32, BLOCK: tl.constexpr, PARTIALS: tl.constexpr, MODE: tl.constexpr,
                    HAS_VALID: tl.constexpr, MULTI: tl.constexpr, OUTPUTS: tl.constexpr, COUNT: tl.constexpr):
    # in_ptr, tok_ptr, valid_ptr: as _block_counts_kernel; partial_ptr: [num_blocks, 3] int32 (if MULTI);
    # run_rows_ptr, proj_rows_ptr: [T] int32; counts_ptr: [2] int32; gate_ptr: [T] (MODE GATE, if OUTPUTS);
    # run_ptr: [T] uint8 (if OUTPUTS); counter_ptr: [2, 3] int64 (phase, (tokens, run, non-finite)) and
    # phase_ptr: [2] int64 one-hot (if COUNT)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    is_run, is_proj, is_bad, gate, run = _classes(in_ptr, tok_ptr, valid_ptr, offs, T, threshold, hash_key,
                                                  hash_cut, mul_pos, mul_tok, mix1, mix2, m32, MODE, HAS_VALID)
    if OUTPUTS:
        tl.store(run_ptr + offs, run.to(tl.uint8), mask=inb)
        if MODE == 1:
            tl.store(gate_ptr + offs, gate.to(gate_ptr.dtype.element_ty), mask=inb)
    if MULTI:  # this block's offset = members of the blocks before it; totals over all blocks
        run_before = tl.sum(is_run * 0, axis=0)  # an int32 zero scalar (loop-carried: must be a tensor)
        proj_before = run_before
        run_total = run_before
        proj_total = run_before
        bad_total = run_before
        for start in range(0, num_blocks, PARTIALS):
            b = start + tl.arange(0, PARTIALS)
            mb = b < num_blocks
            pr = tl.load(partial_ptr + b.to(tl.int64) * 3, mask=mb, other=0)
            pp = tl.load(partial_ptr + b.to(tl.int64) * 3 + 1, mask=mb, other=0)
            run_before += tl.sum(tl.where(b < pid, pr, 0), axis=0)
            proj_before += tl.sum(tl.where(b < pid, pp, 0), axis=0)
            run_total += tl.sum(pr, axis=0)
            proj_total += tl.sum(pp, axis=0)
            bad_total += tl.sum(tl.load(partial_ptr + b.to(tl.int64) * 3 + 2, mask=mb, other=0), axis=0)
    else:
        run_before = tl.sum(is_run * 0, axis=0)
        proj_before = run_before
        run_total = tl.sum(is_run, axis=0)
        proj_total = tl.sum(is_proj, axis=0)
        bad_total = tl.sum(is_bad, axis=0)
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
        if COUNT:  # the route counter's row of this phase: += (tokens, run, non-finite)
            for p in range(2):
                on = tl.load(phase_ptr + p)
                tl.store(counter_ptr + p * 3, tl.load(counter_ptr + p * 3) + on * (run_total + proj_total))
                tl.store(counter_ptr + p * 3 + 1, tl.load(counter_ptr + p * 3 + 1) + on * run_total)
                tl.store(counter_ptr + p * 3 + 2, tl.load(counter_ptr + p * 3 + 2) + on * bad_total)


@eager_only
def check(run_mask: torch.Tensor, valid: torch.Tensor | None) -> None:
    check_dim("route_maps", "run_mask", run_mask, 1, "[T]")
    check_dtype("route_maps", "run_mask", run_mask, (torch.bool,))
    _check_valid("route_maps", run_mask, valid)


def _check_valid(op: str, x: torch.Tensor, valid: torch.Tensor | None) -> None:
    if valid is not None:
        check_dtype(op, "valid", valid, (torch.bool,))
        expect(valid.shape == x.shape, op, f"valid has shape {list(valid.shape)} but the rows are {list(x.shape)}")
    check_devices(op, rows=x, valid=valid)
    expect(x.shape[0] < 2**31, op, f"T = {x.shape[0]} rows do not fit int32 maps")


@eager_only
def check_route(x, token_ids, valid, counter, phase, mode: int, hash_params) -> None:
    """x [T]: the router's decisions (bool, mode DECISIONS) or gates (float, GATE), or the positions (int,
    HASH: RandomSkip's hash of x and token_ids with hash_params (key, cut, A, B, C1, C2, M32))."""
    op = "route"
    check_dim(op, "x", x, 1, "[T]")
    expect(mode in MODES.values(), op, f"mode {mode!r} is not one of {MODES}")
    if mode == DECISIONS:
        check_dtype(op, "x (decisions)", x, (torch.bool,))
    elif mode == GATE:
        check_dtype(op, "x (gates)", x, FLOATS)
    else:
        check_dtype(op, "x (positions)", x, INDEXES)
        expect(token_ids is not None, op, "mode 'hash' needs token_ids")
        check_dtype(op, "token_ids", token_ids, INDEXES)
        expect(token_ids.shape == x.shape, op, f"token_ids has shape {list(token_ids.shape)} but x is {list(x.shape)}")
        expect(len(hash_params) == 7, op, f"hash_params must be (key, cut, A, B, C1, C2, M32), got {hash_params!r}")
    _check_valid(op, x, valid)
    check_dtype(op, "counter", counter, (torch.int64,))
    expect(counter.shape == (2, 3), op, f"counter is {list(counter.shape)}, expected [2, 3] (phase, count)")
    check_dtype(op, "phase", phase, (torch.int64,))
    expect(phase.shape == (2,), op, f"phase is {list(phase.shape)}, expected [2] (a one-hot)")
    check_devices(op, x=x, counter=counter, phase=phase, token_ids=token_ids)


def _launch(x, token_ids, valid, counter, phase, mode: int, threshold: float, hash_params, tuned: bool,
            outputs: bool):
    T = x.shape[0]
    new = dict(dtype=torch.int32, device=x.device)
    run_rows, project_rows = torch.empty(T, **new), torch.empty(T, **new)
    gate = torch.empty(T if outputs and mode == GATE else 0, dtype=x.dtype, device=x.device)
    run = torch.empty(T if outputs else 0, dtype=torch.bool, device=x.device)
    if T == 0:
        return run_rows, project_rows, torch.zeros(2, **new), gate, run
    counts = torch.empty(2, **new)
    cfg = kernel_configs.lookup("route_maps", T, x.device, default_config, tuned)
    block, warps = cfg["BLOCK"], cfg["num_warps"]
    num_blocks = triton.cdiv(T, block)
    src = x.view(torch.uint8) if x.dtype == torch.bool else x
    valid_u8 = src if valid is None else valid.view(torch.uint8)  # not read when HAS_VALID is False
    tok = token_ids if token_ids is not None else src  # not read outside MODE HASH
    key, cut, mul_pos, mul_tok, mix1, mix2, m32 = hash_params if mode == HASH else (0, 0, 1, 1, 1, 1, 1)
    scalars = (float(threshold), key, cut, mul_pos, mul_tok, mix1, mix2, m32)
    multi = num_blocks > 1
    partial = torch.empty(num_blocks if multi else 1, 3, **new)
    if multi:
        _block_counts_kernel[(num_blocks,)](src, tok, valid_u8, partial, T, *scalars, BLOCK=block, MODE=mode,
                                            HAS_VALID=valid is not None, num_warps=warps)
    count = counter is not None
    _compact_kernel[(num_blocks,)](src, tok, valid_u8, partial, run_rows, project_rows, counts,
                                   gate if mode == GATE and outputs else counts, run.view(torch.uint8) if outputs
                                   else counts, counter if count else counts, phase if count else counts, T,
                                   num_blocks, *scalars, BLOCK=block, PARTIALS=PARTIALS_BLOCK, MODE=mode,
                                   HAS_VALID=valid is not None, MULTI=multi, OUTPUTS=outputs, COUNT=count,
                                   num_warps=warps)
    return run_rows, project_rows, counts, gate, run


def launch(run_mask: torch.Tensor, valid: torch.Tensor | None = None, tuned: bool = True):
    """run_mask [T] bool, valid [T] bool | None -> (run_rows [T] int32, project_rows [T] int32, counts [2] int32)."""
    check(run_mask, valid)
    check_launchable("route_maps", _compact_kernel, run_mask.device)
    check_contiguous("route_maps", "run_mask", run_mask)
    if valid is not None:
        check_contiguous("route_maps", "valid", valid)
    return _launch(run_mask, None, valid, None, None, DECISIONS, 0.0, (), tuned, outputs=False)[:3]


def launch_route(x, token_ids, valid, counter, phase, mode: int, threshold: float, hash_params, tuned: bool = True):
    """-> (gate [T] (MODE GATE; else empty), run [T] bool, run_rows [T] int32, project_rows [T] int32,
    counts [2] int32); counter [2, 3] int64 gains this step's counts in the row `phase` [2] selects."""
    check_route(x, token_ids, valid, counter, phase, mode, hash_params)
    check_launchable("route", _compact_kernel, x.device)
    for name, t in (("x", x), ("valid", valid), ("token_ids", token_ids),
                    ("counter", counter), ("phase", phase)):
        if t is not None:
            check_contiguous("route", name, t)
    if mode == GATE:  # torch compares a tensor with a Python float in the tensor's dtype: so must the kernel
        threshold = float(torch.tensor(threshold, dtype=x.dtype))
    run_rows, project_rows, counts, gate, run = _launch(x, token_ids, valid, counter, phase, mode,
                                                        threshold, hash_params, tuned, outputs=True)
    return gate, run, run_rows, project_rows, counts


def torch_op(run_mask: torch.Tensor, valid: torch.Tensor | None = None):
    """The same maps in plain torch: fixed shapes, no host sync, deterministic (a stable sort puts
    each map's members first, both in ascending order)."""
    check(run_mask, valid)
    run = run_mask if valid is None else run_mask & valid
    proj = ~run_mask if valid is None else ~run_mask & valid
    counts = torch.stack([run, proj]).sum(1, dtype=torch.int32)
    return (torch.argsort(~run, stable=True).to(torch.int32), torch.argsort(~proj, stable=True).to(torch.int32),
            counts)


def torch_op_route(x, token_ids, valid, counter, phase, mode: int, threshold: float, hash_params):
    """`route` in plain torch (fixed shapes, no host sync): the decisions as sanitize_gate or RandomSkip
    make them, torch_op's maps, the counts added as RouteCounter adds them."""
    check_route(x, token_ids, valid, counter, phase, mode, hash_params)
    bad = None
    if mode == DECISIONS:
        gate, run = x.new_empty(0), x
    elif mode == GATE:
        finite = torch.isfinite(x)
        gate = torch.where(finite, x, 1.0)
        run, bad = gate > threshold, ~finite
    else:
        key, cut, mul_pos, mul_tok, mix1, mix2, m32 = hash_params
        h = torch.add(x.long() * mul_pos, token_ids.long(), alpha=mul_tok).add_(key).bitwise_and_(m32)
        for shift, mul in ((16, mix1), (15, mix2), (16, None)):
            h ^= h >> shift
            if mul is not None:
                h.mul_(mul).bitwise_and_(m32)
        gate, run = x.new_empty(0), h >= cut
    maps = torch_op(run, valid)
    v = torch.ones_like(run) if valid is None else valid
    rows = [v, run] + ([bad] if bad is not None else [])
    sums = (torch.stack(rows) & v).reshape(len(rows), -1).sum(1)
    counter[:, :len(rows)].add_(phase[:, None] * sums)
    return (gate, run, *maps)
