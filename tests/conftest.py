"""Test settings: the Triton interpreter off a GPU machine, hypothesis profiles, threads, a seed per test.
(What the tests share as code is in helpers.py, tiny.py, sglang_util.py and training_util.py.)"""
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

settings.register_profile("cpu", deadline=None, max_examples=25)
settings.register_profile("gpu", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cpu"))

# two threads, or OMP_NUM_THREADS where set: on a machine whose other core is busy, a second thread
# waits for it at every op (a tiny matmul then takes milliseconds), so run the tests with one there
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
