"""Shared test settings: tolerances per dtype, hypothesis profiles, tiny model builders."""
from __future__ import annotations

import os
import shutil

# Triton kernels run on CPU only under the interpreter, which is chosen when @triton.jit decorates:
# on a machine with no NVIDIA device, set it before any kernel module is imported.
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

# One tolerance table per dtype (atol, rtol). fp32: the reference recomputes attention by hand
# in a different reduction order, so last-bit noise accumulates over a few layers.
TOL = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

settings.register_profile("cpu", deadline=None, max_examples=25)
settings.register_profile("gpu", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cpu"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    atol, rtol = TOL[expected.dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != {list(expected.shape)}")
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        worst = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches (max abs diff {worst:.3g}), first at {idx}")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != {list(expected.shape)}")
    if not torch.equal(actual, expected):
        idx = (actual != expected).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((actual != expected).sum())} entries differ, first at {idx}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
