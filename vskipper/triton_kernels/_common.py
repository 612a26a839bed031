"""What every op file shares: the optional Triton import, interpreter detection, argument checks.

Triton is optional: without it (a CPU-only or macOS install) the op files still import, their
torch forms (`torch_op`) work, and a launcher raises a ValueError that says how to choose them.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the kernels below are then plain functions that are never launched
    HAS_TRITON = False

    class _NoTriton:
        __version__ = "none"

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, n - 1).bit_length()

    class _NoTl:
        constexpr = None

    triton = _NoTriton()
    tl = _NoTl()

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEXES = (torch.int32, torch.int64)


def interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_flags(dtype: torch.dtype, kernel) -> tuple[bool, str]:
    """(UPCAST, PRECISION) for tl.dot on inputs of `dtype`.

    The interpreter's tl.dot on bf16 is silently wrong (docs/architecture.md): upcast to f32 there. On a GPU
    bf16/fp16 go to the tensor cores as they are; f32 asks for "ieee" so that results match torch's
    f32 matmul (torch does not use tf32 by default) within the f32 tolerance."""
    upcast = dtype == torch.bfloat16 and interpreted(kernel)
    return upcast, "ieee" if (dtype == torch.float32 or upcast) else "tf32"


def stages_for(dtype: torch.dtype, stages: int) -> int:
    """Pipeline stages for GEMM tiles of `dtype`: the configs are sized for 16-bit tiles (4 stages of
    a 64 x 64 + 64 x 128 tile is 96 KB in bf16); f32 tiles are twice that, so at most 2 stages."""
    return stages if dtype in (torch.float16, torch.bfloat16) else min(stages, 2)


def eager_only(check):
    """A check of an op's arguments, run eagerly and skipped while torch.compile traces: its messages
    format the shapes they name, and formatting a symbolic size fixes it to the traced value (a compiled
    region would then recompile for every batch size). The eager call of the same op has checked them."""
    @functools.wraps(check)
    def checked(*args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return check(*args, **kwargs)
    return checked


def expect(ok: bool, op: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"vskipper.ops.{op}: {msg}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    expect(t.dtype in allowed, op, f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")


def check_dim(op: str, name: str, t: torch.Tensor, dim: int, legend: str) -> None:
    expect(t.dim() == dim, op, f"{name} must be {legend}, got shape {list(t.shape)}")


def check_devices(op: str, **tensors: torch.Tensor | None) -> torch.device:
    named = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(named.items()))
    for k, v in named.items():
        expect(v.device == first.device, op, f"{k} is on {v.device} but {first_name} is on {first.device}")
    return first.device


def check_count(op: str, count: torch.Tensor, name: str = "count") -> None:
    """A device-side count: one int32/int64 element, shape [1] or []."""
    check_dtype(op, name, count, INDEXES)
    expect(count.numel() == 1 and count.dim() <= 1, op,
           f"{name} must hold one element ([1] or []), got shape {list(count.shape)}")


def check_inner_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """Kernels take any row stride but need the last dimension dense."""
    expect(t.shape[-1] <= 1 or t.stride(-1) == 1, op,
           f"{name} must have a contiguous last dimension (stride {t.stride()}); call .contiguous() first")


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    expect(t.is_contiguous(), op, f"{name} must be contiguous (stride {t.stride()}); call .contiguous() first")


def check_launchable(op: str, kernel, device: torch.device) -> None:
    expect(HAS_TRITON, op, "Triton is not installed; use Config(impl='torch') (VSKIPPER_IMPL=torch in SGLang) "
                           "for the ops in plain torch")
    expect(device.type == "cuda" or interpreted(kernel), op,
           f"the Triton kernel needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before "
           "vskipper's kernels are imported, or use Config(impl='torch')")


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile (pid_m, pid_n) of program `pid`, GROUP_M row tiles at a time so that the weight tiles a
    group shares stay in L2 (the Triton matmul tutorial's ordering)."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def paged_kv_block(k_head, v_head, slots_row, start, end, offs_d, in_d, stride_kp, stride_vp,
                   BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Positions start .. start + BLOCK_N - 1 of one request in SGLang's paged KV pool, those >= end
    masked (loaded as zeros): (K transposed [BLOCK_D, BLOCK_N], V [BLOCK_N, BLOCK_D], the positions
    offs_n, their mask in_n). k_head / v_head point at the KV head in k_buffer / v_buffer, slots_row
    at the request's row of req_to_token; K and V in f32 when UPCAST."""
    offs_n = start + tl.arange(0, BLOCK_N)
    in_n = offs_n < end
    slots = tl.load(slots_row + offs_n, mask=in_n, other=0).to(tl.int64)
    k = tl.load(k_head + slots[None, :] * stride_kp + offs_d[:, None],
                mask=in_d[:, None] & in_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
    v = tl.load(v_head + slots[:, None] * stride_vp + offs_d[None, :],
                mask=in_n[:, None] & in_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, offs_n, in_n


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One block of the online softmax (flash attention): scores s [M, N] in f32 (masked ones -inf;
    each row needs a finite score by now, or its m stays -inf and the result is NaN), values
    v [N, D] -> the running row max m_i [M], row sum l_i [M] and f32 accumulator acc [M, D], updated."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@eager_only
def check_paged_kv(op: str, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                   req_to_token: torch.Tensor, q_legend: str) -> None:
    """What the paged attention ops share: q [rows, nh, d] and SGLang's KV pool, k_buffer and v_buffer
    [P, kvh, d] of q's float dtype with nh a multiple of kvh, and req_to_token [R, C] int32."""
    check_dim(op, "q", q, 3, q_legend)
    check_dim(op, "k_buffer", k_buffer, 3, "[P, kvh, d]")
    check_dim(op, "v_buffer", v_buffer, 3, "[P, kvh, d]")
    check_dim(op, "req_to_token", req_to_token, 2, "[R, C]")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_dtype(op, name, t, FLOATS)
        expect(t.dtype == q.dtype, op, f"{name} has dtype {t.dtype} but q has {q.dtype}")
    check_dtype(op, "req_to_token", req_to_token, (torch.int32,))
    expect(k_buffer.shape == v_buffer.shape, op,
           f"k_buffer {list(k_buffer.shape)} and v_buffer {list(v_buffer.shape)} must have one shape")
    nh, kvh = q.shape[1], k_buffer.shape[1]
    expect(kvh > 0 and nh % kvh == 0, op, f"query heads nh = {nh} must be a multiple of KV heads kvh = {kvh}")
    expect(k_buffer.shape[2] == q.shape[2], op, f"k_buffer has head dim {k_buffer.shape[2]} but q has {q.shape[2]}")
