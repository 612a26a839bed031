"""The one dispatch point for vskipper's grouped-execution ops.

Legend: T = rows (tokens) in the batch, H = hidden size, R = rows in a map (= T in the routed body),
I = MLP width, B = decode rows, nh / kvh = query / KV heads, d = head dim.

Every op is a `torch.library.custom_op` in the `vskipper` namespace (torch.ops.vskipper.<op>) with
a fake implementation, so it traces under torch.compile (opaque to it) and keeps fixed output
shapes; counts stay on the device. The public names below are plain functions over them, so that
fx passes can use them as call_function targets. Which implementation runs is decided per call by
`implementation(device)`:

    triton  the kernel in vskipper/triton_kernels/<op>.py: CUDA tensors (CPU ones too under
            TRITON_INTERPRET=1, which is how the tests run them)
    torch   the pure-torch reference beside it. On an accelerator, the fixed-shape reference:
            no host sync, CUDA-graph safe. On CPU, where there are no graphs and reading a count
            costs nothing, the dynamic variant that touches only the rows the count names.

Default: triton for CUDA tensors, torch for everything else. VSKIPPER_IMPL=torch|triton forces one.
"""
import contextlib
import importlib
import os
import threading
from typing import Optional

import torch
from torch import Tensor

IMPLS = ("torch", "triton")

__all__ = [
    "route_maps", "gather_rows", "scatter_combine_", "grouped_linear", "grouped_swiglu_",
    "masked_decode_attention", "masked_decode_attention_dynamic", "implementation", "fixed_shapes",
]


_CPU = torch.device("cpu")


def implementation(device: torch.device) -> str:
    """The one place VSKIPPER_IMPL is read: "torch" or "triton" for tensors on `device`."""
    value = os.environ.get("VSKIPPER_IMPL", "")
    if value == "":
        return "triton" if device.type == "cuda" else "torch"
    if value not in IMPLS:
        raise ValueError(f"VSKIPPER_IMPL={value!r} is not one of {list(IMPLS)} "
                         "(leave it unset for Triton on CUDA tensors and torch elsewhere)")
    return value


def _kernels(name: str):
    return importlib.import_module(f"vskipper.triton_kernels.{name}")


_fixed = threading.local()


@contextlib.contextmanager
def fixed_shapes():
    """Within this context the torch path on CPU also runs the fixed-shape references (no host
    sync): the static routed body uses it, so that its graph safety can be tested on CPU."""
    prev = getattr(_fixed, "on", False)
    _fixed.on = True
    try:
        yield
    finally:
        _fixed.on = prev


def _call(name: str, device: torch.device, *args):
    mod = _kernels(name)
    if implementation(device) == "triton":
        return mod.launch(*args)
    if device.type == "cpu" and not getattr(_fixed, "on", False):
        return getattr(mod, "reference_dynamic", mod.reference)(*args)
    return mod.reference(*args)


