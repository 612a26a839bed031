"""masked_decode_attention: paged decode attention over SGLang's KV layout, for RUN rows only.

B = decode rows (one new token per request), nh / kvh = query / KV heads (GQA: head h reads KV head
h // (nh // kvh)), d = head dim, P = KV pool slots, R x C = SGLang's req_to_token table.
    q [B, nh, d], k_buffer, v_buffer [P, kvh, d], req_to_token [R, C] int32,
    req_pool_indices [B], seq_lens [B], run_mask [B] bool, sm_scale -> o [B, nh, d]
Position p < seq_lens[b] of request b lives at pool slot req_to_token[req_pool_indices[b], p]; all
are attended (causality is implicit at decode). Rows whose run_mask is False read no K/V and get
zeros. The softmax is in f32; a row with seq_len 0 gets zeros. One program per (row, KV head)
holds the whole query group; no split over the sequence yet (long contexts at small batches leave
SMs idle: a second, split-K stage is the next step if the GPU check shows it).
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels import _common
from vskipper.triton_kernels._common import online_softmax_step, paged_kv_block, tl, triton


def default_config(bucket: int) -> dict:
    """Untuned defaults (no GPU measured yet): 64 positions of K and V per step (32 KB of bf16 at
    d = 128), the flash-decoding tile; 4 warps, 2 stages to overlap the next page's loads."""
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _masked_decode_attention_kernel(q_ptr, k_ptr, v_ptr, r2t_ptr, rpi_ptr, seq_ptr, run_ptr, o_ptr, sm_scale, D,
                                    stride_qb, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_r2t,
                                    stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                                    PRECISION: tl.constexpr):
    # q_ptr: [B, nh, d]; k_ptr, v_ptr: [P, kvh, d]; r2t_ptr: [R, C] int32; rpi_ptr, seq_ptr: [B] int;
    # run_ptr: [B] uint8; o_ptr: [B, nh, d]
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    gd_mask = (offs_g < GROUP)[:, None] & (offs_d < D)[None, :]
    o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if tl.load(run_ptr + b) == 0:  # a skipped row: no K/V reads
        tl.store(o_ptrs, tl.zeros((BLOCK_G, BLOCK_D), dtype=o_ptr.dtype.element_ty), mask=gd_mask)
        return
    seq_len = tl.load(seq_ptr + b).to(tl.int32)  # positions index one row of req_to_token: < 2**31
    slots_row = r2t_ptr + tl.load(rpi_ptr + b).to(tl.int64) * stride_r2t
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    in_d = offs_d < D
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        k, v, offs_n, in_n = paged_kv_block(k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, slots_row,
                                            start, seq_len, offs_d, in_d, stride_kp, stride_vp, BLOCK_N, UPCAST)
        s = tl.dot(q, k, input_precision=PRECISION) * sm_scale  # [BLOCK_G, BLOCK_N], f32
        s = tl.where(in_n[None, :], s, float("-inf"))  # every step has a position < seq_len: m stays finite
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=gd_mask)


@_common.eager_only
def check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask) -> None:
    op = "masked_decode_attention"
    _common.check_paged_kv(op, q, k_buffer, v_buffer, req_to_token, "[B, nh, d]")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens), ("run_mask", run_mask)):
        _common.check_dim(op, name, t, 1, "[B]")
        _common.expect(t.shape[0] == q.shape[0], op,
                       f"{name} has {t.shape[0]} entries but q has B = {q.shape[0]} rows")
    _common.check_dtype(op, "req_pool_indices", req_pool_indices, _common.INDEXES)
    _common.check_dtype(op, "seq_lens", seq_lens, _common.INDEXES)
    _common.check_dtype(op, "run_mask", run_mask, (torch.bool,))
    _common.check_devices(op, q=q, k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token,
                          req_pool_indices=req_pool_indices, seq_lens=seq_lens, run_mask=run_mask)


def launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale: float,
           tuned: bool = True):
    check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask)
    op = "masked_decode_attention"
    _common.check_launchable(op, _masked_decode_attention_kernel, q.device)
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("req_to_token", req_to_token)):
        _common.check_inner_contiguous(op, name, t)
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens), ("run_mask", run_mask)):
        _common.check_contiguous(op, name, t)
    B, nh, d = q.shape
    kvh = k_buffer.shape[1]
    o = torch.empty(B, nh, d, dtype=q.dtype, device=q.device)
    if B == 0 or nh == 0 or d == 0:
        return o
    cfg = kernel_configs.lookup(op, B, q.device, default_config, tuned)
    group = nh // kvh
    upcast, precision = _common.dot_flags(q.dtype, _masked_decode_attention_kernel)
    _masked_decode_attention_kernel[(B, kvh)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask.view(torch.uint8), o,
        float(sm_scale), d, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), o.stride(0), o.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=cfg["BLOCK_N"], UPCAST=upcast, PRECISION=precision, num_warps=cfg["num_warps"],
        num_stages=_common.stages_for(q.dtype, cfg["num_stages"]))
    return o


def _attend(q, k, v, attended, sm_scale: float):
    """q [B, nh, d], k/v [B, L, kvh, d], attended [B, L] bool -> [B, nh, d] in f32 (GQA without copies)."""
    B, nh, d = q.shape
    kvh = k.shape[2]
    qg = q.float().reshape(B, kvh, nh // kvh, d) * sm_scale  # [B, kvh, G, d]
    s = qg @ k.float().permute(0, 2, 3, 1)  # [B, kvh, G, L]
    s = s.masked_fill(~attended[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with nothing attended: zeros
    return (p @ v.float().transpose(1, 2)).reshape(B, nh, d)  # [B, kvh, G, d] -> [B, nh, d]


def torch_op(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale: float):
    """Fixed shapes, no host sync: every row gathers all C columns (slots clamped into the pool),
    masked to its sequence; skipped rows are zeroed. Only for tiny shapes: it holds [B, C, kvh, d]."""
    check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask)
    B, C, P = q.shape[0], req_to_token.shape[1], k_buffer.shape[0]
    if B == 0 or C == 0 or P == 0:
        return q.new_zeros(q.shape)
    slots = req_to_token.index_select(0, req_pool_indices.long()).long().clamp(0, P - 1)  # [B, C]
    attended = torch.arange(C, device=q.device)[None, :] < seq_lens[:, None]  # [B, C]
    o = _attend(q, k_buffer[slots], v_buffer[slots], attended, sm_scale)
    return torch.where(run_mask[:, None, None], o, 0.0).to(q.dtype)


def torch_op_dynamic(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale: float):
    """CPU serving path (may sync): gathers only the RUN rows' K/V, up to their longest sequence
    (index_select: half the time of advanced indexing), and attends with torch's SDPA, the query
    heads of a KV head as its query rows (GQA without copies; measured 1.5-3x faster than `_attend`
    at 8-32 rows of 160-300 tokens, one CPU thread)."""
    check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask)
    o = q.new_zeros(q.shape)
    run = run_mask.nonzero().squeeze(1)
    if run.numel() == 0:
        return o
    lens = seq_lens.index_select(0, run)
    L = int(lens.max())
    if L <= 0:
        return o
    slots = req_to_token.index_select(0, req_pool_indices.index_select(0, run).long())[:, :L].long()  # [n, L]
    attended = torch.arange(L, device=q.device)[None, :] < lens[:, None]
    slots = torch.where(attended, slots, 0).reshape(-1)
    n, (_, nh, d), kvh = run.numel(), q.shape, k_buffer.shape[1]
    k = k_buffer.index_select(0, slots).view(n, L, kvh, -1).transpose(1, 2).float()  # [n, kvh, L, d]
    v = v_buffer.index_select(0, slots).view(n, L, kvh, -1).transpose(1, 2).float()
    qg = q.index_select(0, run).float().reshape(n, kvh, nh // kvh, d)  # [n, kvh, G, d]
    a = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=attended[:, None, None, :], scale=sm_scale)
    o[run] = a.nan_to_num(0.0).reshape(n, nh, -1).to(q.dtype)  # (a row with nothing attended: zeros)
    return o
