"""The one dispatch point for vskipper's grouped-execution ops.

Legend: T = rows (tokens) in the batch, H = hidden size, R = rows in a map (= T in the routed body),
I = MLP width, B = decode rows, nh / kvh = query / KV heads, d = head dim.

Every op takes `impl` (and `tuned`: whether a Triton launch reads this GPU's tuned launch
configs), decided once per model at transform time (`resolve_impl`, from `Config.impl`;
`Config.tuned_kernels`) and held by the routed layer's body; nothing here reads the environment:

    triton  the kernel in vskipper/triton_kernels/<op>.py, through a `torch.library.custom_op`
            (torch.ops.vskipper.<op>) with a fake implementation, so it traces under torch.compile
            (opaque to it) with fixed output shapes. CUDA tensors (CPU ones too under
            TRITON_INTERPRET=1, which is how the tests run them).
    torch   the op in plain torch beside the kernel (`torch_op`), called directly (no custom-op dispatch,
            which costs more than the op at small T; torch.compile traces into it): fixed shapes,
            counts kept on the device, no host sync, CUDA-graph safe.

One op has a third, dynamic form that only the dynamic routed body uses (CPU serving, where there
are no graphs and reading a count costs nothing): `masked_decode_attention_dynamic`. The prefill op
`routed_prefill_attention` has one torch form for both bodies, which reads the batch's lengths on
the host (prefill batches are never captured in a graph); its Triton form does not.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch
from torch import Tensor

IMPLS = ("torch", "triton")

__all__ = ["IMPLS", "resolve_impl", "route_maps", "grouped_swiglu_", "masked_decode_attention",
           "masked_decode_attention_dynamic", "cache_decode_attention", "routed_prefill_attention"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """Config.impl ("auto", "torch", "triton") for tensors on `device`: auto is triton on CUDA,
    torch elsewhere. Called once, at transform time; it also imports the op modules then, so that
    a later torch.compile traces into the torch forms without an import."""
    if impl == "auto":
        impl = "triton" if torch.device(device).type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of 'auto', {', '.join(map(repr, IMPLS))}")
    for name in ("route_maps", "grouped_swiglu", "masked_decode_attention", "cache_decode_attention",
                 "routed_prefill_attention"):
        _kernels(name)
    return impl


def _kernels(name: str):
    # imported on first use: a kernel is decorated at import, and TRITON_INTERPRET=1 must be set before
    # that. (sys.modules first: torch.compile traces a dict lookup, not importlib)
    mod = sys.modules.get(f"vskipper.triton_kernels.{name}")
    return mod if mod is not None else importlib.import_module(f"vskipper.triton_kernels.{name}")


def _bad_impl(impl) -> ValueError:
    return ValueError(f"vskipper op: impl={impl!r} is not one of {list(IMPLS)} (resolve Config.impl with resolve_impl)")


# --- route_maps -------------------------------------------------------------------------------
@torch.library.custom_op("vskipper::route_maps", mutates_args=())
def _route_maps(run_mask: Tensor, valid: Optional[Tensor], tuned: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels("route_maps").launch(run_mask, valid, tuned)


@_route_maps.register_fake
def _(run_mask, valid, tuned=True):
    _kernels("route_maps").check(run_mask, valid)
    T = run_mask.shape[0]
    return (run_mask.new_empty(T, dtype=torch.int32), run_mask.new_empty(T, dtype=torch.int32),
            run_mask.new_empty(2, dtype=torch.int32))


def route_maps(run_mask: Tensor, valid: Optional[Tensor] = None, *, impl: str,
               tuned: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """run_mask [...] bool, valid [...] bool | None -> (run_rows [T] int32, project_rows [T] int32, counts [2] int32),
    T = run_mask.numel() (any shape is flattened).

    run_rows[:counts[0]] are the rows where run_mask & valid, ascending; project_rows[:counts[1]]
    where ~run_mask & valid, ascending. Past a count every entry is still a valid row index (each
    map is a stable partition of 0..T-1). Deterministic (prefix sums), no host sync."""
    run_mask = run_mask.reshape(-1).contiguous()
    if valid is not None:
        valid = valid.reshape(-1).contiguous()
    if impl == "torch":
        return _kernels("route_maps").torch_op(run_mask, valid)
    if impl == "triton":
        return _route_maps(run_mask, valid, tuned)
    raise _bad_impl(impl)


# --- grouped_swiglu_ --------------------------------------------------------------------------
@torch.library.custom_op("vskipper::grouped_swiglu_", mutates_args=("out",))
def _grouped_swiglu_(out: Tensor, residual: Tensor, x: Tensor, rows: Tensor, count: Tensor, w_gate: Tensor,
                     w_up: Tensor, w_down: Tensor, weight: Optional[Tensor], tuned: bool = True) -> None:
    _kernels("grouped_swiglu").launch(out, residual, x, rows, count, w_gate, w_up, w_down, weight, tuned)


@_grouped_swiglu_.register_fake
def _(out, residual, x, rows, count, w_gate, w_up, w_down, weight, tuned=True):
    _kernels("grouped_swiglu").check(out, residual, x, rows, count, w_gate, w_up, w_down, weight)


def grouped_swiglu_(out: Tensor, residual: Tensor, x: Tensor, rows: Tensor, count: Tensor, w_gate: Tensor,
                    w_up: Tensor, w_down: Tensor, weight: Optional[Tensor] = None, *, impl: str,
                    tuned: bool = True) -> None:
    """In place, for j < count, r = rows[j]:
        out[r] = residual[r] + w[r] * (silu(x[r] @ w_gate.T) * (x[r] @ w_up.T)) @ w_down.T   (w = 1 if None)
    out, residual, x [T, H]; w_gate, w_up [I, H]; w_down [H, I]; weight [T]. Other rows untouched.
    FlexiDepth's adapter up_proj(silu(gate_proj(y)) * down_proj(y)) is w_gate=gate_proj,
    w_up=down_proj, w_down=up_proj. With residual = h1, weight = g this is a RUN row's
    `run_value`, with residual = h, weight = 1 - g a PROJECT row's `project_value`
    (vskipper/skippers/base.py); weight None is the hard gate."""
    if impl == "torch":
        return _kernels("grouped_swiglu").torch_op(out, residual, x, rows, count, w_gate, w_up, w_down, weight)
    if impl == "triton":
        return _grouped_swiglu_(out, residual, x, rows, count, w_gate, w_up, w_down, weight, tuned)
    raise _bad_impl(impl)


# --- masked_decode_attention ------------------------------------------------------------------
@torch.library.custom_op("vskipper::masked_decode_attention", mutates_args=())
def _masked_decode_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                             req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor, sm_scale: float,
                             tuned: bool = True) -> Tensor:
    return _kernels("masked_decode_attention").launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                                      seq_lens, run_mask, sm_scale, tuned)


@_masked_decode_attention.register_fake
def _(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale, tuned=True):
    _kernels("masked_decode_attention").check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                              run_mask)
    return q.new_empty(q.shape)


def masked_decode_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                            req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor, sm_scale: float, *,
                            impl: str, tuned: bool = True) -> Tensor:
    """Paged decode attention for RUN rows over SGLang's KV layout. q [B, nh, d], k_buffer and
    v_buffer [P, kvh, d], req_to_token [R, C] int32, req_pool_indices [B] int, seq_lens [B] int,
    run_mask [B] bool -> o [B, nh, d]. Position p < seq_lens[b] of request b is pool slot
    req_to_token[req_pool_indices[b], p]; GQA: head h reads KV head h // (nh // kvh); softmax in f32.
    Rows with run_mask False read no K/V and get zeros."""
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, float(sm_scale))
    if impl == "torch":
        return _kernels("masked_decode_attention").torch_op(*args)
    if impl == "triton":
        return _masked_decode_attention(*args, tuned)
    raise _bad_impl(impl)


def masked_decode_attention_dynamic(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                                    req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor,
                                    sm_scale: float) -> Tensor:
    """The same result as masked_decode_attention in plain torch, gathering only the RUN rows up to
    their longest sequence. It syncs with the host (nonzero, max): the dynamic routed body's form
    (CPU serving), never inside a CUDA graph."""
    return _kernels("masked_decode_attention").torch_op_dynamic(q, k_buffer, v_buffer, req_to_token,
                                                                 req_pool_indices, seq_lens, run_mask, sm_scale)


# --- cache_decode_attention -------------------------------------------------------------------
@torch.library.custom_op("vskipper::cache_decode_attention", mutates_args=())
def _cache_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, attended: Optional[Tensor],
                            run_mask: Tensor, sm_scale: float, tuned: bool = True) -> Tensor:
    return _kernels("cache_decode_attention").launch(q, k_cache, v_cache, attended, run_mask, sm_scale, tuned)


@_cache_decode_attention.register_fake
def _(q, k_cache, v_cache, attended, run_mask, sm_scale, tuned=True):
    _kernels("cache_decode_attention").check(q, k_cache, v_cache, attended, run_mask)
    return q.new_empty(q.shape)


def cache_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, attended: Optional[Tensor], run_mask: Tensor,
                           sm_scale: float, *, impl: str, tuned: bool = True) -> Tensor:
    """Decode attention for RUN rows over a contiguous per-sequence cache (transformers' layout).
    q [B, nh, d], k_cache and v_cache [B, kvh, L, d], attended [B or 1, L] bool | None (None: every
    position), run_mask [B] bool -> o [B, nh, d]. GQA and the f32 softmax as in
    masked_decode_attention; rows with run_mask False read no K/V and get zeros, and so does a row
    that attends nothing."""
    args = (q, k_cache, v_cache, attended, run_mask, float(sm_scale))
    if impl == "torch":
        return _kernels("cache_decode_attention").torch_op(*args)
    if impl == "triton":
        return _cache_decode_attention(*args, tuned)
    raise _bad_impl(impl)


# --- routed_prefill_attention -----------------------------------------------------------------
@torch.library.custom_op("vskipper::routed_prefill_attention", mutates_args=())
def _routed_prefill_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                              req_pool_indices: Tensor, prefix_lens: Tensor, extend_lens: Tensor, run_mask: Tensor,
                              sm_scale: float, tuned: bool = True) -> Tensor:
    return _kernels("routed_prefill_attention").launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                                       prefix_lens, extend_lens, run_mask, sm_scale, tuned)


@_routed_prefill_attention.register_fake
def _(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask, sm_scale, tuned=True):
    _kernels("routed_prefill_attention").check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens,
                                               extend_lens, run_mask)
    return q.new_empty(q.shape)


def routed_prefill_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                             req_pool_indices: Tensor, prefix_lens: Tensor, extend_lens: Tensor, run_mask: Tensor,
                             sm_scale: float, *, impl: str, tuned: bool = True) -> Tensor:
    """Causal paged attention of an extend (prefill) batch for RUN rows, over SGLang's KV layout.
    q [T, nh, d] (the rows of request b are extend_lens[b] consecutive rows, requests in order),
    k_buffer and v_buffer [P, kvh, d], req_to_token [R, C] int32, req_pool_indices, prefix_lens,
    extend_lens [B] int, run_mask [T] bool -> o [T, nh, d]. Row i of request b is position
    p = prefix_lens[b] + i and attends pool slots req_to_token[req_pool_indices[b], :p + 1] (the
    cached prefix and the chunk's earlier tokens, RUN or not, already written); GQA as in
    masked_decode_attention. Rows with run_mask False read no K/V and get zeros."""
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, run_mask, float(sm_scale))
    if impl == "torch":
        return _kernels("routed_prefill_attention").torch_op(*args)
    if impl == "triton":
        return _routed_prefill_attention(*args, tuned)
    raise _bad_impl(impl)