# --- route_maps -------------------------------------------------------------------------------
@torch.library.custom_op("vskipper::route_maps", mutates_args=())
def _route_maps(run_mask: Tensor, valid: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return _call("route_maps", run_mask.device, run_mask, valid)


@_route_maps.register_fake
def _(run_mask, valid):
    _kernels("route_maps").check(run_mask, valid)
    T = run_mask.shape[0]
    return (run_mask.new_empty(T, dtype=torch.int32), run_mask.new_empty(T, dtype=torch.int32),
            run_mask.new_empty(2, dtype=torch.int32))


def route_maps(run_mask: Tensor, valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """run_mask [...] bool, valid [...] bool | None -> (run_rows [T] int32, project_rows [T] int32, counts [2] int32),
    T = run_mask.numel() (any shape is flattened).

    run_rows[:counts[0]] are the rows where run_mask & valid, ascending; project_rows[:counts[1]]
    where ~run_mask & valid, ascending. Past a count every entry is still a valid row index (each
    map is a stable partition of 0..T-1). Deterministic (prefix sums), no host sync."""
    run_mask = run_mask.reshape(-1).contiguous()
    if valid is not None:
        valid = valid.reshape(-1).contiguous()
    if run_mask.is_cpu and implementation(_CPU) == "torch" and not torch.compiler.is_compiling():
        # eager CPU serving: the custom op's dispatch costs more than the op itself (T small); same
        # function. (is_cpu, not .device: reading a tensor's device costs ~5 us inside a step)
        return _kernels("route_maps").reference(run_mask, valid)
    return _route_maps(run_mask, valid)


# --- gather_rows ------------------------------------------------------------------------------
@torch.library.custom_op("vskipper::gather_rows", mutates_args=())
def _gather_rows(x: Tensor, rows: Tensor, count: Tensor) -> Tensor:
    return _call("gather_rows", x.device, x, rows, count)


def gather_rows(x: Tensor, rows: Tensor, count: Tensor) -> Tensor:
    """x [T, H], rows [R] int, count [1] int -> y [R, H]: y[j] = x[rows[j]] for j < count, zeros after."""
    return _gather_rows(x, rows, count)


@_gather_rows.register_fake
def _(x, rows, count):
    _kernels("gather_rows").check(x, rows, count)
    return x.new_empty(rows.shape[0], x.shape[1])


# --- scatter_combine_ -------------------------------------------------------------------------
@torch.library.custom_op("vskipper::scatter_combine_", mutates_args=("out",))
def _scatter_combine_(out: Tensor, residual: Tensor, y: Tensor, rows: Tensor, count: Tensor,
                      weight: Optional[Tensor]) -> None:
    _call("scatter_combine", out.device, out, residual, y, rows, count, weight)


def scatter_combine_(out: Tensor, residual: Tensor, y: Tensor, rows: Tensor, count: Tensor,
                     weight: Optional[Tensor] = None) -> None:
    """In place, for j < count: out[rows[j]] = residual[rows[j]] + w[rows[j]] * y[j] (w = 1 if weight
    is None). out, residual [T, H]; y [R, H]; rows [R] int; count [1] int; weight [T]. Other rows of
    out are untouched; residual may be out itself."""
    _scatter_combine_(out, residual, y, rows, count, weight)


@_scatter_combine_.register_fake
def _(out, residual, y, rows, count, weight):
    _kernels("scatter_combine").check(out, residual, y, rows, count, weight)


# --- grouped_linear ---------------------------------------------------------------------------
@torch.library.custom_op("vskipper::grouped_linear", mutates_args=())
def _grouped_linear(x: Tensor, rows: Tensor, count: Tensor, weight: Tensor) -> Tensor:
    return _call("grouped_linear", x.device, x, rows, count, weight)


def grouped_linear(x: Tensor, rows: Tensor, count: Tensor, weight: Tensor) -> Tensor:
    """x [T, K], rows [R] int, count [1] int, weight [N, K] -> y [R, N]: y[j] = x[rows[j]] @ weight.T
    for j < count, zeros after. The gather is fused into the GEMM's A load; row tiles past the
    device-side count exit early."""
    return _grouped_linear(x, rows, count, weight)


@_grouped_linear.register_fake
def _(x, rows, count, weight):
    _kernels("grouped_linear").check(x, rows, count, weight)
    return x.new_empty(rows.shape[0], weight.shape[0])


# --- grouped_swiglu_ --------------------------------------------------------------------------
@torch.library.custom_op("vskipper::grouped_swiglu_", mutates_args=("out",))
def _grouped_swiglu_(out: Tensor, residual: Tensor, x: Tensor, rows: Tensor, count: Tensor, w_gate: Tensor,
                     w_up: Tensor, w_down: Tensor, weight: Optional[Tensor]) -> None:
    _call("grouped_swiglu", x.device, out, residual, x, rows, count, w_gate, w_up, w_down, weight)


def grouped_swiglu_(out: Tensor, residual: Tensor, x: Tensor, rows: Tensor, count: Tensor, w_gate: Tensor,
                    w_up: Tensor, w_down: Tensor, weight: Optional[Tensor] = None) -> None:
    """In place, for j < count, r = rows[j]:
        out[r] = residual[r] + w[r] * (silu(x[r] @ w_gate.T) * (x[r] @ w_up.T)) @ w_down.T   (w = 1 if None)
    out, residual, x [T, H]; w_gate, w_up [I, H]; w_down [H, I]; weight [T]. Other rows untouched.
    FlexiDepth's adapter up_proj(silu(gate_proj(y)) * down_proj(y)) is w_gate=gate_proj,
    w_up=down_proj, w_down=up_proj."""
    _grouped_swiglu_(out, residual, x, rows, count, w_gate, w_up, w_down, weight)


@_grouped_swiglu_.register_fake
def _(out, residual, x, rows, count, w_gate, w_up, w_down, weight):
    _kernels("grouped_swiglu").check(out, residual, x, rows, count, w_gate, w_up, w_down, weight)


# --- masked_decode_attention ------------------------------------------------------------------
@torch.library.custom_op("vskipper::masked_decode_attention", mutates_args=())
def _masked_decode_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                             req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor, sm_scale: float) -> Tensor:
    return _call("masked_decode_attention", q.device, q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                 seq_lens, run_mask, sm_scale)


def masked_decode_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                            req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor, sm_scale: float) -> Tensor:
    """Paged decode attention for RUN rows over SGLang's KV layout. q [B, nh, d], k_buffer and
    v_buffer [P, kvh, d], req_to_token [R, C] int32, req_pool_indices [B] int, seq_lens [B] int,
    run_mask [B] bool -> o [B, nh, d]. Position p < seq_lens[b] of request b is pool slot
    req_to_token[req_pool_indices[b], p]; GQA: head h reads KV head h // (nh // kvh); softmax in f32.
    Rows with run_mask False read no K/V and get zeros."""
    return _masked_decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask,
                                    float(sm_scale))


@_masked_decode_attention.register_fake
def _(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, run_mask, sm_scale):
    _kernels("masked_decode_attention").check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                              run_mask)
    return q.new_empty(q.shape)


def masked_decode_attention_dynamic(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                                    req_pool_indices: Tensor, seq_lens: Tensor, run_mask: Tensor,
                                    sm_scale: float) -> Tensor:
    """The same result as masked_decode_attention in plain torch, gathering only the RUN rows up to
    their longest sequence. It syncs with the host (nonzero, max): for CPU serving, never inside a
    CUDA graph. (The custom op already takes this path for CPU tensors.)"""
    return _kernels("masked_decode_attention").reference_dynamic(q, k_buffer, v_buffer, req_to_token,
                                                                 req_pool_indices, seq_lens, run_mask, sm_scale)
