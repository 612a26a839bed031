"""Routed prefill: the op (torch form and Triton kernel under TRITON_INTERPRET=1, against the
masked decode attention reference row by row), and the routed bodies through transformers'
generate and SGLang's extend batches (chunked prefill, radix-cache hits) against the eager reference.

Legend: T = query rows of an extend batch, B = requests, nh / kvh = heads, d = head dim.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import vskipper
from vskipper import ops
from vskipper.reference import reference_generate
from vskipper.triton_kernels import masked_decode_attention as MA
from vskipper.triton_kernels import routed_prefill_attention as RP
from vskipper.triton_kernels._common import HAS_TRITON, interpreted

from conftest import assert_close, assert_equal
from tiny import VOCAB, flexidepth_for, record_routes, tiny_llama, tiny_qwen3, transformed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = HAS_TRITON and (DEVICE.type == "cuda" or interpreted(RP._routed_prefill_attention_kernel))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- the op ------------------------------------------------------------------------------------
@st.composite
def extend_batches(draw):
    """An extend batch over a random paged pool: B requests, each a chunk of extend_lens[b] tokens
    after a cached prefix of prefix_lens[b] (0: a fresh prompt; > 0: a radix hit or a later chunk)."""
    B = draw(st.integers(1, 4))
    kvh = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from([1, 10, 16, 40]))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["all", "none", "mixed"]))
    g = torch.Generator().manual_seed(seed)
    pre = [draw(st.sampled_from([0, 0, 1, 5, 37])) for _ in range(B)]
    ext = [draw(st.sampled_from([0, 1, 2, 7, 19, 40])) for _ in range(B)]
    T, C = sum(ext), max(p + e for p, e in zip(pre, ext)) + 3
    P, R = B * C + 5, B + 2
    q = (torch.randn(T, G * kvh, d, generator=g)).to(dtype).to(DEVICE)
    k = torch.randn(P, kvh, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(P, kvh, d, generator=g).to(dtype).to(DEVICE)
    req_to_token = torch.randint(0, P, (R, C), generator=g, dtype=torch.int32).to(DEVICE)
    rpi = torch.randperm(R, generator=g)[:B].to(DEVICE)
    run = {"all": torch.ones(T, dtype=torch.bool), "none": torch.zeros(T, dtype=torch.bool),
           "mixed": torch.rand(T, generator=g) < 0.6}[kind].to(DEVICE)
    return (q, k, v, req_to_token, rpi, torch.tensor(pre, device=DEVICE), torch.tensor(ext, dtype=torch.int32, device=DEVICE),
            run, d ** -0.5)


def as_decode_rows(q, k, v, req_to_token, rpi, pre, ext, run, scale):
    """The same batch as decode rows: row i of request b is a decode row of sequence length p + 1."""
    req = torch.repeat_interleave(torch.arange(len(ext), device=q.device), ext.long())
    start = torch.cumsum(ext, 0) - ext
    i = torch.arange(q.shape[0], device=q.device) - start[req]
    return q, k, v, req_to_token, rpi[req], pre[req] + i + 1, run, scale


@given(extend_batches())
@example((torch.zeros(0, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.zeros(1, 4, dtype=torch.int32),
          torch.tensor([0]), torch.tensor([2]), torch.tensor([0]), torch.zeros(0, dtype=torch.bool), 0.3))
def test_routed_prefill_attention(args):
    want = MA.reference(*as_decode_rows(*args))
    got = RP.reference(*args)
    assert_close(got, want, "reference vs masked decode attention, row by row")
    assert_close(ops.routed_prefill_attention(*args, impl="torch"), want, "ops, torch")
    if TRITON_RUNS:
        got = ops.routed_prefill_attention(*args, impl="triton")
        assert_close(got, want, "kernel vs masked decode attention")
        skipped = ~args[7]
        assert_equal(got[skipped], torch.zeros_like(got[skipped]), "zeros for skipped rows")


def batch(pre, ext, run, kvh=1, G=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    T, C = sum(ext), max(p + e for p, e in zip(pre, ext))
    B = len(ext)
    return (torch.randn(T, G * kvh, d, generator=g).to(dtype), torch.randn(B * C, kvh, d, generator=g).to(dtype),
            torch.randn(B * C, kvh, d, generator=g).to(dtype),
            torch.arange(B * C, dtype=torch.int32).view(B, C), torch.arange(B), torch.tensor(pre),
            torch.tensor(ext), torch.tensor(run, dtype=torch.bool), d ** -0.5)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("case", ["none_run", "all_run", "chunk_after_prefix", "several_requests"])
def test_routed_prefill_attention_cases(impl, case):
    """The named cases, explicitly (beside the property test): zero RUN rows, all RUN, a chunk after
    a cached prefix, several requests of different prefixes in one batch (a decode row among them,
    as SGLang's mixed batches have)."""
    pre, ext = {"none_run": ([0], [9]), "all_run": ([0], [33]), "chunk_after_prefix": ([64], [17]),
                "several_requests": ([0, 5, 30, 12], [20, 1, 9, 33])}[case]
    T = sum(ext)
    run = {"none_run": [False] * T, "all_run": [True] * T}.get(case, [i % 3 != 1 for i in range(T)])
    args = batch(pre, ext, run)
    want = MA.reference(*as_decode_rows(*args))
    got = ops.routed_prefill_attention(*(a.to(DEVICE) if torch.is_tensor(a) else a for a in args), impl=impl)
    assert_close(got.cpu(), want, case)
    if case == "all_run" and pre == [0]:  # all RUN and no prefix: plain causal attention
        q, k, v = args[0], args[1][:T], args[2][:T]
        full = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).expand(q.shape[1], -1, -1), v.transpose(0, 1).expand(q.shape[1], -1, -1),
            is_causal=True, scale=args[-1]).transpose(0, 1)
        assert_close(got.cpu(), full, "all RUN = causal attention")


def test_routed_prefill_attention_bad_input():
    args = list(batch([0, 2], [3, 4], [True] * 7))
    bad = args.copy()
    bad[6] = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="extend_lens sum to 8 but q has T = 7"):
        ops.routed_prefill_attention(*bad, impl="torch")
    bad = args.copy()
    bad[7] = bad[7][:5]
    with pytest.raises(ValueError, match="run_mask has 5 entries but q has T = 7"):
        ops.routed_prefill_attention(*bad, impl="torch")
    bad = args.copy()
    bad[5] = torch.tensor([0, 9])
    with pytest.raises(ValueError, match="request 1: prefix 9 \\+ extend 4"):
        ops.routed_prefill_attention(*bad, impl="torch")
    with pytest.raises(ValueError, match="impl='cuda'"):
        ops.routed_prefill_attention(*args, impl="cuda")
