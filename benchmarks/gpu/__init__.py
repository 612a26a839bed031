"""The GPU check (gpu_check.sh) and what it runs: the model under CUDA graphs, decode, kernel timings."""
from __future__ import annotations

import os
import sys


def open_base(args, what: str):
    """The start every GPU benchmark shares: (harness, device, dtype, shape, base model), or None after a
    message when there is no CUDA device and this is not a --smoke run (tiny shapes on CPU, the Triton
    interpreter set before the harness imports vskipper)."""
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from benchmarks.gpu import harness as G

    if not G.cuda() and not args.smoke:
        print(f"gpu {what}: no CUDA device; this benchmark needs a GPU (or --smoke: tiny shapes on CPU)",
              file=sys.stderr)
        return None
    device = torch.device("cuda" if G.cuda() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = G.parse_shape(args.shape)
    return G, device, dtype, shape, G.build_llama(shape, device, dtype)
