"""cache_decode_attention: decode attention over a contiguous per-sequence KV cache (transformers'
layout), for RUN rows only.

B = decode rows (one new token per sequence), nh / kvh = query / KV heads (GQA: head h reads KV head
h // (nh // kvh)), d = head dim, L = cache length (a static cache: its capacity).
    q [B, nh, d], k_cache, v_cache [B, kvh, L, d], attended [B or 1, L] bool | None, run_mask [B] bool,
    sm_scale -> o [B, nh, d]
Row b attends position p of its own cache where attended[b, p] (None: every position; a row of 1 is
broadcast over B). Rows whose run_mask is False read no K/V and get zeros; so does a row that attends
nothing. The softmax is in f32. The sibling of masked_decode_attention (SGLang's paged pool), for the
caches transformers keeps (DynamicCache, StaticCache) and the GPU harness's fixed-address one: one
program per (row, KV head) holds the whole query group; a block of positions none of which is attended
(a static cache's unfilled tail, left padding) is not read.
"""
from __future__ import annotations

import torch

from vskipper import kernel_configs
from vskipper.triton_kernels import _common
from vskipper.triton_kernels._common import tl, triton

OP = "cache_decode_attention"


def default_config(bucket: int) -> dict:
    """Untuned defaults (no GPU measured yet): masked_decode_attention's (64 positions of K and V per
    step, 4 warps, 2 stages)."""
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _cache_decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, run_ptr, o_ptr, sm_scale, D, L,
                                   stride_qb, stride_qh, stride_kb, stride_kh, stride_kp, stride_vb, stride_vh,
                                   stride_vp, stride_mb, stride_run, stride_ob, stride_oh, GROUP: tl.constexpr,
                                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                   HAS_MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # q_ptr: [B, nh, d]; k_ptr, v_ptr: [B, kvh, L, d]; m_ptr: [B or 1, L] uint8 (if HAS_MASK);
    # run_ptr: [B] uint8 (any stride); o_ptr: [B, nh, d]
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    in_d = offs_d < D
    gd_mask = (offs_g < GROUP)[:, None] & in_d[None, :]
    o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if tl.load(run_ptr + b * stride_run) == 0:  # a skipped row: no K/V reads
        tl.store(o_ptrs, tl.zeros((BLOCK_G, BLOCK_D), dtype=o_ptr.dtype.element_ty), mask=gd_mask)
        return
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_head = k_ptr + b * stride_kb + kv_head * stride_kh
    v_head = v_ptr + b * stride_vb + kv_head * stride_vh
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(0, L, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < L
        if HAS_MASK:
            in_n = in_n & (tl.load(m_ptr + b * stride_mb + offs_n, mask=in_n, other=0) != 0)
        if tl.max(in_n.to(tl.int32), axis=0) > 0:  # a block nothing attends is not read
            k = tl.load(k_head + offs_n[None, :] * stride_kp + offs_d[:, None], mask=in_d[:, None] & in_n[None, :],
                        other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(v_head + offs_n[:, None] * stride_vp + offs_d[None, :], mask=in_n[:, None] & in_d[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_D]
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION) * sm_scale  # [BLOCK_G, BLOCK_N], f32
            s = tl.where(in_n[None, :], s, float("-inf"))  # this block attends a position: m becomes finite
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that attends nothing: zeros
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=gd_mask)


@_common.eager_only
def check(q, k_cache, v_cache, attended, run_mask) -> None:
    _common.check_dim(OP, "q", q, 3, "[B, nh, d]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _common.check_dim(OP, name, t, 4, "[B, kvh, L, d]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _common.check_dtype(OP, name, t, _common.FLOATS)
        _common.expect(t.dtype == q.dtype, OP, f"{name} has dtype {t.dtype} but q has {q.dtype}")
    _common.expect(k_cache.shape == v_cache.shape, OP,
                   f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} must have one shape")
    B, nh, d = q.shape
    _common.expect(k_cache.shape[0] == B, OP, f"k_cache holds {k_cache.shape[0]} sequences but q has B = {B} rows")
    kvh = k_cache.shape[1]
    _common.expect(kvh > 0 and nh % kvh == 0, OP, f"query heads nh = {nh} must be a multiple of KV heads kvh = {kvh}")
    _common.expect(k_cache.shape[3] == d, OP, f"k_cache has head dim {k_cache.shape[3]} but q has {d}")
    if attended is not None:
        _common.check_dim(OP, "attended", attended, 2, "[B or 1, L]")
        _common.check_dtype(OP, "attended", attended, (torch.bool,))
        _common.expect(attended.shape[0] in (1, B) and attended.shape[1] == k_cache.shape[2], OP,
                       f"attended is {list(attended.shape)}, expected [B or 1, L] = [{B} or 1, {k_cache.shape[2]}]")
    _common.check_dim(OP, "run_mask", run_mask, 1, "[B]")
    _common.check_dtype(OP, "run_mask", run_mask, (torch.bool,))
    _common.expect(run_mask.shape[0] == B, OP, f"run_mask has {run_mask.shape[0]} entries but q has B = {B} rows")
    _common.check_devices(OP, q=q, k_cache=k_cache, v_cache=v_cache, attended=attended, run_mask=run_mask)


def launch(q, k_cache, v_cache, attended, run_mask, sm_scale: float, tuned: bool = True):
    check(q, k_cache, v_cache, attended, run_mask)
    _common.check_launchable(OP, _cache_decode_attention_kernel, q.device)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("attended", attended)):
        if t is not None:
            _common.check_inner_contiguous(OP, name, t)
    B, nh, d = q.shape
    kvh, L = k_cache.shape[1], k_cache.shape[2]
    o = torch.empty(B, nh, d, dtype=q.dtype, device=q.device)
    if B == 0 or nh == 0 or d == 0:
        return o
    cfg = kernel_configs.lookup(OP, B, q.device, default_config, tuned)
    group = nh // kvh
    upcast, precision = _common.dot_flags(q.dtype, _cache_decode_attention_kernel)
    run_u8 = run_mask.view(torch.uint8)
    m = run_u8 if attended is None else attended.view(torch.uint8)  # not read without a mask
    stride_mb = 0 if attended is None or attended.shape[0] == 1 else attended.stride(0)
    _cache_decode_attention_kernel[(B, kvh)](
        q, k_cache, v_cache, m, run_u8, o, float(sm_scale), d, L, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), stride_mb, run_mask.stride(0), o.stride(0), o.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=cfg["BLOCK_N"], HAS_MASK=attended is not None, UPCAST=upcast, PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=_common.stages_for(q.dtype, cfg["num_stages"]))
    return o


def torch_op(q, k_cache, v_cache, attended, run_mask, sm_scale: float):
    """Fixed shapes, no host sync: every row attends its whole cache in f32, masked, skipped rows
    zeroed (GQA without copies: the query heads of a KV head are its query rows)."""
    check(q, k_cache, v_cache, attended, run_mask)
    B, nh, d = q.shape
    kvh = k_cache.shape[1]
    if B == 0 or k_cache.shape[2] == 0:
        return q.new_zeros(q.shape)
    qg = q.float().reshape(B, kvh, nh // kvh, d) * sm_scale  # [B, kvh, G, d]
    s = qg @ k_cache.float().transpose(-1, -2)  # [B, kvh, G, L]
    if attended is not None:
        s = s.masked_fill(~attended[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that attends nothing: zeros
    o = (p @ v_cache.float()).reshape(B, nh, d)
    return torch.where(run_mask[:, None, None], o, 0.0).to(q.dtype)
