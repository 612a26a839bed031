"""What the tests share: tolerances and comparisons, prompts, padding and greedy decoding of tiny models.
(Tiny models and skippers: tiny.py; a real SGLang engine: sglang_util.py.)"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from vskipper.skippers.base import sanitize_gate

from tiny import VOCAB

# One tolerance table per dtype (atol, rtol). fp32: the reference recomputes attention by hand
# in a different reduction order, so last-bit noise accumulates over a few layers. fp16: a kernel that
# accumulates in fp32 and rounds once, against a reference that rounds each step to fp16, can each sit
# ~2 ulp from the exact value on opposite sides (a SwiGLU row: 0.0032 either way at |y| ~ 3), so 4 ulp.
TOL = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
NEW_TOKENS = 24


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    atol, rtol = TOL[expected.dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != {list(expected.shape)}")
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        worst = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches (max abs diff {worst:.3g}), first at {idx}")


def assert_close_terms(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, what: str = "") -> None:
    """assert_close for a sum of terms (a residual plus an update): the dtype's tolerance on the terms'
    magnitude `scale` (elementwise), not on the sum's, which cancellation can make far smaller than the
    rounding of the terms that made it (bf16: a 0.125 step at |terms| ~ 16 in a sum near 0)."""
    atol, rtol = TOL[expected.dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != {list(expected.shape)}")
    diff = (actual.float() - expected.float()).abs()
    bad = diff > atol + rtol * scale.float()
    if bad.any():
        idx, worst = bad.nonzero()[:5].tolist(), diff.max().item()
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches (max abs diff {worst:.3g}), first at {idx}")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {list(actual.shape)} != {list(expected.shape)}")
    if not torch.equal(actual, expected):
        idx = (actual != expected).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((actual != expected).sum())} entries differ, first at {idx}")


def prompts(lengths=(5, 11, 1), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def left_pad(seqs):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):], mask[b, L - len(s):] = s, 1
    return ids, mask


def greedy(model, ids, mask=None, n=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


def assert_batch_matches_reference(model, base, skipper, seqs, n=NEW_TOKENS) -> None:
    """`model` (transformed; its routes recorded) generates for the left-padded batch of `seqs`: each
    sequence's greedy tokens and route decisions equal the eager reference's."""
    from vskipper.reference import reference_generate

    from tiny import record_routes

    ids, mask = left_pad(seqs)
    calls = record_routes(model)
    out = greedy(model, ids, mask, n)
    for b, p in enumerate(seqs):
        ref_tokens, ref_dec = reference_generate(base, skipper, p, n)
        assert_equal(out[b, ids.shape[1]:], ref_tokens[len(p):], f"greedy tokens of sequence {b}")
        for l in skipper.layers:
            assert_equal(fast_decisions(calls, l, b, ids.shape[1] - len(p)), ref_dec[l], f"routes, seq {b}, layer {l}")


def fast_decisions(calls, layer, b=0, pad=0):
    """Route decisions of sequence b from the recorded router outputs (prefill, then 1 per step)."""
    outs = calls[layer]
    seq = [outs[0][b, pad:]] + [o[b, -1:] for o in outs[1:]]
    return sanitize_gate(torch.cat(seq), 0.5)[1]


README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS_SERVER = "# needs a server"  # the first line of a README block that talks to `vskipper serve` on port 30000


def readme_blocks(server: bool) -> list[str]:
    """The README's ```python blocks that need a server, or those that do not."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if b.startswith(NEEDS_SERVER) == server]


def run_block(code: str, cwd, timeout: float = 600) -> str:
    """Run a README block as pasted, in a fresh interpreter; its stdout, or AssertionError with its stderr."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, f"README block failed:\n{code}\n{r.stderr[-3000:]}"
    return r.stdout
