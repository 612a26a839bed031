"""routed_prefill_attention: causal attention of an extend (prefill) batch over SGLang's paged KV
layout, for RUN rows only.

T = query rows of the batch, B = requests, nh / kvh = query / KV heads (GQA: head h reads KV head
h // (nh // kvh)), d = head dim, P = KV pool slots, R x C = SGLang's req_to_token table.
    q [T, nh, d], k_buffer, v_buffer [P, kvh, d], req_to_token [R, C] int32, req_pool_indices [B],
    prefix_lens [B], extend_lens [B], run_mask [T] bool, sm_scale -> o [T, nh, d]
The rows of request b are extend_lens[b] consecutive rows, requests in order (SGLang's extend
layout: row start of b = sum(extend_lens[:b]), sum(extend_lens) = T). Row i of request b is the
token at position p = prefix_lens[b] + i; a RUN row attends the request's first p + 1 tokens
(pool slots req_to_token[req_pool_indices[b], :p + 1]: the cached prefix and the chunk's earlier
tokens, whether they ran or not), which is masked_decode_attention of one row with sequence length
p + 1 (masked_decode_attention's torch_op is this op's oracle in the tests). The chunk's own K/V must already be in the
pool. Rows whose run_mask is False get zeros.

Two forms:
  torch_op   per request: gather its K/V once and its RUN queries, SDPA with a position-based
             causal mask over blocks of BLOCK_ROWS queries, each block over the keys up to its last
             position. Reads the lengths on the host (prefill is never captured in a graph).
  launch     the Triton kernel, no host sync: one program per (request, block of BLOCK_M rows,
             query head); a block with no RUN row stores zeros and reads no K/V; the others run
             online softmax over the K/V up to the block's last position, f32 accumulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vskipper import kernel_configs
from vskipper.triton_kernels import _common
from vskipper.triton_kernels._common import online_softmax_step, paged_kv_block, tl, triton

OP = "routed_prefill_attention"
# torch_op attends blocks of this many RUN rows, each over the keys up to its last position (a
# causal mask alone does not skip the masked half): at 1024 tokens with half the rows RUN, 128-row
# blocks took 0.7x the time of one call over all keys on one CPU thread (in git history, its timings).
BLOCK_ROWS = 128


def default_config(bucket: int) -> dict:
    """Untuned defaults (no GPU measured yet): 32 query rows x 64 positions, the flash-attention
    tile at head dim 128 in 16-bit; 4 warps, 2 stages."""
    return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _routed_prefill_attention_kernel(q_ptr, k_ptr, v_ptr, r2t_ptr, rpi_ptr, pre_ptr, ext_ptr, start_ptr, run_ptr,
                                     o_ptr, sm_scale, D, stride_qt, stride_qh, stride_kp, stride_kh, stride_vp,
                                     stride_vh, stride_r2t, stride_ot, stride_oh, GROUP: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # q_ptr: [T, nh, d]; k_ptr, v_ptr: [P, kvh, d]; r2t_ptr: [R, C] int32; rpi_ptr, pre_ptr, ext_ptr,
    # start_ptr: [B] int; run_ptr: [T] uint8; o_ptr: [T, nh, d]
    b = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1).to(tl.int32) * BLOCK_M
    head = tl.program_id(2).to(tl.int64)
    ext = tl.load(ext_ptr + b).to(tl.int32)
    if m0 >= ext:  # past this request's rows
        return
    pre = tl.load(pre_ptr + b).to(tl.int32)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # row offsets inside the request
    in_m = offs_m < ext
    rows = tl.load(start_ptr + b).to(tl.int64) + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    md_mask = in_m[:, None] & in_d[None, :]
    o_ptrs = o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    run = tl.load(run_ptr + rows, mask=in_m, other=0)
    if tl.max(run, axis=0) == 0:  # no RUN row in this block: no K/V reads
        tl.store(o_ptrs, tl.zeros((BLOCK_M, BLOCK_D), dtype=o_ptr.dtype.element_ty), mask=md_mask)
        return
    kv_head = head // GROUP
    slots_row = r2t_ptr + tl.load(rpi_ptr + b).to(tl.int64) * stride_r2t
    pos = pre + offs_m  # [BLOCK_M] positions; each row attends positions <= pos
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=md_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_end = pre + tl.minimum(m0 + BLOCK_M, ext)  # one past the block's last position
    for start in range(0, kv_end, BLOCK_N):
        k, v, offs_n, in_n = paged_kv_block(k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, slots_row,
                                            start, kv_end, offs_d, in_d, stride_kp, stride_vp, BLOCK_N, UPCAST)
        s = tl.dot(q, k, input_precision=PRECISION) * sm_scale  # [BLOCK_M, BLOCK_N], f32
        # position 0 is in the first step for every row: m stays finite
        s = tl.where(in_n[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = tl.where(run[:, None] != 0, o, 0.0)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=md_mask)


@_common.eager_only
def check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask) -> None:
    _common.check_paged_kv(OP, q, k_buffer, v_buffer, req_to_token, "[T, nh, d]")
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens), ("extend_lens", extend_lens)):
        _common.check_dim(OP, name, t, 1, "[B]")
        _common.check_dtype(OP, name, t, _common.INDEXES)
        _common.expect(t.shape[0] == req_pool_indices.shape[0], OP,
                       f"{name} has {t.shape[0]} entries but req_pool_indices has B = {req_pool_indices.shape[0]}")
    _common.check_dim(OP, "run_mask", run_mask, 1, "[T]")
    _common.expect(run_mask.shape[0] == q.shape[0], OP,
                   f"run_mask has {run_mask.shape[0]} entries but q has T = {q.shape[0]} rows")
    _common.check_dtype(OP, "run_mask", run_mask, (torch.bool,))
    _common.check_devices(OP, q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                          req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_lens=extend_lens,
                          run_mask=run_mask)


def check_lengths(T: int, C: int, prefix_lens: list[int], extend_lens: list[int]) -> None:
    """The host-side checks of the lengths (torch_op reads them anyway; the kernel trusts them)."""
    _common.expect(sum(extend_lens) == T, OP, f"extend_lens sum to {sum(extend_lens)} but q has T = {T} rows")
    for b, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        _common.expect(pre >= 0 and ext >= 0 and pre + ext <= C, OP,
                       f"request {b}: prefix {pre} + extend {ext} must be >= 0 and fit req_to_token's {C} columns")


def launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask,
           sm_scale: float, tuned: bool = True):
    check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask)
    _common.check_launchable(OP, _routed_prefill_attention_kernel, q.device)
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("req_to_token", req_to_token)):
        _common.check_inner_contiguous(OP, name, t)
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("run_mask", run_mask)):
        _common.check_contiguous(OP, name, t)
    T, nh, d = q.shape
    B, kvh = req_pool_indices.shape[0], k_buffer.shape[1]
    o = torch.empty(T, nh, d, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0 or nh == 0 or d == 0:
        return o.zero_()
    cfg = kernel_configs.lookup(OP, T, q.device, default_config, tuned)
    starts = torch.cumsum(extend_lens, 0) - extend_lens  # [B], on the device
    upcast, precision = _common.dot_flags(q.dtype, _routed_prefill_attention_kernel)
    # grid over T // BLOCK_M row blocks per request (no host read of the longest extend): the blocks
    # past a request's rows return at once
    _routed_prefill_attention_kernel[(B, triton.cdiv(T, cfg["BLOCK_M"]), nh)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, starts,
        run_mask.view(torch.uint8), o, float(sm_scale), d, q.stride(0), q.stride(1), k_buffer.stride(0),
        k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), o.stride(0), o.stride(1),
        GROUP=nh // kvh, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=cfg["BLOCK_N"],
        UPCAST=upcast, PRECISION=precision, num_warps=cfg["num_warps"],
        num_stages=_common.stages_for(q.dtype, cfg["num_stages"]))
    return o


def torch_op(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask,
              sm_scale: float):
    """Per request: its K/V gathered once, its RUN queries gathered, one SDPA in q's dtype with the
    causal mask by position (key j attended by the query at position p iff j <= p)."""
    check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask)
    pre_l, ext_l = prefix_lens.tolist(), extend_lens.tolist()
    T, nh, d = q.shape
    check_lengths(T, req_to_token.shape[1], pre_l, ext_l)
    o = q.new_zeros(q.shape)
    run = run_mask.nonzero().squeeze(1)  # [n] ascending
    if run.numel() == 0 or d == 0:
        return o
    starts = [sum(ext_l[:b]) for b in range(len(ext_l) + 1)]
    cuts = torch.searchsorted(run, torch.tensor(starts, device=run.device)).tolist()
    gqa = nh != k_buffer.shape[1]
    for b, (pre, ext) in enumerate(zip(pre_l, ext_l)):
        n = cuts[b + 1] - cuts[b]
        if n == 0:
            continue
        rows = run[cuts[b]:cuts[b + 1]]  # this request's RUN rows
        L = pre + ext
        slots = req_to_token[req_pool_indices[b], :L].long()  # [L]
        k, v = k_buffer[slots].transpose(0, 1)[None], v_buffer[slots].transpose(0, 1)[None]  # [1, kvh, L, d]
        qb = q[rows].transpose(0, 1)[None]  # [1, nh, n, d]
        if n == ext and pre == 0:  # every row runs, no prefix: plain causal attention
            o[rows] = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=sm_scale,
                                                     enable_gqa=gqa)[0].transpose(0, 1)
            continue
        pos = rows - starts[b] + pre  # [n] ascending
        last = pos[BLOCK_ROWS - 1::BLOCK_ROWS].tolist() + [pos[-1].item()]
        for i, j in enumerate(range(0, n, BLOCK_ROWS)):  # blocks of rows: keys up to the block's last position
            Lb = last[i] + 1
            mask = torch.arange(Lb, device=q.device)[None, :] <= pos[j:j + BLOCK_ROWS, None]  # [nb, Lb]
            out = F.scaled_dot_product_attention(qb[:, :, j:j + BLOCK_ROWS], k[:, :, :Lb], v[:, :, :Lb],
                                                 attn_mask=mask, scale=sm_scale, enable_gqa=gqa)  # [1, nh, nb, d]
            o[rows[j:j + BLOCK_ROWS]] = out[0].transpose(0, 1)
    return o
