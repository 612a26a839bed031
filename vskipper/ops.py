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

__all__ = ["IMPLS", "resolve_impl", "route_maps", "route", "grouped_swiglu_", "routed_swiglu_",
           "masked_decode_attention", "masked_decode_attention_dynamic", "cache_decode_attention",
           "routed_prefill_attention"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """Config.impl ("auto", "torch", "triton") for tensors on `device`: auto is triton on CUDA,
    torch elsewhere. Called once, at transform time; it also imports the op modules then, so that
    a later torch.compile traces into the torch forms without an import."""
    if impl == "auto":
        impl = "triton" if torch.device(device).type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of 'auto', {', '.join(map(repr, IMPLS))}")
    for name in ("route_maps", "grouped_swiglu", "routed_swiglu", "masked_decode_attention", "cache_decode_attention",
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


# --- route ------------------------------------------------------------------------------------
@torch.library.custom_op("vskipper::route", mutates_args=("counter",))
def _route(x: Tensor, token_ids: Optional[Tensor], valid: Optional[Tensor], counter: Tensor, phase: Tensor, kind: int,
           threshold: float, hash_params: list[int],
           tuned: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _kernels("route_maps").launch_route(x, token_ids, valid, counter, phase, kind, threshold, hash_params, tuned)


@_route.register_fake
def _(x, token_ids, valid, counter, phase, kind, threshold, hash_params, tuned=True):
    RM = _kernels("route_maps")
    RM.check_route(x, token_ids, valid, counter, phase, kind, hash_params)
    T = x.shape[0]
    return (x.new_empty(T if kind == RM.GATE else 0), x.new_empty(T, dtype=torch.bool),
            x.new_empty(T, dtype=torch.int32), x.new_empty(T, dtype=torch.int32), x.new_empty(2, dtype=torch.int32))


def route(x: Tensor, valid: Optional[Tensor], counter: Tensor, phase: Tensor, threshold: float = 0.5, *,
          token_ids: Optional[Tensor] = None, hash_params: Optional[tuple[int, ...]] = None, impl: str,
          tuned: bool = True) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Router output to a routed layer's inputs in one launch (T <= 1024): the decisions, the route
    maps, and the layer's route counts added in place.

    x [...]: the router's output, bool decisions (as they are) or float gates (sanitized as
    skippers/base.py's sanitize_gate does: a non-finite gate RUNs with g = 1; RUN where g > threshold);
    or, with hash_params = RandomSkipRouter.hash_params, the positions, token_ids [...] beside them
    (RandomSkip's decisions, made here instead of by the router). valid [...] bool | None; counter
    [2, 3] int64 (RouteCounter.counts: per phase tokens, RUN, non-finite) gains this step's counts in
    the row phase [2] (counters.Phase.onehot) selects. -> (g [...] (the sanitized gate; bool decisions
    where there is none), run [...] bool, route_maps(run, valid): (run_rows [T], project_rows [T], counts [2]))."""
    RM = _kernels("route_maps")
    shape = x.shape
    mode = RM.HASH if hash_params is not None else RM.DECISIONS if x.dtype == torch.bool else RM.GATE
    flat = x.reshape(-1).contiguous()
    ids = None if token_ids is None else token_ids.reshape(-1).contiguous()
    v = None if valid is None else valid.reshape(-1).contiguous()
    hp = list(hash_params) if hash_params is not None else []
    if impl == "torch":
        gate, run, *maps = RM.torch_op_route(flat, ids, v, counter, phase, mode, float(threshold), hp)
    elif impl == "triton":
        gate, run, *maps = _route(flat, ids, v, counter, phase, mode, float(threshold), hp, tuned)
    else:
        raise _bad_impl(impl)
    run = run.view(shape)
    return (gate.view(shape) if mode == RM.GATE else run), run, tuple(maps)


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


# --- routed_swiglu_ --------------------------------------------------------------------------
@torch.library.custom_op("vskipper::routed_swiglu_", mutates_args=("out",))
def _routed_swiglu_(out: Tensor, h: Tensor, a: Tensor, run_rows: Tensor, project_rows: Tensor, counts: Tensor,
                    w_gate: Tensor, w_up: Tensor, w_down: Tensor, a_gate: Optional[Tensor], a_up: Optional[Tensor],
                    a_down: Optional[Tensor], norm_w: Tensor, eps: float, g: Optional[Tensor], valid: Optional[Tensor],
                    tuned: bool = True) -> None:
    adapter = None if a_gate is None else (a_gate, a_up, a_down)
    _kernels("routed_swiglu").launch(out, h, a, run_rows, project_rows, counts, (w_gate, w_up, w_down), adapter,
                                     norm_w, eps, g, valid, tuned)


@_routed_swiglu_.register_fake
def _(out, h, a, run_rows, project_rows, counts, w_gate, w_up, w_down, a_gate, a_up, a_down, norm_w, eps, g, valid,
      tuned=True):
    adapter = None if a_gate is None else (a_gate, a_up, a_down)
    _kernels("routed_swiglu").check(out, h, a, run_rows, project_rows, counts, (w_gate, w_up, w_down), adapter, norm_w,
                                    g, valid)


def routed_swiglu_(out: Tensor, h: Tensor, a: Tensor, maps: tuple[Tensor, Tensor, Tensor],
                   mlp: tuple[Tensor, Tensor, Tensor], adapter: Optional[tuple[Tensor, Tensor, Tensor]],
                   norm_w: Tensor, eps: float, g: Optional[Tensor] = None, valid: Optional[Tensor] = None, *,
                   impl: str, tuned: bool = True) -> None:
    """A fixed-shape routed layer's MLP side, in place, every row of out [T, H] written: RUN rows
    (maps' run_rows[:counts[0]]) out = h1 + w * mlp(rmsnorm(h1)), h1 = h + a (a: the attention output);
    PROJECT rows (project_rows[:counts[1]]) with an adapter out = h + w' * adapter(rmsnorm(h)); every
    other row (PROJECT without an adapter, padding: valid False) out = h. w = g, w' = 1 - g with a soft
    gate g [T], else 1. mlp and adapter: (w_gate [N, H], w_up [N, H], w_down [H, N]) (FlexiDepth's
    adapter: (gate_proj, down_proj, up_proj)); rmsnorm: transformers' LlamaRMSNorm with norm_w [H], eps.
    h, a, out [T, H] (out not h or a); maps = route_maps(run, valid) (their counts [2] on the device)."""
    run_rows, project_rows, counts = maps
    ad = adapter if adapter is not None else (None, None, None)
    if impl == "torch":
        return _kernels("routed_swiglu").torch_op(out, h, a, run_rows, project_rows, counts, tuple(mlp), adapter,
                                                  norm_w, float(eps), g, valid)
    if impl == "triton":
        return _routed_swiglu_(out, h, a, run_rows, project_rows, counts, *mlp, *ad, norm_w, float(eps), g, valid,
                               tuned)
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
